"""The TrainConfig is the run's request, read and never rewritten: assigning to it fails, resolving it copies."""

from __future__ import annotations

import dataclasses

import pytest

from qerl_cli.train.config import TrainConfig


def test_assigning_a_field_raises() -> None:
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.resolved().lr = 1.0  # type: ignore[misc]
    assert cfg.steps == 20


def test_resolved_leaves_the_request_as_asked() -> None:
    cfg = TrainConfig(algo="dapo", rollout_quant="int8")
    before = dataclasses.asdict(cfg)
    r = cfg.resolved()
    assert dataclasses.asdict(cfg) == before
    assert (r.lr, r.lora_alpha, r.scale_rewards, r.dynamic_sampling) == (1e-5, 2 * cfg.lora_rank, "group", True)
    assert (r.correction, r.correction_cap, r.requant_scales) == ("token_tis", 2.0, "fixed")
    assert r.overlong_buffer == cfg.max_completion_length // 4
    assert r.epsilon is not None and r.epsilon_high is not None
    assert r.resolved() == r


def test_replace_builds_a_new_config() -> None:
    cfg = TrainConfig()
    assert dataclasses.replace(cfg, steps=3).steps == 3 and cfg.steps == 20
