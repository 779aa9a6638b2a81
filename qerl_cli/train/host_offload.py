"""AdamW with its moment estimates in (pinned) host memory, streamed through the GPU for each step.

Why: AdamW keeps two fp32 moments per trained parameter (8 bytes), on the parameters' device. For LoRA r32 on
Qwen2.5-72B that is 3.4 GB of GPU memory that sits idle through the whole rollout and training pass and is
touched once per step. :class:`HostOffloadAdamW` keeps those moments in host memory (pinned when the parameters
are on CUDA) and, at ``step()``, streams them to the device in buckets of ``bucket_bytes`` of parameters: a
side stream uploads the next bucket while the current one is updated, and a second side stream copies each
updated bucket back. The GPU holds at most three buckets of moments at a time; ``step()`` returns once every
moment is back in host memory, so ``state_dict()`` right after it reads finished values.

Exactness: the update of each bucket is torch's own functional AdamW (``torch.optim.adam.adam`` with
``decoupled_weight_decay=True``), called with the same arguments ``torch.optim.AdamW.step`` passes, on device
copies of the moments, and it picks its implementation (foreach or per-tensor) from the parameters' device as
AdamW does. Every operation is elementwise per tensor, so splitting a group into buckets changes nothing: the
parameters and moments are bit-identical to ``torch.optim.AdamW``'s (tests/test_host_offload.py checks several
steps, weight decay, a changing learning rate and a resume, on CPU; on the GPU it matched AdamW bit for bit).

State: the class is an ``AdamW`` subclass with AdamW's per-parameter state keys (``step``, ``exp_avg``,
``exp_avg_sq``), so ``state_dict()`` / ``load_state_dict()`` are the normal ones and a checkpoint moves freely
between this class and ``torch.optim.AdamW``; loading puts the moments straight into host memory (never a
transient device copy of the whole state). LR schedulers and ``GradScaler.unscale_`` see an ordinary optimizer.

Off the critical path (the first step and checkpoints): AdamW creates its state lazily in the first ``step()``;
here that is ~10 GB of pinned, zeroed host memory at Qwen3-30B-A3B LoRA r32 (1.29 B parameters), and pinning runs
at 1-3 GB/s, so the first step's optimizer took 8.8 s on an H200 (2026-11-29). :meth:`HostOffloadAdamW.prepare_state`
allocates that state in a background thread the trainer starts once the optimizer exists; ``step()``,
``state_dict()`` and ``load_state_dict()`` join it first, and it creates exactly what AdamW's lazy init would
(``step`` 0 and zeroed moments), so the numbers stay AdamW's. A background checkpoint borrows the live host moments
instead of cloning them (:meth:`HostOffloadAdamW.lend_state`, 2.2 s of the same step's checkpoint phase): the
writer thread reads them while the next step's rollout and training pass run, and the next ``step()`` (or
``load_state_dict()``) waits until the writer releases them, so it never changes a moment the writer still reads.

Generic over parameters: any list of tensors or parameter groups on one device. Parameters that are DTensor
shards (FSDP2) are updated through their local shards (AdamW is elementwise); their state then holds local
shards. Not supported (refused): ``amsgrad``, ``fused``, ``capturable``, ``differentiable``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch
from torch.optim.adam import adam

DEFAULT_BUCKET_BYTES = 64 << 20  # parameter bytes per streamed bucket (the device holds moments of <= 3 buckets)
MOMENTS = ("exp_avg", "exp_avg_sq")


def _scalar_dtype() -> torch.dtype:
    """The dtype AdamW gives its ``step`` counter (float64 only under a float64 default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and hasattr(t, "placements") else t


class HostStateLoan:
    """The live host moments of a :class:`HostOffloadAdamW`, lent to a reader on another thread (a background
    checkpoint write) instead of copied. The optimizer's next ``step()`` / ``load_state_dict()`` waits for
    :meth:`release`: a loan the reader never releases stalls training, so the reader releases it in a ``finally``."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors  # kept referenced so the ids below cannot be reused while the loan is out
        self.ids = frozenset(id(t) for t in tensors)
        self._released = threading.Event()

    def release(self) -> None:
        """The reader is done with the tensors (idempotent)."""
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def wait(self) -> None:
        self._released.wait()


class HostOffloadAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``exp_avg`` / ``exp_avg_sq`` live in host memory (see the module docstring)."""

    def __init__(self, params: Iterable[Any], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **adamw: Any) -> None:
        super().__init__(params, **adamw)
        for group in self.param_groups:
            bad = [k for k in ("amsgrad", "fused", "capturable", "differentiable") if group.get(k)]
            if bad:
                raise ValueError(f"HostOffloadAdamW does not support {', '.join(bad)}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.bucket_bytes = int(bucket_bytes)
        self._streams: dict[torch.device, tuple[Any, Any]] = {}
        self._eager = False  # prepare_state() was asked for: a load_state_dict() prepares what it did not fill
        self._preparing: threading.Thread | None = None
        self._prepared: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # filled by the thread, merged at join
        self._prepare_error: list[BaseException] = []
        self._loans: list[HostStateLoan] = []
        self.last_loan_wait_s = 0.0  # how long the last step() waited for a checkpoint writer to release the moments

    # ---- host storage ----------------------------------------------------------------------------------
    @staticmethod
    def _host_like(p: torch.Tensor, src: torch.Tensor | None = None) -> torch.Tensor:
        """A host tensor shaped like ``p``'s local data (pinned when ``p`` is on CUDA): zeros, or ``src``."""
        local = _local(p)
        out = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.is_cuda)
        if src is None:
            return out.zero_()
        return out.copy_(src.reshape(local.shape))

    def prepare_state(self) -> None:
        """Create every parameter's state (``step`` 0, zeroed host moments: what AdamW's lazy init creates) in a
        background thread, so the pinning is paid while the first step's rollout runs, not in its optimizer phase.
        Harmless to call again (after a resume load, say): only parameters without state are prepared. The thread
        only allocates; the state is put in place on the caller's thread when ``step()``, ``state_dict()``,
        ``load_state_dict()`` or :meth:`lend_state` join it, so nothing else ever sees a half-built state."""
        self._settle()
        self._eager = True
        todo = []
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state.get(p):  # .get: indexing the defaultdict would insert an empty state
                    todo.append(p)
        if not todo:
            return
        done: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        errors: list[BaseException] = []

        def alloc() -> None:
            try:
                for p in todo:
                    done.append((p, [self._host_like(p) for _ in MOMENTS]))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread at the join
                errors.append(exc)

        self._prepared, self._prepare_error = done, errors
        self._preparing = threading.Thread(target=alloc, name="qerl-adamw-state", daemon=True)
        self._preparing.start()

    def _settle(self) -> None:
        """Join the preparing thread and put its state in place (for parameters that still have none)."""
        if self._preparing is None:
            return
        self._preparing.join()
        self._preparing = None
        done, errors = self._prepared, self._prepare_error
        self._prepared, self._prepare_error = [], []
        if errors:
            raise errors[0]
        for p, moments in done:
            if not self.state.get(p):  # as AdamW's lazy init: the step counter on the CPU, then the moments
                self.state[p] = {"step": torch.tensor(0.0, dtype=_scalar_dtype()),
                                 **dict(zip(MOMENTS, moments, strict=True))}

    # ---- lending the moments to a background checkpoint writer ---------------------------------------------
    def lend_state(self) -> HostStateLoan:
        """The live host moments (the tensors ``state_dict()`` returns) for a reader on another thread, without a
        copy; ``step()`` and ``load_state_dict()`` wait until the loan is released (:class:`HostStateLoan`)."""
        self._settle()
        self._loans = [lent for lent in self._loans if not lent.released]  # checkpoints without a step between
        loan = HostStateLoan(tuple(s[k] for s in self.state.values() if isinstance(s, dict) for k in MOMENTS
                                   if torch.is_tensor(s.get(k))))
        self._loans.append(loan)
        return loan

    def _await_loans(self) -> None:
        t0 = time.perf_counter()
        for loan in self._loans:
            loan.wait()
        self._loans.clear()
        self.last_loan_wait_s = time.perf_counter() - t0

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:  # as AdamW's lazy init (step on the CPU: neither capturable nor fused)
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            for k in MOMENTS:
                state[k] = self._host_like(p)
        return state

    def state_dict(self) -> dict[str, Any]:
        self._settle()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's ``load_state_dict`` (same checks and hyper-parameters), with the moments copied into host
        memory directly instead of onto the parameters' device: into the host tensors already prepared for them
        where shapes match (a resume after :meth:`prepare_state` pins its memory once, not twice). Parameters the
        checkpoint has no state for get it prepared again when :meth:`prepare_state` was called before."""
        self._settle()
        self._await_loans()  # the prepared tensors below are written in place: never while a writer reads them
        saved = state_dict["state"]
        before = {p: self.state.get(p) or {} for g in self.param_groups for p in g["params"]}
        # a saved tensor that is another parameter's held one (a permuted state dict of this very optimizer) would be
        # overwritten before it is read: such a load allocates afresh
        held_ids = {id(t) for s in before.values() for t in s.values() if torch.is_tensor(t)}
        super().load_state_dict({**state_dict, "state": {}})
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        by_id = dict(zip(ids, params, strict=True))
        for key, value in saved.items():
            p = by_id.get(key)
            if p is None:  # state not tied to a parameter: kept as it is, as torch does
                self.state[key] = value
                continue
            state: dict[str, Any] = {}
            local = _local(p)
            for k, v in value.items():
                held = before[p].get(k)
                if k in MOMENTS and torch.is_tensor(held) and held.shape == local.shape and held.dtype == local.dtype \
                        and (v is held or id(v) not in held_ids):
                    state[k] = held.copy_(v.detach().to(dtype=p.dtype).reshape(local.shape))
                elif k in MOMENTS:
                    state[k] = self._host_like(p, v.detach().to(dtype=p.dtype))
                elif k == "step":
                    state[k] = v.detach().to("cpu").clone() if torch.is_tensor(v) else \
                        torch.tensor(float(v), dtype=_scalar_dtype())
                else:
                    state[k] = v
            self.state[p] = state
        if self._eager:
            self.prepare_state()

    # ---- the step --------------------------------------------------------------------------------------
    def _side_streams(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def _buckets(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        out: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in params:
            nbytes = _local(p).numel() * _local(p).element_size()
            if out[-1] and size + nbytes > self.bucket_bytes:
                out.append([])
                size = 0
            out[-1].append(p)
            size += nbytes
        return [b for b in out if b]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: ANN401 - the closure's loss, as torch.optim returns it
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._settle()
        self._await_loans()  # a background checkpoint may still be reading the moments this step updates in place
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("HostOffloadAdamW does not support sparse gradients")
            for p in params:
                self._init_state(p)
            device = _local(params[0]).device
            if device.type == "cuda":
                self._step_cuda(group, params, device)
            else:  # same code path without streams: device "copies" are plain copies
                for bucket in self._buckets(params):
                    moments = [[self.state[p][k].clone() for p in bucket] for k in MOMENTS]
                    self._update(group, bucket, moments)
                    for k, dev in zip(MOMENTS, moments, strict=True):
                        for p, t in zip(bucket, dev, strict=True):
                            self.state[p][k].copy_(t)
        return loss

    def _step_cuda(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device) -> None:
        upload, download = self._side_streams(device)
        compute = torch.cuda.current_stream(device)
        buckets = self._buckets(params)
        # the previous step's write-backs are complete (step() synchronizes at its end), so the host moments
        # may be read now; uploads also wait for the compute stream so the staging memory they write is free
        upload.wait_stream(compute)

        def fetch(bucket: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], Any]:
            with torch.cuda.stream(upload):
                moments = [[self.state[p][k].to(device, non_blocking=True) for p in bucket] for k in MOMENTS]
            for t in chain.from_iterable(moments):  # allocated on `upload`, also used on compute and download
                t.record_stream(compute)
                t.record_stream(download)
            return moments, upload.record_event()

        pending = fetch(buckets[0])
        for i, bucket in enumerate(buckets):
            moments, ready = pending
            if i + 1 < len(buckets):
                pending = fetch(buckets[i + 1])  # the next upload overlaps this update
            compute.wait_event(ready)
            self._update(group, bucket, moments)
            done = compute.record_event()
            download.wait_event(done)
            with torch.cuda.stream(download):
                for k, dev in zip(MOMENTS, moments, strict=True):
                    for p, t in zip(bucket, dev, strict=True):
                        self.state[p][k].copy_(t, non_blocking=True)
            del moments
        download.synchronize()  # every moment is back in host memory: state_dict() may read it

    def _update(self, group: dict[str, Any], bucket: list[torch.Tensor], moments: list[list[torch.Tensor]]) -> None:
        """torch.optim.AdamW.step's call of the functional Adam for one bucket (see the module docstring)."""
        beta1, beta2 = group["betas"]
        locals_ = [_local(p) for p in bucket]
        adam(locals_, [_local(p.grad) for p in bucket], moments[0], moments[1], [],
             [self.state[p]["step"] for p in bucket], amsgrad=False,
             has_complex=any(torch.is_complex(p) for p in locals_), beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
             foreach=group["foreach"], capturable=False, differentiable=False, fused=None,
             grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
             decoupled_weight_decay=group["decoupled_weight_decay"])


def lend_host_state(optimizer: torch.optim.Optimizer) -> HostStateLoan | None:
    """The optimizer's host moments lent to a background checkpoint (None: it keeps none, e.g. plain AdamW, whose
    device moments the snapshot copies to host buffers instead)."""
    return optimizer.lend_state() if isinstance(optimizer, HostOffloadAdamW) else None


def host_state_bytes(params: Iterable[torch.Tensor]) -> int:
    """Host memory the moments of ``params`` take (8 bytes per fp32 parameter)."""
    return sum(2 * _local(p).numel() * _local(p).element_size() for p in params)


__all__ = ["DEFAULT_BUCKET_BYTES", "HostOffloadAdamW", "HostStateLoan", "host_state_bytes", "lend_host_state"]
