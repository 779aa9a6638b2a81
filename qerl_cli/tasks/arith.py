"""`arith`: integer arithmetic problems for sanity runs of the RL loop on a tiny model.

As measured (CPU, fp32), the embedded SmolLM2-135M only answers arithmetic reliably enough to learn
from with a few-shot COMPLETION prompt ("2 + 3 = 5\\n14 + 5 = 19\\n7 * 6 = 42\\n31 + 22 = 53\\na + b ="),
not with its chat template (at most 9% accuracy). The completion after "=" is scored on its first
number and generation stops at a newline.

Difficulty is a knob because the sanity set must sit where the starting model is right 20-80% of the
time. Levels 1-4 are the four kinds measured there (accuracy at T=1.0 in brackets); 5-7 give headroom
for larger models and are unmeasured:
  1: one-digit + one-digit (64%)   2: two-digit + one-digit (34%)   3: two-digit + two-digit (16%)
  4: one-digit * one-digit (59%)   5: two-digit * one-digit   6: three-digit + three-digit
  7: two-digit * two-digit
A continuous knob `d=<0..1>` walks the measured kinds from easiest to hardest (1, 4, 2, 3), mixing the
two neighbours of each point, so that accuracy falls monotonically as d rises -- for this model. The
order is a measurement, not a law: recalibrate it for another model.

Train and test never share a problem: a stable hash of the problem text assigns it to one split, and
the shot problems are excluded from both.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.tasks.answers import extract_first_number, numbers_equal

STOP = "\n"
STOP_STRINGS: tuple[str, ...] = (STOP,)

# (a, op, b) of the few-shot prefix that measurement used, in that order.
SHOTS: tuple[tuple[int, str, int], ...] = ((2, "+", 3), (14, "+", 5), (7, "*", 6), (31, "+", 22))

_DIGITS = {1: (1, 9), 2: (10, 99), 3: (100, 999)}


@dataclass(frozen=True)
class Level:
    op: str
    digits_a: int
    digits_b: int
    description: str

    def size(self) -> int:
        lo_a, hi_a = _DIGITS[self.digits_a]
        lo_b, hi_b = _DIGITS[self.digits_b]
        return (hi_a - lo_a + 1) * (hi_b - lo_b + 1)


LEVELS: dict[int, Level] = {
    1: Level("+", 1, 1, "one-digit + one-digit"),
    2: Level("+", 2, 1, "two-digit + one-digit"),
    3: Level("+", 2, 2, "two-digit + two-digit"),
    4: Level("*", 1, 1, "one-digit * one-digit"),
    5: Level("*", 2, 1, "two-digit * one-digit"),
    6: Level("+", 3, 3, "three-digit + three-digit"),
    7: Level("*", 2, 2, "two-digit * two-digit"),
}
MEASURED_LEVELS: tuple[int, ...] = (1, 2, 3, 4)
# Easiest to hardest by accuracy measured on SmolLM2-135M (the figures in the module's docstring).
DIFFICULTY_ORDER: tuple[int, ...] = (1, 4, 2, 3)
TEST_FRACTION_MOD = 5  # one problem in five (by hash) belongs to the test split


@dataclass(frozen=True)
class ArithProblem:
    a: int
    op: str
    b: int
    level: int

    @property
    def text(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def answer(self) -> int:
        return _apply(self.a, self.op, self.b)


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


def problem_split(text: str) -> str:
    """"test" or "train" for a problem text, fixed forever (crc32 does not depend on PYTHONHASHSEED)."""
    return "test" if zlib.crc32(text.encode()) % TEST_FRACTION_MOD == 0 else "train"


_SHOT_TEXTS = frozenset(f"{a} {op} {b}" for a, op, b in SHOTS)


def shot_prefix(shots: int = len(SHOTS), tool: Any = None) -> str:
    """The first `shots` worked examples, one per line ("2 + 3 = 5\\n..."); with a ``tool`` (the calculator)
    each is worked with a call first ("2 + 3 = <calc>2 + 3</calc> <result>5</result> 5\\n")."""
    if not 0 <= shots <= len(SHOTS):
        raise QerlError(f"arith supports 0 to {len(SHOTS)} shots, got {shots}")
    if tool is None:
        return "".join(f"{a} {op} {b} = {_apply(a, op, b)}\n" for a, op, b in SHOTS[:shots])
    return "".join(f"{a} {op} {b} = {tool.shot(f'{a} {op} {b}', str(_apply(a, op, b)))} {_apply(a, op, b)}\n"
                   for a, op, b in SHOTS[:shots])


def arith_prompt(problem: ArithProblem | str, shots: int = len(SHOTS), tool: Any = None) -> str:
    """Few-shot completion prompt ending in "a op b =" (no trailing space: the model writes " 5")."""
    text = problem.text if isinstance(problem, ArithProblem) else problem.strip()
    return f"{shot_prefix(shots, tool)}{text} ="


def score_arith(completion: str, answer: str | int) -> bool:
    """First number of the completion's first line equals the answer exactly."""
    first_line = completion.split(STOP, 1)[0]
    found = extract_first_number(first_line)
    return found is not None and numbers_equal(found, str(answer))


