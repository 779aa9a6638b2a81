"""Graceful stop: Ctrl-C and SIGTERM end a run at a step boundary, with the finished step checkpointed."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from qerl_cli.errors import Preempted


class GracefulStop:
    """Stop requests at a step boundary: Ctrl-C (SIGINT) and SIGTERM (what SLURM, Kubernetes and spot instances
    send before they kill a job). Before :meth:`loop` (model loading) either signal interrupts at once.

    Ctrl-C: the step in flight finishes, a checkpoint is written, exit 130; a second Ctrl-C interrupts at once.
    SIGTERM: the step in flight may finish within ``grace_s`` seconds (``--sigterm-grace-s``) and is then
    checkpointed; past that, or at a second SIGTERM, the step is abandoned (:class:`Preempted` is raised inside
    it, so nothing of it is logged or saved) and the previous checkpoint stays the one `--resume` continues
    from. Either way the stage is recorded `interrupted` and `qerl train` exits 143. ``can_abandon`` is off for
    data-parallel ranks: they can only stop together (agreed before each step), so their step always finishes.
    """

    def __init__(self, grace_s: float = 0.0, *, can_abandon: bool = True) -> None:
        self.grace_s = grace_s
        self.can_abandon = can_abandon
        self.requested = False
        self.preempted = False
        self.in_step = False
        self.looping = False  # set by loop(): before it (setup), a signal interrupts at once
        self._old: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self._main = threading.main_thread().ident

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested or not self.looping:
            raise KeyboardInterrupt
        self.requested = True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        first = not self.preempted
        self.requested = self.preempted = True
        if not self.looping:  # still setting up: nothing to finish or save
            raise Preempted("preempted (SIGTERM) while setting up, before any step: run the same command with "
                            "--resume to continue")
        if first and self.can_abandon and self.grace_s > 0:
            # the grace period's end is a second SIGTERM to this (main) thread: it also wakes a blocking call
            self._timer = threading.Timer(self.grace_s, self._expire)
            self._timer.daemon = True
            self._timer.start()
        if self.in_step and self.can_abandon and (not first or self.grace_s <= 0):
            raise Preempted("abandoned")

    def _expire(self) -> None:
        if self.in_step and self._main is not None:
            signal.pthread_kill(self._main, signal.SIGTERM)

    def loop(self) -> None:
        """From here on a stop request waits for the step boundary."""
        self.looping = True

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold SIGINT/SIGTERM back for a short block that must not stop halfway (they arrive after it)."""
        signals = {signal.SIGINT, signal.SIGTERM}
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one train step: the span a SIGTERM past its grace period abandons."""
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    def __enter__(self) -> GracefulStop:
        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            self._old[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
            self._old[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.in_step = False
        if self._timer is not None:  # never a SIGTERM from the timer once the default handler is back
            self._timer.cancel()
            self._timer.join()
        for signum, old in self._old.items():
            signal.signal(signum, old)

