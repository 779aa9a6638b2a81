"""Policy-gradient losses on padded [B, T] tensors: GRPO, DAPO, Dr.GRPO, GSPO, PG-Seq-IS/TIS.

Inputs (B sequences, T completion positions, padding where ``mask`` is 0):
- ``logp``        log pi_theta(y_t), the current policy, carries the gradient;
- ``old_logp``    log pi_old(y_t), the trainer's recompute at rollout time (no grad);
- ``rollout_logp`` log mu(y_t), the rollout engine's sampled-token log-probs (PG-Seq-IS only here;
  the token/sequence corrections against mu live in ``corrections.py`` and arrive as ``is_weights``);
- ``advantages``  [B], one outcome advantage per sequence (see ``advantages.group_advantages``).

The per-token loss follows TRL's GRPOTrainer: clipped surrogate, times the optional importance weights,
plus beta * k3 KL, then aggregated per ``algo``. Padding positions are zeroed before any exp/log so a
padded -inf log-prob cannot turn the loss or its gradient into NaN. Arithmetic runs in at least fp32
(fp64 inputs stay fp64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qerl_cli.errors import QerlError

ALGOS: tuple[str, ...] = ("grpo", "dapo", "dr_grpo", "gspo", "pg_seq_is", "pg_seq_tis")
CLIPPED_ALGOS: tuple[str, ...] = ("grpo", "dapo", "dr_grpo", "gspo")

# (epsilon_low, epsilon_high) used when the caller passes None. GRPO/Dr.GRPO clip symmetrically (TRL
# epsilon 0.2), DAPO clips higher (0.28), GSPO clips the sequence ratio in [1-3e-4, 1+4e-4] (paper).
DEFAULT_CLIP: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
}
# PG-Seq-TIS truncates the sequence ratio at 3 (FP16-vs-BF16 paper).
DEFAULT_SEQ_TIS_CAP = 3.0


def resolve_clip(algo: str, epsilon: float | None, epsilon_high: float | None) -> tuple[float, float]:
    """(epsilon_low, epsilon_high) for ``algo``: explicit values win, else DEFAULT_CLIP.

    For the symmetric algorithms an explicit ``epsilon`` with no ``epsilon_high`` clips symmetrically
    (TRL: epsilon_high defaults to epsilon); DAPO and GSPO keep their own upper default.
    """
    if algo not in DEFAULT_CLIP:
        raise QerlError(f"{algo!r} has no clipping; clipped algorithms: {', '.join(CLIPPED_ALGOS)}")
    lo_default, hi_default = DEFAULT_CLIP[algo]
    lo = lo_default if epsilon is None else float(epsilon)
    if epsilon_high is not None:
        hi = float(epsilon_high)
    elif algo in ("dapo", "gspo"):
        hi = hi_default
    else:
        hi = lo
    if not (0.0 <= lo < 1.0) or hi < 0.0:
        raise QerlError(f"clip range must satisfy 0 <= epsilon < 1 and epsilon_high >= 0; got {lo}, {hi}")
    return lo, hi


def _check_bt(name: str, t: torch.Tensor | None, shape: torch.Size) -> None:
    if t is not None and t.shape != shape:
        raise QerlError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp")


def policy_loss(
    algo: str,
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
    Aggregation (normaliser in brackets; ``loss_normalizer`` replaces it, e.g. the full batch's token
    count or sequence count when a batch is split into gradient-accumulation micro-batches):
      grpo, gspo:       mean over the sequence's tokens, summed over sequences [B]   (TRL "grpo")
      dapo:             sum over all tokens [total completion tokens]                 (token-level mean)
      dr_grpo:          sum over all tokens [B * max_completion_length]               (TRL "dr_grpo")
      pg_seq_is/_tis:   sum over the sequence's tokens, summed over sequences [B]
                        i.e. mean over sequences of -sg(rho) A log pi_theta(y); the token SUM is the
                        sequence log-prob, so long sequences weigh more (no length normalisation).
    GSPO uses the token-wise form of the paper: s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)] with
    s_i = exp(mean_t(logp - old_logp)); its value is s_i and its gradient s_i * grad log pi(y_t), so
    the clip acts on the sequence ratio while gradients flow per token. Advantages are used as given:
    GRPO/GSPO expect group-std-normalised ones, Dr.GRPO unscaled ones.
    PG-Seq-IS: rho(y) = pi_old(y) / mu(y) = exp(sum_t(old_logp - rollout_logp)), detached; pg_seq_tis
    clamps it at ``seq_is_cap`` (default 3); pg_seq_is applies a cap only when one is given.

    Metrics (TRL names, token fractions over completion tokens; for GSPO, fractions of sequences as
    TRL does for sequence-level ratios): ``clip_ratio`` (= ``clip_ratio/region_mean``),
    ``clip_ratio/low_mean`` (r < 1-eps_low with A < 0), ``clip_ratio/high_mean`` (r > 1+eps_high with
    A > 0); ``kl`` (mean k3 over tokens) when beta != 0; for pg_seq_*: ``seq_is/rho_mean|min|max``
    (after the cap) and ``seq_is/capped_frac``.
    """
    _check_loss_inputs(algo, logp, old_logp, advantages, mask, is_weights=is_weights, ref_logp=ref_logp, beta=beta,
                       rollout_logp=rollout_logp, loss_normalizer=loss_normalizer)
    t = _TokenView.of(logp, old_logp, advantages, mask)
    metrics: dict[str, float] = {}
    if algo in CLIPPED_ALGOS:
        per_token = _clipped_per_token(algo, t, epsilon, epsilon_high, metrics)
    else:
        per_token = _seq_is_per_token(algo, t, rollout_logp, seq_is_cap, metrics)
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
    return _aggregate(algo, per_token, t, loss_normalizer, max_completion_length), metrics


