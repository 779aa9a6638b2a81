"""An evaluation made with settings other than the defaults (--limit, --samples, --temperature, ...) is written to
a result of its own, named by those settings: it never replaces the default result, and the defaults given
explicitly are the default result. The tiny random model (fast; its scores do not matter here)."""

from __future__ import annotations

import json
from pathlib import Path

from qerl_cli.eval.harness import run_eval
from qerl_cli.manifest import RunDir
from qerl_cli.report import build_report


def test_other_settings_never_replace_the_default_result(tiny_run: Path) -> None:
    full = run_eval(tiny_run, "arith", checkpoint="base", device="cpu")
    assert full["files"]["result"] == "eval/arith-base.json" and full["settings"] == {}
    n_full = full["counts"]["problems"]
    assert n_full > 2
    before = (tiny_run / "eval/arith-base.json").read_bytes()

    part = run_eval(tiny_run, "arith", checkpoint="base", limit=2, device="cpu")
    assert part["files"]["result"] == "eval/arith-base-limit2.json" and part["settings"] == {"limit": 2}
    assert part["counts"]["problems"] == 2
    sampled = run_eval(tiny_run, "arith", checkpoint="base", limit=2, samples=2, temperature=0.7, seed=3,
                       device="cpu")
    assert sampled["files"]["result"] == "eval/arith-base-limit2-n2-t0.7-seed3.json"
    assert sampled["settings"] == {"limit": 2, "samples": 2, "temperature": 0.7, "seed": 3}
    # the defaults given explicitly (arith's 4 shots, 8 tokens, greedy, where the seed changes nothing) are the
    # default settings: the same file as `--limit 2` alone
    again = run_eval(tiny_run, "arith", checkpoint="base", limit=2, shots=4, max_tokens=8, temperature=0.0, seed=5,
                     chat_template=False, device="cpu")
    assert again["files"]["result"] == "eval/arith-base-limit2.json" and again["settings"] == {"limit": 2}
    other = run_eval(tiny_run, "arith", checkpoint="base", limit=2, shots=0, max_tokens=4, device="cpu")
    assert other["files"]["result"] == "eval/arith-base-limit2-max4-shots0.json"

    assert (tiny_run / "eval/arith-base.json").read_bytes() == before  # the full result is still the full one
    assert json.loads((tiny_run / "eval/arith-base.json").read_text())["counts"]["problems"] == n_full
    stages = RunDir(tiny_run).read()["stages"]
    assert sorted(k for k in stages if k.startswith("eval/")) == [
        "eval/arith-base", "eval/arith-base-limit2", "eval/arith-base-limit2-max4-shots0",
        "eval/arith-base-limit2-n2-t0.7-seed3"]

    numbers = build_report(tiny_run)["numbers"]
    assert numbers["eval/arith-base"] == full["scores"]["arith"]["accuracy"]["mean"]
    assert numbers["eval/arith-base-limit2"] == again["scores"]["arith"]["accuracy"]["mean"]
    assert numbers["eval/arith-base-limit2-n2-t0.7-seed3"] == sampled["scores"]["arith"]["accuracy"]["mean"]
