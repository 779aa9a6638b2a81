"""Advantages, overlong shaping and dynamic sampling against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.train.advantages import (
    DynamicSampler,
    dapo_overlong_penalty,
    dynamic_sampling_keep,
    group_advantages,
)

# Two prompts x G=4: group 0 is half right, group 1 all equal.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)


def test_group_scaling_uses_unbiased_group_std():
    adv, stats = group_advantages(REWARDS, 4, "group")
    # group 0: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3
    std0 = math.sqrt(1.0 / 3.0)
    a = 0.5 / (std0 + 1e-4)
    expected = [a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-12)
    assert stats["reward"] == pytest.approx(10.0 / 8.0)
    assert stats["reward_std"] == pytest.approx((4 * std0 + 4 * 0.0) / 8)
    assert stats["frac_reward_zero_std"] == pytest.approx(0.5)
    assert stats["frac_group_zero_std"] == pytest.approx(0.5)


def test_batch_scaling_group_mean_batch_std():
    adv, stats = group_advantages(REWARDS, 4, "batch")
    # batch mean 1.25; squared deviations 0.0625, 1.5625, 1.5625, 0.0625, 4 x 0.5625 -> 5.5; /7
    std = math.sqrt(5.5 / 7.0)
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-12)
    assert stats["reward_std"] == pytest.approx(std)
    assert stats["frac_reward_zero_std"] == 0.0  # TRL: batch std is not zero
    assert stats["frac_group_zero_std"] == pytest.approx(0.5)


def test_none_scaling_is_dr_grpo():
    adv, stats = group_advantages(REWARDS, 4, "none")
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert stats["reward_std"] == pytest.approx(4 * math.sqrt(1 / 3) / 8)


def test_custom_eps_and_group_of_one():
    adv, _ = group_advantages(torch.tensor([3.0, 1.0]), 2, "group", eps=0.0)
    # mean 2, unbiased std = sqrt(2 / 1)
    assert adv.tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-6)
    adv1, stats1 = group_advantages(torch.tensor([3.0, 1.0]), 1, "group")
    assert adv1.tolist() == [0.0, 0.0]
    assert stats1["frac_reward_zero_std"] == 1.0


def test_bad_inputs_raise():
    with pytest.raises(QerlError):
        group_advantages(REWARDS, 3)
    with pytest.raises(QerlError):
        group_advantages(REWARDS, 4, "std")  # type: ignore[arg-type]


def test_overlong_penalty_piecewise():
    # L = 10, buffer 4: free up to 6, linear ramp on (6, 10], -1 beyond
    pen = dapo_overlong_penalty(torch.tensor([0, 5, 6, 7, 8, 10, 11, 40]), 10, 4)
    assert pen.tolist() == [0.0, 0.0, 0.0, (6 - 7) / 4, (6 - 8) / 4, (6 - 10) / 4, -1.0, -1.0]
    hard = dapo_overlong_penalty(torch.tensor([10, 11]), 10, 0)
    assert hard.tolist() == [0.0, -1.0]
    with pytest.raises(QerlError):
        dapo_overlong_penalty(torch.tensor([1]), 4, 5)


def test_dynamic_sampling_keep():
    keep = dynamic_sampling_keep(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5]), 2)
    assert keep.tolist() == [False, True, False, False]


def test_dynamic_sampler_refills_and_counts():
    s: DynamicSampler[str] = DynamicSampler(batch_prompts=2, group_size=2, max_refill_rounds=3)
    # round 1: groups a (all 1), b (mixed), c (all 0) -> keeps b
    assert s.add(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), ["a", "b", "c"]) == 1
    assert s.needed == 1 and not s.done
    # round 2: d mixed, e all equal, f mixed -> d fills the batch, f is surplus
    assert s.add(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]), ["d", "e", "f"]) == 1
    assert s.done and s.full
    groups, stats = s.result()
    assert groups == ["b", "d"]
    assert stats == {
        "dynamic/rounds": 2.0,
        "dynamic/groups_generated": 6.0,
        "dynamic/groups_dropped": 3.0,
        "dynamic/groups_surplus": 1.0,
        "dynamic/groups_kept": 2.0,
        "dynamic/filled": 1.0,
        "dynamic/uninformative": 0.0,
    }
    with pytest.raises(QerlError):
        s.add(torch.tensor([1.0, 0.0]), ["g"])


def test_dynamic_sampler_gives_up_after_max_refills():
    s: DynamicSampler[int] = DynamicSampler(batch_prompts=2, group_size=2, max_refill_rounds=1)
    calls = []

    def generate(n: int) -> tuple[torch.Tensor, list[int]]:
        calls.append(n)
        return torch.tensor([1.0, 1.0] * n), list(range(n))  # every group uninformative

    s.fill(generate, prompts_per_round=3)
    groups, stats = s.result()
    assert calls == [3, 3]  # first round + one refill
    # nothing informative anywhere (a saturated policy): the last round's groups, as many as the batch holds,
    # train with zero advantages instead of stopping the run
    assert groups == [0, 1] and stats["dynamic/uninformative"] == 1.0
    assert stats["dynamic/filled"] == 0.0
    assert stats["dynamic/groups_dropped"] == 6.0
