"""Preallocated static KV cache: one row ("slot") per running sequence, fixed maximum length.

Layout ``[layers, slots, max_len, kv_heads, head_dim]`` for K and for V. A slot is a contiguous
``[max_len, kv_heads, head_dim]`` block, so the decode step can read the first ``B`` slots as a plain view
(no gather) and SDPA/flash kernels take ``[B, max_len, kv_heads, head_dim]`` transposed without a copy.
The scheduler keeps the running sequences in slots ``0..B-1`` (it compacts on retire), which is what
makes that view possible.

The cache is zero-initialised: masked-out positions still enter the attention matmul with weight 0,
and ``0 * NaN`` would poison it, so stale memory must never hold NaN/Inf.

``QERL_KV_CACHE=fp8`` (the ``kv_cache`` option) stores K and V as E4M3 with a unit scale, as vLLM's uncalibrated
``kv_cache_dtype=fp8`` does: every write rounds to nearest and saturates at +-448 (torch's cast and the Triton
write both), every read widens exactly. Half the bytes per token: twice the sequences in the same memory and half
the attention's reads. The price is E4M3's 3 mantissa bits on every key and value (relative 2**-4) and a floor
of 2**-9 under which small values flush to zero; the rollout's log-probs move by that, which the importance
correction sees (measure with ``qerl bench mismatch`` before trusting it at scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_cli.errors import QerlError
from qerl_cli.rollout.routing import RoutingCache, RoutingShape

FP8_KV = torch.float8_e4m3fn
# the kv_cache option's values that store the cache in a dtype of their own ("auto": the model's)
STORED_AS = {"fp8": FP8_KV}


def cache_dtype(model_dtype: torch.dtype, kv_cache: str) -> torch.dtype:
    """The dtype the KV cache is stored in: the model's, or E4M3 with ``kv_cache="fp8"`` (the one place deciding)."""
    return STORED_AS.get(kv_cache, model_dtype)


