"""`bench_step` on CPU: a tiny random shape and the embedded model's run dir; overrides; bad input."""

from __future__ import annotations

import json

import pytest

from qerl_cli.bench.overrides import grid_cells, parse_grid
from qerl_cli.bench.step import bench_step, render_table, short_summary
from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir
from qerl_cli.train.config import parse_sets
from qerl_cli.train.phases import STEP_PHASES as PHASES

SMALL = {"batch_prompts": 2, "num_generations": 2, "max_completion_length": 8, "lora_rank": 4}


def _check_phases(row: dict) -> None:
    for p in PHASES:
        assert row[f"{p}_s"] >= 0.0
    total = sum(row[f"{p}_s"] for p in PHASES)
    for step in row["steps"]:  # per step the phases and "other" add up to the measured step exactly
        s = sum(step[f"{p}_s"] for p in PHASES)
        assert s + step["other_s"] == pytest.approx(step["step_s"], rel=1e-9)
        assert s <= step["step_s"] * 1.0001 and step["other_s"] < 0.5 * step["step_s"]
    assert total <= row["step_s"] * 1.0001


def test_tiny_shape_phases_tokens_speedup(tmp_path):
    res = bench_step(shape="tiny", formats=("bf16", "nvfp4", "nf4"), overrides=SMALL, prompt_len=8, warmup=1,
                     measure=1, out_dir=tmp_path, log=lambda _m: None)
    on_disk = json.loads((tmp_path / "step.json").read_text())
    rows = {r["format"]: r for r in on_disk["results"]}
    assert rows["nf4"]["status"].startswith("skipped") and "CUDA" in rows["nf4"]["status"]
    for fmt in ("bf16", "nvfp4"):
        r = rows[fmt]
        assert r["status"] == "ok"
        _check_phases(r)
        # fixed length, EOS ignored: 2 prompts x 2 generations x 8 tokens, every step
        assert r["rollout_tokens"] == r["generated_tokens"] == 2 * 2 * 8
        assert r["train_tokens"] == 4 * 8 + 32
        assert len(r["steps"]) == 2 and r["steps"][0]["warmup"] and not r["steps"][1]["warmup"]
        assert r["step_s"] == r["steps"][1]["step_s"]  # median of one measured step
        assert r["rollout_tok_s"] == pytest.approx(32 / r["rollout_s"])
        assert "router" not in r and not any("router" in s for s in r["steps"])  # a dense model: no router stats
    assert rows["bf16"]["speedup_vs_bf16"] == 1.0
    assert rows["nvfp4"]["speedup_vs_bf16"] == pytest.approx(rows["bf16"]["step_s"] / rows["nvfp4"]["step_s"])
    assert (tmp_path / "step.png").read_bytes()[:4] == b"\x89PNG"
    assert render_table(res).row_count == 3
    assert any("JSON" in line for line in short_summary(res))


def test_run_dir_step_and_manifest(run_dir, tmp_path):
    out = tmp_path / "b"
    # one measured step of 1 prompt x 2 generations, zero-shot prompts: the CPU cost is the model, not the step
    res = bench_step(run_dir=run_dir, overrides={**SMALL, "aqn": False, "batch_prompts": 1, "shots": 0,
                                                  "max_completion_length": 4}, warmup=0, measure=1, out_dir=out,
                     log=lambda _m: None)
    (row,) = res["results"]
    assert row["format"] == "nvfp4" and row["status"] == "ok"
    _check_phases(row)
    assert row["aqn_s"] < 1e-3  # AQN off: two clock reads
    # the engine's token count is the completions' lengths summed (real lengths: EOS / stop strings)
    for step in row["steps"]:
        assert step["rollout_tokens"] == step["generated_tokens"] and 2 <= step["rollout_tokens"] <= 8
    rec = RunDir(run_dir, create=False).record("bench/step")
    assert rec["status"] == "completed" and rec["outputs"]["json"]["path"].endswith("step.json")
    assert not (run_dir / "train").exists()  # checkpoints went to a scratch run, not the run's train/


