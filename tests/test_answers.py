"""Answer extraction and number normalisation, checked against hand-read expectations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import qerl_cli
from qerl_cli.tasks.answers import (
    extract_answer_tag,
    extract_boxed,
    extract_first_number,
    extract_flexible,
    extract_gsm8k,
    extract_strict,
    gsm8k_gold,
    normalize_number,
    numbers_equal,
)

GSM8K_DIR = Path(qerl_cli.__file__).parent / "data" / "gsm8k"

# (completion, strict, flexible, answer_tag) exactly as each extractor must return them.
EXTRACTION_TABLE = [
    ("So she sold 48 + 24 = 72 clips.\n#### 72", "72", "72", None),
    ("Total is 1,234 apples.\n#### 1,234", "1,234", "1,234", None),
    ("#### 1,000.", "1,000.", "1,000", None),
    ("He pays $18.\n#### $18", None, "18", None),  # lm-eval strict regex has no "$"
    ("It costs 18 dollars.", None, "18", None),
    ("The distance is 5 km.", None, "5", None),
    ("The temperature drops to -3 degrees.\n#### -3", "-3", "-3", None),
    ("The temperature drops to \u22123 degrees.", None, "\u22123", None),  # U+2212 minus sign
    ("10-3=7", None, "7", None),  # a hyphen between operands is not a sign
    ("Each costs 2.50, so\n#### 2.50", "2.50", "2.50", None),
    ("#### 72.0", "72.0", "72.0", None),
    ("She ate 3/4 of the pie.", None, "3/4", None),
    ("First 12, then 15, finally 20.", None, "20", None),
    ("#### 3 was wrong, the right one:\n#### 5", "5", "5", None),
    ("I do not know.", None, None, None),
    ("Hmm... thinking...", None, None, None),
    ("<answer>18 dollars</answer>", None, "18", "18 dollars"),
    ("<answer>7</answer> then <answer> 9 </answer>", None, "9", "9"),
    ("We add them. The answer is 42.", None, "42", "42"),
    ("Final answer: $1,500", None, "1,500", "1,500"),  # "$" is stripped like a TeX math delimiter
    ("The answer is $\\frac{3}{4}$.", None, "4", "\\frac{3}{4}"),
    ("so $x = \\boxed{\\frac{1}{2}}$", None, "2", "\\frac{1}{2}"),
    ("The final answer is $\\boxed{7}$. I hope it is correct.", None, "7", "7"),
]


@pytest.mark.parametrize(("completion", "strict", "flexible", "tag"), EXTRACTION_TABLE)
def test_extraction_table(completion: str, strict: str | None, flexible: str | None, tag: str | None) -> None:
    assert extract_strict(completion) == strict
    assert extract_flexible(completion) == flexible
    assert extract_answer_tag(completion) == tag


NORMALIZE_TABLE = [
    ("1,000", "1000"),
    ("$1000.00", "1000"),
    ("1000", "1000"),
    ("1,000.", "1000"),
    ("+5", "5"),
    ("-3", "-3"),
    ("\u22123", "-3"),
    ("2.50", "2.5"),
    ("72.0", "72"),
    ("0.750", "0.75"),
    ("3/4", "0.75"),
    ("1/3", "1/3"),
    ("-1/8", "-0.125"),
    (".5", "0.5"),
    ("18 dollars", "18"),
    ("5 km", "5"),
    ("50%", "50"),
    ("\\$5", "5"),
    ("1,234,567", "1234567"),
    (" 7 ", "7"),
    ("abc", None),
    ("", None),
    ("3.5.2", None),  # not a number followed by a unit
    ("2,50", None),  # not a thousands group
    ("1/0", None),
]


@pytest.mark.parametrize(("text", "expected"), NORMALIZE_TABLE)
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


# (gold, prediction, equal?)
EQUAL_TABLE = [
    ("1000", "1,000", True),
    ("1000", "$1000.00", True),
    ("2.5", "2.50", True),
    ("0.75", "3/4", True),
    ("-3", "\u22123", True),
    ("1000", "1000.5", False),
    ("1000000", "1000001", False),  # no float tolerance between integers
    ("0.1", "0.1000001", False),  # terminating decimals compare exactly
    ("1/3", "0.333333", True),  # a non-terminating value may be written rounded (rel tol 1e-6)
    ("2/3", "0.666667", True),
    ("1/3", "0.33333", False),  # ... but not rounded too coarsely
    ("5", None, False),
    ("5", "five", False),
]


@pytest.mark.parametrize(("gold", "pred", "equal"), EQUAL_TABLE)
def test_numbers_equal(gold: str, pred: str | None, equal: bool) -> None:
    assert numbers_equal(gold, pred) is equal
    assert numbers_equal(pred, gold) is equal


BOXED_TABLE = [
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{\\left\\{ 1, 2 \\right\\}}", "\\left\\{ 1, 2 \\right\\}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}} is it", "\\frac{\\sqrt{3}}{2}"),
    ("$\\boxed 5$", "5"),
    ("\\fbox{3}", "3"),
    ("\\boxed {12}", "12"),
    ("\\boxed{\\frac{1}{2", None),  # truncated: braces never close
    ("no box", None),
    ("\\boxedx{3}", None),  # a different command
]


@pytest.mark.parametrize(("text", "expected"), BOXED_TABLE)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_extract_first_number_reads_the_answer_after_equals() -> None:
    assert extract_first_number(" 19\n3 + 4 = 7") == "19"
    assert extract_first_number(" -4") == "-4"
    assert extract_first_number(" twelve") is None


def test_extract_gsm8k_modes() -> None:
    text = "<answer>12</answer> I also computed 99"
    assert extract_gsm8k(text, "auto") == "12"  # the declared answer beats the last number
    assert extract_gsm8k(text, "flexible") == "99"
    assert extract_gsm8k(text, "strict") is None
    assert extract_gsm8k(text + "\n#### 13", "auto") == "13"
    assert extract_gsm8k("The answer is $\\frac{3}{4}$.", "auto") == "3/4"
    assert extract_gsm8k("The answer is forty. 40", "auto") == "40"  # tag without a number falls through
    with pytest.raises(ValueError, match="unknown GSM8K extraction mode"):
        extract_gsm8k(text, "fuzzy")


def test_gsm8k_gold_on_bundled_rows() -> None:
    train = [json.loads(line) for line in (GSM8K_DIR / "train.jsonl").open()]
    test = [json.loads(line) for line in (GSM8K_DIR / "test.jsonl").open()]
    assert gsm8k_gold(train[0]["answer"]) == "72"  # Natalia's clips
    assert gsm8k_gold(train[1]["answer"]) == "10"  # Weng's babysitting
    assert gsm8k_gold(test[0]["answer"]) == "18"  # Janet's ducks
    with_commas = [r for r in train if "####" in r["answer"] and "," in r["answer"].rsplit("####", 1)[1]]
    assert gsm8k_gold(with_commas[0]["answer"]) == "1080"
    negatives = [gsm8k_gold(r["answer"]) for r in test if gsm8k_gold(r["answer"]).startswith("-")]
    assert negatives == ["-10", "-3"]
    # Every gold of both splits is a plain (possibly negative) integer once commas are gone.
    for row in train + test:
        gold = gsm8k_gold(row["answer"])
        assert normalize_number(gold) == gold
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_gold("no marker here")


def test_reference_solutions_score_themselves() -> None:
    # The worked solutions of the test split, used as completions, must all score under strict-match.
    test = [json.loads(line) for line in (GSM8K_DIR / "test.jsonl").open()]
    for row in test:
        gold = gsm8k_gold(row["answer"])
        assert numbers_equal(extract_strict(row["answer"]), gold)
        assert numbers_equal(extract_gsm8k(row["answer"]), gold)