def parse_level_spec(spec: int | str | Sequence[int] | None) -> dict[int, float]:
    """Mixture weights over levels from a knob value.

    3 or "3" -> level 3; "mixed" (default) -> levels 1-4 uniformly; "1,2,4" or [1, 2, 4] -> those
    uniformly; "d=0.5" -> the continuous knob over DIFFICULTY_ORDER (0 easiest, 1 hardest).
    """
    if spec is None or spec == "mixed":
        return {k: 1.0 / len(MEASURED_LEVELS) for k in MEASURED_LEVELS}
    if isinstance(spec, bool):
        raise QerlError(f"arith level must be a number, a list, 'mixed' or 'd=<0..1>', got {spec!r}")
    if isinstance(spec, int):
        levels: list[int] = [spec]
    elif isinstance(spec, str):
        s = spec.strip().lower()
        if s.startswith("d="):
            try:
                d = float(s[2:])
            except ValueError:
                raise QerlError(f"arith difficulty {spec!r}: expected d=<number in [0, 1]>") from None
            return continuous_mixture(d)
        try:
            levels = [int(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise QerlError(
                f"arith level {spec!r}: use 1-{max(LEVELS)}, a list like '1,2,4', 'mixed' or 'd=0.5'"
            ) from None
    else:
        levels = [int(x) for x in spec]
    unknown = [k for k in levels if k not in LEVELS]
    if not levels or unknown:
        raise QerlError(f"arith level {spec!r}: known levels are {', '.join(map(str, LEVELS))}")
    return {k: 1.0 / len(levels) for k in dict.fromkeys(levels)}


def continuous_mixture(d: float) -> dict[int, float]:
    """Weights for the continuous knob: d in [0, 1] along DIFFICULTY_ORDER, linear between neighbours."""
    if not 0.0 <= d <= 1.0:
        raise QerlError(f"arith difficulty d={d} is outside [0, 1]")
    pos = d * (len(DIFFICULTY_ORDER) - 1)
    lo = min(int(pos), len(DIFFICULTY_ORDER) - 2)
    frac = pos - lo
    weights = {DIFFICULTY_ORDER[lo]: 1.0 - frac, DIFFICULTY_ORDER[lo + 1]: frac}
    return {k: w for k, w in weights.items() if w > 0}


def _allocate(n: int, weights: dict[int, float]) -> dict[int, int]:
    """Largest-remainder split of n over levels: exact proportions, deterministic, sums to n."""
    total = sum(weights.values())
    raw = {k: n * w / total for k, w in weights.items()}
    counts = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: (-(raw[k] - counts[k]), k))[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


# Pools above this size are sampled by rejection instead of enumerated.
_ENUMERATE_MAX = 20_000


def _pool(level: int, split: str) -> list[ArithProblem]:
    lv = LEVELS[level]
    lo_a, hi_a = _DIGITS[lv.digits_a]
    lo_b, hi_b = _DIGITS[lv.digits_b]
    out = []
    for a in range(lo_a, hi_a + 1):
        for b in range(lo_b, hi_b + 1):
            p = ArithProblem(a, lv.op, b, level)
            if p.text not in _SHOT_TEXTS and problem_split(p.text) == split:
                out.append(p)
    return out


def _draw(level: int, split: str, count: int, rng: random.Random, unique: bool) -> list[ArithProblem]:
    lv = LEVELS[level]
    if lv.size() <= _ENUMERATE_MAX:
        pool = _pool(level, split)
        if unique and count > len(pool):
            raise QerlError(
                f"arith level {level} ({lv.description}) has only {len(pool)} {split} problems, "
                f"{count} requested: lower --limit or mix in harder levels"
            )
        out: list[ArithProblem] = []
        while len(out) < count:
            # Each pass is a fresh permutation: every problem appears once before any appears twice.
            order = pool[:]
            rng.shuffle(order)
            out.extend(order[: count - len(out)])
        return out
    lo_a, hi_a = _DIGITS[lv.digits_a]
    lo_b, hi_b = _DIGITS[lv.digits_b]
    seen: set[str] = set()
    out = []
    while len(out) < count:
        p = ArithProblem(rng.randint(lo_a, hi_a), lv.op, rng.randint(lo_b, hi_b), level)
        if p.text in _SHOT_TEXTS or problem_split(p.text) != split or (unique and p.text in seen):
            continue
        seen.add(p.text)
        out.append(p)
    return out


def generate_arith(
    n: int,
    level: int | str | Sequence[int] | None = "mixed",
    split: str = "train",
    seed: int = 0,
) -> list[ArithProblem]:
    """n problems of the given level mix, deterministic in (n, level, split, seed).

    The test split never repeats a problem (accuracy must not count one twice) and fails with a
    QerlError if a level has too few; the train split cycles through its pool when n exceeds it.
    """
    if split not in ("train", "test"):
        raise QerlError(f"arith split must be 'train' or 'test', got {split!r}")
    if n < 0:
        raise QerlError(f"arith needs a non-negative number of problems, got {n}")
    weights = parse_level_spec(level)
    counts = _allocate(n, weights)
    rng = random.Random(f"qerl-arith:{seed}:{split}")
    keyed: list[tuple[float, ArithProblem]] = []
    for k in sorted(counts):
        drawn = _draw(k, split, counts[k], rng, unique=(split == "test"))
        # Interleave levels by jittered relative position rather than a global shuffle: each level's
        # order (already random) is kept, so a train pass covers its pool before repeating any problem.
        keyed.extend(((i + rng.random()) / len(drawn), p) for i, p in enumerate(drawn))
    keyed.sort(key=lambda kp: kp[0])
    return [p for _, p in keyed]


def pool_size(level: int, split: str) -> int:
    """Distinct problems of one level in a split (estimated for the large sampled levels)."""
    lv = LEVELS[level]
    if lv.size() <= _ENUMERATE_MAX:
        return len(_pool(level, split))
    test = lv.size() // TEST_FRACTION_MOD
    return test if split == "test" else lv.size() - test


def max_unique(level: int | str | Sequence[int] | None, split: str = "test") -> int:
    """The largest n for which generate_arith(n, level, split) can keep every problem distinct."""
    weights = parse_level_spec(level)
    sizes = {k: pool_size(k, split) for k in weights}
    n = int(min(sizes[k] / w for k, w in weights.items()))
    while n > 0 and any(c > sizes[k] for k, c in _allocate(n, weights).items()):
        n -= 1
    return n