def test_killed_bench_leaves_no_json(tmp_path):
    def stop(msg: str) -> None:
        if "step 1" in msg:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench_step(shape="tiny", formats=("bf16",), overrides=SMALL, prompt_len=4, warmup=1, measure=1,
                   out_dir=tmp_path / "k", log=stop)
    assert not (tmp_path / "k" / "step.json").exists()


def test_bad_input(tmp_path):
    with pytest.raises(QerlError, match="qerl quantize --run"):
        bench_step(run_dir=RunDir(tmp_path / "empty").path, out_dir=tmp_path / "o", log=lambda _m: None)
    with pytest.raises(QerlError, match="exactly one of"):
        bench_step(log=lambda _m: None)
    with pytest.raises(QerlError, match="needs a CUDA GPU"):
        bench_step(shape="qwen2.5-7b", log=lambda _m: None)
    with pytest.raises(QerlError, match="unknown format"):
        bench_step(shape="tiny", formats=("nvfp5",), log=lambda _m: None)
    with pytest.raises(QerlError, match=r"unknown train option 'finetun'; valid options: .*lora_rank"):
        parse_sets(["finetun=full"])
    with pytest.raises(QerlError, match="expected KEY=VALUE"):
        parse_sets(["lr"])
    with pytest.raises(QerlError, match="lr='fast': expected float"):
        parse_sets(["lr=fast"])


def test_overrides_are_typed():
    got = parse_sets(["lr=1e-4", "aqn=true", "steps=3", "correction=none", "reward=null", "lora_targets=q_proj,v_proj",
                      "dynamic_sampling=none", "max-completion-length=16"])
    assert got == {"lr": 1e-4, "aqn": True, "steps": 3, "correction": "none", "reward": None,
                   "lora_targets": ["q_proj", "v_proj"], "dynamic_sampling": None, "max_completion_length": 16}
    axes = parse_grid(["format=bf16,nvfp4", "aqn=false,true", "precision=bf16,fp16"], ("bf16", "nvfp4"))
    assert axes == {"format": ["bf16", "nvfp4"], "aqn": [False, True], "precision": ["bf16", "fp16"]}
    cells = grid_cells(axes)
    assert len(cells) == 8 and cells[0] == {"format": "bf16", "aqn": False, "precision": "bf16"}
    assert cells[-1] == {"format": "nvfp4", "aqn": True, "precision": "fp16"}
    assert grid_cells({}) == [{}]


def test_oom_cell_names_phase_estimate_capacity_and_setting(tmp_path, monkeypatch, capsys):
    """A step that runs out of memory in its forward+backward (forced: the real host allocator is asked for
    1 EiB inside the real update phase) records the phase, the plan's estimate for it, the capacity and the
    setting to change, in the row, the JSON and the printed report; the other formats still run."""
    import torch
    from rich.console import Console

    from qerl_cli.bench import harness
    from qerl_cli.train.updater import PolicyUpdater

    def update_past_the_host(self, *args, **kwargs):
        torch.empty(1 << 60, dtype=torch.uint8)  # the allocator refuses: can't allocate memory

    monkeypatch.setattr(PolicyUpdater, "_update", update_past_the_host)
    res = bench_step(shape="tiny", formats=("bf16",), overrides=SMALL, prompt_len=8, warmup=0, measure=1,
                     out_dir=tmp_path, log=lambda _m: None)
    (row,) = json.loads((tmp_path / "step.json").read_text())["results"]
    assert row["status"] == "OOM in fwd_bwd"
    oom = row["oom"]
    assert oom["phase"] == "fwd_bwd" and oom["plan_part"] == "train_peak"
    assert oom["plan_estimate_gib"] == pytest.approx(row["memory_plan"]["train_peak"] / 2**30)
    assert oom["capacity_source"] == "host memory" and oom["capacity_gib"] > 0.5
    # the plan chose micro-batch 4 (all 2 x 2 sequences) without checkpointing: halve the micro-batch first
    assert row["micro_batch_size"] == 4 and oom["setting"].startswith("--set micro_batch_size=2")
    assert row["note"].startswith("out of memory in fwd_bwd: the memory plan estimated ")
    assert f"of {oom['capacity_gib']:.1f} GiB (host memory)" in row["note"]
    out = Console(width=100, record=True, file=open("/dev/null", "w"))  # noqa: SIM115 - closed with the test
    harness.show(out, *harness.report(res))
    printed = out.export_text()
    assert "OOM in fwd_bwd" in printed and "change: --set micro_batch_size=2" in printed


