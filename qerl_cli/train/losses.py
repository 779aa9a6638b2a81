"""Policy-gradient losses on padded [B, T] tensors: GRPO, DAPO, Dr.GRPO, GSPO, PG-Seq-IS/TIS.

Inputs (B sequences, T completion positions, padding where ``mask`` is 0):
- ``logp``        log pi_theta(y_t), the current policy, carries the gradient;
- ``old_logp``    log pi_old(y_t), the trainer's recompute at rollout time (no grad);
- ``rollout_logp`` log mu(y_t), the rollout engine's sampled-token log-probs (PG-Seq-IS only here;
  the token/sequence corrections against mu live in ``corrections.py`` and arrive as ``is_weights``);
- ``advantages``  [B], one outcome advantage per sequence (see ``advantages.group_advantages``).

The per-token loss follows TRL's GRPOTrainer: clipped surrogate, times the optional importance weights,
plus beta * k3 KL, then aggregated per ``algo``: what differs between algorithms is the algorithm object's
(``qerl_cli/train/algos/``). Padding positions are zeroed before any exp/log so a
padded -inf log-prob cannot turn the loss or its gradient into NaN. Arithmetic runs in at least fp32
(fp64 inputs stay fp64).
"""

from __future__ import annotations

import torch

from qerl_cli.errors import QerlError
from qerl_cli.train.algos import Algorithm, ClippedAlgorithm, LossSettings, TokenView, as_algorithm, clipped_names


def resolve_clip(algo: str | Algorithm, epsilon: float | None, epsilon_high: float | None) -> tuple[float, float]:
    """(epsilon_low, epsilon_high) for ``algo``: explicit values win, else its defaults (``ClippedAlgorithm``)."""
    alg = as_algorithm(algo)
    if not isinstance(alg, ClippedAlgorithm):
        raise QerlError(f"{alg.name!r} has no clipping; clipped algorithms: {', '.join(clipped_names())}")
    return alg.resolve_clip(epsilon, epsilon_high)


def _check_bt(name: str, t: torch.Tensor | None, shape: torch.Size) -> None:
    if t is not None and t.shape != shape:
        raise QerlError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp")


