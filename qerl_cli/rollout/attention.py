"""Decode attention of the builtin engine: cuDNN SDPA (default) or FlashInfer's batch decode (a measured peer).

The KV cache is ``[layers, slots, max_len, kv_heads, head_dim]`` and running sequence ``b`` lives in slot
``b`` (``kv_cache.py``). Two ways to attend one query token per slot:

* ``sdpa``: torch SDPA (cuDNN on Hopper) over the first ``kv_len`` positions (a power-of-two bucket) of each
  slot with an additive ``position <= current`` mask, GQA folded onto SDPA's query axis; it reads the whole
  bucket, so up to twice the live context.
* ``flashinfer``: ``BatchDecodeWithPagedKVCacheWrapper``, which reads exactly each row's live keys and splits
  long rows across CTAs. qerl's cache is already a paged cache: a layer's ``[slots, max_len, kvh, d]`` viewed
  as ``[slots * max_len / P, P, kvh, d]`` (``cache_pages``) has slot ``b``'s position ``p`` in page
  ``b * max_len / P + p // P`` at offset ``p % P``. A step's page table (``paged_layout``) lists, per row,
  the pages ``0 .. ceil(len / P) - 1`` of its slot, and ``last_page_len`` the filled part of the last one;
  ``paged_decode_reference`` computes, in torch, what FlashInfer computes from those arguments (the CPU
  tests check it against the SDPA path). FlashInfer plans on the host, once per step, before the step runs
  (graph replays included: one wrapper per batch bucket in CUDA-graph mode, buffers fixed); the scheduler
  knows every row's position on the host, so no device sync is needed. FlashInfer's plan stages its
  schedule in pinned memory and copies it asynchronously, so a plan waits for the previous plan's copy to
  have run before overwriting that memory (an event per plan) - the host stays at most one step ahead.

* ``split``: qerl's split-KV decode (``qerl_kernels.decode_attention``, two Triton kernels): each (row, KV head,
  split) reads only the live keys of its split, once for the whole GQA group; the lengths come from the step's
  device positions, so it needs no host plan and a graph captures it like SDPA.

Which one runs: the ``decode_attn`` option (``QERL_DECODE_ATTN``, qerl_cli/options.py) = ``auto`` (default: on
CUDA ``split``, or per CUDA graph, i.e. per batch bucket and KV bucket, the faster of ``split`` and FlashInfer timed
on the live cache when the graph is first captured, where FlashInfer imports; SDPA on other devices, where the
split kernels would run in Triton's interpreter) | ``split`` | ``sdpa`` | ``flashinfer``. The split kernels read
1.4-5x fewer microseconds than cuDNN's SDPA on an H200 at every measured batch (8-256) and context (512-8192;
docs/decode.md), so SDPA is the fallback, not the default. ``flashinfer`` falls back to SDPA with one warning when
the package does not import or its first call fails, ``split`` without CUDA (unless the Triton interpreter runs
it, as the CPU tests ask). FlashInfer is optional (``pip install flashinfer-python``; it JIT-builds its kernels
with nvcc on first use) and is never imported unless ``flashinfer`` or ``auto`` asks for it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from qerl_cli.options import DECODE_ATTN

log = logging.getLogger("qerl.rollout")

BACKENDS = DECODE_ATTN
PAGE_SIZE = 16  # divides the engine's cache length (a multiple of 64)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's split-KV scratch (its documented recommendation)


def _interpreted() -> bool:
    from qerl_kernels._common import INTERPRET

    return INTERPRET


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        from qerl_cli.errors import QerlError

        raise QerlError(f"decode attention {name!r}: choose one of {', '.join(BACKENDS)}")
    return name


# ---- the paged view of qerl's cache (what FlashInfer is handed) ------------------------------------------------
def cache_pages(layer_cache: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """A layer's ``[slots, max_len, kvh, d]`` cache as FlashInfer's NHD pages ``[slots * max_len / P, P, kvh, d]``
    (a view: no copy)."""
    slots, max_len, kvh, d = layer_cache.shape
    if max_len % page_size:
        raise ValueError(f"cache length {max_len} is not a multiple of the page size {page_size}")
    return layer_cache.view(slots * (max_len // page_size), page_size, kvh, d)


def paged_layout(lengths: list[int] | torch.Tensor, max_len: int,
                 page_size: int = PAGE_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [B+1], indices [sum pages], last_page_len [B]), int32 on the CPU, for rows whose KV is in slots
    ``0..B-1`` with ``lengths[b]`` >= 1 keys each (positions ``0..len-1``): row b's pages are its slot's first
    ``ceil(len / P)`` pages, ``b * max_len / P + j``."""
    lens = torch.as_tensor(lengths, dtype=torch.int64).cpu()
    if lens.numel() and int(lens.min()) < 1:
        raise ValueError("every row attends at least one key (length >= 1)")
    if lens.numel() and int(lens.max()) > max_len:
        raise ValueError(f"a row is longer ({int(lens.max())}) than the cache ({max_len})")
    per_slot = max_len // page_size
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(pages, 0)
    row = torch.repeat_interleave(torch.arange(lens.numel()), pages)
    within = torch.arange(int(indptr[-1])) - indptr[:-1].repeat_interleave(pages)
    indices = row * per_slot + within
    last = lens - (pages - 1) * page_size
    return indptr.to(torch.int32), indices.to(torch.int32), last.to(torch.int32)