def _check_loss_inputs(algo: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, *, is_weights: torch.Tensor | None, ref_logp: torch.Tensor | None,
                       beta: float, rollout_logp: torch.Tensor | None, loss_normalizer: float | None) -> None:
    if algo not in ALGOS:
        raise QerlError(f"unknown loss algorithm {algo!r}; choose one of {', '.join(ALGOS)}")
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


@dataclass(frozen=True)
class _TokenView:
    """The loss's inputs in its compute dtype (at least fp32), padding zeroed: ``lp`` (with gradient), ``old`` and
    ``adv`` (detached), the mask ``m`` and its token counts per sequence and in all."""

    dt: torch.dtype
    valid: torch.Tensor
    m: torch.Tensor
    zero: torch.Tensor
    lp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    n_tok: torch.Tensor
    total_tok: torch.Tensor

    @classmethod
    def of(cls, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
           mask: torch.Tensor) -> _TokenView:
        dt = torch.promote_types(logp.dtype, torch.float32)
        valid = mask.bool()
        m = valid.to(dt)
        zero = torch.zeros((), dtype=dt, device=logp.device)
        return cls(dt, valid, m, zero, torch.where(valid, logp.to(dt), zero),
                   torch.where(valid, old_logp.detach().to(dt), zero), advantages.detach().to(dt).reshape(-1),
                   m.sum(-1), m.sum().clamp(min=1.0))


