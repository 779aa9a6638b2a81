"""The arith sanity task: prompt format, determinism, split hygiene, difficulty knob, scoring."""

from __future__ import annotations

import pytest

from qerl_cli.errors import QerlError
from qerl_cli.tasks.arith import (
    LEVELS,
    SHOTS,
    STOP,
    ArithProblem,
    arith_prompt,
    continuous_mixture,
    generate_arith,
    max_unique,
    parse_level_spec,
    pool_size,
    problem_split,
    score_arith,
)

REFERENCE_PREFIX = "2 + 3 = 5\n14 + 5 = 19\n7 * 6 = 42\n31 + 22 = 53\n"


def test_prompt_is_the_measured_few_shot_completion_format() -> None:
    assert arith_prompt(ArithProblem(8, "+", 9, 1)) == REFERENCE_PREFIX + "8 + 9 ="
    assert arith_prompt("8 * 9", shots=2) == "2 + 3 = 5\n14 + 5 = 19\n8 * 9 ="
    assert arith_prompt("8 * 9", shots=0) == "8 * 9 ="
    assert STOP == "\n"
    with pytest.raises(QerlError, match="0 to 4 shots"):
        arith_prompt("1 + 1", shots=5)


def test_levels_generate_their_kind() -> None:
    for level, lv in LEVELS.items():
        probs = generate_arith(40, level, "train", seed=1)
        assert len(probs) == 40
        for p in probs:
            assert p.level == level and p.op == lv.op
            assert len(str(p.a)) == lv.digits_a and len(str(p.b)) == lv.digits_b
    assert ArithProblem(12, "*", 7, 5).answer == 84
    assert ArithProblem(31, "+", 22, 3).answer == 53


def test_generation_is_deterministic_and_seeded() -> None:
    a = generate_arith(50, "mixed", "train", seed=3)
    b = generate_arith(50, "mixed", "train", seed=3)
    c = generate_arith(50, "mixed", "train", seed=4)
    assert a == b
    assert a != c


def test_train_and_test_never_share_a_problem_and_shots_are_excluded() -> None:
    shot_texts = {f"{x} {op} {y}" for x, op, y in SHOTS}
    for level in LEVELS:
        if level == 6:
            continue  # 810,000 problems: sampled, checked below on a sample
        train = {p.text for p in generate_arith(pool_size(level, "train"), level, "train", seed=0)}
        test = {p.text for p in generate_arith(max_unique(level, "test"), level, "test", seed=0)}
        assert not train & test
        assert not (train | test) & shot_texts
        assert all(problem_split(t) == "train" for t in train)
        assert all(problem_split(t) == "test" for t in test)
    big_train = {p.text for p in generate_arith(500, 6, "train")}
    big_test = {p.text for p in generate_arith(500, 6, "test")}
    assert not big_train & big_test


def test_pool_sizes_by_hand() -> None:
    # One-digit operands are 1..9: 81 problems per kind; "2 + 3" is a shot (level 1), "7 * 6" too (level 4).
    assert pool_size(1, "train") + pool_size(1, "test") == 81 - 1
    assert pool_size(4, "train") + pool_size(4, "test") == 81 - 1
    assert pool_size(2, "train") + pool_size(2, "test") == 90 * 9 - 1  # minus "14 + 5"
    assert pool_size(3, "train") + pool_size(3, "test") == 90 * 90 - 1  # minus "31 + 22"


def test_test_split_is_unique_and_capped() -> None:
    n = max_unique(1, "test")
    probs = generate_arith(n, 1, "test")
    assert len({p.text for p in probs}) == n
    with pytest.raises(QerlError, match="only"):
        generate_arith(n + 1, 1, "test")
    # The train split cycles: every problem once before any problem twice.
    pool = pool_size(1, "train")
    cycled = generate_arith(pool + 5, 1, "train")
    assert len({p.text for p in cycled[:pool]}) == pool
    assert len({p.text for p in cycled}) == pool


def test_level_specs() -> None:
    assert parse_level_spec(3) == {3: 1.0}
    assert parse_level_spec("3") == {3: 1.0}
    assert parse_level_spec("mixed") == {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25}
    assert parse_level_spec("1,4") == {1: 0.5, 4: 0.5}
    assert parse_level_spec([2, 3]) == {2: 0.5, 3: 0.5}
    for bad in ("9", "easy", "d=2", "d=x", 0):
        with pytest.raises(QerlError):
            parse_level_spec(bad)


def test_continuous_knob_walks_measured_difficulty() -> None:
    # Order by accuracy measured on SmolLM2-135M: 1 (64%), 4 (59%), 2 (34%), 3 (16%).
    assert continuous_mixture(0.0) == {1: 1.0}
    assert continuous_mixture(1.0) == {3: 1.0}
    assert continuous_mixture(0.5) == {4: 0.5, 2: 0.5}
    mix = continuous_mixture(1 / 6)
    assert mix.keys() == {1, 4} and mix[1] == pytest.approx(0.5)
    probs = generate_arith(100, "d=0.5", "train", seed=0)
    assert sorted(p.level for p in probs) == [2] * 50 + [4] * 50


def test_mixed_allocation_is_exact() -> None:
    probs = generate_arith(10, "mixed", "train")
    counts = {k: sum(p.level == k for p in probs) for k in (1, 2, 3, 4)}
    assert sorted(counts.values()) == [2, 2, 3, 3]


SCORE_TABLE = [
    (" 17\n", "17", True),
    (" 17", "17", True),
    ("17", "17", True),
    (" 17.0\n", "17", True),
    (" 18\n", "17", False),
    (" 1 7", "17", False),
    (" 17 + 1 = 18", "17", True),  # the first number decides
    ("\n17", "17", False),  # nothing before the stop string
    (" seventeen", "17", False),
    (" -4", "-4", True),
    ("", "17", False),
]


@pytest.mark.parametrize(("completion", "answer", "correct"), SCORE_TABLE)
def test_score_arith(completion: str, answer: str, correct: bool) -> None:
    assert score_arith(completion, answer) is correct
