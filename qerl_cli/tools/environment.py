"""User environments: ``--env module:Class`` or ``--env path/to/file.py:Class`` (TRL's environment-factory shape).

One instance per episode, built with no arguments::

    class Env:
        stop = ("</answer>",)  # optional: strings that end a model turn (beside the task's stops and EOS)
        turn_tokens = 16  # optional: a turn also ends after this many tokens

        def reset(self, prompt: str) -> str:
            ...  # text appended to the prompt before the first turn ("" for none)

        def step(self, action: str) -> tuple[str, bool, float]:
            ...  # (observation appended after the turn, done, reward)

Every model turn is an action; the episode's reward is the sum of the rewards its steps returned. The class is
imported only from a name given on the command line (or a preset the user passes), never from a run directory.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Protocol

from qerl_cli.errors import QerlError


class Env(Protocol):
    def reset(self, prompt: str) -> str: ...

    def step(self, action: str) -> tuple[str, bool, float]: ...


def _module(name: str, spec_text: str) -> Any:
    if name.endswith(".py"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise QerlError(f"--env {spec_text}: file {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"qerl_user_env_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise QerlError(f"--env {spec_text}: cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(name)


def load_env(spec_text: str) -> type:
    """The environment class named by ``module:Class`` or ``file.py:Class``; checked for reset() and step()."""
    name, sep, attr = spec_text.rpartition(":")
    if not sep or not name or not attr:
        raise QerlError(f"--env {spec_text!r}: give module:Class or path/to/file.py:Class")
    try:
        module = _module(name, spec_text)
    except QerlError:
        raise
    except ImportError as exc:
        raise QerlError(f"--env {spec_text}: cannot import {name!r} ({exc})") from exc
    except Exception as exc:
        raise QerlError(f"--env {spec_text}: importing {name!r} raised {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise QerlError(f"--env {spec_text}: {name} has no attribute {attr!r}")
    if not isinstance(cls, type):
        raise QerlError(f"--env {spec_text}: {attr} is not a class (one instance is built per episode)")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise QerlError(f"--env {spec_text}: {attr} has no {' or '.join(missing)} method; an environment needs "
                        "reset(prompt) -> str and step(action) -> (observation, done, reward)")
    stop = getattr(cls, "stop", ())
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise QerlError(f"--env {spec_text}: {attr}.stop must be a tuple of non-empty strings")
    turn_tokens = getattr(cls, "turn_tokens", None)
    if turn_tokens is not None and (not isinstance(turn_tokens, int) or turn_tokens < 1):
        raise QerlError(f"--env {spec_text}: {attr}.turn_tokens must be a positive int (or absent)")
    return cls


def check_step(name: str, value: Any) -> tuple[str, bool, float]:
    """An environment's step() return value, checked: (observation str, done bool, reward finite float)."""
    if not isinstance(value, tuple | list) or len(value) != 3:
        raise QerlError(f"environment {name}.step returned {type(value).__name__}; it must return "
                        "(observation, done, reward)")
    obs, done, reward = value
    if not isinstance(obs, str):
        raise QerlError(f"environment {name}.step returned an observation of type {type(obs).__name__}, not str")
    try:
        r = float(reward)
    except (TypeError, ValueError):
        raise QerlError(f"environment {name}.step returned reward {reward!r}; it must be a number") from None
    if r != r or r in (float("inf"), float("-inf")):
        raise QerlError(f"environment {name}.step returned reward {r}; rewards must be finite")
    return obs, bool(done), r


def check_reset(name: str, value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise QerlError(f"environment {name}.reset returned {type(value).__name__}; it must return a str")
    return value