def test_floor_lines_state_the_decode_step_against_its_compute_aware_floor() -> None:
    """A profiled cell: a 6.00 ms graph step over a 4.50 ms floor is 75% of it; the training MFU beside it."""
    from qerl_cli.bench.step import floor_lines

    prof = {"batch": 64, "graph_step_ms": 6.0, "kernel_ms_per_step": 5.5, "step_floor_ms": 4.5, "pct_of_floor": 75.0}
    res = {"results": [{"format": "nvfp4", "status": "ok", "rollout_profile": prof, "fwd_bwd_mfu": 0.31},
                       {"format": "bf16", "status": "ok"}]}
    assert floor_lines(res) == ["nvfp4: decode step 6.00 ms at batch 64, 75% of its compute-aware floor (4.50 ms); "
                                "fwd+bwd MFU 31%"]


def test_moe_shape_records_the_trainers_router_metrics(tmp_path):
    # 2 steps with AQN on, so 2 AQN stages: step 1 (stage 0, no noise) rolls out with the weights the update
    # forward runs, in fp32 on one device, so routing replay's disagreement is exactly 0 (docs/moe.md, "The
    # metric"); step 2 rolls out with noisy norms (the post-attention norm feeds the router) that the clean update
    # forward lacks, so some (token, layer) top-k sets differ
    import dataclasses

    import torch

    from qerl_cli.bench.harness import shape_for
    from qerl_cli.bench.overrides import build_bench_config
    from qerl_cli.bench.step import _FormatStep, default_config, router_lines, step_router_metrics
    from qerl_cli.train.trainer import Trainer

    res = bench_step(shape="tiny-moe", formats=("bf16",), overrides=SMALL, prompt_len=8, warmup=0, measure=2,
                     out_dir=tmp_path / "bench", log=lambda _m: None)
    (row,) = json.loads((tmp_path / "bench" / "step.json").read_text())["results"]
    assert row["status"] == "ok"
    keys = {"replay_disagreement", "load_cv", "load_max", "load_min", "aux_loss", "dropped_tokens"}
    per_step = [s["router"] for s in row["steps"]]
    assert set(row["router"]) == keys and all(set(r) == keys for r in per_step)
    shares = [r["replay_disagreement"] for r in per_step]
    assert shares[0] == 0.0 and 0.0 < shares[1] <= 1.0
    assert row["router"]["replay_disagreement"] == pytest.approx(sum(shares) / 2)  # the median of two steps
    (line,) = [ln for ln in short_summary(res) if "replay disagreement" in ln]
    assert line.startswith("bf16: ") and f"{row['router']['replay_disagreement']:.2%}" in line
    assert router_lines({**res, "results": [{**row, "router": None}]}) == []  # a dense row: no line

    # the trainer's own step metrics: the cell's trainer built again the way the bench builds it, two steps each
    # followed by a save, as the bench runs them
    device = torch.device("cpu")
    cfg = dataclasses.replace(build_bench_config(default_config(device, 0, 2), SMALL), steps=2)
    cell = _FormatStep(res, "bf16", "bf16", "torch", cfg, device=device, dtype=torch.float32, warmup=0, measure=2,
                       prompt_len=8, seed=0, spec=shape_for("tiny-moe", device), run=None, out=tmp_path,
                       log=lambda _m: None)
    trainer = Trainer(RunDir(tmp_path / "scratch"), cfg, device="cpu")
    cell._setup(trainer, {}, tmp_path / "scratch")
    want = []
    for _ in range(2):
        want.append(step_router_metrics(trainer.train_step()))
        trainer.save()
    trainer.wait_checkpoint()
    trainer.engine.release()
    assert per_step == want