def policy_loss(
    algo: str | Algorithm,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float | None = None,
    epsilon_high: float | None = None,
    max_completion_length: int | None = None,
    is_weights: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    rollout_logp: torch.Tensor | None = None,
    seq_is_cap: float | None = None,
    loss_normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (scalar loss to minimise, metrics).

    Per token, with r the ratio and A the sequence's advantage:
      clipped algos: l_t = -min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A)
      pg_seq_*:      l_t = -sg(rho(y)) A log pi_theta(y_t)
      then l_t *= is_weights_t (if given), l_t += beta * k3_t (if beta != 0).
    The per-token loss, its metrics, the aggregation and the normaliser are the algorithm object's
    (``qerl_cli/train/algos/``); ``loss_normalizer`` replaces the normaliser, as the trainer does with the whole
    batch's (``Algorithm.normalizer``) when the batch is split into gradient-accumulation micro-batches:
      grpo, gspo:       mean over the sequence's tokens, summed over sequences [B]   (TRL "grpo")
      dapo:             sum over all tokens [total completion tokens]                 (token-level mean)
      dr_grpo:          sum over all tokens [B * max_completion_length]               (TRL "dr_grpo")
      pg_seq_is/_tis:   sum over the sequence's tokens, summed over sequences [B]
                        i.e. mean over sequences of -sg(rho) A log pi_theta(y); the token SUM is the
                        sequence log-prob, so long sequences weigh more (no length normalisation).
    GSPO clips the sequence ratio s_i = exp(mean_t(logp - old_logp)) while gradients flow per token.
    Advantages are used as given: GRPO/GSPO expect group-std-normalised ones, Dr.GRPO unscaled ones.
    PG-Seq-IS: rho(y) = pi_old(y) / mu(y) = exp(sum_t(old_logp - rollout_logp)), detached; pg_seq_tis
    clamps it at ``seq_is_cap`` (default 3); pg_seq_is applies a cap only when one is given.

    Metrics (TRL names, token fractions over completion tokens; for GSPO, fractions of sequences as
    TRL does for sequence-level ratios): ``clip_ratio`` (= ``clip_ratio/region_mean``),
    ``clip_ratio/low_mean`` (r < 1-eps_low with A < 0), ``clip_ratio/high_mean`` (r > 1+eps_high with
    A > 0); ``kl`` (mean k3 over tokens) when beta != 0; for pg_seq_*: ``seq_is/rho_mean|min|max``
    (after the cap) and ``seq_is/capped_frac``.
    """
    alg = as_algorithm(algo)
    _check_loss_inputs(logp, old_logp, advantages, mask, is_weights=is_weights, ref_logp=ref_logp, beta=beta,
                       rollout_logp=rollout_logp, loss_normalizer=loss_normalizer)
    t = TokenView.of(logp, old_logp, advantages, mask, rollout_logp)
    metrics: dict[str, float] = {}
    per_token = alg.per_token(t, LossSettings(epsilon, epsilon_high, seq_is_cap), metrics)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(t.dt)
    if beta != 0.0:
        assert ref_logp is not None
        ref = torch.where(t.valid, ref_logp.detach().to(t.dt), t.zero)
        d = ref - t.lp
        k3 = torch.exp(d) - d - 1.0
        per_token = per_token + beta * k3
        metrics["kl"] = ((k3.detach() * t.m).sum() / t.total_tok).item()
    per_token = per_token * t.m
    if loss_normalizer is None:
        loss_normalizer = alg.normalizer(mask, max_completion_length)
    return alg.aggregate(per_token, t) / loss_normalizer, metrics


def _check_loss_inputs(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, *, is_weights: torch.Tensor | None, ref_logp: torch.Tensor | None,
                       beta: float, rollout_logp: torch.Tensor | None, loss_normalizer: float | None) -> None:
    if logp.dim() != 2:
        raise QerlError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    shape = logp.shape
    for name, t in (("old_logp", old_logp), ("mask", mask), ("is_weights", is_weights),
                    ("ref_logp", ref_logp), ("rollout_logp", rollout_logp)):
        _check_bt(name, t, shape)
    if advantages.numel() != shape[0]:
        raise QerlError(f"advantages must hold one value per sequence ({shape[0]}), got {advantages.numel()}")
    if beta != 0.0 and ref_logp is None:
        raise QerlError("beta != 0 needs ref_logp (reference-model log-probs) for the KL term")
    if loss_normalizer is not None and loss_normalizer <= 0:
        raise QerlError(f"loss_normalizer must be positive, got {loss_normalizer}")


def token_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) at each position, [..., V] -> [...], in fp32 (fp64 stays fp64).

    Rows are processed ``chunk_size`` at a time so only one chunk's fp32 softmax is alive at once
    (a [B*T, V] fp32 copy of 150k-vocab logits is the memory peak otherwise). Apply the sampling
    temperature to the logits first. -inf logits (masked vocabulary) contribute 0.
    """
    if chunk_size < 1:
        raise QerlError(f"chunk_size must be >= 1, got {chunk_size}")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    dt = torch.promote_types(logits.dtype, torch.float32)
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].to(dt)
        lse = torch.logsumexp(z, dim=-1)
        p = torch.exp(z - lse[:, None])
        out.append(lse - (p * z.masked_fill(torch.isneginf(z), 0.0)).sum(-1))
    if not out:
        return flat.new_zeros(lead, dtype=dt)
    return torch.cat(out).reshape(lead)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Mean entropy over completion tokens (TRL metric ``entropy``): logits [B, T, V], mask [B, T]."""
    if logits.shape[:-1] != mask.shape:
        raise QerlError(f"logits {tuple(logits.shape)} and mask {tuple(mask.shape)} disagree on [B, T]")
    ent = token_entropy(logits, chunk_size)
    m = mask.to(ent.dtype)
    return (ent * m).sum() / m.sum().clamp(min=1.0)


__all__ = [
    "entropy_from_logits",
    "policy_loss",
    "resolve_clip",
    "token_entropy",
]
