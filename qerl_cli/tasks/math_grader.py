"""MATH / MATH-500 grading: math-verify when installed, a normalised exact match otherwise.

math-verify (the optional extra `qerl[math]`) is the grader lighteval and open-r1 use. Its built-in
timeouts rely on `signal.alarm`, which raises off the main thread, and RL reward functions and eval
loops do run off it. So qerl calls it with `parsing_timeout=None` / `timeout_seconds=None` inside
separate worker processes and enforces its own wall-clock limit from outside: a worker that overruns
is killed and replaced, and the answer is graded by the fallback instead. A killed process, unlike a
thread, cannot leave a runaway sympy simplification burning a core for the rest of the run.

Every grade says which method decided (`MathGrade.method`), and `scorer_version()` names the grader and
its version, so eval reports can state how answers were scored.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from qerl_cli.tasks.answers import extract_answer_tag, extract_boxed, numbers_equal, parse_number

DEFAULT_TIMEOUT_S = 5.0
# Importing sympy + math-verify in a fresh interpreter takes 1-3 s; a loaded machine can be slower.
_STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class MathGrade:
    """Outcome of grading one completion against one gold answer.

    method: "math_verify" or "fallback" -- whichever decided `correct`.
    note: why the fallback decided when math-verify was meant to ("timeout", "error: ...",
    "math_verify not installed"), else "".
    pred: the answer the fallback extracted from the completion (boxed / answer tag), for logs.
    """

    correct: bool
    method: str
    note: str = ""
    pred: str | None = None


def math_verify_available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def scorer_version() -> str:
    """e.g. "math_verify 0.9.0 (latex2sympy2_extended 1.11.0) + qerl fallback", for eval manifests."""
    if not math_verify_available():
        return "qerl fallback (normalised exact match; math_verify not installed)"
    parts = []
    for dist in ("math-verify", "latex2sympy2_extended"):
        try:
            parts.append(f"{dist.replace('-', '_')} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist.replace('-', '_')} unknown")
    return f"{parts[0]} ({parts[1]}) + qerl fallback"


# ---------------------------------------------------------------- fallback: normalised exact match

_UNWRAP_COMMANDS = ("text", "textbf", "textit", "mathrm", "mathbf", "mbox", "operatorname")
_SPACING = (r"\!", r"\,", r"\;", r"\:", r"\ ", "~", r"\quad", r"\qquad")


def _unwrap_command(s: str, name: str) -> str:
    r"""Replace \name{X} by X with balanced braces (regexes cannot match nested braces)."""
    token = "\\" + name + "{"
    while True:
        i = s.find(token)
        if i < 0:
            return s
        depth, j = 0, i + len(token) - 1
        for j in range(i + len(token) - 1, len(s)):
            if s[j] == "{":
                depth += 1
            elif s[j] == "}":
                depth -= 1
                if depth == 0:
                    break
        else:
            return s
        s = s[:i] + s[i + len(token) : j] + s[j + 1 :]


def normalize_latex_answer(s: str) -> str:
    r"""Canonical text of a short LaTeX answer, for exact comparison when math-verify is unavailable.

    Removes what does not change the value: `$`, \left/\right, spacing commands, spaces, \text{} and
    \mathrm{} wrappers, unit words after a number, degree signs, \%, a trailing ".", a single-variable
    "x =" prefix; \dfrac/\tfrac -> \frac, \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}, 1{,}000 -> 1000.
    """
    s = s.strip()
    boxed = extract_boxed(s)
    if boxed is not None and s.startswith(("\\boxed", "\\fbox", "$\\boxed")):
        s = boxed
    s = s.strip().strip("$").strip()
    s = s.replace("\\left", "").replace("\\right", "")
    for sp in _SPACING:
        s = s.replace(sp, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\circ", "").replace("°", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    s = s.replace("{,}", "")
    for name in _UNWRAP_COMMANDS:
        s = _unwrap_command(s, name)
    s = s.strip()
    # A number followed by a unit word ("5 cm", "12 inches^2"): the unit does not change the value.
    m = re.fullmatch(r"(-?[\d.,/]+)\s*[A-Za-z][A-Za-z\s]*(\^\{?\d\}?)?", s)
    if m and parse_number(m.group(1)) is not None:
        s = m.group(1)
    # "x = 5", "k=3": the prompt asked for the value; a longer "x+y=5" is an equation and stays.
    s = re.sub(r"^[A-Za-z]\s*=\s*", "", s)
    s = s.replace(" ", "").replace("\n", "")
    s = s.rstrip(".")
    # Shorthand TeX: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}.
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _simple_value(s: str) -> str | None:
    r"""A plain number string for "-\frac{3}{4}", "0.75", "3/4"; None for anything symbolic."""
    m = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", s)
    if m:
        return f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    if re.fullmatch(r"-?(\d+(\.\d+)?|\.\d+)(/\d+)?", s):
        return s
    return None


def extract_math_answer(completion: str) -> str | None:
    r"""The final answer of a MATH-style completion: last \boxed{}, else the answer tag / phrase."""
    boxed = extract_boxed(completion)
    return boxed if boxed is not None else extract_answer_tag(completion)


def fallback_equal(pred: str | None, gold: str) -> bool:
    """Normalised exact match of an extracted answer against the gold answer (numbers exactly)."""
    if pred is None:
        return False
    p, g = normalize_latex_answer(pred), normalize_latex_answer(gold)
    if not p:
        return False
    if p == g:
        return True
    pv, gv = _simple_value(p), _simple_value(g)
    return pv is not None and gv is not None and numbers_equal(pv, gv)


# ---------------------------------------------------------------- math-verify in worker processes


def _serve() -> None:
    """Worker loop: one JSON request per stdin line, one JSON reply per stdout line."""
    # Anything math-verify or sympy prints must not corrupt the protocol on stdout.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        from math_verify import parse, verify
    except Exception as exc:  # report, then exit: the parent falls back
        out.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            req = json.loads(line)
            gold = parse(f"${req['gold']}$", parsing_timeout=None)
            pred = parse(req["completion"], parsing_timeout=None)
            correct = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None)
            reply = {"ok": True, "correct": bool(correct), "parsed": bool(gold) and bool(pred)}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        out.write(json.dumps(reply) + "\n")


class _WorkerTimeout(Exception):
    pass


class _WorkerError(Exception):
    pass


class _WorkerStartError(_WorkerError):
    pass


class _Worker:
    """One math-verify subprocess talking JSON lines; restarted lazily after a kill or crash."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._buf = b""

    def _start(self) -> None:
        env = dict(os.environ)
        # The child must import this very module even when qerl runs from a source tree.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from qerl_cli.tasks.math_grader import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._buf = b""
        try:
            hello = self._read_line(_STARTUP_TIMEOUT_S)
        except (_WorkerTimeout, _WorkerError, ValueError) as exc:
            self.kill()
            raise _WorkerStartError(f"math_verify worker did not start: {exc or type(exc).__name__}") from exc
        if not hello.get("ready"):
            self.kill()
            raise _WorkerStartError(hello.get("error", "math_verify worker failed to start"))

    def _read_line(self, timeout_s: float) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _WorkerTimeout()
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise _WorkerError(f"math_verify worker exited (code {self.proc.poll()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def request(self, gold: str, completion: str, timeout_s: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"gold": gold, "completion": completion}) + "\n").encode())
            self.proc.stdin.flush()
            return self._read_line(timeout_s)
        except _WorkerTimeout:
            self.kill()
            raise
        except (OSError, ValueError) as exc:
            self.kill()
            raise _WorkerError(f"{type(exc).__name__}: {exc}") from exc
        except _WorkerError:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    stream.close()
        self.proc = None
        self._buf = b""


class MathGrader:
    """Grades MATH completions; safe to call from any thread.

    use_math_verify: None = use it when installed; False = fallback only; True = require it.
    workers: math-verify processes (each ~100 MB); grade_many spreads work over them.
    """

    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, use_math_verify: bool | None = None, workers: int = 1
    ) -> None:
        available = math_verify_available()
        if use_math_verify and not available:
            from qerl_cli.errors import QerlError

            raise QerlError("math_verify is not installed: run `pip install 'qerl[math]'` (math-verify>=0.7)")
        self.use_math_verify = available if use_math_verify is None else use_math_verify
        self.timeout_s = timeout_s
        self._workers = [_Worker() for _ in range(max(1, workers))] if self.use_math_verify else []
        self._free: queue.Queue[_Worker] = queue.Queue()
        for w in self._workers:
            self._free.put(w)
        self._startup_error: str | None = None
        self._lock = threading.Lock()

    @property
    def method_name(self) -> str:
        return "math_verify" if self.use_math_verify else "fallback"

    def grade(self, completion: str, gold: str) -> MathGrade:
        pred = extract_math_answer(completion)
        fb = fallback_equal(pred, gold)
        if not self.use_math_verify:
            note = "" if math_verify_available() else "math_verify not installed"
            return MathGrade(fb, "fallback", note, pred)
        if self._startup_error is not None:
            return MathGrade(fb, "fallback", f"error: {self._startup_error}", pred)
        worker = self._free.get()
        try:
            reply = worker.request(gold, completion, self.timeout_s)
        except _WorkerTimeout:
            return MathGrade(fb, "fallback", "timeout", pred)
        except _WorkerStartError as exc:
            # A worker that cannot start will not start next time either: stop paying for it.
            with self._lock:
                self._startup_error = str(exc)
            return MathGrade(fb, "fallback", f"error: {exc}", pred)
        except _WorkerError as exc:
            return MathGrade(fb, "fallback", f"error: {exc}", pred)
        finally:
            self._free.put(worker)
        if not reply.get("ok"):
            return MathGrade(fb, "fallback", f"error: {reply.get('error')}", pred)
        if reply["correct"]:
            return MathGrade(True, "math_verify", "", pred)
        # math-verify can miss textual answers (\text{Evelyn}); an exact normalised match is still right.
        if fb:
            return MathGrade(True, "fallback", "", pred)
        return MathGrade(False, "math_verify", "", pred)

    def grade_many(self, completions: Sequence[str], golds: Sequence[str]) -> list[MathGrade]:
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
        if len(self._workers) <= 1:
            return [self.grade(c, g) for c, g in zip(completions, golds, strict=True)]
        with ThreadPoolExecutor(max_workers=len(self._workers)) as pool:
            return list(pool.map(self.grade, completions, golds))

    def close(self) -> None:
        for w in self._workers:
            w.kill()

    def __del__(self) -> None:
        # Workers would exit on their own at EOF of stdin; killing them here frees the memory sooner.
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> MathGrader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: MathGrader | None = None
_default_lock = threading.Lock()


def default_grader() -> MathGrader:
    """A process-wide grader, started on first use and shut down at interpreter exit."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathGrader()
            atexit.register(_default.close)
        return _default


def grade_math(completion: str, gold: str) -> MathGrade:
    """Grade one completion with the process-wide grader."""
    return default_grader().grade(completion, gold)
