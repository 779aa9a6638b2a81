"""`qerl report` on a small synthetic run directory (no model is loaded); the page is checked in headless Chromium."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir
from qerl_cli.report import build_report, render_summary


def _eval_result(task: str, ckpt: str, correct: int, total: int, low: float, high: float) -> dict:
    acc = {"mean": correct / total, "low": low, "high": high, "n": total, "method": "wilson"}
    return {"schema": 1, "task": task, "harness": "builtin", "checkpoint": {"requested": ckpt, "name": ckpt},
            "primary": task, "scores": {task: {"accuracy": acc, "correct": correct, "total": total, "pass@1": acc}},
            "files": {"result": f"eval/{task}-{ckpt}.json"}}


def _make_run(root: Path) -> Path:
    run = RunDir(root / "run")
    with run.stage("quantize", config={"format": "nvfp4"}) as rec:
        rec.metrics.update({"format": "nvfp4", "rel_fro_mean": 0.095, "bytes_before_bf16": 1000, "bytes_after": 433})
        rec.extra["layers"] = [{"name": f"l{i}", "rel_fro": 0.09 + 0.001 * i} for i in range(10)]
    (run.path / "train").mkdir()
    steps = [
        {"step": s, "reward": 0.25 * s, "accuracy": 0.25 * s, "entropy": 0.5 / s, "completions/mean_length": 4.0 + s,
         "sampling/k3": 10.0 ** (-3 - s), "aqn/sigma": 0.01 / s, "aqn/noise_norm": 2.0 / s,
         "timing/rollout_tokens_per_s": 100.0 + s}
        for s in (1, 2, 3, 4)
    ]
    # A torn last line (trainer killed mid-write) must be skipped, not crash the report.
    (run.path / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps) + '{"step": 5, "re')
    with run.stage("train", config={"algo": "grpo", "task": "arith", "steps": 4}) as rec:
        rec.outputs.update({"metrics": "train/metrics.jsonl", "checkpoint": "train/checkpoints/step_4"})
    (run.path / "eval").mkdir()
    for ckpt, correct, lo, hi in (("base", 10, 0.15, 0.40), ("step_4", 20, 0.40, 0.68)):
        key = f"eval/arith-{ckpt}"
        with run.stage("eval", config={"checkpoint": ckpt}, key=key) as rec:
            (run.path / f"{key}.json").write_text(json.dumps(_eval_result("arith", ckpt, correct, 40, lo, hi)))
            rec.outputs["result"] = f"{key}.json"
            rec.metrics["arith"] = correct / 40
    return run.path


def test_report_page_plots_and_summary(tmp_path):
    run_path = _make_run(tmp_path)
    result = build_report(run_path)

    out = run_path / "report"
    assert result["html"] == out / "index.html"
    expected = {"quantize_error", "train_reward", "train_entropy", "train_length", "train_mismatch", "train_aqn",
                "train_throughput", "eval_scores"}
    assert set(result["plots"]) == expected
    for name in expected:
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]  # atomic writes left no temp files

    page = result["html"].read_text()
    for title in ("Stages", "Quantization", "Training", "Evaluation", "Rollout benchmark"):
        assert f"<h2>{title}</h2>" in page
    # Self-contained: every image is a data URI of exactly the PNG written next to the page; nothing external.
    uris = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(uris) == len(expected)
    assert {base64.b64decode(u) for u in uris} == {(out / f"{n}.png").read_bytes() for n in expected}
    assert "http://" not in page and "https://" not in page and "<link" not in page and "<script" not in page
    # The absent stage names the command that produces it.
    assert f"qerl bench rollout --run {run_path}" in page
    assert result["sections"]["bench/rollout"] == f"qerl bench rollout --run {run_path}"

    # Key numbers, hand-computed from what was written.
    assert result["numbers"]["train/steps"] == 4  # the torn 5th line is skipped
    assert result["numbers"]["train/reward"] == 1.0
    assert result["numbers"]["eval/arith-base"] == 0.25
    assert result["numbers"]["eval/arith-step_4"] == 0.5
    assert "<td class='num'>25.0</td><td class='num'>[15.0, 40.0]</td>" in page
    assert {k: v["status"] for k, v in result["stages"].items()} == {
        "quantize": "completed", "train": "completed", "eval/arith-base": "completed",
        "eval/arith-step_4": "completed"}

    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(render_summary(result))
    text = console.export_text()
    assert "eval/arith-step_4" in text and "50.0%" in text and "qerl bench rollout" in text

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed: the page was not checked in a headless browser")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--screenshot={shot}", "--window-size=1200,2000",
         result["html"].resolve().as_uri()],
        check=True, capture_output=True, timeout=60,
    )
    import matplotlib.image

    img = matplotlib.image.imread(shot)
    assert img.shape[:2] == (2000, 1200)
    # Not blank: the header band, tables and plots give a wide spread of pixel values.
    assert img[..., :3].std() > 0.05
    # The dark header band (#1f3a5f) is drawn at the top, so the stylesheet applied.
    assert abs(img[5, 600, 2] - 0x5F / 255) < 0.05 and img[5, 600, 0] < 0.2


def test_report_rollout_bench_section(tmp_path):
    run_path = _make_run(tmp_path)
    (run_path / "bench").mkdir()
    bench = {"results": [
        {"format": "nvfp4", "batch": 1, "status": "ok", "decode_tok_s": 16.0, "e2e_tok_s": 15.0, "peak_mem_gib": 1.5},
        {"format": "nvfp4", "batch": 8, "status": "ok", "decode_tok_s": 98.0, "e2e_tok_s": 86.0, "peak_mem_gib": 2.0},
    ]}
    (run_path / "bench" / "rollout.json").write_text(json.dumps(bench))
    result = build_report(run_path, out_dir=tmp_path / "elsewhere")
    assert result["html"] == tmp_path / "elsewhere" / "index.html"
    assert result["sections"]["bench/rollout"] == "present"
    assert (tmp_path / "elsewhere" / "bench_rollout.png").stat().st_size > 2000
    assert result["numbers"]["bench/nvfp4/b8/decode_tok_s"] == 98.0
    assert "<h2>Rollout benchmark</h2>" in result["html"].read_text()


def test_report_bad_input(tmp_path):
    with pytest.raises(QerlError, match="does not exist"):
        build_report(tmp_path / "nope")
    with pytest.raises(QerlError, match="no manifest.json"):
        build_report(tmp_path)
    assert not (tmp_path / "report").exists()


def test_report_evidence_section(tmp_path):
    """bench/evidence in the manifest -> an Evidence section with the verdict table, the pairs and a band plot."""
    from qerl_cli.bench.evidence import write_evidence

    run_path = _make_run(tmp_path)
    rows = []
    for seed in range(3):
        for fmt, ent in (("bf16", 0.5), ("nvfp4", 0.6)):  # nvfp4 +0.1 nats on every seed
            acc = [0.5, 0.9, 1.0, 1.0]
            rows.append({"cell": {"format": fmt, "aqn": False}, "label": f"format={fmt}, aqn=False", "seed": seed,
                         "status": "ok", "accuracy": acc, "reward": acc, "entropy": [ent + 0.01 * seed] * 4,
                         "k3": [1e-4] * 4, "steps_run": 4, "steps_to_threshold": 3, "final": 1.0, "collapsed": False,
                         "heldout_before": 0.4, "heldout": 0.5})
    src = tmp_path / "sanity.json"
    src.write_text(json.dumps({"config": {"subset": {"key": {"k": 1}}}, "results": rows, "wall_s": 1.0}))
    write_evidence(inputs={"qerl": [src]}, out_dir=run_path / "bench" / "evidence", run_dir=run_path, n_boot=200,
                   log=lambda _m: None)
    result = build_report(run_path)
    html = result["html"].read_text()
    assert result["sections"]["bench/evidence"] == "present" and "evidence_curves" in result["plots"]
    assert "<h2>Evidence</h2>" in html and "initial entropy (step 1): nvfp4 vs bf16 (AQN off)" in html
    assert "Q4_1 GGUF" in html and "level beside it: heldout_before" in html and "paired t" in html
    # claim 1: all three parts supported (same steps within 1, same held-out gain, +0.1 nats), from 3 pairs: the
    # exact sign-flip test cannot agree (2^-3), so the verdicts are marked; claims 2-4 not run
    assert result["numbers"]["evidence/claim1"] == "supported" and "supported (t only)" in html
    assert "8 pairs or enough by its spread" in html
    assert result["numbers"]["evidence/claim4"] == "not run"
    # without the stage the section is absent and names its producer
    bare = build_report(_make_run(tmp_path / "b"))
    assert bare["sections"]["bench/evidence"].startswith("qerl bench sanity --run")


def _add_eval(run_path: Path, name: str, result: dict) -> None:
    """A result file under eval/ and its completed manifest record (as `qerl eval` leaves them)."""
    run = RunDir(run_path)
    with run.stage("eval", key=f"eval/{name}") as rec:
        (run_path / f"eval/{name}.json").write_text(json.dumps({**result, "files": {"result": f"eval/{name}.json"}}))
        rec.outputs["result"] = f"eval/{name}.json"


def test_report_never_pairs_other_settings_or_a_tool_with_the_default(tmp_path):
    """A --limit result, one of an older qerl without "settings" (its protocol says the limit) and a calculator
    eval of the trained checkpoint each stand in a group of their own, never beside the default base/trained pair."""
    from qerl_cli.report import _read_evals

    run_path = _make_run(tmp_path)  # arith-base 25% and arith-step_4 50%, default settings
    _add_eval(run_path, "arith-base-limit2", {**_eval_result("arith", "base", 2, 2, 0.34, 1.0),
                                              "settings": {"limit": 2}})
    _add_eval(run_path, "arith-step_4-limit3", {**_eval_result("arith", "step_4", 0, 3, 0.0, 0.56),
                                                "protocol": {"limit": 3, "sampling": {"n": 1, "temperature": 0.0}}})
    _add_eval(run_path, "arith-step_4-calculator", {**_eval_result("arith", "step_4", 30, 40, 0.6, 0.86),
                                                    "settings": {}, "protocol": {"episodes": {"kind": "calculator"}}})
    result = build_report(run_path)
    numbers = {k: v for k, v in result["numbers"].items() if k.startswith("eval/")}
    assert numbers == {"eval/arith-base": 0.25, "eval/arith-step_4": 0.5, "eval/arith-base-limit2": 1.0,
                       "eval/arith-step_4-limit3": 0.0, "eval/arith-step_4-calculator": 0.75}
    groups: dict[str, list[str]] = {}
    for e in _read_evals(RunDir(run_path), RunDir(run_path).read()):
        groups.setdefault(e["group"], []).append(e["checkpoint"])
    assert groups == {"arith": ["base", "step_4"], "arith (limit=2)": ["base"], "arith (limit=3)": ["step_4"],
                      "arith (calculator)": ["step_4"]}
    page = result["html"].read_text()
    assert "<td>arith</td><td>limit=2</td><td>base</td>" in page
    assert "<td>arith</td><td>default</td><td>base</td>" in page
    assert "<td>calculator</td><td>step_4</td>" in page


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "2.5"])
def test_report_refuses_a_metrics_step_that_is_no_step_in_one_line(tmp_path, bad):
    run_path = _make_run(tmp_path)
    metrics = run_path / "train/metrics.jsonl"
    metrics.write_text(metrics.read_text().rsplit("\n", 1)[0] + f'\n{{"step": {bad}, "reward": 0.5}}\n')
    with pytest.raises(QerlError, match=r"metrics.jsonl line 5 is not a metrics record \(a JSON object with a "
                                        r"whole-number step\)"):
        build_report(run_path)


def test_report_survives_bad_values_in_results_and_metrics(tmp_path, capsys):
    """Non-finite or non-numeric values: a result whose accuracy is a string is left out with a note, a NaN or
    infinite metric is not drawn or printed; the report is written and the CLI exits 0."""
    from tests.helpers import qerl_in_process

    run_path = _make_run(tmp_path)
    metrics = run_path / "train/metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()[:4]]
    rows[3].update({"reward": float("inf"), "accuracy": "0.9", "entropy": float("nan"), "episodes/turns_mean": 2.0,
                    "episodes/tool_errors": "many"})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json writes NaN and Infinity as such
    bad = _eval_result("arith", "step_8", 1, 2, 0.1, 0.9)
    bad["scores"]["arith"]["accuracy"]["mean"] = "0.5"
    _add_eval(run_path, "arith-step_8", bad)
    nan = _eval_result("gsm8k", "base", 1, 2, 0.1, 0.9)
    nan["scores"]["gsm8k"]["accuracy"]["high"] = float("nan")
    _add_eval(run_path, "gsm8k-base", nan)

    code, out, err = qerl_in_process(capsys, "report", "--run", str(run_path))
    assert code == 0 and "Traceback" not in out + err, err
    text = " ".join(out.split())
    assert "note: eval/arith-step_8.json left out: its accuracy mean is '0.5', not a number between 0 and 1" in text
    assert "note: eval/gsm8k-base.json left out: its accuracy high is nan" in text
    result = build_report(run_path)
    assert result["numbers"]["train/steps"] == 4 and "train/reward" not in result["numbers"]
    assert "train/accuracy" not in result["numbers"] and result["numbers"]["train/episodes/tool_errors"] == 0
    assert set(k for k in result["numbers"] if k.startswith("eval/")) == {"eval/arith-base", "eval/arith-step_4"}
    assert "arith-step_8.json left out" in result["html"].read_text()
