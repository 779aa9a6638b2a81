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

Only basic ``tl`` ops (load/store/arange/sum/exp/sqrt), so the same source compiles with Triton 3.6 and
runs under the 3.9 interpreter. ``LAUNCHES`` counts launches per kernel (op-count tests).
"""

from __future__ import annotations

from collections import Counter

import torch
import triton
import triton.language as tl

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
                    BHK: tl.constexpr, BHALF: tl.constexpr):
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
    tl.store(ko, k1.to(ktype), mask=mk)
    tl.store(ko + HALF, k2.to(ktype), mask=mk)

    vb = v_ptr + b * stride_v + hk * (2 * HALF) + jj
    vo = vc_ptr + b * stride_vc_slot + pos * stride_vc_pos + hk * (2 * HALF) + jj
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
                              BHK=triton.next_power_of_2(hk), BHALF=triton.next_power_of_2(half), num_warps=4)
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
