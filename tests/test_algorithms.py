"""The RL algorithm registry: each algorithm's defaults, config rules and normaliser, and that a new algorithm is
one class plus one registry line (policy_loss, the config's --algo choices and its validation pick it up)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.train.algos import ALGORITHMS, Algorithm, LossSettings, TokenView, clipped_names, get_algorithm
from qerl_cli.train.config import TrainConfig, check_value
from qerl_cli.train.losses import policy_loss, resolve_clip

D = torch.float64
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.4, 0.0]], dtype=D)
ADV = torch.tensor([1.0, -2.0], dtype=D)


def test_the_registry_lists_each_algorithm_once_under_its_own_name() -> None:
    assert list(ALGORITHMS) == ["grpo", "dapo", "dr_grpo", "gspo", "pg_seq_is", "pg_seq_tis"]
    assert all(cls.name == name for name, cls in ALGORITHMS.items())
    assert clipped_names() == ("grpo", "dapo", "dr_grpo", "gspo")


def test_an_unknown_name_is_one_line_naming_the_choices() -> None:
    with pytest.raises(QerlError, match=r"^unknown loss algorithm 'ppo'; choose one of grpo, dapo, dr_grpo, gspo, "
                                        r"pg_seq_is, pg_seq_tis$"):
        get_algorithm("ppo")
    with pytest.raises(QerlError, match=r"^'pg_seq_is' has no clipping; clipped algorithms: grpo, dapo, dr_grpo, "
                                        r"gspo$"):
        resolve_clip("pg_seq_is", None, None)


@pytest.mark.parametrize(("algo", "expected"), [
    # scale_rewards, dynamic_sampling, overlong_buffer (max_completion_length 256), epsilon, epsilon_high
    ("grpo", ("group", False, 0, 0.2, 0.2)),
    ("dapo", ("group", True, 64, 0.2, 0.28)),
    ("dr_grpo", ("none", False, 0, 0.2, 0.2)),
    ("gspo", ("group", False, 0, 3e-4, 4e-4)),
    ("pg_seq_is", ("group", False, 0, None, None)),
    ("pg_seq_tis", ("group", False, 0, None, None)),
])
def test_each_algorithm_fills_in_its_defaults(algo: str, expected: tuple[object, ...]) -> None:
    r = TrainConfig(algo=algo).resolved()
    assert (r.scale_rewards, r.dynamic_sampling, r.overlong_buffer, r.epsilon, r.epsilon_high) == expected


def test_explicit_values_win_over_the_algorithm_defaults() -> None:
    r = TrainConfig(algo="dapo", epsilon=0.1, scale_rewards="batch", dynamic_sampling=False, overlong_buffer=8,
                    tools="calculator", max_episode_tokens=400).resolved()
    assert (r.epsilon, r.epsilon_high, r.scale_rewards, r.dynamic_sampling, r.overlong_buffer) == (
        0.1, 0.28, "batch", False, 8)
    assert TrainConfig(algo="grpo", epsilon=0.1).resolved().epsilon_high == 0.1  # symmetric: follows epsilon
    # DAPO's buffer is a quarter of an episode's tokens where there are episodes
    assert TrainConfig(algo="dapo", tools="calculator", max_episode_tokens=400).resolved().overlong_buffer == 100


def test_a_group_is_needed_except_by_pg_seq_is() -> None:
    TrainConfig(algo="pg_seq_is", num_generations=1).validate()
    for algo in ("grpo", "pg_seq_tis"):
        with pytest.raises(QerlError, match="^--num-generations must be >= 2: group-relative advantages need a "
                                            "group$"):
            TrainConfig(algo=algo, num_generations=1).validate()


def test_normalizers_are_the_whole_batch_ones_the_trainer_used() -> None:
    # before the algorithms were objects the trainer divided by: DAPO the mask's sum, Dr. GRPO B x the completion
    # length, every other algorithm B
    assert get_algorithm("dapo").normalizer(MASK, 8) == 5.0
    assert get_algorithm("dr_grpo").normalizer(MASK, 8) == 16.0
    for algo in ("grpo", "gspo", "pg_seq_is", "pg_seq_tis"):
        assert get_algorithm(algo).normalizer(MASK, 8) == 2.0
    assert get_algorithm("dapo").normalizer(torch.zeros(2, 3), None) == 1.0  # never a division by zero
    with pytest.raises(QerlError, match="dr_grpo needs max_completion_length"):
        get_algorithm("dr_grpo").normalizer(MASK, None)
    with pytest.raises(QerlError, match="completions have 3 positions but max_completion_length is 2"):
        get_algorithm("dr_grpo").normalizer(MASK, 2)


class Reinforce(Algorithm):
    """Plain REINFORCE: -A log pi(y_t) per token, each sequence's sum, averaged over sequences."""

    name = "reinforce_test"

    def per_token(self, t: TokenView, settings: LossSettings, metrics: dict[str, float]) -> torch.Tensor:
        metrics["adv_mean"] = t.adv.mean().item()
        return -t.adv[:, None] * t.lp


def test_a_new_algorithm_is_one_class_and_one_registry_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as mp:
        mp.setitem(ALGORITHMS, Reinforce.name, Reinforce)  # the registry line
        logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.4, -math.inf]], dtype=D, requires_grad=True)
        loss, metrics = policy_loss("reinforce_test", logp, OLD, ADV, MASK)
        # row 0: -(1)(-3.5) = 3.5; row 1: -(-2)(-0.7) = -1.4; the padded -inf never enters
        assert loss.item() == pytest.approx((3.5 - 1.4) / 2, abs=1e-12)
        (g,) = torch.autograd.grad(loss, logp)
        assert g[0].tolist() == pytest.approx([-0.5, -0.5, -0.5], abs=1e-12)  # -A / B
        assert g[1].tolist() == pytest.approx([1.0, 1.0, 0.0], abs=1e-12)
        assert metrics == {"adv_mean": -0.5}
        # the config takes it as a choice, fills in the base defaults and checks the base rules
        assert check_value("algo", "reinforce_test") == "reinforce_test"
        r = TrainConfig(algo="reinforce_test").resolved()
        assert (r.scale_rewards, r.dynamic_sampling, r.overlong_buffer, r.epsilon) == ("group", False, 0, None)
        with pytest.raises(QerlError, match="--num-generations must be >= 2"):
            dataclasses.replace(r, num_generations=1).validate()
    assert "reinforce_test" not in ALGORITHMS
    with pytest.raises(QerlError, match="unknown loss algorithm 'reinforce_test'"):
        policy_loss("reinforce_test", OLD.clone(), OLD, ADV, MASK)
