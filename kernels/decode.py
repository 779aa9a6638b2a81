"""Small fused kernels of the rollout engine's decode step (``qerl_cli/rollout``).

Each one replaces a handful of torch launches per layer and reproduces the torch reference's roundings:
arithmetic runs in fp32 (loads are upcast, so the interpreter never sees bf16 arithmetic) and every
intermediate the torch code stores in the activation dtype is rounded to it here too, so with fp32
activations the results equal the torch path up to reduction order.

* ``add_rmsnorm``: ``h' = h + delta`` (rounded), ``x = w * (h' * rsqrt(mean(h'^2) + eps)).to(dtype)``;
  one program per row; ``delta=None`` gives a plain RMSNorm (also Qwen3's per-head q/k norm). The
  weight is read through its pointer at every call, so in-place updates (AQN) apply.
* ``rope_kv_write``: RoPE of one decode token's q and k at each slot's position, the rotated k and the
  v written into the KV cache at ``[slot, position]``; returns rotated q ``[B, heads, head_dim]``.
* ``silu_mul``: ``silu(gate).to(dtype) * up``.
* ``token_uniform``: the sampler's counter-based uniforms over [B, V] (bit-identical to its torch hashing).
* LoRA shrinks inside the kernel that produces their input (docs/decode.md, "LoRA inside the step"):
  ``rmsnorm_shrink`` (residual add + RMSNorm, and ``h = x A^T`` of the projection group that reads x),
  ``silu_mul_shrink`` (the activation and ``h = act A_down^T``) and ``lora_shrink`` (plain ``h = x A^T``,
  o_proj). One kernel family: ``tl.dot`` over [16..64 rows, BK] x [BK, R] tiles with K split across
  programs and the partials summed in a fixed order by the last program to arrive (deterministic).
* ``sample_tokens``: temperature sampling and the sampled token's log-prob in one pass over each row's
  logits (online max / log-sum-exp and the exponential race on the engine's counter-based noise, the row
  keys hashed in the kernel), for ``qerl_cli.rollout.sampling``.

Only basic ``tl`` ops (load/store/arange/sum/exp/sqrt/dot/atomics), so the same source compiles with Triton
3.6 and runs under the 3.9 interpreter; where the GPU needs the exact libdevice functions torch calls
(``log1p``, ``log``), an ``ACCURATE`` constexpr selects them and the interpreter gets an accurate tl-only
form. ``LAUNCHES`` counts launches per kernel (op-count tests).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from qerl_kernels._common import INTERPRET, num_sms
from qerl_kernels.fp4 import tile_counters

try:  # the exact CUDA math functions torch itself calls (log1pf, logf); not in the interpreter
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    libdevice = None

LAUNCHES: Counter[str] = Counter()


@triton.jit
def _add_rmsnorm_kernel(h_ptr, d_ptr, w_ptr, hout_ptr, xout_ptr, n_cols, stride_h, stride_d, stride_ho, stride_xo,
                        eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
        # torch adds in the activation dtype: round the sum before the norm reads it
        h = (h + d).to(hout_ptr.dtype.element_ty)
        tl.store(hout_ptr + row * stride_ho + cols, h, mask=mask)
        h = h.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    r = 1.0 / tl.sqrt(var + eps)
    n = (h * r).to(xout_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(xout_ptr + row * stride_xo + cols, (w * n).to(xout_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                h_out: torch.Tensor | None = None,
                x_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rmsnorm(h + delta) * weight) over the last dim; ``delta=None``: (h, rmsnorm(h) * weight).

    Inputs: same dtype, contiguous. Returns new tensors shaped like ``h`` (or the given contiguous outs)."""
    n_cols = h.shape[-1]
    h2 = h.reshape(-1, n_cols)
    rows = h2.shape[0]
    x = x_out if x_out is not None else torch.empty(h.shape, dtype=h.dtype, device=h.device)
    x2 = x.view(-1, n_cols)
    if delta is None:
        hout, d2, ho2 = h, h2, h2
    else:
        d2 = delta.reshape(-1, n_cols)
        hout = h_out if h_out is not None else torch.empty(h.shape, dtype=h.dtype, device=h.device)
        ho2 = hout.view(-1, n_cols)
    if rows:
        block = triton.next_power_of_2(n_cols)
        _add_rmsnorm_kernel[(rows,)](h2, d2, weight, ho2, x2, n_cols, h2.stride(0), d2.stride(0), ho2.stride(0),
                                     x2.stride(0), eps, HAS_DELTA=delta is not None, BLOCK=block,
                                     num_warps=4 if block <= 2048 else 8)
        LAUNCHES["add_rmsnorm"] += 1
    return hout, x


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, qout_ptr, kc_ptr, vc_ptr,
                    stride_q, stride_k, stride_v, stride_cs, stride_kc_slot, stride_kc_pos, stride_vc_slot,
                    stride_vc_pos, H: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr,
                    BHK: tl.constexpr, BHALF: tl.constexpr, FP8: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    jj = tl.arange(0, BHALF)[None, :]
    jmask = jj < HALF
    dt = qout_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + pos * stride_cs + jj, mask=jmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cs + HALF + jj, mask=jmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_cs + jj, mask=jmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_cs + HALF + jj, mask=jmask, other=0.0).to(tl.float32)

    # q: out = x * cos + cat(-x2, x1) * sin, each product and the sum rounded as torch does
    hq = tl.arange(0, BH)[:, None]
    mq = (hq < H) & jmask
    qb = q_ptr + b * stride_q + hq * (2 * HALF) + jj
    x1 = tl.load(qb, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(qb + HALF, mask=mq, other=0.0).to(tl.float32)
    o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    qo = qout_ptr + b * (H * 2 * HALF) + hq * (2 * HALF) + jj
    tl.store(qo, o1, mask=mq)
    tl.store(qo + HALF, o2, mask=mq)

    hk = tl.arange(0, BHK)[:, None]
    mk = (hk < HK) & jmask
    kb = k_ptr + b * stride_k + hk * (2 * HALF) + jj
    y1 = tl.load(kb, mask=mk, other=0.0).to(tl.float32)
    y2 = tl.load(kb + HALF, mask=mk, other=0.0).to(tl.float32)
    ktype = kc_ptr.dtype.element_ty
    k1 = ((y1 * c1).to(dt).to(tl.float32) + (-y2 * s1).to(dt).to(tl.float32)).to(dt)
    k2 = ((y2 * c2).to(dt).to(tl.float32) + (y1 * s2).to(dt).to(tl.float32)).to(dt)
    ko = kc_ptr + b * stride_kc_slot + pos * stride_kc_pos + hk * (2 * HALF) + jj
    vb = v_ptr + b * stride_v + hk * (2 * HALF) + jj
    vo = vc_ptr + b * stride_vc_slot + pos * stride_vc_pos + hk * (2 * HALF) + jj
    if FP8:  # an E4M3 cache: saturate as torch's cast does (E4M3 has no infinity), then round to nearest
        vtype = vc_ptr.dtype.element_ty
        tl.store(ko, tl.clamp(k1.to(tl.float32), -448.0, 448.0).to(ktype), mask=mk)
        tl.store(ko + HALF, tl.clamp(k2.to(tl.float32), -448.0, 448.0).to(ktype), mask=mk)
        v1 = tl.load(vb, mask=mk, other=0.0).to(tl.float32)
        v2 = tl.load(vb + HALF, mask=mk, other=0.0).to(tl.float32)
        tl.store(vo, tl.clamp(v1, -448.0, 448.0).to(vtype), mask=mk)
        tl.store(vo + HALF, tl.clamp(v2, -448.0, 448.0).to(vtype), mask=mk)
    else:
        tl.store(ko, k1.to(ktype), mask=mk)
        tl.store(ko + HALF, k2.to(ktype), mask=mk)
        tl.store(vo, tl.load(vb, mask=mk, other=0.0), mask=mk)
        tl.store(vo + HALF, tl.load(vb + HALF, mask=mk, other=0.0), mask=mk)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  q_out: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE + KV-cache write for one decode token per slot.

    q [B, H*D] / k, v [B, HK*D] (row-strided, head dims contiguous), positions int64 [B], cos/sin tables
    [max_len, D], cache_k/cache_v one layer ``[slots, max_len, HK, D]`` (last two dims contiguous).
    Writes rotated k and v at ``cache[b, positions[b]]``; returns rotated q ``[B, H, D]``.
    """
    b = q.shape[0]
    hk, d = cache_k.shape[-2], cache_k.shape[-1]
    h = q.shape[-1] // d
    half = d // 2
    if q_out is None:
        q_out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    if b:
        _rope_kv_kernel[(b,)](q, k, v, positions, cos, sin, q_out, cache_k, cache_v, q.stride(0), k.stride(0),
                              v.stride(0), cos.stride(0), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0),
                              cache_v.stride(1), H=h, HK=hk, HALF=half, BH=triton.next_power_of_2(h),
                              BHK=triton.next_power_of_2(hk), BHALF=triton.next_power_of_2(half),
                              FP8=cache_k.element_size() == 1, num_warps=4)
        LAUNCHES["rope_kv_write"] += 1
    return q_out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(dt), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for same-shape, same-dtype tensors whose rows are packed (last dim contiguous,
    every other dim collapsible into one row stride): e.g. the gate and up column halves of one fused
    gate/up GEMM output. ``out`` (contiguous) defaults to a new tensor."""
    out = out if out is not None else torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n_cols = gate.shape[-1]
    if gate.numel():
        g2, u2, o2 = (t.view(-1, n_cols) for t in (gate, up, out))
        block = min(1024, triton.next_power_of_2(n_cols))
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(n_cols, block))](g2, u2, o2, n_cols, g2.stride(0), u2.stride(0),
                                                                   o2.stride(0), BLOCK=block, num_warps=4)
        LAUNCHES["silu_mul"] += 1
    return out