def kv_elem(model_elem: int) -> int:
    """Bytes per cached K or V element under the current options, for plans that size the cache before it exists."""
    from qerl_cli.options import options

    stored = STORED_AS.get(options().kv_cache)
    return stored.itemsize if stored is not None else model_elem


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_len: int
    dtype: torch.dtype
    routing: RoutingShape | None = None  # a mixture of experts' recorded routing kept beside the K/V (routing.py)

    def bytes_per_slot(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        routing = self.routing.bytes_per_token() if self.routing is not None else 0
        return (2 * self.num_layers * self.num_kv_heads * self.head_dim * elem + routing) * self.max_len


def activation_reserve(*, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, layers: int,
                       vocab: int, elem: int, prefill_tokens: int, slots: int) -> int:
    """Rough peak of non-cache memory during a builtin-engine rollout (bytes); generous on purpose.

    The engine keeps this much free beside its KV cache, and the trainer's memory plan counts it.
    """
    per_token = (
        4 * hidden
        + 3 * intermediate
        + (heads + 2 * kv_heads) * head_dim
        + 2 * layers * kv_heads * head_dim  # prefill K/V handed to the slots
    )
    prefill = int(1.5 * prefill_tokens * per_token * elem)
    # Sampling works on [slots, vocab]: float32 logits/logp/noise and int64 hashes.
    sampling = slots * vocab * 48
    return prefill + sampling + (512 << 20)


@dataclass(frozen=True)
class KVBudget:
    """The CUDA memory a KV cache may take (bytes): what the process may hold, what is in use, the activation
    reserve; ``fit`` whole slots of ``per_slot`` bytes. It explains a cache smaller than asked for."""

    total: int
    utilization: float
    in_use: int
    reserve: int
    per_slot: int
    max_len: int

    @property
    def budget(self) -> int:
        return int(self.total * self.utilization) - self.in_use - self.reserve

    @property
    def fit(self) -> int:
        return self.budget // self.per_slot if self.budget > 0 else 0

    def describe(self) -> str:
        gib = 2**30
        return (f"{self.in_use / gib:.1f} GiB in use (weights, adapters, optimizer) and {self.reserve / gib:.1f} GiB "
                f"kept for activations, of {self.utilization:g} x {self.total / gib:.1f} GiB, leave KV room for "
                f"{self.fit} sequences of {self.max_len} tokens ({self.per_slot / gib:.3f} GiB each)")


def kv_budget(shape: CacheShape, device: torch.device, gpu_memory_utilization: float,
              reserve_bytes: int) -> KVBudget:
    """The KV-cache budget on CUDA, following vLLM's meaning of ``gpu_memory_utilization``: the fraction of the
    whole GPU this process may hold. What is already in use (weights, optimizer state, other tensors) and
    ``reserve_bytes`` (activations of a prefill chunk and of sampling) come off it; the rest is KV cache."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise QerlError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free, total = torch.cuda.mem_get_info(device)
    # blocks this process's caching allocator holds but no tensor uses (e.g. a model build's freed
    # temporaries) are free for the cache too: count only what is allocated, plus other processes' memory
    used = total - free - (torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return KVBudget(total=total, utilization=gpu_memory_utilization, in_use=used, reserve=reserve_bytes,
                    per_slot=shape.bytes_per_slot(), max_len=shape.max_len)


def plan_num_slots(shape: CacheShape, max_slots: int, budget: KVBudget | None) -> int:
    """How many slots to allocate: ``max_slots``, fewer if the CUDA memory ``budget`` says so (None, on CPU:
    ``max_slots`` as is)."""
    if budget is None:
        return max_slots
    if budget.fit < 1:
        raise QerlError(
            f"no room for even one KV-cache slot: budget {budget.budget / 2**30:.2f} GiB "
            f"(gpu_memory_utilization={budget.utilization}, in use {budget.in_use / 2**30:.2f} GiB of "
            f"{budget.total / 2**30:.2f} GiB), one slot of {shape.max_len} tokens needs "
            f"{budget.per_slot / 2**30:.3f} GiB; raise gpu_memory_utilization or lower max_model_len"
        )
    return int(min(max_slots, budget.fit))


def bucket_for(buckets: list[int], need: int, what: str) -> int:
    """The smallest of the ascending ``buckets`` that holds ``need``; a bucket list sized by a memory budget may
    hold none, and then the error says ``what`` needed how much (never a bare StopIteration)."""
    for b in buckets:
        if b >= need:
            return b
    raise QerlError(f"{what}: needs {need}, the largest is {buckets[-1] if buckets else 0}")


class KVCache:
    """K and V tensors ``[layers, slots, max_len, kv_heads, head_dim]`` and, for a mixture of experts whose routing
    is recorded, its :class:`RoutingCache` (slot for slot); ``release()`` frees them."""

    def __init__(self, shape: CacheShape, num_slots: int, device: torch.device) -> None:
        self.shape = shape
        self.num_slots = num_slots
        dims = (shape.num_layers, num_slots, shape.max_len, shape.num_kv_heads, shape.head_dim)
        self.k: torch.Tensor | None = torch.zeros(dims, dtype=shape.dtype, device=device)
        self.v: torch.Tensor | None = torch.zeros(dims, dtype=shape.dtype, device=device)
        self.routing: RoutingCache | None = (RoutingCache(shape.routing, num_slots, shape.max_len, device)
                                             if shape.routing is not None else None)

    @property
    def allocated(self) -> bool:
        return self.k is not None

    def write_prompt(self, slot: int, k: torch.Tensor, v: torch.Tensor, routing: torch.Tensor | None = None) -> None:
        """Copy one prompt's K/V, each ``[layers, length, kv_heads, head_dim]``, into positions 0..length-1 (and its
        recorded routing ``[length, layers, k]`` when given)."""
        assert self.k is not None and self.v is not None
        length = k.shape[1]
        self.k[:, slot, :length].copy_(k)
        self.v[:, slot, :length].copy_(v)
        if routing is not None and self.routing is not None:
            self.routing.write_prompt(slot, routing)

    def read(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of positions 0..length-1 of one slot, each ``[layers, length, kv_heads, head_dim]``."""
        assert self.k is not None and self.v is not None
        return self.k[:, slot, :length].clone(), self.v[:, slot, :length].clone()

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of every layer from slot ``src`` to slot ``dst``."""
        assert self.k is not None and self.v is not None
        self.k[:, dst, :length].copy_(self.k[:, src, :length])
        self.v[:, dst, :length].copy_(self.v[:, src, :length])
        if self.routing is not None:
            self.routing.copy_slot(src, dst, length)

    def read_routing(self, slot: int, length: int) -> torch.Tensor | None:
        """A copy of the recorded routing of ``slot``'s first ``length`` positions, or None when none is kept."""
        return self.routing.read(slot, length) if self.routing is not None else None

    def release(self) -> None:
        self.k = None
        self.v = None
        self.routing = None
