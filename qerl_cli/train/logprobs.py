"""Sampled-token log-probabilities and entropies without a [tokens, vocab] fp32 tensor of the whole batch.

The training forward, the pi_old recompute and the reference (KL) pass all need, per completion token,
``log softmax(W h / T)[y]`` (and for the recompute the entropy of that distribution). Computed the direct
way (``batch.sampled_logprobs``) the logits of every completion position exist at once, in the model dtype
and again in fp32 with their log-softmax and its gradient: for a 152k vocabulary that is ~2.4 MB per token,
the largest tensor of a 7B RL step.

Here the decoder runs without its ``lm_head`` and the output projection, log-softmax, gather and entropy
run ``chunk_tokens`` rows at a time (:class:`ChunkedLogProb`). Only completion tokens that carry a loss
(``mask > 0``) are projected. The backward needs no second pass over the vocabulary: log p(y_t) depends on
its own hidden state only, so its Jacobian is the single vector ``(W[y_t] - E_p[W]) / T``, computed per
chunk in the forward and kept (one [tokens, hidden] tensor, the size of the hidden states themselves);
the backward is then ``grad_h = grad_out[:, None] * J``. The arithmetic per row is the one of the direct
path (logits in the model dtype, then fp32 / T, log-softmax, gather), so in fp32 the two agree to
rounding (tests/test_logprobs.py: 1e-6 on log-probs, entropies and LoRA gradients).

The chunked path is taken for the plain decoder + linear-head models qerl trains (an architecture whose spec
declares ``plain_head``, qerl_cli/arch); any other model, or an ``lm_head`` that is trainable or not a plain
``nn.Linear``, falls back to the direct computation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qerl_cli.arch import find_spec
from qerl_cli.errors import QerlError
from qerl_cli.train.batch import RolloutBatch
from qerl_cli.train.batch import sampled_logprobs as full_sampled_logprobs

DEFAULT_CHUNK_TOKENS = 512


def _causal_lm(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def plain_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder, lm_head) when the logits are exactly ``lm_head(decoder(...).last_hidden_state)``."""
    causal = _causal_lm(model)
    config = getattr(causal, "config", None)
    spec = find_spec(config)
    if spec is None or not spec.plain_head:  # soft-capped or scaled logits, or an architecture qerl does not know
        return None
    head = getattr(causal, "lm_head", None)
    decoder = getattr(causal, "model", None)
    if type(head) is not nn.Linear or decoder is None or head.weight.requires_grad:
        return None
    return decoder, head


class ChunkedLogProb(torch.autograd.Function):
    """log softmax(h W^T + b) / T at ``targets``, chunk by chunk; entropy alongside (no gradient)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, temperature: float, chunk: int,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        dt = torch.promote_types(hidden.dtype, torch.float32)  # fp32 at least, as the direct path (fp64 stays)
        logp = torch.empty(n, dtype=dt, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=dt, device=hidden.device)
        need_grad = ctx.needs_input_grad[0]
        jac = torch.empty_like(hidden) if need_grad else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = torch.nn.functional.linear(hidden[s:e], weight, bias).to(dt) / temperature
            lp_all = torch.log_softmax(z, dim=-1)
            tgt = targets[s:e]
            logp[s:e] = lp_all.gather(-1, tgt[:, None]).squeeze(-1)
            if with_entropy or need_grad:
                p = lp_all.exp_()  # the fp32 softmax, in place of the log-softmax (no longer needed)
            if with_entropy:
                lse = torch.logsumexp(z, dim=-1)
                ent[s:e] = lse - (p * z.masked_fill(torch.isneginf(z), 0.0)).sum(-1)
            if need_grad:
                # d log p_y / d z = onehot(y) - p; through z = (h W^T + b) / T that is (W[y] - p W) / T
                p.neg_().scatter_add_(-1, tgt[:, None], torch.ones_like(tgt[:, None], dtype=p.dtype))
                jac[s:e] = (p / temperature).to(weight.dtype) @ weight
            del z, lp_all
        if need_grad:
            ctx.save_for_backward(jac)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_ent: torch.Tensor | None) -> tuple[Any, ...]:
        (jac,) = ctx.saved_tensors
        dt = torch.promote_types(jac.dtype, torch.float32)
        grad_h = (grad_logp.to(dt)[:, None] * jac.to(dt)).to(jac.dtype)
        return grad_h, None, None, None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           targets: torch.Tensor, temperature: float, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of ``hidden`` [N, H] -> (log p(targets) [N] fp32 with gradient to ``hidden``, entropy [N] or None)."""
    if chunk_tokens < 1:
        raise QerlError(f"logprob chunk must be >= 1 token, got {chunk_tokens}")
    logp, ent = ChunkedLogProb.apply(hidden, weight, bias, targets, float(temperature), int(chunk_tokens),
                                     with_entropy)
    return logp, (ent if with_entropy else None)