def paged_decode_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, indptr: torch.Tensor,
                           indices: torch.Tensor, last_page_len: torch.Tensor, scale: float) -> torch.Tensor:
    """What FlashInfer's batch decode returns for these arguments, in torch (float32 math): for row b, the keys
    and values of pages ``indices[indptr[b]:indptr[b+1]]`` in order, the last page cut to ``last_page_len[b]``;
    query head h attends KV head ``h // (H / kvh)``. q [B, H, D] -> [B, H, D] in q's dtype."""
    from qerl_kernels.decode_attention import attend

    b, _, d = q.shape
    kvh = k_pages.shape[2]
    page = k_pages.shape[1]
    out = torch.empty_like(q)
    for i in range(b):
        pg = indices[int(indptr[i]):int(indptr[i + 1])].long()
        n = (pg.numel() - 1) * page + int(last_page_len[i])
        k = k_pages[pg].reshape(-1, kvh, d)[:n]  # [n, kvh, d]
        v = v_pages[pg].reshape(-1, kvh, d)[:n]
        out[i] = attend(q[i], k, v, scale).to(q.dtype)
    return out


def sdpa_decode(q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, kv_len: int, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Today's path: q [B, H, D] over the first ``kv_len`` positions of slots ``0..B-1`` with the additive
    ``mask`` [B, 1, 1, kv_len]; the query heads of one KV head go on SDPA's query-length axis. -> [B, H, D]."""
    b, hq, d = q.shape
    kvh = layer_k.shape[2]
    keys = layer_k[:b, :kv_len].transpose(1, 2)  # [B, kvh, kv_len, d]: a strided view, no copy
    vals = layer_v[:b, :kv_len].transpose(1, 2)
    if keys.dtype != q.dtype:  # an FP8 cache: SDPA takes one dtype, so the bucket is widened (a copy; split doesn't)
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
    o = F.scaled_dot_product_attention(q.reshape(b, kvh, hq // kvh, d), keys, vals, attn_mask=mask, scale=scale)
    return o.reshape(b, hq, d)


# head sizes FlashInfer's decode takes: with FlashInfer 0.7.2 head_dim 32 fails in both its
# tensor-core path ("Invalid configuration ... NUM_MMA_D_QK=2") and its split-KV merge ("Unsupported head_dim: 32")
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def flashinfer_tensor_cores(group: int) -> bool:
    """Whether FlashInfer's decode runs on its tensor-core (prefill-kernel) path for this GQA group size: FlashInfer
    advises it for groups >= 4, and its CUDA-core decode kernel takes groups 1-4 and 8 only."""
    return group >= 4


class DecodeAttention:
    """The runner's decode attention: which backend runs each step, and FlashInfer's per-step plan."""

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, max_len: int,
                 dtype: torch.dtype, device: torch.device, backend: str | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        if backend is None:
            from qerl_cli.options import options

            backend = options().decode_attn
        self.backend = check_backend(backend)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.max_len, self.dtype, self.device = scale, max_len, dtype, device
        self.kv_dtype = kv_dtype or dtype  # the cache's (E4M3 with QERL_KV_CACHE=fp8)
        self.current = "sdpa"  # what the next decode step runs (set below once the backend is settled)
        self.choices: dict[tuple[int, int], str] = {}  # (batch bucket, kv_len) -> backend (auto)
        self._fi: Any = None  # the flashinfer module, once imported
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[int | None, Any] = {}  # batch bucket (graph mode) or None (eager) -> wrapper
        self._active: Any = None
        self._planned: torch.cuda.Event | None = None
        if self.backend == "auto":
            # SDPA off CUDA (the split kernels would be interpreted); split alone where FlashInfer cannot run
            if device.type != "cuda":
                self.backend = "sdpa"
            elif head_dim not in FLASHINFER_HEAD_DIMS or not self._load(quiet=True):
                self.backend = "split"
        elif self.backend == "split":
            if device.type != "cuda" and not _interpreted():
                log.warning("decode attention split needs CUDA (or the Triton interpreter); using SDPA")
                self.backend = "sdpa"
        elif self.backend == "flashinfer":
            if head_dim not in FLASHINFER_HEAD_DIMS:
                log.warning("FlashInfer decode takes head_dim %s only, this model has %d; decode attention uses SDPA",
                            "/".join(map(str, FLASHINFER_HEAD_DIMS)), head_dim)
                self.backend = "sdpa"
            elif not self._load():
                self.backend = "sdpa"
        self.current = "split" if self.backend == "auto" else self.backend

    @property
    def needs_host_positions(self) -> bool:
        """Whether each step must be planned on the host with every row's position (FlashInfer may run)."""
        return self.backend in ("flashinfer", "auto")

    def _load(self, quiet: bool = False) -> bool:
        """Import FlashInfer; ``quiet``: its absence is expected (``auto``), not worth a warning."""
        if self.device.type != "cuda":
            log.warning("decode attention %s needs CUDA; using SDPA", self.backend)
            return False
        try:
            import flashinfer
        except Exception as exc:  # noqa: BLE001 - not installed, or its import fails on this image
            (log.debug if quiet else log.warning)("FlashInfer unavailable (%s: %s); decode attention uses %s",
                                                  type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                                                  "split" if quiet else "SDPA")
            return False
        self._fi = flashinfer
        return True

    def _fail(self, exc: BaseException) -> None:
        fallback = "split" if self.backend == "auto" else "sdpa"
        log.warning("FlashInfer decode failed (%s: %s); decode attention uses %s from now on", type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "", fallback)
        self.backend = self.current = fallback

    def _wrapper(self, bucket: int | None) -> Any:
        w = self._wrappers.get(bucket)
        if w is None:
            if self._workspace is None:
                self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            # FlashAttention-2-style kernels, JIT-built with nvcc ("auto" may pick other libraries' backends)
            kw: dict[str, Any] = {"use_tensor_cores": flashinfer_tensor_cores(self.num_heads // self.num_kv_heads),
                                  "backend": "fa2"}
            if bucket is not None:  # CUDA-graph mode: fixed batch and buffers the captured kernels read
                pages = bucket * (self.max_len // PAGE_SIZE)
                kw.update(use_cuda_graph=True,
                          paged_kv_indptr_buffer=torch.zeros(bucket + 1, dtype=torch.int32, device=self.device),
                          paged_kv_indices_buffer=torch.zeros(pages, dtype=torch.int32, device=self.device),
                          paged_kv_last_page_len_buffer=torch.zeros(bucket, dtype=torch.int32, device=self.device))
            w = self._wrappers[bucket] = self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", **kw)
        return w

    def plan(self, positions: list[int], bucket: int | None = None) -> None:
        """Plan FlashInfer for one step whose rows write (and attend up to) ``positions`` (host ints; rows in
        slots 0..B-1). ``bucket``: the CUDA-graph batch bucket (len(positions) == bucket), None when eager."""
        if self.current != "flashinfer":
            return
        indptr, indices, last = paged_layout([p + 1 for p in positions], self.max_len)
        if self._planned is not None:
            self._planned.synchronize()  # the previous plan's pinned staging buffer has been copied out
        try:
            w = self._wrapper(bucket)
            w.plan(indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, PAGE_SIZE,
                   pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                   sm_scale=self.scale)
        except Exception as exc:  # noqa: BLE001 - e.g. the JIT build failed: SDPA from now on
            self._fail(exc)
            return
        self._active = w
        self._planned = torch.cuda.Event()
        self._planned.record()

    def select(self, bucket: int, kv_len: int, time_both: Any = None) -> str:
        """The backend of the (batch bucket, kv_len) graph: fixed, or (auto) timed once by ``time_both()`` ->
        {backend: ms}. Sets ``current``."""
        if self.backend != "auto":
            self.current = self.backend
            return self.current
        choice = self.choices.get((bucket, kv_len))
        if choice is None:
            choice = "split"
            if time_both is not None:
                ms = time_both()
                choice = min(ms, key=ms.get) if ms else "split"
                log.info("decode attention batch %d kv %d: %s (%s)", bucket, kv_len, choice,
                         ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
            self.choices[(bucket, kv_len)] = choice
        self.current = choice
        return choice

    def time_both(self, positions: list[int], layer_k: torch.Tensor, layer_v: torch.Tensor, kv_len: int,
                  reps: int = 20) -> dict[str, float]:
        """ms per call of split and FlashInfer on one layer of the live cache for rows at ``positions`` (``auto``)."""
        b = len(positions)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        keys = torch.arange(kv_len, device=self.device)
        visible = (keys[None, :] <= pos[:, None])[:, None, None, :]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        q = torch.randn(b, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        out: dict[str, float] = {}
        for name in ("split", "flashinfer"):
            self.current = name
            if name == "flashinfer":
                self.plan(positions)
                if self.current != "flashinfer":  # the plan failed: split only
                    break
            fn = (lambda: self(q, layer_k, layer_v, kv_len, mask, pos))  # noqa: E731
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            out[name] = start.elapsed_time(end) / reps
        return out

    def __call__(self, q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, kv_len: int,
                 mask: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, D] (RoPE applied, this step's K/V already written at ``positions``) -> [B, H, D]."""
        if self.current == "flashinfer" and self._active is not None:
            try:
                return self._active.run(q, (cache_pages(layer_k), cache_pages(layer_v)))
            except Exception as exc:  # noqa: BLE001 - first-call failures (JIT) fall back; never inside a capture
                if torch.cuda.is_current_stream_capturing():
                    raise
                self._fail(exc)
        if self.current == "split" and positions is not None:
            from qerl_kernels.decode_attention import split_kv_decode

            return split_kv_decode(q, layer_k, layer_v, positions, kv_len, self.scale)
        assert mask is not None, "the SDPA path needs the step's mask"
        return sdpa_decode(q, layer_k, layer_v, kv_len, mask, self.scale)
