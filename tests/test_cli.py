"""The `qerl` command line: bad input gives one clear line and exit code 2, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def qerl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI the way users do; cwd outside the repo keeps the `kernels/` folder off sys.path."""
    env = {**os.environ, "COLUMNS": "200", "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "qerl_cli", *args], capture_output=True, text=True,
                          cwd=cwd or Path(tempfile.gettempdir()), env=env, timeout=600)


def assert_one_line_error(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    err = res.stderr.strip()
    assert err.count("\n") == 0, err
    for n in needles:
        assert n in err, err


def test_help_lists_the_four_stages() -> None:
    res = qerl("--help")
    assert res.returncode == 0
    for cmd in ("quantize", "train", "eval", "bench"):
        assert cmd in res.stdout


def test_unknown_format(tmp_path: Path) -> None:
    assert_one_line_error(qerl("quantize", "--run", str(tmp_path / "r"), "--format", "fp5"),
                          "unknown format 'fp5'", "nvfp4")


def test_unknown_method(tmp_path: Path) -> None:
    assert_one_line_error(qerl("quantize", "--run", str(tmp_path / "r"), "--method", "magic"), "unknown method")


def test_model_that_does_not_exist(tmp_path: Path) -> None:
    assert_one_line_error(qerl("quantize", str(tmp_path / "nope"), "--run", str(tmp_path / "r")),
                          "does not exist")


def test_run_dir_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    assert_one_line_error(qerl("quantize", "--run", str(f)), "is a file")


def test_truncated_gguf(tmp_path: Path) -> None:
    from qerl_cli.models import embedded_gguf_path

    src = embedded_gguf_path()
    bad = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(src.stat().st_size // 2))
    res = qerl("quantize", str(bad), "--run", str(tmp_path / "r"))
    assert_one_line_error(res, "truncated")
    assert not (tmp_path / "r").exists()  # a refusal leaves no run directory behind (nor a record in one)


def test_truncated_safetensors(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=128).save_pretrained(model_dir)
    save_file({"model.embed_tokens.weight": torch.randn(128, 32)}, str(model_dir / "model.safetensors"))
    data = (model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(data[: len(data) - 100])
    assert_one_line_error(qerl("quantize", str(model_dir), "--run", str(tmp_path / "r")), "truncated")


def test_corrupted_manifest_is_not_overwritten(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "manifest.json").write_text("{not json")
    assert_one_line_error(qerl("quantize", "--run", str(run)), "corrupted")
    assert (run / "manifest.json").read_text() == "{not json"


@pytest.mark.parametrize(("args", "needle"), [
    (("train", "--lr", "abc"), "Invalid value for '--lr'"),
    (("train", "--stepz", "3"), "No such option: --stepz"),
    (("eval", "--run", "R"), "Missing argument 'task'"),
    (("frobnicate",), "No such command 'frobnicate'"),
])
def test_usage_errors_are_one_line_exit_2(args: tuple[str, ...], needle: str) -> None:
    """Click usage errors (raised by typer's bundled click since typer 0.29) are usage errors, not internal ones."""
    res = qerl(*args)
    assert_one_line_error(res, needle, "--help`")
    assert "internal error" not in res.stderr


@pytest.mark.parametrize("args", [(), ("bench",)])
def test_bare_command_prints_help_and_no_error(args: tuple[str, ...]) -> None:
    res = qerl(*args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Usage:" in res.stdout and "Commands" in res.stdout
    assert "error" not in res.stderr.lower() and "Traceback" not in res.stderr


def test_install_hint_keeps_its_extra(tmp_path: Path) -> None:
    """`pip install 'qerl[llmcompressor]'` must print with its extra (rich would read `[...]` as markup)."""
    import importlib.util

    if importlib.util.find_spec("llmcompressor") is not None:
        pytest.skip("llm-compressor is installed, so --method gptq runs instead of printing the hint")
    res = qerl("quantize", "--run", str(tmp_path / "r"), "--method", "gptq")
    assert_one_line_error(res, "pip install 'qerl[llmcompressor]'")


def test_debug_shows_traceback(tmp_path: Path) -> None:
    res = qerl("--debug", "quantize", "--run", str(tmp_path / "r"), "--format", "fp5")
    assert res.returncode != 0 and "Traceback" in res.stderr


@pytest.mark.slow
def test_quantize_default_model_end_to_end(tmp_path: Path) -> None:
    """`qerl quantize --run r` with no model: the embedded default, NVFP4, recorded in the manifest."""
    run = tmp_path / "r"
    res = qerl("quantize", "--run", str(run))
    assert res.returncode == 0, res.stderr
    assert "nvfp4" in res.stdout and "unquantized: lm_head" in res.stdout.replace("\n", " ")
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["quantize"]["status"] == "completed"
    assert (run / "model" / "model.safetensors").is_file()
    assert not [p for p in run.iterdir() if p.name.startswith(".model")]
    shutil.rmtree(run)


def test_training_panel_fits_80_columns() -> None:
    """The live panel once had one column per metric (~130 wide) and was cut to "…" at 80 columns."""
    import io

    from rich.console import Console

    from qerl_cli.train.config import build_config
    from qerl_cli.train.console import LEAD, TrainConsole, training_scope_note

    cfg = build_config("quick_cpu", {}).resolved()
    out = Console(width=80, file=io.StringIO(), record=True, force_terminal=False)
    ui = TrainConsole(out, cfg)
    metrics = {"step": 3, "reward": 0.625, "accuracy": 0.625, "completions/mean_length": 3.25,
               "sampling/k3": 1.234e-4, "entropy": 0.912, "aqn/sigma": 1e-2, "clip_ratio": 0.0, "grad_norm": 0.456,
               "timing/rollout_tokens_per_s": 1234.0}
    ui.first = ui.last = metrics
    out.print(ui._render())
    text = out.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for _, label, _ in LEAD:
        assert label in text
    assert "62.5%" in text and "1.23e-04" in text
    # the quick preset trains on arith level 1 while `qerl eval arith` scores 1-4: the summary says so
    assert training_scope_note(cfg) == ("note: trained on arith level 1 only; `qerl eval arith` scores levels 1-4, "
                                        "so most of what it measures is harder than what was trained")
    assert training_scope_note(build_config("quick_cpu", {"task_level": "mixed"})) is None


def test_bench_tables_fit_80_columns_and_shape_needs_out(tmp_path: Path) -> None:
    """`bench rollout --shape tiny` without --out writes to ./qerl-bench/rollout-<date>-<time>/ (the one default
    place, a new folder per run), says so on its last line, and its table is not cut at 80 columns."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "COLUMNS": "80", "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-m", "qerl_cli", "bench", "rollout", "--shape", "tiny",
                          "--formats", "bf16,nvfp4", "--batches", "1", "--new-tokens", "2",
                          "--prompt-len", "4"], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "…" not in res.stdout and max(len(line) for line in res.stdout.splitlines()) <= 80
    for header in ("format", "linears", "decode tok/s", "% roofline", "status", "nvfp4", "reference"):
        assert header in res.stdout, header
    assert [p.name for p in cwd.iterdir()] == ["qerl-bench"]
    (folder,) = (cwd / "qerl-bench").iterdir()
    assert re.fullmatch(r"rollout-\d{8}-\d{6}", folder.name) and (folder / "rollout.json").is_file()
    last = " ".join(res.stdout.split("\n" + "JSON:")[-1].split())
    assert last.startswith(f"{Path('qerl-bench') / folder.name / 'rollout.json'} plot:"), res.stdout[-500:]
