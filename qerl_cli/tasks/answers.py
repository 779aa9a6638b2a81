"""Number normalisation and answer extraction, shared by the rewards and by `qerl eval`.

Reward and eval must read a completion the same way: if they disagree, training optimises something
other than what eval reports. Every extractor here returns the raw answer text (or None); callers
compare with `numbers_equal`, which is exact (Fraction arithmetic), never a float tolerance on integers.

Semantics follow lm-eval-harness' GSM8K filters where they exist:
- strict-match: regex `#### (\\-?[0-9\\.\\,]+)`. lm-eval takes the FIRST match; qerl takes the LAST,
  because an RL policy that restates "#### 3" in its reasoning before the final "#### 5" should be
  scored on its final answer (with the usual stop strings there is only one match and both agree).
- flexible-extract: the last number in the text. lm-eval's regex `(-?[$0-9.,]{2,})|(-?[0-9]+)` also
  matches bare punctuation such as "..." and lets "5-3" end in "-3"; qerl's regex only matches numbers.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

# Minus-like characters models emit: ASCII hyphen, U+2212 minus sign, en dash, figure dash.
_MINUS = "-\u2212\u2013\u2012"
_MINUS_CLASS = "[" + re.escape(_MINUS) + "]"

# One number as written in prose: thousands groups ("1,234,567") or plain digits, optional decimals,
# or a bare decimal (".5"). A fraction "3/4" is two such integers around a slash.
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_UNSIGNED_FRAC = rf"(?:{_UNSIGNED})(?:\s*/\s*(?:\d{{1,3}}(?:,\d{{3}})+|\d+))?"

# A sign only counts when it does not sit between two operands ("10-3" is not "-3"), so it must not
# follow a word character or a closing bracket/dot.
_NUMBER_IN_TEXT = re.compile(
    rf"(?<![\w.)\]}}])(?P<sign>{_MINUS_CLASS})?\$?(?P<num>{_UNSIGNED_FRAC})(?![\d])"
    rf"|(?P<num2>{_UNSIGNED_FRAC})(?![\d])"
)

# The leading number of a short answer string such as "$1,000.00", "-3 km", "+5", "18 dollars", "50%".
_LEADING_NUMBER = re.compile(
    rf"^\s*(?P<sign>[+{re.escape(_MINUS)}])?\s*(?:\$|\\\$|USD\s*|€|£)?\s*(?P<sign2>[+{re.escape(_MINUS)}])?"
    rf"(?P<num>{_UNSIGNED_FRAC})(?P<rest>.*)$",
    re.DOTALL,
)

# lm-eval's strict-match pattern, verbatim.
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_PHRASE = re.compile(r"(?:the\s+(?:final\s+)?answer\s+is|answer\s*:)\s*:?\s*(?P<rest>[^\n]*)", re.IGNORECASE)


def _to_fraction(num: str) -> Fraction | None:
    """Exact value of an unsigned number token (commas already allowed as thousands separators)."""
    num = num.replace(",", "").replace(" ", "")
    try:
        if "/" in num:
            p, q = num.split("/", 1)
            den = Fraction(Decimal(q))
            if den == 0:
                return None
            return Fraction(Decimal(p)) / den
        return Fraction(Decimal(num))
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None


def _canonical(value: Fraction) -> str:
    """Terminating values as plain decimals ("2.5", "1000", "-3"); others as "p/q" so "1/3" stays exact."""
    if value.denominator == 1:
        return str(value.numerator)
    if not _terminates(value):
        return f"{value.numerator}/{value.denominator}"
    # Exact decimal expansion: scale by the smallest power of ten the denominator divides.
    k = 0
    while (10**k) % value.denominator:
        k += 1
    digits = str(abs(value.numerator) * (10**k // value.denominator)).rjust(k + 1, "0")
    text = (digits[:-k] + "." + digits[-k:]).rstrip("0").rstrip(".")
    return ("-" if value < 0 else "") + text


def parse_number(s: str | None) -> Fraction | None:
    """Exact value of an answer string, or None if it does not start with a number.

    Accepts "1,000", "$1000.00", "+5", "-3", "\u22123", "2.50", "3/4", "18 dollars", "5 km", "50%",
    "1,000." and "72.0". Text after the number is ignored (units); text before it is not, because
    "about 5" or "x = 5" are not numbers and the caller should pick an extractor instead.
    """
    if s is None:
        return None
    m = _LEADING_NUMBER.match(s)
    if m is None:
        return None
    rest = m.group("rest")
    # "3.5.2", "12:30" or "2,50" are not a number followed by a unit.
    if rest[:1] in {".", ":", ","} and rest[1:2].isdigit():
        return None
    value = _to_fraction(m.group("num"))
    if value is None:
        return None
    signs = (m.group("sign") or "") + (m.group("sign2") or "")
    if sum(ch in _MINUS for ch in signs) % 2 == 1:
        value = -value
    return value


def normalize_number(s: str | None) -> str | None:
    """Canonical string of a number so that equal values compare equal as strings.

    "1,000", "$1000.00", "1000" -> "1000"; "2.50" -> "2.5"; "3/4", "0.75" -> "0.75"; "1/3" -> "1/3";
    "\u22123", "-3" -> "-3"; "18 dollars" -> "18". Returns None when `s` does not start with a number.
    """
    value = parse_number(s)
    return None if value is None else _canonical(value)


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Exact numeric equality of two answer strings.

    Fractions compare exactly ("3/4" == "0.75", "2.50" == "2.5"). A relative tolerance of 1e-6 applies
    only when one side is a non-terminating value (like 1/3), because then the other side, written as a
    decimal, can only ever be a rounded form of it; integers and terminating decimals never get one.
    """
    x, y = parse_number(a), parse_number(b)
    if x is None or y is None:
        return False
    if x == y:
        return True
    if _terminates(x) and _terminates(y):
        return False
    scale = max(abs(x), abs(y))
    return abs(x - y) <= Fraction(1, 10**6) * scale


