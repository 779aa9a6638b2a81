"""What flows between the rollout ranks and the trainers of ``--rollout-gpus`` (train/disagg.py), as plain data:
the prompts handed out to generate, the scored groups coming back, and the staleness gate between the two.

Kept free of torch.distributed so that the rules are unit-tested on their own (tests/test_disagg.py):

* a group is the unit: all ``num_generations`` samples of one prompt, generated in one engine call under ONE
  adapter version, so group advantages are always computed over a complete group of one policy;
* staleness gate: a group generated under adapter version ``v`` may be trained by the update that starts from
  version ``s`` only if ``s <= v + K`` (``--max-staleness K``); an older one is dropped and counted;
* nothing is lost silently: every group received is, at the end, trained, dropped as stale, dropped for zero
  reward variance (dynamic sampling) or dropped at the stop; :meth:`SampleQueue.accounting` adds them up.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def is_fresh(version: int, train_version: int, max_staleness: int) -> bool:
    """Whether a group sampled under adapter ``version`` may be trained by the update from ``train_version``."""
    return train_version <= version + max_staleness


@dataclass
class GroupItem:
    """One prompt's scored group as a rollout rank produced it."""

    prompt_index: int
    samples: list[Any]
    raw: torch.Tensor
    shaped: torch.Tensor
    # the oldest adapter version (optimizer steps seen) any of the group's tokens was sampled under: the staleness
    # bound holds for every token (later tokens may come from newer versions applied between decode windows)
    version: int
    rank: int = -1  # the rollout rank that generated it
    tokens: int = 0  # completion tokens of the group

    @property
    def zero_std(self) -> bool:
        """All rewards equal: no advantage signal (dynamic sampling drops such groups)."""
        return self.shaped.numel() < 2 or bool((self.shaped == self.shaped[0]).all())


@dataclass
class Accounting:
    """Where every received group went; ``received == trained + dropped`` once the queue is closed."""

    received: int = 0
    trained: int = 0
    dropped_stale: int = 0
    dropped_zero_std: int = 0
    dropped_at_stop: int = 0
    queued: int = 0

    @property
    def dropped(self) -> int:
        return self.dropped_stale + self.dropped_zero_std + self.dropped_at_stop

    def balanced(self) -> bool:
        return self.received == self.trained + self.dropped + self.queued

    def to_dict(self) -> dict[str, int]:
        return {"received": self.received, "trained": self.trained, "dropped_stale": self.dropped_stale,
                "dropped_zero_std": self.dropped_zero_std, "dropped_at_stop": self.dropped_at_stop,
                "queued": self.queued}


class QueueFailed(Exception):
    """What a waiting :meth:`SampleQueue.take` raises when ``failed()`` reports a broken producer."""


