"""The next step's rollouts generated while this step trains (``--async-rollout``).

Decoding is bound by memory bandwidth and the update by arithmetic and host work, so the two can share the GPU: a
thread generates step N+1's rollouts on a second CUDA stream while the main thread runs step N's update. The
rollout policy is then one update stale: the adapters are copied into the engine's shadows before the update
starts (:meth:`BuiltinEngine.snapshot_adapters`), so the sequences sample pi_{N-1} while the update moves to
pi_N. The update's importance weights (``--correction``, required) correct for it, as asynchronous RL systems
do: pi_old is the update forward's own policy and mu the stale one that sampled.

Everything the rollout reads that a checkpoint also writes is settled on the main thread before the thread
starts (train/rollouter.py's ``Rollouter.start_next``): the AQN noise of step N+1 is drawn, and the data position
and AQN state the checkpoint of step N must record (those before step N+1's rollouts) are kept
(:attr:`BackgroundRollouts.resume_state`); this module only runs the collection in its thread. A run resumed
from that checkpoint regenerates step N+1's rollouts with the checkpoint's own adapters, so it continues exactly
from the data position, not bit for bit like the uninterrupted run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class BackgroundRollouts(Generic[T]):
    """One step's rollouts collected in a thread (``collect``, on a second CUDA stream); :meth:`take` waits for them
    (and re-raises their error). ``resume_state``: where the data and AQN stood before they began."""

    def __init__(self, step: int, resume_state: dict[str, Any], collect: Callable[[], T],
                 device: torch.device) -> None:
        self.step = step
        self.resume_state = resume_state
        self._result: T | None = None
        self._error: BaseException | None = None
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        ready = torch.cuda.current_stream(device).record_event() if stream is not None else None

        def run() -> None:
            try:
                if stream is None:
                    self._result = collect()
                    return
                stream.wait_event(ready)  # the snapshot and the noise are written before the first decode reads them
                with torch.cuda.stream(stream):
                    self._result = collect()
                stream.synchronize()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread at take()
                self._error = exc

        self._thread = threading.Thread(target=run, name="qerl-async-rollout", daemon=True)
        self._thread.start()

    def take(self) -> T:
        """The rollouts, once generated (the training thread waits here when the update finished first)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