@triton.jit
def _mix32(x):
    # lowbias32 on values in [0, 2^32) held as int64; a wrapped int64 product keeps its low 32 bits exact
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _token_uniform_kernel(keys_ptr, vhash_ptr, out_ptr, n_vocab, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_vocab
    key = tl.load(keys_ptr + row).to(tl.int64)
    vh = tl.load(vhash_ptr + cols, mask=mask, other=0).to(tl.int64)
    h = _mix32(key ^ vh)
    u = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2^-32
    u = tl.minimum(u, 0.99999994039535522)  # 1 - 2^-24
    tl.store(out_ptr + row * stride_out + cols, u, mask=mask)


def token_uniform(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """u[b, v] = clamp((mix32(keys[b] ^ vocab_hash[v]) + 0.5) * 2^-32, max=1 - 2^-24), float32 [B, V].

    Bit-identical to ``qerl_cli.rollout.sampling.TokenNoise``'s torch arithmetic (integer hashing is exact,
    int -> fp32 conversion and the fp32 ops round the same), in one pass instead of ~25 int64 passes."""
    b, n = keys.shape[0], vocab_hash.shape[0]
    out = torch.empty(b, n, dtype=torch.float32, device=keys.device)
    if b and n:
        block = 1024
        _token_uniform_kernel[(b, triton.cdiv(n, block))](keys, vocab_hash, out, n, out.stride(0), BLOCK=block,
                                                         num_warps=4)
        LAUNCHES["token_uniform"] += 1
    return out


# ---- LoRA shrinks fused into the kernel that produces their input -----------------------------------------
SHRINK_PLAIN, SHRINK_NORM, SHRINK_SILU = 0, 1, 2
SHRINK_MAX_R = 256  # sum of the ranks a group's shrink may have (the [BM, R] accumulator lives in registers)


@triton.jit
def _lora_shrink_kernel(p0_ptr, p1_ptr, w_ptr, hout_ptr, xout_ptr, a_ptr, out_ptr, ws_ptr, cnt_ptr,
                        M, K, R, stride_p0, stride_p1, stride_ho, stride_xo, stride_a, stride_out, k_split, eps,
                        S: tl.constexpr, PROLOGUE: tl.constexpr, HAS_DELTA: tl.constexpr, SPLIT: tl.constexpr,
                        BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BKN: tl.constexpr, NKN: tl.constexpr,
                        F32: tl.constexpr):
    """out[M, R] = x @ A^T with x made here from the inputs (PROLOGUE): 0 x = p0; 1 (RMSNorm) x = w *
    rmsnorm(p0 + p1), also storing p0 + p1 (HAS_DELTA) and x; 2 (SiLU) x = silu(p0) * p1, also storing x.
    Program (m tile, K split): its slice of x is made, stored once, and multiplied into an fp32 [BM, R]
    partial; with SPLIT the last program of an m tile to arrive sums the S partials in order s = 0..S-1."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    offs_k = tl.arange(0, BK)
    dt = out_ptr.dtype.element_ty
    rstd = tl.zeros((BM,), dtype=tl.float32)
    if PROLOGUE == 1:
        # the norm needs the whole row: every K split reads it (L2-resident after the first). Unrolled, so the
        # NKN block loads are independent and issued back to back (a loop of dependent loads is latency-bound)
        ss = tl.zeros((BM,), dtype=tl.float32)
        offs_n = tl.arange(0, BKN)
        for i in tl.static_range(NKN):  # own names: the K loop below reuses none of these with another shape
            ncols = i * BKN + offs_n
            n2 = rmask[:, None] & (ncols < K)[None, :]
            sn = tl.load(p0_ptr + rows64[:, None] * stride_p0 + ncols[None, :], mask=n2, other=0.0).to(tl.float32)
            if HAS_DELTA:
                dn = tl.load(p1_ptr + rows64[:, None] * stride_p1 + ncols[None, :], mask=n2, other=0.0)
                sn = (sn + dn.to(tl.float32)).to(dt).to(tl.float32)  # torch adds in the activation dtype
            ss += tl.sum(sn * sn, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    rr = tl.arange(0, BR)
    rrmask = rr < R
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    k_start = pid_k * k_split
    k_end = tl.minimum(k_start + k_split, K)
    for k0 in range(k_start, k_end, BK):
        cols = k0 + offs_k
        cmask = cols < k_end
        m2 = rmask[:, None] & cmask[None, :]
        a = tl.load(a_ptr + rr[None, :] * stride_a + cols[:, None], mask=rrmask[None, :] & cmask[:, None], other=0.0)
        if PROLOGUE == 0:
            x = tl.load(p0_ptr + rows64[:, None] * stride_p0 + cols[None, :], mask=m2, other=0.0)
        elif PROLOGUE == 1:
            s = tl.load(p0_ptr + rows64[:, None] * stride_p0 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            if HAS_DELTA:
                d = tl.load(p1_ptr + rows64[:, None] * stride_p1 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
                s = (s + d).to(dt)
                tl.store(hout_ptr + rows64[:, None] * stride_ho + cols[None, :], s, mask=m2)
                s = s.to(tl.float32)
            n = (s * rstd[:, None]).to(dt).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            x = (w[None, :] * n).to(dt)
            tl.store(xout_ptr + rows64[:, None] * stride_xo + cols[None, :], x, mask=m2)
        else:
            g = tl.load(p0_ptr + rows64[:, None] * stride_p0 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            u = tl.load(p1_ptr + rows64[:, None] * stride_p1 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            x = (sg * u).to(dt)
            tl.store(xout_ptr + rows64[:, None] * stride_xo + cols[None, :], x, mask=m2)
        if F32:
            acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
    omask = rmask[:, None] & rrmask[None, :]
    if SPLIT:
        tl.store(ws_ptr + (pid_k * M + rows64[:, None]) * R + rr[None, :], acc, mask=omask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel")
        if arrived == S - 1:
            total = tl.zeros((BM, BR), dtype=tl.float32)
            for s_i in tl.static_range(0, S):  # unrolled: the S loads are issued back to back, summed in order
                total += tl.load(ws_ptr + (s_i * M + rows64[:, None]) * R + rr[None, :], mask=omask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + rows64[:, None] * stride_out + rr[None, :], total.to(dt), mask=omask)
            tl.atomic_xchg(cnt_ptr + pid_m, 0)
    else:
        tl.store(out_ptr + rows64[:, None] * stride_out + rr[None, :], acc.to(dt), mask=omask)


class ShrinkPlan(NamedTuple):
    """How a fused shrink is launched: rows per program, padded rank, K tile, K splits (programs per row tile),
    the norm pass's block width, warps and pipeline stages. The summation order, so the bits, follow it."""

    bm: int
    br: int
    bk: int
    splits: int
    bkn: int = 256
    warps: int = 4
    stages: int = 1

    def key(self) -> str:
        return f"bm{self.bm}_bk{self.bk}_s{self.splits}_n{self.bkn}_w{self.warps}_st{self.stages}"


# the last program of a row tile sums the S partials: at most this many bytes of them (one SM reads them)
SHRINK_SUM_BYTES = 128 * 1024
# Rows up to which the engine runs the one-launch producer forms (RMSNorm + shrink, SiLU + shrink); beyond, the
# producer kernel and then the shrink (two launches). Measured on an H100 (`qerl_cli.bench.lora_shrinks`,
# docs/benchmarks.md): at M = 8 and 64 on Qwen2.5-7B/32B layers, norm + the plain shrink kernel took 6.9-10.6 us and
# every one-launch norm plan 7.2-13.6 us (each K split re-reads its rows' whole width for the norm); SiLU + a
# cuBLAS shrink 9.1-10.9 us, every one-launch SiLU plan 9.3-16.2 us (the down shrink's K of 19-28k needs 54-108
# partials, which the last program sums). So neither one-launch form is used; both stay for the bench and tests.
NORM_SHRINK_MAX_ROWS = 0
SILU_SHRINK_MAX_ROWS = 0


def shrink_plan(m: int, k: int, r: int, prologue: int, sms: int = 132) -> ShrinkPlan:
    """The fused shrink's plan: a fixed rule (the summation order, and so the bits, follow from it).

    A decode-size shrink moves ~0.3-2 MB of A and is bound by how many loads are in flight, not by bandwidth
    (measured on an H100: plans of <= 8 K splits, each a loop of 5-27 dependent K tiles, took
    20-40 us per launch). So: 16 rows per program (the smallest ``tl.dot`` tile), a K tile whose A slice is
    ~32 KB, and as many K splits as there are K tiles (one tile per program, every SM streaming A), capped so
    that the last program's fixed-order sum of the partials reads at most ``SHRINK_SUM_BYTES``."""
    br = max(16, triton.next_power_of_2(r))
    bm = 16
    bk = min(256, max(32, 16384 // br), triton.next_power_of_2(k))
    kt = triton.cdiv(k, bk)
    cap = max(1, SHRINK_SUM_BYTES // (min(m, bm) * br * 4))
    return ShrinkPlan(bm, br, bk, max(1, min(kt, cap)))


def _shrink(prologue: int, p0: torch.Tensor, p1: torch.Tensor | None, weight: torch.Tensor | None, a: torch.Tensor,
            eps: float, h_out: torch.Tensor | None, x_out: torch.Tensor | None,
            out: torch.Tensor | None, plan: ShrinkPlan | None = None) -> torch.Tensor:
    """Launch one fused shrink over 2-D row views (see the public wrappers); returns out [M, R]."""
    m, k = p0.shape
    r = a.shape[0]
    if a.shape[1] != k or a.stride(1) != 1:
        raise ValueError(f"A must be [R, {k}] with contiguous rows, got {tuple(a.shape)}")
    if r > SHRINK_MAX_R:
        raise ValueError(f"a fused shrink takes at most {SHRINK_MAX_R} ranks, got {r}")
    out = out if out is not None else torch.empty((m, r), dtype=p0.dtype, device=p0.device)
    if m == 0:
        return out
    plan = plan or shrink_plan(m, k, r, prologue, num_sms(p0.device))
    bk = plan.bk
    k_split = triton.cdiv(triton.cdiv(k, plan.splits), bk) * bk
    splits = triton.cdiv(k, k_split)
    mt = triton.cdiv(m, plan.bm)
    ws = torch.empty((splits, m, r), dtype=torch.float32, device=p0.device) if splits > 1 else out
    cnt = tile_counters(p0.device, mt) if splits > 1 else out
    p1_ = p1 if p1 is not None else p0
    w_ = weight if weight is not None else a
    ho = h_out if h_out is not None else p0
    xo = x_out if x_out is not None else p0
    bkn = min(plan.bkn, triton.next_power_of_2(k))
    _lora_shrink_kernel[(mt, splits)](
        p0, p1_, w_, ho, xo, a, out, ws, cnt, m, k, r, p0.stride(0), p1_.stride(0), ho.stride(0), xo.stride(0),
        a.stride(0), out.stride(0), k_split, eps, splits, PROLOGUE=prologue, HAS_DELTA=p1 is not None and
        prologue == SHRINK_NORM, SPLIT=splits > 1, BM=plan.bm, BR=plan.br, BK=bk, BKN=bkn,
        NKN=triton.cdiv(k, bkn) if prologue == SHRINK_NORM else 1, F32=INTERPRET or p0.dtype == torch.float32,
        num_warps=plan.warps, num_stages=plan.stages)
    return out


def _rows2(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def lora_shrink(x: torch.Tensor, a: torch.Tensor, out: torch.Tensor | None = None,
                plan: ShrinkPlan | None = None) -> torch.Tensor:
    """h = x @ A^T [M, R] in x's dtype (fp32 accumulation), one launch: x [..., K] with packed rows, A [R, K]."""
    h = _shrink(SHRINK_PLAIN, _rows2(x), None, None, a, 0.0, None, None, out, plan)
    LAUNCHES["lora_shrink"] += 1
    return h


def rmsnorm_shrink(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, a: torch.Tensor,
                   h_out: torch.Tensor | None = None, x_out: torch.Tensor | None = None,
                   out: torch.Tensor | None = None,
                   plan: ShrinkPlan | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_rmsnorm`` and the LoRA shrink of the group reading its output, in one launch:
    (h + delta, x = rmsnorm(h + delta) * weight, x @ A^T [M, R]); ``delta=None``: (h, rmsnorm(h) * weight, ...).
    Contiguous inputs of one dtype; A [R, hidden]."""
    n = h.shape[-1]
    x = x_out if x_out is not None else torch.empty(h.shape, dtype=h.dtype, device=h.device)
    hout = h if delta is None else (h_out if h_out is not None else torch.empty(h.shape, dtype=h.dtype,
                                                                              device=h.device))
    hl = _shrink(SHRINK_NORM, h.reshape(-1, n), None if delta is None else delta.reshape(-1, n), weight, a, eps,
                 hout.view(-1, n), x.view(-1, n), out, plan)
    LAUNCHES["rmsnorm_shrink"] += 1
    return hout, x, hl


def silu_mul_shrink(gate: torch.Tensor, up: torch.Tensor, a: torch.Tensor,
                    out: torch.Tensor | None = None,
                    plan: ShrinkPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_mul`` and the down projection's LoRA shrink in one launch: (act = silu(gate) * up, act @ A^T).
    gate/up: same shape and dtype, packed rows (e.g. the column halves of the fused gate/up output)."""
    act = out if out is not None else torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.shape[-1]
    hl = _shrink(SHRINK_SILU, gate.view(-1, n), up.view(-1, n), None, a, 0.0, None, act.view(-1, n), None, plan)
    LAUNCHES["silu_mul_shrink"] += 1
    return act, hl


# ---- sampling: temperature + race + the sampled token's log-prob, one pass over the logits -------------------
@triton.jit
def _mix32u(x):
    # lowbias32 in uint32 arithmetic (multiplies wrap mod 2^32), = sampling.mix32 on int64
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _store_pick(tok_ptr, lp_ptr, row, tok, x, m, s, ACCURATE: tl.constexpr):
    """Store a row's token and its log-prob x - (m + log s), the log-sum-exp from running max m and sum s."""
    if ACCURATE:
        lse = m + libdevice.log(s)
    else:
        lse = m + tl.log(s)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, x - lse)


@triton.jit
def _sample_kernel(logits_ptr, vhash_ptr, base_ptr, uid_ptr, step_ptr, tok_ptr, lp_ptr, ws_ptr, cnt_ptr, V,
                   stride_l, chunk, S, scale, GREEDY: tl.constexpr, SCALE: tl.constexpr, ACCURATE: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, vocabulary chunk). One pass over the chunk's logits keeps: the running max and sum of
    exp (log-sum-exp of x / T), and the race winner: argmax_v x_v / T - log(E_v) with E_v = -log1p(-u_v)
    and u_v the sampler's counter-based uniform (GREEDY: argmax_v x_v), first index on ties. SCALE: 0 none,
    1 x * scale (torch's CUDA division by a Python float multiplies by its reciprocal), 2 x / scale."""
    row = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    key = tl.zeros((), dtype=tl.uint32)
    if not GREEDY:
        base = (tl.load(base_ptr) & 0xFFFFFFFF).to(tl.uint32)
        uid = (tl.load(uid_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
        stp = (tl.load(step_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
        key = _mix32u(_mix32u(base ^ uid) ^ stp)
    m_run = tl.zeros((), dtype=tl.float32) + float("-inf")
    s_run = tl.zeros((), dtype=tl.float32)
    best = tl.zeros((), dtype=tl.float32) + float("-inf")
    best_i = tl.zeros((), dtype=tl.int32)
    best_x = tl.zeros((), dtype=tl.float32)
    start = pid_s * chunk
    end = tl.minimum(start + chunk, V)
    offs0 = tl.arange(0, BLOCK)
    for v0 in range(start, end, BLOCK):
        offs = v0 + offs0
        msk = offs < end
        x = tl.load(logits_ptr + row * stride_l + offs, mask=msk, other=float("-inf")).to(tl.float32)
        if SCALE == 1:
            xt = x * scale
        elif SCALE == 2:
            xt = tl.math.div_rn(x, scale)
        else:
            xt = x
        bmax = tl.max(xt, axis=0)
        new_m = tl.maximum(m_run, bmax)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        s_run = s_run * tl.exp(m_run - safe) + tl.sum(tl.exp(xt - safe), axis=0)
        m_run = new_m
        if GREEDY:
            race = x
        else:
            vh = tl.load(vhash_ptr + offs, mask=msk, other=0).to(tl.uint32, bitcast=True)
            hsh = _mix32u(key ^ vh)
            u = (hsh.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2^-32
            u = tl.minimum(u, 0.99999994039535522)  # 1 - 2^-24
            if ACCURATE:
                e = -libdevice.log1p(-u)
                le = libdevice.log(e)
            else:  # log1p(-u) to a few ulps with tl ops only (Kahan's form): the interpreter lacks libdevice
                w = 1.0 - u
                lw = tl.where(w == 1.0, -u, tl.log(w) * (-u) / (w - 1.0))
                e = -lw
                le = tl.log(e)
            race = tl.where(msk, xt - le, float("-inf"))
        bk = tl.max(race, axis=0)
        bi = tl.argmax(race, axis=0)
        bx = tl.sum(tl.where(offs0 == bi, xt, 0.0), axis=0)
        take = bk > best
        best_i = tl.where(take, v0 + bi, best_i)
        best_x = tl.where(take, bx, best_x)
        best = tl.where(take, bk, best)
    if SPLIT:
        wsr = ws_ptr + (row * S + pid_s) * 8
        tl.store(wsr + 0, m_run)
        tl.store(wsr + 1, s_run)
        tl.store(wsr + 2, best)
        tl.store(wsr + 3, best_i.to(tl.float32))
        tl.store(wsr + 4, best_x)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
        if arrived == S - 1:
            m_all = tl.zeros((), dtype=tl.float32) + float("-inf")
            for s_i in range(0, S):
                m_all = tl.maximum(m_all, tl.load(ws_ptr + (row * S + s_i) * 8 + 0, cache_modifier=".cg"))
            safe = tl.where(m_all == float("-inf"), 0.0, m_all)
            tot = tl.zeros((), dtype=tl.float32)
            best = tl.zeros((), dtype=tl.float32) + float("-inf")
            best_i = tl.zeros((), dtype=tl.int32)
            best_x = tl.zeros((), dtype=tl.float32)
            for s_i in range(0, S):
                p = ws_ptr + (row * S + s_i) * 8
                tot += tl.load(p + 1, cache_modifier=".cg") * tl.exp(tl.load(p + 0, cache_modifier=".cg") - safe)
                bk = tl.load(p + 2, cache_modifier=".cg")
                take = bk > best
                best_i = tl.where(take, tl.load(p + 3, cache_modifier=".cg").to(tl.int32), best_i)
                best_x = tl.where(take, tl.load(p + 4, cache_modifier=".cg"), best_x)
                best = tl.where(take, bk, best)
            _store_pick(tok_ptr, lp_ptr, row, best_i, best_x, m_all, tot, ACCURATE)
            tl.atomic_xchg(cnt_ptr + row, 0)
    else:
        _store_pick(tok_ptr, lp_ptr, row, best_i, best_x, m_run, s_run, ACCURATE)


SAMPLE_SCALE_NONE, SAMPLE_SCALE_MUL, SAMPLE_SCALE_DIV = 0, 1, 2


SAMPLE_CHUNK = 8192  # vocabulary entries per program


def sample_splits(vocab: int, chunk: int = SAMPLE_CHUNK) -> int:
    """Programs per row: a fixed chunk of the vocabulary each, so the log-sum-exp's summation order (and so a
    log-prob's last bits) depends on the vocabulary only, never on the batch (a row samples the same token
    and log-prob alone or among others). Per element the kernel hashes, takes two logs and an exp, so one
    program per row would be ALU-bound at small batches: 152k entries make 19 programs per row."""
    return max(1, triton.cdiv(vocab, chunk))


def sample_tokens(logits: torch.Tensor, vocab_hash32: torch.Tensor, base_key: torch.Tensor, uids: torch.Tensor,
                  steps: torch.Tensor, *, greedy: bool, scale_mode: int, scale: float = 1.0,
                  tokens: torch.Tensor | None = None,
                  logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [B, V] (any float dtype, unit column stride) and its float32 log-prob.

    Non-greedy: the exponential race of ``qerl_cli.rollout.sampling`` on ``x / T`` (``scale_mode``/``scale``
    say how x is divided by T), noise keyed by ``base_key`` (0-dim int64), ``uids`` and ``steps`` (int64 [B])
    and ``vocab_hash32`` (the sampler's hashed vocabulary, as int32 bits); greedy: argmax of the raw
    logits. Log-prob: ``x_t / T - logsumexp(x / T)``. No host sync, static shapes: CUDA-graph capturable."""
    b, v = logits.shape
    if v >= 2**24:
        raise ValueError("the fused sampler keeps token ids in fp32 partials: vocab must be < 2^24")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = tokens if tokens is not None else torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = logprobs if logprobs is not None else torch.empty(b, dtype=torch.float32, device=logits.device)
    if b == 0:
        return tokens, logprobs
    block = 1024
    chunk = SAMPLE_CHUNK
    splits = sample_splits(v, chunk)
    ws = torch.empty((b, splits, 8), dtype=torch.float32, device=logits.device) if splits > 1 else logprobs
    cnt = tile_counters(logits.device, b) if splits > 1 else tokens
    accurate = not INTERPRET and logits.is_cuda and libdevice is not None
    _sample_kernel[(b, splits)](logits, vocab_hash32, base_key, uids, steps, tokens, logprobs, ws, cnt, v,
                                logits.stride(0), chunk, splits, scale, GREEDY=greedy, SCALE=scale_mode,
                                ACCURATE=accurate, SPLIT=splits > 1, BLOCK=block, num_warps=4,
                                # torch rounds x / T and each subtraction in kernels of their own: no FMA
                                # contraction of x * (1/T) - log E, or a race key would round differently
                                enable_fp_fusion=False)
    LAUNCHES["sample_tokens"] += 1
    return tokens, logprobs
