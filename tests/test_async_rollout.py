"""--async-rollout: the next step's rollouts are generated while this step trains, from the adapters as they were
before the update (one update stale), and the update corrects them with its importance weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_cli.bench.shapes import get_shape
from qerl_cli.bench.step import _synthetic_task, build_shape_model, synthetic_prompts, synthetic_reward
from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir
from qerl_cli.train.config import TrainConfig, build_config
from qerl_cli.train.trainer import Trainer


def _trainer(run: Path, async_rollout: bool) -> Trainer:
    spec = get_shape("tiny")
    cfg = TrainConfig(batch_prompts=2, num_generations=3, max_completion_length=5, lora_rank=4, precision="fp32",
                      lr=5e-2, steps=3, aqn=True, aqn_stages=3, log_rollouts=False, seed=4, micro_batch_size=3,
                      async_rollout=async_rollout, correction="token_tis")
    t = Trainer(RunDir(run), cfg, device="cpu")
    t.setup(model=build_shape_model(spec, "bf16", torch.device("cpu"), torch.float32, seed=0), tokenizer=None,
            task=_synthetic_task(6, 6, 5), prompt_ids=synthetic_prompts(6, 6, spec.vocab, 0),
            reward_fn=synthetic_reward(0))
    return t


def _tokens(groups: list) -> list[list[int]]:
    return [list(s.token_ids) for _, samples, _, _ in groups for s in samples]


def test_next_rollouts_sample_the_policy_before_the_update(tmp_path: Path) -> None:
    fast = _trainer(tmp_path / "async", True)
    first = fast.train_step()
    assert first["rollout/policy_lag"] == 0.0 and fast.pending is not None
    in_flight = fast.pending.take()
    # the same two steps' rollouts collected back to back, no update between: what the stale policy samples
    ref = _trainer(tmp_path / "ref", False)
    ref.collect_rollouts(0, ref.rollout_noise(0))
    stale = ref.collect_rollouts(1, ref.rollout_noise(1))
    assert in_flight.step == 1 and _tokens(in_flight.groups) == _tokens(stale.groups)
    assert [s.logprobs.tolist() for _, ss, _, _ in in_flight.groups for s in ss] == \
        [s.logprobs.tolist() for _, ss, _, _ in stale.groups for s in ss]
    # after that update the policy moved: the sync run's own step-2 rollouts (fresh adapters) differ in log-probs
    sync = _trainer(tmp_path / "sync", False)
    sync.train_step()
    fresh = sync.collect_rollouts(1, sync.rollout_noise(1))
    assert [s.logprobs.tolist() for _, ss, _, _ in fresh.groups for s in ss] != \
        [s.logprobs.tolist() for _, ss, _, _ in stale.groups for s in ss]


def test_async_steps_train_with_the_correction_and_checkpoint_the_data_position(tmp_path: Path) -> None:
    t = _trainer(tmp_path / "run", True)
    lags = []
    for _ in range(3):
        m = t.train_step()
        lags.append(m["rollout/policy_lag"])
        assert torch.isfinite(torch.tensor(m["loss"])) and "sampling/is_weight_mean" in m
        if t.pending is not None:
            # a checkpoint now records the data position before the rollouts in flight
            assert t.trainer_state()["data"] == t.pending.resume_state["data"] != t.stream.state()
    assert lags == [0.0, 1.0, 1.0] and t.pending is None


def test_async_rollout_refusals() -> None:
    assert build_config(None, {"async_rollout": True}).resolved().correction == "token_tis"
    with pytest.raises(QerlError, match="keep an importance correction"):
        build_config(None, {"async_rollout": True, "correction": "none"})
    with pytest.raises(QerlError, match="does not combine with --rollout-engine vllm"):
        build_config(None, {"async_rollout": True, "rollout_engine": "vllm"})