def liger_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(targets) [N] through Liger-Kernel's fused linear + cross-entropy (per token, ``reduction="none"``).

    ``log softmax((h W^T + b) / T)[y]`` is minus the cross-entropy of ``h / T`` against ``W`` (and ``b / T``), so
    the temperature is folded into the input. Liger recomputes the vocabulary pass in its backward instead of
    keeping a Jacobian row per token as :class:`ChunkedLogProb` does. CUDA only (Triton kernels).
    """
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as exc:
        raise QerlError("--logprob-backend liger needs liger-kernel (pip install liger-kernel)") from exc
    b = None if bias is None else bias / temperature
    ce = liger_fused_linear_cross_entropy(hidden / temperature, weight, targets, b, reduction="none")
    ce = ce[0] if isinstance(ce, tuple) else ce
    return -ce.float()


LOGPROB_BACKENDS = ("chunked", "liger")


def runs_packed(model: nn.Module, chunk_tokens: int, packed: bool) -> bool:
    """Whether :func:`sampled_logprobs` feeds the decoder the packed row (else the padded batch): packing rides on
    the chunked path only."""
    return packed and chunk_tokens > 0 and plain_head(model) is not None


def sampled_logprobs(model: nn.Module, batch: RolloutBatch, temperature: float, with_entropy: bool = False,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS, packed: bool = False,
                     backend: str = "chunked") -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t) [B, T] (0 where ``mask`` is 0) and optionally the entropy [B, T], as ``batch.sampled_logprobs``.

    ``chunk_tokens`` = 0 takes the direct path (every completion position's logits at once). ``packed``: the
    rows' real tokens run as one packed row with per-sequence attention (train/packing.py), so no layer computes
    on padding. ``backend`` "liger": the log-probs (not the entropy) through Liger-Kernel's fused linear +
    cross-entropy instead of :class:`ChunkedLogProb`.
    """
    parts = plain_head(model) if chunk_tokens > 0 else None
    if parts is None:
        return full_sampled_logprobs(model, batch, temperature, with_entropy=with_entropy)
    decoder, head = parts
    b, t = batch.completion_ids.shape
    # hidden state at position j predicts token j+1: completion token k sits at prompt_len + k
    device = batch.input_ids.device
    pos = (batch.prompt_lens.to(device)[:, None] - 1 + torch.arange(t, device=device)[None, :])
    keep = (batch.mask > 0).to(device)
    rows, cols = keep.nonzero(as_tuple=True)
    if packed:
        from qerl_cli.train.packing import packed_hidden

        flat, layout = packed_hidden(decoder, batch.input_ids, batch.attention_mask)  # [T_real, H]
        h = flat[layout.offsets[rows] + pos[rows, cols]]
    else:
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         use_cache=False).last_hidden_state  # [B, L, H]
        flat_pos = pos[rows, cols].clamp(max=hidden.shape[1] - 1)
        h = hidden[rows, flat_pos]  # [n, H]: only the tokens that carry a loss
    targets = batch.completion_ids.to(device)[rows, cols]
    if backend == "liger" and not with_entropy:
        lp, ent = liger_token_logprobs(h, head.weight, head.bias, targets, temperature), None
    elif backend in LOGPROB_BACKENDS:
        lp, ent = chunked_token_logprobs(h, head.weight, head.bias, targets, temperature, chunk_tokens, with_entropy)
    else:
        raise QerlError(f"unknown log-prob backend {backend!r}; choose one of {', '.join(LOGPROB_BACKENDS)}")
    logp = lp.new_zeros(b, t).index_put((rows, cols), lp)
    entropy = None
    if with_entropy:
        assert ent is not None
        entropy = ent.new_zeros(b, t).index_put((rows, cols), ent.detach())
    return logp, entropy


__all__ = ["DEFAULT_CHUNK_TOKENS", "LOGPROB_BACKENDS", "ChunkedLogProb", "chunked_token_logprobs",
           "liger_token_logprobs", "plain_head", "runs_packed", "sampled_logprobs"]
