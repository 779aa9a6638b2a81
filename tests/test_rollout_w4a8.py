"""`TrainConfig.rollout_w4a8` (`--rollout-w4a8`): the W4A8 kernel option switched on around a run's training rollouts
only, refused where W4A8 cannot run. On CPU the W4A8 kernel never runs (it needs the FP8 tensor cores:
`backends.use_w4a8` is False off CUDA, and the CPU forward is torch's), so these tests check the plumbing: the option
is on inside a training rollout and off everywhere else (the update's forwards, the held-out score, the training-set
sampling, the next grid cell, after the run)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
from qerl_kernels.options import kernel_options

from qerl_cli.errors import QerlError
from qerl_cli.train.config import FIELD_HELP, TrainConfig, parse_sets, train_flags
from qerl_cli.train.rollouter import rollout_kernels, rollout_seed


def test_the_field_is_off_by_default_recorded_and_a_flag():
    assert TrainConfig().rollout_w4a8 is False
    cfg = TrainConfig(rollout_w4a8=True, correction="token_tis")
    cfg.validate()
    assert cfg.resolved().to_dict()["rollout_w4a8"] is True  # the manifest's resolved config
    assert parse_sets(["rollout_w4a8=true"]) == {"rollout_w4a8": True}
    flag = next(f for f in train_flags() if f.field == "rollout_w4a8")
    assert flag.decl == "--rollout-w4a8/--no-rollout-w4a8" and "16x" in FIELD_HELP["rollout_w4a8"]


@pytest.mark.parametrize(("fields", "weights", "needle"), [
    ({"rollout_engine": "vllm"}, None, "--rollout-w4a8 runs in the builtin engine's kernels"),
    ({"async_rollout": True}, None, "--async-rollout runs the rollout beside the update"),
    ({"rollout_quant": "int8"}, None, "needs nvfp4 or mxfp4 rollout weights"),
    ({}, "bf16", "not bf16: quantize the run to nvfp4 or mxfp4"),
    ({}, "int8", "not int8"),
])
def test_refused_where_w4a8_cannot_run(fields, weights, needle):
    cfg = TrainConfig(rollout_w4a8=True, **fields)
    with pytest.raises(QerlError, match=needle) as exc:
        cfg.validate()
        cfg.check_rollout_w4a8(weights)
    assert "\n" not in str(exc.value)


def test_allowed_formats_and_flashrl_copies():
    for fmt in ("nvfp4", "mxfp4"):
        TrainConfig(rollout_w4a8=True).check_rollout_w4a8(fmt)
    # FlashRL: the rollout runs the quantized copy, whatever the run's own weights
    TrainConfig(rollout_w4a8=True, rollout_quant="nvfp4").check_rollout_w4a8("bf16")
    TrainConfig(rollout_w4a8=False, rollout_quant="int8").validate()


def test_the_scope_is_one_rollout_and_is_restored_on_error():
    assert not kernel_options().w4a8
    with rollout_kernels(TrainConfig()):
        assert not kernel_options().w4a8
    with rollout_kernels(TrainConfig(rollout_w4a8=True)):
        assert kernel_options().w4a8
        assert kernel_options().w4a8_min_m == 64  # the threshold stays the process's (QERL_W4A8_MIN_M)
    assert not kernel_options().w4a8
    with pytest.raises(RuntimeError), rollout_kernels(TrainConfig(rollout_w4a8=True)):
        raise RuntimeError("a rollout failed")
    assert not kernel_options().w4a8


def test_a_sanity_grid_turns_it_on_for_its_cells_rollouts_only(tiny_run, tmp_path, monkeypatch):
    """`--grid rollout_w4a8=true,false`: the first cell's training rollouts see the option on; its held-out scores,
    its update's forwards, the training-set sampling and every forward of the second cell see it off, and so does
    the process afterwards."""
    from qerl_cli.bench.sanity import bench_sanity, parse_axes
    from qerl_cli.qlinear import QuantLinear
    from qerl_cli.rollout import BuiltinEngine

    calls: list[tuple[int | None, bool]] = []  # (sampling seed, W4A8 on) per engine.generate
    update_forwards: list[bool] = []  # W4A8 on, per quantized weight read outside any generate (the update's)
    generating = [0]
    generate, weight = BuiltinEngine.generate, QuantLinear.dequantized_weight

    def spy_generate(self, prompts, sampling, *args, **kwargs):
        calls.append((sampling.seed, kernel_options().w4a8))
        generating[0] += 1
        try:
            return generate(self, prompts, sampling, *args, **kwargs)
        finally:
            generating[0] -= 1

    def spy_weight(self, *args, **kwargs):  # the CPU path of every quantized forward (LoRA's base ops included)
        if not generating[0]:
            update_forwards.append(kernel_options().w4a8)
        return weight(self, *args, **kwargs)

    monkeypatch.setattr(BuiltinEngine, "generate", spy_generate)
    monkeypatch.setattr(QuantLinear, "dequantized_weight", spy_weight)
    sets = {"steps": 2, "batch_prompts": 1, "num_generations": 2, "max_completion_length": 4, "task_level": "1",
            "lora_rank": 4, "shots": 0, "correction": "token_tis"}
    res = bench_sanity(run_dir=tiny_run, grid=parse_axes(["rollout_w4a8=true,false"]), overrides=sets, candidates=2,
                       samples=2, lo=0.0, hi=1.0, seed_start=3, heldout=1, heldout_samples=2, out_dir=tmp_path / "s",
                       log=lambda _m: None)
    assert [r["cell"] for r in res["results"]] == [{"rollout_w4a8": True}, {"rollout_w4a8": False}]
    assert all(r["status"] == "ok" for r in res["results"])
    assert res["config"]["train"]["rollout_w4a8"] is False  # the base config; the cells' values are the grid's
    rollouts = {rollout_seed(3, step, 0) for step in range(2)}
    assert [on for seed, on in calls if seed in rollouts] == [True, True, False, False]
    others = [(seed, on) for seed, on in calls if seed not in rollouts]
    assert {seed for seed, _ in others} == {0, 3 + 10**6}  # the training-set sampling and the held-out scores
    assert not any(on for _, on in others)
    assert update_forwards and not any(update_forwards)
    assert not kernel_options().w4a8


def test_a_grid_cell_w4a8_cannot_run_is_refused_before_any_sampling(tiny_run, tmp_path, monkeypatch):
    from qerl_cli.bench import sanity

    def never(*_a, **_k):
        raise AssertionError("the training set was sampled")

    monkeypatch.setattr(sanity, "build_subset", never)
    with pytest.raises(QerlError, match="--rollout-w4a8 needs nvfp4 or mxfp4 rollout weights .* not bf16"):
        sanity.bench_sanity(run_dir=tiny_run, grid=sanity.parse_axes(["format=nvfp4,bf16", "rollout_w4a8=true"]),
                            out_dir=tmp_path / "s", log=lambda _m: None)


def test_qerl_train_on_a_bf16_run_refuses_in_one_line(tiny_source, tmp_path):
    from qerl_cli.quantize import quantize_model

    run = tmp_path / "bf"
    quantize_model(run, str(tiny_source), fmt="bf16")
    env = {**os.environ, "COLUMNS": "200", "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-m", "qerl_cli", "train", "--run", str(run), "--rollout-w4a8",
                          "--steps", "1"], capture_output=True, text=True,
                         cwd=tempfile.gettempdir(), env=env, timeout=300)
    err = res.stderr.strip()
    assert res.returncode == 2 and "Traceback" not in err and err.count("\n") == 0, err
    assert "--rollout-w4a8 needs nvfp4 or mxfp4 rollout weights" in err and "not bf16" in err
