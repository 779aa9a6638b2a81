"""Split-KV decode attention (flash decoding) over the builtin engine's KV cache, as two Triton kernels.

The engine attends one query token per slot: row ``b`` lives in slot ``b`` of a layer's cache
``[slots, max_len, kv_heads, d]`` and, this step, attends its keys ``0 .. positions[b]``. cuDNN's SDPA (today's
default) is a prefill kernel: it reads the whole power-of-two bucket of every row with a mask, up to twice the live
keys, and does not split a long row across SMs. Here each program takes one (row, KV head, split) and reads only the
live keys of its split, once, for all the query heads of the KV head's group (GQA: the group's queries are the rows
of one ``tl.dot``); a second kernel merges the splits' partial softmaxes. The grid depends on the batch and the
cache's length bucket only, and the lengths are read on the device: a CUDA graph captures it as SDPA's call is
captured (no host plan, unlike FlashInfer).

Per split s of row b, KV head k (keys ``[s C, min((s+1) C, len))``, C a multiple of BLOCK_N):
    m_s = max score, l_s = sum exp(score - m_s), o_s = sum exp(score - m_s) v       (fp32, online over blocks)
and the merge: out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s, M = max_s m_s; an empty split has
m = -inf, l = 0, o = 0 and weighs nothing. On the GPU the probabilities are rounded to the cache dtype before the
P V product, as flash attention does; everything else is fp32. Under the Triton interpreter (the CPU tests) every
load is upcast and both products are fp32 (the interpreter's 16-bit dot is wrong: `_common`). ``reference``
computes the same in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qerl_kernels._common import f32_path

BLOCK_N = 64  # keys per step of a split
TARGET_PROGRAMS = 264  # splits enough rows x KV heads x splits to fill an H200 twice (132 SMs)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, wo_ptr, wm_ptr, wl_ptr, stride_qb, stride_qh, stride_ks,
                  stride_kn, stride_kh, stride_vs, stride_vn, stride_vh, scale, chunk, H: tl.constexpr,
                  NSPLIT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  BLOCK: tl.constexpr, F32: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(pos_ptr + b).to(tl.int32) + 1
    start = s * chunk
    end = tl.minimum(start + chunk, length)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    heads = kh * G + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
    if F32:
        q = q.to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for n0 in range(start, end, BLOCK):
        offs_n = n0 + tl.arange(0, BLOCK)
        nmask = offs_n < end
        # an FP8 cache is widened to q's dtype here, exactly (E4M3 fits in bf16/fp16): one read of its bytes
        k = tl.load(k_ptr + b * stride_ks + offs_n[:, None] * stride_kn + kh * stride_kh + offs_d[None, :],
                    mask=nmask[:, None], other=0.0).to(q.dtype)
        if F32:
            sc = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            sc = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        sc = tl.where(nmask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m - m_new)
        lsum = lsum * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * stride_vs + offs_n[:, None] * stride_vn + kh * stride_vh + offs_d[None, :],
                    mask=nmask[:, None], other=0.0).to(q.dtype)
        if F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new
    row = (b * H + heads) * NSPLIT + s
    tl.store(wo_ptr + row[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])
    tl.store(wm_ptr + row, m, mask=gmask)
    tl.store(wl_ptr + row, lsum, mask=gmask)


@triton.jit
def _merge_kernel(wo_ptr, wm_ptr, wl_ptr, out_ptr, stride_ob, stride_oh, H: tl.constexpr, NSPLIT: tl.constexpr,
                  SP: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, D)
    smask = offs_s < NSPLIT
    base = (b * H + h) * NSPLIT
    m = tl.load(wm_ptr + base + offs_s, mask=smask, other=float("-inf"))
    lsum = tl.load(wl_ptr + base + offs_s, mask=smask, other=0.0)
    big = tl.max(m, 0)
    w = tl.where(smask & (lsum > 0), tl.exp(m - big), 0.0)
    o = tl.load(wo_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    num = tl.sum(o * w[:, None], 0)
    den = tl.sum(lsum * w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, (num / den).to(out_ptr.dtype.element_ty))


def splits(batch: int, kv_heads: int, kv_len: int, target: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(splits per row, keys per split) for a step of ``batch`` rows over a ``kv_len`` bucket: enough programs to
    fill the GPU, each split a whole number of BLOCK_N blocks. Fixed per (batch, bucket): a graph replays it."""
    blocks = max(1, -(-kv_len // BLOCK_N))
    n = max(1, min(blocks, -(-target // max(1, batch * kv_heads))))
    chunk = -(-blocks // n) * BLOCK_N
    return -(-kv_len // chunk), chunk


def split_kv_decode(q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, positions: torch.Tensor,
                    kv_len: int, scale: float) -> torch.Tensor:
    """q [B, H, D] (this step's K/V already in the cache at ``positions``) over slots ``0..B-1`` of ``layer_k`` /
    ``layer_v`` [slots, max_len, kv_heads, D], row b's keys ``0..positions[b]`` (all < ``kv_len``) -> [B, H, D]."""
    b, hq, d = q.shape
    kvh = layer_k.shape[2]
    if hq % kvh or layer_v.shape != layer_k.shape or d != layer_k.shape[3] or d & (d - 1) or d < 16:
        raise ValueError(f"split-KV decode: q {tuple(q.shape)} over a cache {tuple(layer_k.shape)}")
    if layer_k.stride(3) != 1 or layer_v.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("split-KV decode: unit stride along head_dim")
    group = hq // kvh
    nsplit, chunk = splits(b, kvh, kv_len)
    wo = torch.empty((b, hq, nsplit, d), dtype=torch.float32, device=q.device)
    wm = torch.empty((b, hq, nsplit), dtype=torch.float32, device=q.device)
    wl = torch.empty((b, hq, nsplit), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if b == 0:
        return out
    gp = max(16, triton.next_power_of_2(group))
    _split_kernel[(b, kvh, nsplit)](q, layer_k, layer_v, positions, wo, wm, wl, q.stride(0), q.stride(1),
                                    layer_k.stride(0), layer_k.stride(1), layer_k.stride(2), layer_v.stride(0),
                                    layer_v.stride(1), layer_v.stride(2), float(scale), chunk, H=hq, NSPLIT=nsplit,
                                    G=group, GP=gp, D=d, BLOCK=BLOCK_N, F32=f32_path(q), num_warps=4)
    _merge_kernel[(b, hq)](wo, wm, wl, out, out.stride(0), out.stride(1), H=hq, NSPLIT=nsplit,
                           SP=max(2, triton.next_power_of_2(nsplit)), D=d, num_warps=4)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One row's decode attention in torch, fp32: q [H, d] over keys and values [n, kv_heads, d], query head h on
    KV head ``h // (H / kv_heads)`` -> [H, d] in fp32."""
    hq, d = q.shape
    kvh = k.shape[1]
    qi = q.float().view(kvh, hq // kvh, d)
    att = torch.softmax(torch.einsum("kgd,nkd->kgn", qi, k.float()) * scale, dim=-1)
    return torch.einsum("kgn,nkd->kgd", att, v.float()).reshape(hq, d)


def reference(q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, positions: torch.Tensor,
              scale: float) -> torch.Tensor:
    """What :func:`split_kv_decode` computes, in torch: row b attends its keys ``0..positions[b]``."""
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        n = int(positions[i]) + 1
        out[i] = attend(q[i], layer_k[i, :n], layer_v[i, :n], scale).to(q.dtype)
    return out
