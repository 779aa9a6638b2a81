"""Reward functions with TRL's signature, a registry, and a checked call.

TRL calls `fn(prompts=..., completions=..., completion_ids=..., **columns)` where the dataset's extra
columns (here `answer`, plus meta such as `level`) arrive as keyword arguments, and expects one float
per completion. qerl uses the same contract, so a user's TRL reward function works unchanged, and
qerl's rewards work in TRL. Completions may be strings or, in TRL's conversational format, lists of
{"role", "content"} messages.

Scoring shares tasks/answers.py with `qerl eval`, so the reward the policy is trained on is the
score eval reports.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.tasks.answers import GSM8K_MODES, extract_gsm8k, extract_strict, numbers_equal
from qerl_cli.tasks.arith import score_arith

RewardFn = Callable[..., list[float]]

FORMAT_BONUS = 0.1


def completion_text(completion: Any) -> str:
    """Text of a completion: a string, or the assistant contents of a TRL conversational completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, Sequence):
        return "".join(
            str(m.get("content", "")) for m in completion if isinstance(m, dict) and m.get("role") != "user"
        )
    return str(completion)


def _check_answers(completions: Sequence[Any], answer: Sequence[Any] | None, name: str) -> list[str]:
    if answer is None:
        raise ValueError(f"reward '{name}' needs an 'answer' column in the dataset")
    if isinstance(answer, str):
        raise ValueError(f"reward '{name}' got one answer string for {len(completions)} completions; "
                         "pass a list with one answer per completion")
    if len(answer) != len(completions):
        raise ValueError(f"reward '{name}': {len(completions)} completions but {len(answer)} answers")
    return [str(a) for a in answer]


def make_gsm8k_reward(mode: str = "auto", name: str | None = None) -> RewardFn:
    """1.0 when the number extracted under `mode` (see answers.extract_gsm8k) equals the gold, else 0.0."""
    if mode not in GSM8K_MODES:
        raise QerlError(f"unknown GSM8K extraction mode {mode!r}: use one of {', '.join(GSM8K_MODES)}")
    fn_name = name or ("gsm8k" if mode == "auto" else f"gsm8k_{mode}")

    def reward(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None,
               **kwargs: Any) -> list[float]:
        golds = _check_answers(completions, answer, fn_name)
        return [
            1.0 if numbers_equal(extract_gsm8k(completion_text(c), mode), g) else 0.0
            for c, g in zip(completions, golds, strict=True)
        ]

    reward.__name__ = fn_name
    reward.__qualname__ = fn_name
    return reward


gsm8k_reward = make_gsm8k_reward("auto")
gsm8k_strict_reward = make_gsm8k_reward("strict")
gsm8k_flexible_reward = make_gsm8k_reward("flexible")


def math_reward(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None,
                **kwargs: Any) -> list[float]:
    """1.0 when the MATH grader (math-verify, else normalised exact match) accepts the completion."""
    from qerl_cli.tasks.math_grader import default_grader

    golds = _check_answers(completions, answer, "math")
    grades = default_grader().grade_many([completion_text(c) for c in completions], golds)
    return [1.0 if g.correct else 0.0 for g in grades]


def arith_reward(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None,
                 **kwargs: Any) -> list[float]:
    """1.0 when the first number of the completion's first line equals the answer exactly."""
    golds = _check_answers(completions, answer, "arith")
    return [1.0 if score_arith(completion_text(c), g) else 0.0 for c, g in zip(completions, golds, strict=True)]


def make_format_reward(bonus: float = FORMAT_BONUS) -> RewardFn:
    """`bonus` when the completion states its answer as "#### N" (strict-match parses), else 0.0.

    Small by default so that, summed with a correctness reward, format never outweighs being right.
    """

    def format_reward(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return [bonus if extract_strict(completion_text(c)) is not None else 0.0 for c in completions]

    return format_reward


format_reward = make_format_reward()

REWARDS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_reward,
    "gsm8k_strict": gsm8k_strict_reward,
    "gsm8k_flexible": gsm8k_flexible_reward,
    "math": math_reward,
    "arith": arith_reward,
    "format": format_reward,
}


def _load_module_from_file(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"qerl_user_reward_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise QerlError(f"cannot load reward file {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:  # also what Python raises for a source file that is not UTF-8
        raise QerlError(f"reward file {path}:{exc.lineno}: {exc.msg}; fix the file or pass another --reward") from exc
    return module


def get_reward(name: str) -> RewardFn:
    """A reward by registry name, or by import path: "pkg.module:function", "pkg.module.function" or
    "path/to/file.py:function"."""
    if name in REWARDS:
        return REWARDS[name]
    known = ", ".join(REWARDS)
    if ":" in name:
        module_name, _, attr = name.rpartition(":")
    elif "." in name:
        module_name, _, attr = name.rpartition(".")
    else:
        raise QerlError(f"unknown reward {name!r}: use one of {known}, or package.module:function")
    if not module_name or not attr:
        raise QerlError(f"reward {name!r}: expected package.module:function")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            if not path.is_file():
                raise QerlError(f"reward {name!r}: file {path} does not exist")
            module = _load_module_from_file(path)
        else:
            module = importlib.import_module(module_name)
    except QerlError:
        raise
    except ImportError as exc:
        raise QerlError(f"reward {name!r}: cannot import {module_name!r} ({exc}); "
                        f"built-in rewards are {known}") from exc
    except Exception as exc:
        raise QerlError(f"reward {name!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise QerlError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise QerlError(f"reward {name!r}: {module_name}.{attr} is not callable")
    return fn


def reward_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def safe_rewards(
    fn: RewardFn, prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None,
    **kwargs: Any
) -> list[float]:
    """Call a reward function and check what it returns: one finite float per completion.

    A broken user reward must stop the run with a message naming it, not train on garbage (NaN
    advantages) or crash deep inside the loss.
    """
    name = reward_name(fn)
    try:
        values = fn(prompts=list(prompts), completions=list(completions), answer=answer, **kwargs)
    except QerlError:
        raise
    except Exception as exc:
        raise QerlError(f"reward function '{name}' raised {type(exc).__name__}: {exc}") from exc
    if values is None or isinstance(values, (str, bytes, dict)):
        raise QerlError(f"reward function '{name}' returned {type(values).__name__}; it must return a list "
                        "of floats, one per completion")
    if hasattr(values, "tolist"):  # numpy arrays and torch tensors
        values = values.tolist()
    try:
        values = list(values)
    except TypeError:
        raise QerlError(f"reward function '{name}' returned {type(values).__name__}; it must return a list "
                        "of floats, one per completion") from None
    if len(values) != len(completions):
        raise QerlError(f"reward function '{name}' returned {len(values)} values for {len(completions)} "
                        "completions; it must return exactly one per completion")
    out: list[float] = []
    for i, v in enumerate(values):
        try:
            if isinstance(v, (str, bytes)) or v is None:
                raise TypeError
            f = float(v)
        except (TypeError, ValueError):
            raise QerlError(f"reward function '{name}' returned {v!r} ({type(v).__name__}) at index {i}; "
                            "rewards must be numbers") from None
        if not math.isfinite(f):
            raise QerlError(f"reward function '{name}' returned {f} at index {i}; rewards must be finite")
        out.append(f)
    return out
