"""Bad input found by a fault tour, each one line and exit 2 (no traceback, no hang, no exit 0 on nonsense), and
nothing written that a later stage would trust:

* a checkpoint that lacks a tensor its architecture needs is refused by `qerl quantize` (no random weights);
* absurd model configs (sizes, heads, experts, strings, NaN) are refused before anything is allocated, and a
  run's `model/config.json` is covered by the run's hashes;
* `qerl eval`'s numeric options are checked (finite, in range, below a sane maximum);
* a FIFO where a run's JSON file belongs, a hard-linked lock file, an over-long path, a bad `--ignore` pattern,
  the benches' bad lists and devices;
* a torn metrics row that a checkpoint covers is dropped with a warning naming the file and line;
* a failed or interrupted `quantize --force` gives the quantize stage its earlier record back; a full disk in
  `qerl eval` is recorded as the failure; each stage's Ctrl-C hint is its own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.helpers import qerl_in_process


def assert_one_line(code: int, err: str, *needles: str) -> str:
    """The single `error: ...` line of a refused command (exit 2), containing every needle."""
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def without_tensor(src: Path, dst: Path, name: str) -> Path:
    """A copy of the model directory ``src`` whose safetensors file lacks the tensor ``name``."""
    shutil.copytree(src, dst)
    (weights,) = dst.glob("*.safetensors")
    state = load_file(str(weights))
    del state[name]
    save_file(state, str(weights), metadata={"format": "pt"})
    return dst


# ---- a checkpoint missing a tensor -----------------------------------------------------------------------------
def test_quantize_refuses_a_checkpoint_missing_a_tensor(tiny_source: Path, tmp_path: Path, capsys) -> None:
    src = without_tensor(tiny_source, tmp_path / "src", "model.layers.1.mlp.down_proj.weight")
    run = tmp_path / "run"
    code, _, err = qerl_in_process(capsys, "quantize", str(src), "--run", str(run))
    assert_one_line(code, err, "lacks 1 tensor(s)", "model.layers.1.mlp.down_proj.weight", "complete checkpoint")
    assert not run.exists()  # the run this command created goes again: nothing for eval or train to trust


def test_quantize_refuses_a_missing_tensor_in_a_trained_run_and_keeps_its_record(tiny_source: Path, tmp_path: Path,
                                                                                  capsys) -> None:
    from qerl_cli.quantize import quantize_model

    run = tmp_path / "run"
    quantize_model(run, str(tiny_source), fmt="nvfp4")
    before = (run / "manifest.json").read_bytes()
    src = without_tensor(tiny_source, tmp_path / "src", "model.norm.weight")
    code, _, err = qerl_in_process(capsys, "quantize", str(src), "--run", str(run))
    assert_one_line(code, err, "model.norm.weight")
    assert (run / "manifest.json").read_bytes() == before
