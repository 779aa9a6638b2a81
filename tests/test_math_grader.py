"""MATH grading: math-verify in worker processes (with our own timeout) and the exact-match fallback."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import qerl_cli
from qerl_cli.tasks.math_grader import (
    MathGrader,
    extract_math_answer,
    fallback_equal,
    math_verify_available,
    normalize_latex_answer,
    scorer_version,
)

MATH500 = Path(qerl_cli.__file__).parent / "data" / "math500" / "test.jsonl"

needs_math_verify = pytest.mark.skipif(not math_verify_available(), reason="math-verify not installed")


@pytest.fixture(scope="module")
def mv_grader() -> Iterator[MathGrader]:
    if not math_verify_available():
        pytest.skip("math-verify not installed")
    with MathGrader(timeout_s=10.0, use_math_verify=True) as g:
        yield g


@pytest.fixture(scope="module")
def fb_grader() -> MathGrader:
    return MathGrader(use_math_verify=False)


# (completion, gold) pairs that are the same answer written differently.
EQUIVALENT = [
    ("so the answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("$\\boxed{0.5}$", "\\frac{1}{2}"),
    ("$\\boxed{\\dfrac{3}{56}}$", "\\frac{3}{56}"),
    ("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}"),
    ("$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("$\\boxed{x=5}$", "5"),
    ("$\\boxed{90^\\circ}$", "90"),
    ("$\\boxed{6-5i}$", "6 - 5i"),
    ("$\\boxed{1,000}$", "1000"),
    ("$\\boxed{-\\frac{2}{3}}$", "-\\frac{2}{3}"),
]

# (completion, gold) pairs that must NOT be accepted.
NOT_EQUIVALENT = [
    ("$\\boxed{\\frac{1}{3}}$", "\\frac{1}{2}"),
    ("$\\boxed{2\\sqrt{3}}$", "\\sqrt{8}"),
    ("$\\boxed{\\left( 3, \\pi \\right)}$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("$\\boxed{-5}$", "5"),
    ("I could not solve it.", "5"),
    ("$\\boxed{\\frac{1}{2", "\\frac{1}{2}"),  # truncated completion
]


@needs_math_verify
@pytest.mark.parametrize(("completion", "gold"), EQUIVALENT)
def test_math_verify_accepts_equivalent(mv_grader: MathGrader, completion: str, gold: str) -> None:
    grade = mv_grader.grade(completion, gold)
    assert grade.correct, grade


@needs_math_verify
@pytest.mark.parametrize(("completion", "gold"), NOT_EQUIVALENT)
def test_math_verify_rejects_different(mv_grader: MathGrader, completion: str, gold: str) -> None:
    grade = mv_grader.grade(completion, gold)
    assert not grade.correct, grade
    assert grade.method == "math_verify" and grade.note == ""


@needs_math_verify
def test_math_verify_decides_symbolic_case_fallback_cannot(mv_grader: MathGrader) -> None:
    # 2*sqrt(2) == sqrt(8) needs algebra: only math-verify sees it.
    assert mv_grader.grade("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}").method == "math_verify"
    assert not fallback_equal("2\\sqrt{2}", "\\sqrt{8}")


@needs_math_verify
def test_textual_answer_falls_back_to_exact_match(mv_grader: MathGrader) -> None:
    grade = mv_grader.grade("The winner is $\\boxed{\\text{Evelyn}}$.", "\\text{Evelyn}")
    assert grade.correct


@needs_math_verify
def test_grading_off_the_main_thread(mv_grader: MathGrader) -> None:
    # math-verify's own signal.alarm timeout raises off the main thread; our worker processes do not.
    results: list[object] = []

    def work() -> None:
        try:
            results.append(mv_grader.grade("$\\boxed{\\dfrac{14}{3}}$", "\\frac{14}{3}"))
            results.append(mv_grader.grade("$\\boxed{4}$", "\\frac{14}{3}"))
        except Exception as exc:  # surfaced to the main thread below
            results.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert [getattr(r, "correct", r) for r in results] == [True, False]
    assert all(getattr(r, "method", None) == "math_verify" for r in results)


@needs_math_verify
def test_timeout_kills_worker_and_recovers() -> None:
    with MathGrader(timeout_s=0.5, use_math_verify=True) as g:
        slow = g.grade("$\\boxed{9^{9^{9^{9}}}}$", "1")  # sympy tries to evaluate a tower of powers
        assert (slow.correct, slow.method, slow.note) == (False, "fallback", "timeout")
        # The fallback still decides a timed-out case it can read exactly.
        assert g.grade("$\\boxed{9^{9^{9^{9}}}}$", "9^{9^{9^{9}}}").correct
        after = g.grade("$\\boxed{12}$", "12")  # a fresh worker takes over
        assert (after.correct, after.method) == (True, "math_verify")


@needs_math_verify
def test_reference_solutions_grade_correct(mv_grader: MathGrader) -> None:
    rows = [json.loads(line) for line in MATH500.open()][:60]
    grades = mv_grader.grade_many([r["solution"] for r in rows], [r["answer"] for r in rows])
    assert all(g.correct for g in grades)
    # Shifting every gold by one problem must make (almost) all of them wrong.
    shifted = mv_grader.grade_many([r["solution"] for r in rows[1:]], [r["answer"] for r in rows[:-1]])
    assert sum(g.correct for g in shifted) <= 3


def test_scorer_version_names_the_grader() -> None:
    v = scorer_version()
    if math_verify_available():
        assert v.startswith("math_verify ") and "latex2sympy2_extended" in v
    else:
        assert "fallback" in v


# ---------------------------------------------------------------- fallback path, explicitly

NORMALIZE = [
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("\\dfrac{14}{3}", "\\frac{14}{3}"),
    ("\\tfrac12", "\\frac{1}{2}"),
    ("\\frac{1}2", "\\frac{1}{2}"),
    ("11\\sqrt2", "11\\sqrt{2}"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("x = 5", "5"),
    ("5.", "5"),
    ("10\\%", "10"),
    ("\\$18.50", "18.50"),
    ("5\\text{ cm}", "5"),
    ("12 \\mbox{ inches}^2", "12"),
    ("\\text{Evelyn}", "Evelyn"),
    ("1{,}000", "1000"),
    ("1,000,000", "1000000"),
    ("1,-2", "1,-2"),  # a list, not a thousands separator
    ("3\\!\\cdot\\!4", "3\\cdot4"),
    ("$\\boxed{7}$", "7"),
    ("p - q", "p-q"),
    ("x+y=5", "x+y=5"),  # an equation keeps its left side
]


@pytest.mark.parametrize(("raw", "expected"), NORMALIZE)
def test_normalize_latex_answer(raw: str, expected: str) -> None:
    assert normalize_latex_answer(raw) == expected


FALLBACK_EQUAL = [
    ("\\frac{1}{2}", "0.5", True),
    ("-\\frac{3}{4}", "-0.75", True),
    ("\\dfrac{3}{56}", "\\frac{3}{56}", True),
    ("x=5", "5", True),
    ("5\\text{ cm}", "5", True),
    ("\\left(3,\\frac{\\pi}{2}\\right)", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\frac{1}{3}", "\\frac{1}{2}", False),
    ("6+5i", "6 - 5i", False),
    ("", "5", False),
    (None, "5", False),
]


@pytest.mark.parametrize(("pred", "gold", "equal"), FALLBACK_EQUAL)
def test_fallback_equal(pred: str | None, gold: str, equal: bool) -> None:
    assert fallback_equal(pred, gold) is equal


def test_fallback_grader_reports_its_method(fb_grader: MathGrader) -> None:
    good = fb_grader.grade("Thus $\\boxed{\\dfrac{14}{3}}$.", "\\frac{14}{3}")
    assert (good.correct, good.method, good.pred) == (True, "fallback", "\\dfrac{14}{3}")
    bad = fb_grader.grade("Thus $\\boxed{4}$.", "\\frac{14}{3}")
    assert (bad.correct, bad.method) == (False, "fallback")
    # Without a box the declared answer is read from "The answer is ...".
    assert fb_grader.grade("The answer is 42.", "42").correct
    assert extract_math_answer("no answer here") is None


def test_fallback_off_the_main_thread(fb_grader: MathGrader) -> None:
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(fb_grader.grade("$\\boxed{3}$", "3").correct))
    t.start()
    t.join(10)
    assert out == [True]


def test_fallback_reads_every_reference_solution() -> None:
    # All 500 MATH-500 solutions box an answer that normalises to the dataset's answer field.
    rows = [json.loads(line) for line in MATH500.open()]
    misses = [r["unique_id"] for r in rows if not fallback_equal(extract_math_answer(r["solution"]), r["answer"])]
    assert misses == []


@needs_math_verify
def test_worker_that_cannot_start_falls_back_once_and_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    # An interpreter that exits at once stands in for a broken environment (no real library is faked).
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` executable")
    monkeypatch.setattr(sys, "executable", false)
    with MathGrader(timeout_s=2.0, use_math_verify=True) as g:
        first = g.grade("$\\boxed{3}$", "3")
        assert (first.correct, first.method) == (True, "fallback")
        assert first.note.startswith("error: math_verify worker did not start")
        second = g.grade("$\\boxed{4}$", "3")  # no second start attempt: same note, decided at once
        assert (second.correct, second.method, second.note) == (False, "fallback", first.note)