@dataclass
class SampleQueue:
    """Scored groups in arrival order, filled by the hub thread, drained by the training thread."""

    max_staleness: int
    drop_zero_std: bool = False
    items: deque[GroupItem] = field(default_factory=deque)
    acc: Accounting = field(default_factory=Accounting)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    closed: bool = False

    def put(self, groups: list[GroupItem]) -> None:
        with self._cv:
            if self.closed:  # after the stop: counted, never trained
                self.acc.received += len(groups)
                self.acc.dropped_at_stop += len(groups)
                return
            self.items.extend(groups)
            self.acc.received += len(groups)
            self.acc.queued = len(self.items)
            self._cv.notify_all()

    def _gate(self, train_version: int) -> tuple[int, int]:
        """Drop what the update from ``train_version`` may not train (under the lock); (stale, zero_std) dropped."""
        stale = zero = 0
        keep: deque[GroupItem] = deque()
        for g in self.items:
            if not is_fresh(g.version, train_version, self.max_staleness):
                stale += 1
            elif self.drop_zero_std and g.zero_std:
                zero += 1
            else:
                keep.append(g)
        self.items = keep
        self.acc.dropped_stale += stale
        self.acc.dropped_zero_std += zero
        self.acc.queued = len(self.items)
        return stale, zero

    def take(self, n: int, train_version: int, *, timeout_s: float | None = None, poll_s: float = 0.5,
             failed: Callable[[], str | None] = lambda: None,
             on_wait: Callable[[], None] = lambda: None) -> tuple[list[GroupItem], dict[str, int]]:
        """The ``n`` oldest groups the update from ``train_version`` may train, waiting for them; what the gate
        dropped meanwhile. ``failed()`` (checked every ``poll_s``) names a broken producer: raised as QueueFailed.
        ``on_wait()`` runs at every poll (the trainer hands out more prompts there, as drops eat the supply)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stale = zero = 0
        with self._cv:
            while True:
                s, z = self._gate(train_version)
                stale, zero = stale + s, zero + z
                if len(self.items) >= n:
                    out = [self.items.popleft() for _ in range(n)]
                    self.acc.trained += n
                    self.acc.queued = len(self.items)
                    return out, {"dropped_stale": stale, "dropped_zero_std": zero}
                why = failed()
                if why is not None:
                    raise QueueFailed(why)
                if deadline is not None and time.monotonic() > deadline:
                    raise QueueFailed(f"no {n} trainable groups within {timeout_s:.0f} s")
                self._cv.release()
                try:
                    on_wait()
                finally:
                    self._cv.acquire()
                self._cv.wait(poll_s)

    def close(self) -> Accounting:
        """The stop: every group still queued is dropped and counted; later arrivals too (:meth:`put`)."""
        with self._cv:
            self.closed = True
            self.acc.dropped_at_stop += len(self.items)
            self.items.clear()
            self.acc.queued = 0
            return Accounting(**self.acc.to_dict())

    def snapshot(self) -> Accounting:
        with self._cv:
            return Accounting(**self.acc.to_dict())


def prompt_target(batch_prompts: int, max_staleness: int, waiting: bool) -> int:
    """How many prompts may be handed out, running or queued as groups at once. A group generated now carries the
    adapter version just published, v; the update from version s may train it while s <= v + K. Between takes
    the trainer is computing the update from v, whose groups it already holds, so a new group can serve only the
    K updates after it: K batches. While the trainer waits inside its take for the update from v, that update
    can use it too: K + 1 batches. More is rollout work the gate would throw away: with two batches at K = 1
    and a rollout faster than the update, a batch was dropped stale every second update (7B on two H200s,
    2026-11-29). Zero-variance groups that dynamic sampling drops are made up while the trainer waits."""
    return batch_prompts * (max_staleness + (1 if waiting else 0))


def chunk_prompts(batch_prompts: int, rollout_ranks: int) -> int:
    """The most prompts the hub hands a rollout rank at once: its share of one step, so the ranks share each step's
    prompts and pick up a new adapter version soon, yet enough to fill its engine's slots. A rollout rank's memory
    plan sizes its KV cache for this many prompts' samples (train/memory_plan.py)."""
    return max(1, -(-batch_prompts // max(1, rollout_ranks)))


@dataclass
class PromptPool:
    """Prompt indices handed out to the rollout ranks in chunks. Only the training thread refills it (from the
    trainer's own PromptStream, so the data position a checkpoint records is the trainer's); the hub thread hands
    chunks out. ``outstanding``: prompts handed out whose groups have not come back yet."""

    chunk: int
    pending: deque[int] = field(default_factory=deque)
    outstanding: int = 0
    handed: int = 0  # chunks handed out so far: numbers each chunk (its sampling seed)
    prompts_handed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def top_up(self, target: int, queued: int, take: Callable[[int], list[int]]) -> int:
        """Refill so that prompts pending + outstanding + ``queued`` groups reach ``target``; how many were taken."""
        with self._lock:
            need = target - (len(self.pending) + self.outstanding + queued)
            if need <= 0:
                return 0
            self.pending.extend(take(need))
            return need

    def hand_out(self, limit: int | None = None) -> tuple[int, list[int]]:
        """(chunk number, prompt indices) for a rollout rank that asks (at most ``limit``: what its free slots can
        start, when it streams); an empty list when none is pending."""
        with self._lock:
            k = min(self.chunk, len(self.pending), self.chunk if limit is None else limit)
            if k == 0:
                return -1, []
            out = [self.pending.popleft() for _ in range(k)]
            self.outstanding += k
            self.prompts_handed += k
            self.handed += 1
            return self.handed - 1, out

    def returned(self, n: int) -> None:
        """``n`` handed-out prompts came back (as groups, or lost with their rank)."""
        with self._lock:
            self.outstanding = max(0, self.outstanding - n)


@dataclass
class IdleClock:
    """The rollout ranks' busy and idle seconds since the last read (``async/rollout_idle_frac``)."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, busy_s: float, idle_s: float) -> None:
        with self._lock:
            self.busy_s += busy_s
            self.idle_s += idle_s

    def read(self) -> float:
        """Idle share of the rollout ranks' time since the last read (0 when nothing was reported)."""
        with self._lock:
            total = self.busy_s + self.idle_s
            frac = self.idle_s / total if total > 0 else 0.0
            self.busy_s = self.idle_s = 0.0
            return frac
