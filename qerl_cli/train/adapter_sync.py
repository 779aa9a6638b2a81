"""Publishing adapter versions from trainer rank 0 to the rollout ranks of ``--rollout-gpus`` (train/disagg.py).

Only the LoRA factors travel (tens to hundreds of MB at 7B, not the base): one flat float32 buffer whose first
two entries are a header (version, stop flag), broadcast from trainer rank 0 over a process group of rank 0 and
the rollout ranks (NCCL on CUDA, gloo on CPU).

Why a receiving thread on each rollout rank: a broadcast completes only when every member has joined it. If the
rollout rank joined between its engine calls, the trainer would wait at every publish until the slowest rollout
rank finished its chunk. Instead a thread on each rollout rank always waits for the next version, receives into
a buffer of its own, and hands the newest complete version over under a lock.

Why the thread waits on the CPU (a two-number header over a gloo group, the "doorbell") and posts the payload's
NCCL broadcast only once the trainer announced it: a posted NCCL broadcast is a kernel that spins on the GPU until
its sender joins. Left posted for a whole trainer step, it blocks every device-wide wait of the rollout rank (a
``torch.cuda.synchronize()``, a ``cudaFree`` of ``empty_cache``), and the rollout rank, whose heartbeat still
beats, would wait forever for the trainer that waits for its samples (seen on two H200s, 2026-11-29). With the
doorbell the payload kernel runs only while the trainer sends it (milliseconds). The receive buffers are made once
(two, used in turn) so that the thread never allocates device memory while the engine captures a CUDA graph.

The builtin engine applies it
between decode windows (``BuiltinEngine.adapter_updates``; other engines between calls) by copying it IN PLACE into
the LoRA parameters the engine reads and from them into its shadows: no new tensors, no recompile, no CUDA-graph
recapture. A version that arrives while the previous one was not applied yet simply replaces it (only the newest
matters).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

HEADER = 2  # version, stop flag


def flat_size(params: list[torch.Tensor]) -> int:
    return HEADER + sum(p.numel() for p in params)


def pack(params: list[torch.Tensor], version: int, stop: bool, device: torch.device) -> torch.Tensor:
    """The broadcast buffer: header then every factor as float32 (exact for fp32 and bf16 factors)."""
    head = torch.tensor([float(version), float(stop)], dtype=torch.float32, device=device)
    return torch.cat([head, *(p.detach().reshape(-1).float().to(device) for p in params)])


def unpack_into(buf: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Copy the factors of ``buf`` into ``params`` in place (their storage, hence the engine's views, unchanged)."""
    pos = HEADER
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(buf[pos:pos + n].view(p.shape).to(p.dtype))
            pos += n


class AdapterPublisher:
    """Trainer rank 0's side: :meth:`publish` rings the doorbell (``bell``, gloo) and broadcasts one version over
    ``group``; its wall seconds (``async/sync_s``)."""

    def __init__(self, params: list[torch.Tensor], group: object, bell: object, device: torch.device) -> None:
        self.params, self.group, self.bell, self.device = params, group, bell, device
        self.version = -1

    def publish(self, version: int, *, stop: bool = False) -> float:
        t = time.perf_counter()
        buf = pack(self.params, version, stop, self.device)
        dist.broadcast(buf[:HEADER].cpu(), src=0, group=self.bell)
        dist.broadcast(buf, src=0, group=self.group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.version = version
        return time.perf_counter() - t


class AdapterSubscriber:
    """A rollout rank's side: a thread receives every version; :meth:`apply` installs the newest between engine
    calls. The thread ends at the stop broadcast (the trainer's last publish)."""

    def __init__(self, params: list[torch.Tensor], group: object, bell: object, device: torch.device,
                 version: int) -> None:
        self.params, self.group, self.bell, self.device = params, group, bell, device
        self._bufs = [torch.empty(flat_size(params), dtype=torch.float32, device=device) for _ in range(2)]
        self.applied = version
        self._ready: torch.Tensor | None = None
        self._ready_version = version
        self.stopped = False
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="qerl-adapter-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            stream = None
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device)  # off the decode stream
            head = torch.empty(HEADER, dtype=torch.float32)
            turn = 0
            while True:
                dist.broadcast(head, src=0, group=self.bell)  # waits on the CPU: nothing spins on the GPU
                # the buffer not handed over last time: apply() reads only the one handed over, under the lock
                buf = self._bufs[turn]
                turn = 1 - turn
                if stream is not None:
                    with torch.cuda.stream(stream):
                        dist.broadcast(buf, src=0, group=self.group)
                    stream.synchronize()  # complete before the main thread reads it
                else:
                    dist.broadcast(buf, src=0, group=self.group)
                version, stop = int(head[0].item()), bool(head[1].item())
                with self._lock:
                    if stop:
                        self.stopped = True
                        return
                    self._ready, self._ready_version = buf, version
        except BaseException as exc:  # noqa: BLE001 - reported to the rollout loop, which stops the rank
            self.error = exc

    @property
    def latest(self) -> int:
        with self._lock:
            return self._ready_version

    def apply(self) -> int | None:
        """Install the newest received version if it is newer than the applied one; that version, else None."""
        with self._lock:
            if self._ready is None or self._ready_version <= self.applied:
                return None
            unpack_into(self._ready, self.params)
            if self.device.type == "cuda":  # the copies read the buffer the thread fills the version after next
                torch.cuda.current_stream(self.device).synchronize()
            self.applied, self._ready = self._ready_version, None
            return self.applied

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
