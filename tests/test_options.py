"""The QERL_* settings are read once, in the two options modules, into typed and checked values that every manifest
stage records (qerl_cli/options.py, kernels/options.py, docs/options.md)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from qerl_kernels import options as kopts
from qerl_kernels._common import KernelSettingError

from qerl_cli import options as ropts
from qerl_cli.errors import QerlError
from tests.helpers import environ_uses

ROOT = Path(__file__).resolve().parents[1]
OPTIONS_MODULES = {"qerl_cli/options.py", "kernels/options.py"}


def qerl_env_uses(path: Path) -> list[tuple[int, str]]:
    """(line, variable) of every read or write of a QERL_* variable through os.environ / os.getenv, the name a
    literal or a module-level constant (``CACHE_ENV = "QERL_..."``)."""
    return [(line, var) for line, var in environ_uses(path, writes=True) if var is not None and var.startswith("QERL_")]


def test_the_scan_sees_every_form(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import os\nENV = 'QERL_A'\nos.environ.get(ENV)\nos.getenv('QERL_B')\nos.environ['QERL_C'] = '1'\n"
                   "'QERL_D' in os.environ\nos.environ.setdefault('QERL_E', '1')\nos.environ.get('HOME')\n")
    assert qerl_env_uses(src) == [(3, "QERL_A"), (4, "QERL_B"), (5, "QERL_C"), (6, "QERL_D"), (7, "QERL_E")]


def test_no_qerl_variable_is_read_outside_the_options_modules() -> None:
    outside = {}
    for folder in ("qerl_cli", "kernels", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in OPTIONS_MODULES and (uses := qerl_env_uses(path)):
                outside[rel] = uses
    assert not outside, f"QERL_* variables read or written outside the options modules: {outside}; add a field to " \
                        "qerl_cli/options.py (or kernels/options.py) and read the options instead"
    # the scan does find the reads where they live
    assert {"QERL_FAST_DECODE", "QERL_CACHE_DIR"} <= {v for _, v in qerl_env_uses(ROOT / "qerl_cli/options.py")}
    assert {"QERL_LINEAR_BACKEND", "QERL_FP4_REPACK"} <= {v for _, v in qerl_env_uses(ROOT / "kernels/options.py")}


def _env_names(cls: type) -> list[str]:
    return [f.metadata["env"] for f in dataclasses.fields(cls) if "env" in f.metadata]


def test_every_field_is_read_from_its_variable_and_documented() -> None:
    kernel_vars, run_vars = _env_names(kopts.KernelOptions), _env_names(ropts.RunOptions)
    assert list(kopts.read_environment()) == kernel_vars
    assert list(ropts.read_environment()) == run_vars + kernel_vars
    table = (ROOT / "docs" / "options.md").read_text()
    missing = [v for v in run_vars + kernel_vars if f"`{v}`" not in table]
    assert not missing, f"docs/options.md lacks {missing}"


def test_the_environment_is_parsed_into_typed_values() -> None:
    opts = ropts.RunOptions.from_env({"QERL_FAST_DECODE": "0", "QERL_FUSED_LORA": "true", "QERL_DIST_TIMEOUT_S": "30",
                                      "QERL_DECODE_ATTN": "", "QERL_CACHE_DIR": "/tmp/c",
                                      "QERL_FP4_DEQUANT_M": "256", "QERL_DISPATCH_CANDIDATES": "triton, cublas"})
    assert opts.fast_decode is False and opts.fused_lora is True and opts.dist_timeout_s == 30.0
    assert opts.decode_attn == "auto" and opts.cache_dir == Path("/tmp/c")  # empty: the default
    assert opts.kernels.fp4_dequant_m == 256 and opts.kernels.dispatch_candidates == ("triton", "cublas")
    assert ropts.RunOptions.from_env({}) == ropts.RunOptions()


@pytest.mark.parametrize(("env", "value", "error", "says"), [
    ("QERL_FAST_DECODE", "maybe", QerlError, "use 1 or 0"),
    ("QERL_DECODE_ATTN", "fast", QerlError, "choose one of auto, split, sdpa, flashinfer"),
    ("QERL_DIST_BACKEND", "mpi", QerlError, "choose one of nccl, gloo"),
    ("QERL_DIST_TIMEOUT_S", "-1", QerlError, "seconds > 0"),
    ("QERL_FP4_DEQUANT_M", "abc", KernelSettingError, "whole number"),
    ("QERL_LINEAR_BACKEND", "fastest", KernelSettingError, "choose one of auto, qerl"),
    ("QERL_DISPATCH_CANDIDATES", "marlin", KernelSettingError, "name some of triton"),
    ("QERL_FP8_ACT", "yes", KernelSettingError, "choose one of 0, 1, auto"),
    ("QERL_MOE_ALIGN", "cuda", KernelSettingError, "choose one of triton, torch"),
])
def test_a_bad_value_names_the_variable(env: str, value: str, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=re.escape(f"{env}={value!r}: ") + ".*" + re.escape(says)):
        ropts.RunOptions.from_env({env: value})


def test_a_bad_value_stops_the_cli_at_start_up(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    import sys

    from qerl_cli import cli

    monkeypatch.setenv("QERL_FP4_DEQUANT_M", "abc")
    monkeypatch.setattr(sys, "argv", ["qerl", "report", "--run", "/nonexistent/run"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2 and "QERL_FP4_DEQUANT_M='abc'" in capsys.readouterr().err


def test_options_are_read_once_and_changed_only_on_purpose(monkeypatch: pytest.MonkeyPatch) -> None:
    before = ropts.options()
    monkeypatch.setenv("QERL_FUSED_LORA", "0")
    monkeypatch.setenv("QERL_CUDA_PDL", "0")
    assert ropts.options() == before  # nobody passed it: the environment is not read again
    with ropts.override(fused_proj=False, fp4_repack="0") as inside:
        assert inside.fused_proj is False and inside.kernels.fp4_repack is False
        assert kopts.kernel_options().fp4_repack is False  # kernel fields reach the kernel layer
        kopts.update(linear_backend="cublas")  # as dispatch.set_backend does
        assert ropts.options().kernels.linear_backend == "cublas"
    assert ropts.options() == before  # both layers restored, the update inside included
    reread = ropts.reload_options()  # a start-up read
    assert reread.fused_lora is False and reread.kernels.cuda_pdl is False
    with pytest.raises(TypeError, match="unknown kernel option"):
        ropts.options().replace(no_such_option=1)


def test_the_manifest_records_the_resolved_options(tmp_path: Path, use_options) -> None:  # noqa: ANN001
    from qerl_cli.manifest import RunDir

    use_options(fused_lora=False, decode_attn="auto", fp4_dequant_m=128, dispatch_candidates="triton,cublas")
    run = RunDir(tmp_path / "r")
    with run.stage("quantize"):
        pass
    env = json.loads((tmp_path / "r" / "manifest.json").read_text())["stages"]["quantize"]["env"]
    assert env["options"] == ropts.options().as_record()
    assert env["options"]["fused_lora"] is False and env["options"]["decode_attn"] == "auto"
    assert env["options"]["kernels"]["fp4_dequant_m"] == 128
    assert env["options"]["kernels"]["dispatch_candidates"] == ["triton", "cublas"]
    assert "qerl_env" in env  # the raw QERL_* environment stays beside it
