"""Reward functions: hand-scored completions, the registry, import paths, and checked calls."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.tasks.rewards import (
    FORMAT_BONUS,
    REWARDS,
    arith_reward,
    get_reward,
    make_format_reward,
    make_gsm8k_reward,
    safe_rewards,
)

GSM8K_COMPLETIONS = [
    "16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18",  # strict and flexible
    "She makes $18 every day.",  # flexible only
    "<answer>18</answer> (I first thought 20)",  # answer tag beats the last number
    "#### 1,8",  # not a thousands group: no strict number, and the last number is 8
    "She makes 9 * 2 = $18.00.",  # decimals and currency
    "I cannot tell.",
]


def call(fn, completions, answers, **kwargs):  # TRL's calling convention: everything by keyword
    return fn(prompts=["p"] * len(completions), completions=completions, answer=answers, **kwargs)


def test_gsm8k_rewards_by_hand() -> None:
    gold = ["18"] * len(GSM8K_COMPLETIONS)
    assert call(REWARDS["gsm8k"], GSM8K_COMPLETIONS, gold) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert call(REWARDS["gsm8k_strict"], GSM8K_COMPLETIONS, gold) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert call(REWARDS["gsm8k_flexible"], GSM8K_COMPLETIONS, gold) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert call(make_gsm8k_reward("answer_tag"), GSM8K_COMPLETIONS, gold) == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert REWARDS["gsm8k"].__name__ == "gsm8k"  # TRL logs rewards/<__name__>


def test_gsm8k_reward_with_bundled_gold_and_trl_kwargs() -> None:
    out = call(REWARDS["gsm8k"], ["... #### 1,080", "... #### 1080.0", "... #### 108"], ["1080"] * 3,
               completion_ids=[[1], [2], [3]], trainer_state=None, level=[1, 1, 1])
    assert out == [1.0, 1.0, 0.0]


def test_conversational_completions() -> None:
    completions = [[{"role": "assistant", "content": "so #### 18"}], [{"role": "assistant", "content": "17"}]]
    assert call(REWARDS["gsm8k"], completions, ["18", "18"]) == [1.0, 0.0]


def test_math_reward() -> None:
    completions = ["$\\boxed{\\dfrac{14}{3}}$", "$\\boxed{4}$", "no box at all"]
    assert call(REWARDS["math"], completions, ["\\frac{14}{3}"] * 3) == [1.0, 0.0, 0.0]


def test_arith_reward() -> None:
    assert call(arith_reward, [" 19\n", " 19", " 18\n", "\n19", " 19 + 1 = 20"], ["19"] * 5) == [
        1.0, 1.0, 0.0, 0.0, 1.0]


def test_format_reward() -> None:
    assert call(REWARDS["format"], ["x\n#### 5", "#### five", "5"], None) == [FORMAT_BONUS, 0.0, 0.0]
    assert call(make_format_reward(1.0), ["#### -2"], None) == [1.0]


def test_reward_argument_errors() -> None:
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        call(REWARDS["gsm8k"], ["#### 1"], None)
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        call(REWARDS["arith"], [" 1", " 2"], ["1"])
    with pytest.raises(QerlError, match="unknown GSM8K extraction mode"):
        make_gsm8k_reward("exact")


def test_get_reward_registry_and_import_paths(tmp_path: Path) -> None:
    assert get_reward("arith") is arith_reward
    assert get_reward("qerl_cli.tasks.rewards:arith_reward") is arith_reward
    assert get_reward("qerl_cli.tasks.rewards.arith_reward") is arith_reward
    user = tmp_path / "my_rewards.py"
    user.write_text("def length_penalty(prompts, completions, **kw):\n"
                    "    return [-len(c) / 100 for c in completions]\n")
    fn = get_reward(f"{user}:length_penalty")
    assert call(fn, ["abcd", ""], None) == [-0.04, 0.0]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("gsm8", "unknown reward 'gsm8'"),
        ("no_such_pkg.mod:fn", "cannot import 'no_such_pkg.mod'"),
        ("qerl_cli.tasks.rewards:nope", "has no attribute 'nope'"),
        ("qerl_cli.tasks.rewards:FORMAT_BONUS", "is not callable"),
        ("missing_file.py:fn", "does not exist"),
    ],
)
def test_get_reward_errors(name: str, message: str) -> None:
    with pytest.raises(QerlError, match=message):
        get_reward(name)


def test_safe_rewards_accepts_good_outputs() -> None:
    assert safe_rewards(REWARDS["gsm8k"], ["p", "p"], ["#### 3", "#### 4"], ["3", "3"]) == [1.0, 0.0]

    def as_numpy(prompts, completions, **kw):
        return np.array([0.5, 1])

    def as_tensor(prompts, completions, **kw):
        return torch.tensor([True, False])

    assert safe_rewards(as_numpy, ["p", "p"], ["a", "b"]) == [0.5, 1.0]
    assert safe_rewards(as_tensor, ["p", "p"], ["a", "b"]) == [1.0, 0.0]


def broken(prompts, completions, **kw):
    raise KeyError("answer")


def too_short(prompts, completions, **kw):
    return [1.0]


def nan_reward(prompts, completions, **kw):
    return [0.0, math.nan]


def inf_reward(prompts, completions, **kw):
    return [math.inf, 0.0]


def none_reward(prompts, completions, **kw):
    return [None, 1.0]


def string_reward(prompts, completions, **kw):
    return "1.0"


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (broken, r"reward function 'broken' raised KeyError"),
        (too_short, r"'too_short' returned 1 values for 2 completions"),
        (nan_reward, r"'nan_reward' returned nan at index 1"),
        (inf_reward, r"'inf_reward' returned inf at index 0"),
        (none_reward, r"'none_reward' returned None \(NoneType\) at index 0"),
        (string_reward, r"'string_reward' returned str"),
    ],
)
def test_safe_rewards_names_the_broken_function(fn, message: str) -> None:
    with pytest.raises(QerlError, match=message) as info:
        safe_rewards(fn, ["p", "p"], ["a", "b"], ["1", "2"])
    assert "\n" not in str(info.value)