def _clipped_per_token(algo: str, t: _TokenView, epsilon: float | None, epsilon_high: float | None,
                       metrics: dict[str, float]) -> torch.Tensor:
    """The clipped surrogate per token (GSPO: on the sequence ratio) and the clip fractions."""
    eps_lo, eps_hi = resolve_clip(algo, epsilon, epsilon_high)
    A = t.adv[:, None]
    if algo == "gspo":
        seq_log_ratio = ((t.lp - t.old) * t.m).sum(-1) / t.n_tok.clamp(min=1.0)
        ratio = torch.exp(seq_log_ratio.detach())[:, None] * torch.exp(t.lp - t.lp.detach())
    else:
        ratio = torch.exp(t.lp - t.old)
    per_token = -torch.minimum(ratio * A, ratio.clamp(1.0 - eps_lo, 1.0 + eps_hi) * A)
    r = ratio.detach()
    low = (r < 1.0 - eps_lo) & (A < 0)
    high = (r > 1.0 + eps_hi) & (A > 0)
    if algo == "gspo":
        # The ratio is one value per sequence: count sequences (with at least one token).
        has_tok = (t.n_tok > 0).to(t.dt)
        denom = has_tok.sum().clamp(min=1.0)
        low_f = (low[:, 0].to(t.dt) * has_tok).sum() / denom
        high_f = (high[:, 0].to(t.dt) * has_tok).sum() / denom
        region_f = ((low | high)[:, 0].to(t.dt) * has_tok).sum() / denom
    else:
        low_f = (low.to(t.dt) * t.m).sum() / t.total_tok
        high_f = (high.to(t.dt) * t.m).sum() / t.total_tok
        region_f = ((low | high).to(t.dt) * t.m).sum() / t.total_tok
    metrics["clip_ratio"] = region_f.item()
    metrics["clip_ratio/region_mean"] = region_f.item()
    metrics["clip_ratio/low_mean"] = low_f.item()
    metrics["clip_ratio/high_mean"] = high_f.item()
    return per_token


def _seq_is_per_token(algo: str, t: _TokenView, rollout_logp: torch.Tensor | None, seq_is_cap: float | None,
                      metrics: dict[str, float]) -> torch.Tensor:
    """PG-Seq-IS per token: -sg(rho(y)) A log pi(y_t), rho capped for pg_seq_tis; rho's statistics."""
    if rollout_logp is None:
        raise QerlError(f"{algo} needs rollout_logp (the rollout engine's sampled-token log-probs)")
    cap = seq_is_cap
    if cap is None and algo == "pg_seq_tis":
        cap = DEFAULT_SEQ_TIS_CAP
    if cap is not None and cap <= 0:
        raise QerlError(f"seq_is_cap must be positive, got {cap}")
    mu = torch.where(t.valid, rollout_logp.detach().to(t.dt), t.zero)
    log_rho = ((t.old - mu) * t.m).sum(-1)
    if cap is not None:
        capped = log_rho > math.log(cap)
        log_rho = torch.clamp(log_rho, max=math.log(cap))
    else:
        capped = torch.zeros_like(log_rho, dtype=torch.bool)
    rho = torch.exp(log_rho)
    metrics["seq_is/rho_mean"] = rho.mean().item()
    metrics["seq_is/rho_min"] = rho.min().item()
    metrics["seq_is/rho_max"] = rho.max().item()
    metrics["seq_is/capped_frac"] = capped.to(t.dt).mean().item()
    return -(rho * t.adv)[:, None] * t.lp


def _aggregate(algo: str, per_token: torch.Tensor, t: _TokenView, loss_normalizer: float | None,
               max_completion_length: int | None) -> torch.Tensor:
    """The scalar loss from the masked per-token losses, normalised as ``algo`` does (see :func:`policy_loss`)."""
    batch, positions = per_token.shape
    if algo in ("grpo", "gspo"):
        seq = per_token.sum(-1) / t.n_tok.clamp(min=1.0)
        return seq.sum() / (loss_normalizer if loss_normalizer is not None else batch)
    if algo == "dapo":
        return per_token.sum() / (loss_normalizer if loss_normalizer is not None else t.total_tok)
    if algo == "dr_grpo" and loss_normalizer is None:
        if max_completion_length is None or max_completion_length < 1:
            raise QerlError("dr_grpo needs max_completion_length (its constant loss normaliser)")
        if positions > max_completion_length:
            raise QerlError(f"completions have {positions} positions but max_completion_length is "
                            f"{max_completion_length}")
        loss_normalizer = float(batch * max_completion_length)
    return per_token.sum() / (loss_normalizer if loss_normalizer is not None else batch)


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
    "ALGOS",
    "CLIPPED_ALGOS",
    "DEFAULT_CLIP",
    "DEFAULT_SEQ_TIS_CAP",
    "entropy_from_logits",
    "policy_loss",
    "resolve_clip",
    "token_entropy",
]