def _terminates(v: Fraction) -> bool:
    den = v.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


def extract_strict(completion: str) -> str | None:
    """GSM8K strict-match: the number after the last "#### ", as written (e.g. "1,000." stays)."""
    matches = _STRICT.findall(completion)
    return matches[-1] if matches else None


def _all_numbers(text: str) -> list[str]:
    out = []
    for m in _NUMBER_IN_TEXT.finditer(text):
        if m.group("num") is not None:
            out.append((m.group("sign") or "") + m.group("num"))
        else:
            out.append(m.group("num2"))
    return out


def extract_flexible(completion: str) -> str | None:
    """GSM8K flexible-extract: the last number anywhere in the text ("3/4" counts as one number)."""
    numbers = _all_numbers(completion)
    return numbers[-1] if numbers else None


def extract_first_number(completion: str) -> str | None:
    """The first number in the text: what a completion-style prompt like "a + b =" is scored on."""
    numbers = _all_numbers(completion)
    return numbers[0] if numbers else None


def extract_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} / \fbox{...} (balanced braces) or "\boxed 5" (up to $ or newline).

    Returns None when there is no box or its braces never close (a truncated completion).
    """
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])", text)]
    if not starts:
        return None
    m = starts[-1]
    i = m.end()
    # "\boxed {x}" is valid TeX: skip spaces before the brace.
    j = i
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        depth = 0
        for k in range(j, len(text)):
            ch = text[k]
            if ch == "{" and text[k - 1] != "\\":
                depth += 1
            elif ch == "}" and text[k - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return text[j + 1 : k].strip()
        return None
    if j > i:
        # "\boxed 5$": Hendrycks' MATH convention, content runs to the closing "$".
        content = re.split(r"[$\n]", text[j:], maxsplit=1)[0].strip()
        return content or None
    return None


def extract_answer_tag(completion: str) -> str | None:
    r"""The model's declared final answer: last <answer>...</answer>, else the rest of the line after the
    last "The answer is" / "answer:", else the last \boxed{...}. Raw text; normalise before comparing."""
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1].strip()
    phrases = list(_ANSWER_PHRASE.finditer(completion))
    if phrases:
        rest = phrases[-1].group("rest")
        boxed = extract_boxed(rest)
        if boxed is not None:
            return boxed
        rest = rest.strip().rstrip(".").strip().strip("$").strip()
        if rest:
            return rest
    return extract_boxed(completion)


def answer_number(text: str | None) -> str | None:
    """A number from a short extracted answer: the whole text if it is one ("$18", "18 dollars"), else
    the last number inside it ("The total is 18"). Keeps strict answers strict and prose answers usable."""
    if text is None:
        return None
    # A boxed/tagged LaTeX fraction is one number, not the two integers inside it.
    text = re.sub(r"\\[dt]?frac\{(\d+)\}\{(\d+)\}", r"\1/\2", text)
    if parse_number(text) is not None:
        return text
    return extract_flexible(text)


def gsm8k_gold(answer_field: str) -> str:
    """The gold number of a GSM8K `answer` field ("...\n#### 1,080" -> "1080")."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer has no '####' line: {answer_field[-80:]!r}")
    return answer_field.rsplit("####", 1)[1].strip().replace(",", "")


GSM8K_MODES = ("auto", "strict", "flexible", "answer_tag")


def extract_gsm8k(completion: str, mode: str = "auto") -> str | None:
    """The answer number of a GSM8K completion under one extraction mode.

    strict: "#### N" only (lm-eval strict-match); flexible: the last number (flexible-extract);
    answer_tag: <answer>/"The answer is"/\\boxed only; auto: strict, else answer tag, else flexible --
    the declared answer wins over whatever number happened to come last.
    """
    if mode == "strict":
        return extract_strict(completion)
    if mode == "flexible":
        return extract_flexible(completion)
    if mode == "answer_tag":
        return answer_number(extract_answer_tag(completion))
    if mode == "auto":
        for found in (extract_strict(completion), answer_number(extract_answer_tag(completion))):
            if found is not None and parse_number(found) is not None:
                return found
        return extract_flexible(completion)
    raise ValueError(f"unknown GSM8K extraction mode {mode!r}; use one of {', '.join(GSM8K_MODES)}")
