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

Generic over parameters: any list of tensors or parameter groups on one device. Parameters that are DTensor
shards (FSDP2) are updated through their local shards (AdamW is elementwise); their state then holds local
shards. Not supported (refused): ``amsgrad``, ``fused``, ``capturable``, ``differentiable``.
"""

from __future__ import annotations

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

    # ---- host storage ----------------------------------------------------------------------------------
    @staticmethod
    def _host_like(p: torch.Tensor, src: torch.Tensor | None = None) -> torch.Tensor:
        """A host tensor shaped like ``p``'s local data (pinned when ``p`` is on CUDA): zeros, or ``src``."""
        local = _local(p)
        out = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.is_cuda)
        if src is None:
            return out.zero_()
        return out.copy_(src.reshape(local.shape))

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:  # as AdamW's lazy init (step on the CPU: neither capturable nor fused)
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            for k in MOMENTS:
                state[k] = self._host_like(p)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's ``load_state_dict`` (same checks and hyper-parameters), with the moments copied into host
        memory directly instead of onto the parameters' device."""
        saved = state_dict["state"]
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
            for k, v in value.items():
                if k in MOMENTS:
                    state[k] = self._host_like(p, v.detach().to(dtype=p.dtype))
                elif k == "step":
                    state[k] = v.detach().to("cpu").clone() if torch.is_tensor(v) else \
                        torch.tensor(float(v), dtype=_scalar_dtype())
                else:
                    state[k] = v
            self.state[p] = state

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


def host_state_bytes(params: Iterable[torch.Tensor]) -> int:
    """Host memory the moments of ``params`` take (8 bytes per fp32 parameter)."""
    return sum(2 * _local(p).numel() * _local(p).element_size() for p in params)


__all__ = ["DEFAULT_BUCKET_BYTES", "HostOffloadAdamW", "host_state_bytes"]
