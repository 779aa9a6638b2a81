"""Packed training forwards: the sequences of a micro-batch side by side in one row, no compute on padding.

A right-padded micro-batch ``[B, L]`` makes every projection, the attention and the backward run on
``B * L`` positions, of which only ``sum(n_i)`` are real (``n_i`` = prompt + completion tokens of row
``i``). Rollouts end at EOS, so with RL lengths a third or more of those positions can be padding. Here
the real tokens of the micro-batch are concatenated into one row ``[1, sum(n_i)]`` with position ids that
restart at 0 for every sequence (so RoPE sees exactly the positions the padded row had) and attention
runs per sequence: variable-length ("varlen") attention over the cumulative sequence offsets
``cu_seqlens``, causal inside each sequence, never across two.

How the decoder gets there: transformers' attention interface. :func:`enable_varlen_attention` registers
an attention implementation ``qerl_varlen`` and switches the model's config to it, once (a gradient
checkpointing recompute in the backward reads the config again, so it must stay switched). The function
sees the ``cu_seq_lens_q`` / ``max_length_q`` keyword arguments that :func:`packed_hidden` passes down the
decoder (the same names transformers' flash-attention path uses); a call without them (a normal padded
forward) goes to the implementation the model had before, unchanged. Its mask function returns no mask
for a packed call and the previous implementation's mask otherwise.

Varlen kernels, first that works: flash-attn's ``flash_attn_varlen_func`` (when installed), PyTorch's
``torch.nn.attention.varlen.varlen_attn`` (CUDA; keyword names differ between torch releases and are read
from its signature), else (CUDA) a loop of causal SDPA calls, one per sequence. On the CPU the sequences are
scattered into a right-padded batch for one causal SDPA call (the layers' projections still run on the real
tokens only); both agree with the padded computation to rounding (tests/test_packing.py).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger("qerl.train")

VARLEN_IMPL = "qerl_varlen"
_BASE_ATTR = "_qerl_unpacked_attn"  # config attribute: the implementation a non-packed call goes to


@dataclass
class Packing:
    """Where each row of a right-padded batch sits in its packed row."""

    input_ids: torch.Tensor  # [1, T] the real tokens of every row, back to back
    position_ids: torch.Tensor  # [1, T] 0..n_i-1 per row
    cu_seqlens: torch.Tensor  # [B + 1] int32 offsets of the rows
    max_len: int
    offsets: torch.Tensor  # [B] int64 start of each row
    tokens: int  # T (real tokens)
    padded_tokens: int  # B * L of the padded batch


def packed_rows(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``x`` [B, L, ...] laid out as the packed row [1, T, ...]: each row's first n_i positions, back to back (how
    input_ids and a per-token tensor beside them, such as the recorded routing, are packed alike)."""
    return x[attention_mask.bool()][None]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packing:
    """The packed layout of a right-padded batch (``attention_mask`` 1 on the first n_i positions of row i)."""
    lengths = attention_mask.sum(dim=1).to(torch.int64)
    b, width = input_ids.shape
    device = input_ids.device
    offsets = torch.zeros(b, dtype=torch.int64, device=device)
    if b > 1:
        offsets[1:] = torch.cumsum(lengths, 0)[:-1]
    cu = torch.zeros(b + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    cols = torch.arange(width, device=device).expand(b, width)
    return Packing(input_ids=packed_rows(input_ids, attention_mask), position_ids=packed_rows(cols, attention_mask),
                   cu_seqlens=cu,
                   max_len=int(lengths.max()), offsets=offsets, tokens=int(lengths.sum()), padded_tokens=b * width)


# ---- the attention implementation --------------------------------------------------------------------
def _flash_attn_varlen() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _torch_varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int],
                  scale: float | None) -> torch.Tensor:
    """Causal SDPA one sequence at a time; q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        if e <= s:
            continue
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [heads, n, D]
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=0), vs.repeat_interleave(groups, dim=0)
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                    scale=scale).transpose(0, 1)
    return out


def _padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float | None) -> torch.Tensor:
    """The packed sequences scattered into a right-padded batch [B, heads, L_max, D] and one causal SDPA over it; q
    [T, H, D], k/v [T, Hkv, D] -> [T, H, D]. Causal attention of a right-padded row never lets a real position see
    padding, so each sequence's rows equal :func:`_per_sequence`'s (to rounding). The CPU's kernel: a Python loop
    of one small SDPA per sequence, forward and backward, was ~15x slower at 32 sequences of ~120 tokens."""
    lengths = [e - s for s, e in zip(cu[:-1], cu[1:], strict=True)]
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                   torch.tensor(lengths, device=q.device))
    cols = torch.cat([torch.arange(n, device=q.device) for n in lengths])

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(len(lengths), max(lengths), x.shape[1], x.shape[2])
        out[rows, cols] = x
        return out.transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=scale,
                                                           enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)[rows, cols]


def _flash_attn_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                     scale: float | None) -> torch.Tensor:
    fa = _flash_attn_varlen()
    return fa(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=True)


def _torch_varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                       scale: float | None) -> torch.Tensor:
    tv = _torch_varlen()
    params = inspect.signature(tv).parameters
    kw: dict[str, Any] = {"scale": scale}
    if "is_causal" in params:  # keyword names differ between torch releases
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = tv(q, k, v, cu, cu, max_len, max_len, **kw)
    return out[0] if isinstance(out, tuple) else out


_KERNELS = {"flash_attn": (_flash_attn_varlen, _flash_attn_call), "torch": (_torch_varlen, _torch_varlen_call)}
_kernel_ok: dict[tuple[str, torch.dtype], bool] = {}


@torch.enable_grad()  # the recompute calls into this under no_grad
def _probe(call: Any, q: torch.Tensor, k: torch.Tensor) -> bool:
    g = torch.Generator(device=q.device).manual_seed(0)
    h, hk, d = q.shape[1], k.shape[1], q.shape[2]
    qs, ks, vs = (torch.randn(9, n, d, device=q.device, dtype=q.dtype, generator=g).requires_grad_(True)
                  for n in (h, hk, hk))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=q.device)
    out = call(qs, ks, vs, cu, 5, None)
    out.float().sum().backward()
    ref = _per_sequence(qs.detach(), ks.detach(), vs.detach(), [0, 4, 9], None)
    return bool(torch.allclose(out.detach().float(), ref.float(), atol=2e-2, rtol=2e-2)
                and qs.grad is not None and torch.isfinite(qs.grad).all())


def _usable(name: str, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether kernel ``name`` exists and runs forward AND backward on this device and dtype, checked once
    against per-sequence SDPA on a small packed batch (a kernel without a backward, or a wrong one, is skipped)."""
    key = (name, q.dtype)
    if key not in _kernel_ok:
        find, call = _KERNELS[name]
        ok = False
        if find() is not None:
            try:
                ok = _probe(call, q, k)
            except Exception as exc:  # noqa: BLE001 - any failure: the next kernel
                log.warning("packed attention: %s varlen kernel unusable here (%s)", name, exc)
        _kernel_ok[key] = ok
    return _kernel_ok[key]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                     scale: float | None) -> torch.Tensor:
    """Causal attention within each packed sequence: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
    if q.is_cuda:
        for name, (_, call) in _KERNELS.items():
            if _usable(name, q, k):
                return call(q, k, v, cu_seqlens, max_len, scale)
    if q.is_cuda:  # no varlen kernel: one sequence at a time keeps the memory of the packed row
        return _per_sequence(q, k, v, cu_seqlens.tolist(), scale)
    return _padded(q, k, v, cu_seqlens.tolist(), scale)


def varlen_kernel(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str:
    """Which kernel packed attention uses for these shapes here ("flash_attn", "torch", "per-sequence SDPA" or, off
    CUDA, "padded SDPA")."""
    if device.type == "cuda":
        q = torch.empty(1, heads, head_dim, device=device, dtype=dtype)
        k = torch.empty(1, kv_heads, head_dim, device=device, dtype=dtype)
        for name in _KERNELS:
            if _usable(name, q, k):
                return name
        return "per-sequence SDPA"
    return "padded SDPA"


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        base = getattr(module.config, _BASE_ATTR, "sdpa")
        fn = ALL_ATTENTION_FUNCTIONS[base if base in ALL_ATTENTION_FUNCTIONS else "sdpa"]
        return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError("packed attention expects one packed row")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    out = varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, int(kwargs["max_length_q"]), scaling)
    return out[None], None


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask for a packed call (no 2D mask given; the kernel knows the sequences); else the base's mask."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    base = getattr(kwargs.get("config"), _BASE_ATTR, "sdpa")
    fn = ALL_MASK_ATTENTION_FUNCTIONS[base if base in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"]
    return fn(*args, **kwargs)


def enable_varlen_attention(model: nn.Module) -> bool:
    """Switch ``model`` (any module whose config is a transformers config) to the packed-aware attention;
    False when this transformers has no attention interface to register it with."""
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return False
    config = getattr(model, "config", None)
    if config is None:
        return False
    AttentionInterface.register(VARLEN_IMPL, _attention)
    AttentionMaskInterface.register(VARLEN_IMPL, _mask)
    current = getattr(config, "_attn_implementation", None) or "sdpa"
    if current != VARLEN_IMPL:
        setattr(config, _BASE_ATTR, current)
        config._attn_implementation = VARLEN_IMPL
    return True


def packed_hidden(decoder: nn.Module, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> tuple[torch.Tensor, Packing]:
    """The decoder's last hidden states of the packed micro-batch [T, H] and the layout."""
    if not enable_varlen_attention(decoder):
        raise RuntimeError("this transformers has no attention interface for packed sequences")
    p = pack(input_ids, attention_mask)
    if p.input_ids.is_cuda:
        # decide the kernel here, outside the layers: its probe runs a backward of its own, which must not happen
        # inside a checkpointed layer (the recompute would probe again and save other tensors than the forward)
        cfg = decoder.config
        heads = int(cfg.num_attention_heads)
        varlen_kernel(p.input_ids.device, decoder.embed_tokens.weight.dtype, heads,
                      int(getattr(cfg, "num_key_value_heads", None) or heads),
                      int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads))
    out = decoder(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=None, use_cache=False,
                  cu_seq_lens_q=p.cu_seqlens, cu_seq_lens_k=p.cu_seqlens, max_length_q=p.max_len,
                  max_length_k=p.max_len)
    return out.last_hidden_state[0], p


__all__ = ["VARLEN_IMPL", "Packing", "enable_varlen_attention", "pack", "packed_hidden", "packed_rows",
           "varlen_attention", "varlen_kernel"]
