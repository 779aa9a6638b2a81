"""Training-inference mismatch: metrics and importance-sampling corrections (the FP16-vs-BF16 study's).

pi = the training engine's policy (its log-probs of the sampled tokens, ``train_logp``: normally the
trainer's recompute pi_old at rollout time), mu = the rollout engine's policy (``rollout_logp``, the
log-probs of the distribution actually sampled). Per token rho_t = pi(y_t) / mu(y_t); per sequence
rho(y) = prod_t rho_t = exp(sum_t log rho_t). All quantities are detached; arithmetic runs in fp64
so that sequence ratios of long completions do not lose the small per-token differences.
"""

from __future__ import annotations

import math

import torch

from qerl_cli.errors import QerlError

IS_KINDS: tuple[str, ...] = ("none", "token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mis")
# Truncation caps follow FlashRL's TIS (C = 2); masking caps follow the FP16-vs-BF16 paper (C = 10).
DEFAULT_IS_CAP: dict[str, float] = {
    "none": math.inf,
    "token_tis": 2.0,
    "seq_tis": 2.0,
    "token_mis": 10.0,
    "seq_mis": 10.0,
    "geo_mis": 10.0,
}


def _prepare(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if train_logp.dim() != 2 or train_logp.shape != rollout_logp.shape or train_logp.shape != mask.shape:
        raise QerlError(
            f"train_logp {tuple(train_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)} and mask "
            f"{tuple(mask.shape)} must all be [B, T]"
        )
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float64, device=train_logp.device)
    pi = torch.where(valid, train_logp.detach().double(), zero)
    mu = torch.where(valid, rollout_logp.detach().double(), zero)
    return pi, mu, valid, valid.double()


def _corr_slope(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Pearson correlation and least-squares slope of y on x; 0.0 where undefined (n < 2 or no spread)."""
    if x.numel() < 2:
        return 0.0, 0.0
    dx = x - x.mean()
    dy = y - y.mean()
    sxx = (dx * dx).sum()
    syy = (dy * dy).sum()
    sxy = (dx * dy).sum()
    slope = (sxy / sxx).item() if sxx > 0 else 0.0
    corr = (sxy / torch.sqrt(sxx * syy)).item() if sxx > 0 and syy > 0 else 0.0
    return corr, slope


def mismatch_metrics(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Per-step mismatch between pi (train) and mu (rollout) on the sampled tokens.

    - ``sampling/k1``  = mean_t(log mu - log pi): the k1 estimate of KL(mu || pi), samples from mu;
    - ``sampling/k3``  = mean_t(rho - log rho - 1), rho = pi/mu: the k3 estimate of the same KL (>= 0);
    - ``sampling/max_abs_dprob`` = max_t |mu(y_t) - pi(y_t)| in probability space;
    - ``sampling/seq_log_ratio_mean|min|max`` over sequences of sum_t log rho_t;
    - ``sampling/seq_log_ratio_len_corr`` Pearson correlation of that sum with the completion length and
      ``sampling/seq_log_ratio_len_slope`` its least-squares slope per token (0.0 when undefined: fewer
      than two sequences, or constant lengths / log-ratios).
    Token means are over all completion tokens of the batch; sequences without tokens are ignored.
    """
    pi, mu, valid, m = _prepare(train_logp, rollout_logp, mask)
    n = m.sum().clamp(min=1.0)
    log_rho = pi - mu
    rho = torch.exp(log_rho)
    k1 = ((mu - pi) * m).sum() / n
    k3 = ((rho - log_rho - 1.0) * m).sum() / n
    dprob = ((torch.exp(mu) - torch.exp(pi)).abs() * m).amax() if valid.any() else m.new_zeros(())
    lengths = m.sum(-1)
    has = lengths > 0
    seq = (log_rho * m).sum(-1)[has]
    lens = lengths[has]
    corr, slope = _corr_slope(lens, seq)
    empty = seq.numel() == 0
    return {
        "sampling/k1": k1.item(),
        "sampling/k3": k3.item(),
        "sampling/max_abs_dprob": dprob.item(),
        "sampling/seq_log_ratio_mean": 0.0 if empty else seq.mean().item(),
        "sampling/seq_log_ratio_min": 0.0 if empty else seq.min().item(),
        "sampling/seq_log_ratio_max": 0.0 if empty else seq.max().item(),
        "sampling/seq_log_ratio_len_corr": corr,
        "sampling/seq_log_ratio_len_slope": slope,
    }


def is_weights(
    kind: str,
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None = None,
    lo: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights correcting for sampling from mu while training pi. Returns ([B, T], metrics).

    With C = ``cap`` (default DEFAULT_IS_CAP[kind]: 2 for the truncating kinds, 10 for the masking ones):
    - none:      w_t = 1;
    - token_tis: w_t = min(rho_t, C);
    - token_mis: w_t = rho_t * 1[lo <= rho_t <= C], ``lo`` defaults to 1/C (symmetric in log space);
    - seq_tis:   w_t = min(rho(y), C) for every token of y;
    - seq_mis:   w_t = rho(y) * 1[rho(y) <= C] (upper bound only, as in the paper);
    - geo_mis:   g = exp(mean_t log rho_t) (geometric mean ratio, length-independent);
                 w_t = g * 1[lo <= g <= C], ``lo`` defaults to 1/C. The weight is g itself, not
                 rho(y): the geometric ratio is what is bounded, and rho(y) of a long sequence is
                 extreme even when every token is close.
    Weights are detached, in the dtype of ``train_logp`` (at least fp32), and 0 at padding.
    Metrics over completion tokens: ``sampling/is_weight_min|mean|max``; ``sampling/is_truncated_frac``
    (TIS kinds: fraction whose ratio exceeded C) and ``sampling/is_masked_frac`` (MIS kinds: fraction
    set to 0); both keys are always present (0 where the kind cannot truncate/mask). The fractions
    count tokens for token kinds and sequences (with at least one token) for sequence kinds.
    """
    c, low = _is_bounds(kind, cap, lo)
    pi, mu, valid, m = _prepare(train_logp, rollout_logp, mask)
    log_rho = (pi - mu) * m
    if kind == "none":
        w, truncated, masked = torch.ones_like(log_rho), _ZERO, _ZERO
    elif kind in ("token_tis", "token_mis"):
        w, truncated, masked = _token_weights(kind, log_rho, m, c, low)
    else:
        w_seq, truncated, masked = _sequence_weights(kind, log_rho, m, c, low)
        w = w_seq[:, None].expand_as(log_rho)
    w = w * m
    if valid.any():
        vals = w[valid]
        w_min, w_mean, w_max = vals.min().item(), vals.mean().item(), vals.max().item()
    else:
        w_min = w_mean = w_max = 0.0
    out_dtype = torch.promote_types(train_logp.dtype, torch.float32)
    metrics = {
        "sampling/is_weight_min": w_min,
        "sampling/is_weight_mean": w_mean,
        "sampling/is_weight_max": w_max,
        "sampling/is_truncated_frac": float(truncated),
        "sampling/is_masked_frac": float(masked),
    }
    return w.to(out_dtype).contiguous(), metrics


_ZERO = torch.zeros((), dtype=torch.float64)  # a fraction the kind cannot truncate or mask


def _is_bounds(kind: str, cap: float | None, lo: float | None) -> tuple[float, float | None]:
    """The checked cap C and (MIS kinds) lower bound of ``kind``."""
    if kind not in IS_KINDS:
        raise QerlError(
            f"unknown importance-sampling correction {kind!r}; choose one of {', '.join(IS_KINDS)}"
        )
    c = DEFAULT_IS_CAP[kind] if cap is None else float(cap)
    if c <= 0:
        raise QerlError(f"importance-sampling cap must be positive, got {c}")
    if kind in ("token_mis", "geo_mis"):
        low = 1.0 / c if lo is None else float(lo)
        if low > c:
            raise QerlError(f"lower bound {low} is above the cap {c}: every weight would be masked")
        return c, low
    if lo is not None:
        raise QerlError(f"lo only applies to token_mis and geo_mis, not {kind}")
    return c, None


def _token_weights(kind: str, log_rho: torch.Tensor, m: torch.Tensor, c: float,
                   low: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_tis / token_mis: per-token weights, and the fractions of tokens truncated and masked."""
    rho = torch.exp(log_rho)
    n = m.sum().clamp(min=1.0)
    if kind == "token_tis":
        return torch.clamp(rho, max=c), ((rho > c).double() * m).sum() / n, _ZERO
    keep = (rho >= low) & (rho <= c)
    return torch.where(keep, rho, torch.zeros_like(rho)), _ZERO, ((~keep).double() * m).sum() / n


def _sequence_weights(kind: str, log_rho: torch.Tensor, m: torch.Tensor, c: float,
                      low: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """seq_tis / seq_mis / geo_mis: one weight per sequence, and the fractions of sequences (with at least one
    token) truncated and masked."""
    lengths = m.sum(-1)
    has = lengths > 0
    seq_log = log_rho.sum(-1)
    n_seq = has.double().sum().clamp(min=1.0)
    if kind == "seq_tis":
        w_seq = torch.exp(torch.clamp(seq_log, max=math.log(c)))
        return w_seq, ((seq_log > math.log(c)) & has).double().sum() / n_seq, _ZERO
    if kind == "seq_mis":
        keep = seq_log <= math.log(c)
        # exp only where kept: a masked sequence's rho(y) may overflow.
        w_seq = torch.where(keep, torch.exp(torch.clamp(seq_log, max=math.log(c))), torch.zeros_like(seq_log))
        return w_seq, _ZERO, ((~keep) & has).double().sum() / n_seq
    g_log = seq_log / lengths.clamp(min=1.0)
    keep = (g_log >= math.log(low)) & (g_log <= math.log(c))
    w_seq = torch.where(keep, torch.exp(g_log), torch.zeros_like(g_log))
    return w_seq, _ZERO, ((~keep) & has).double().sum() / n_seq


__all__ = ["DEFAULT_IS_CAP", "IS_KINDS", "is_weights", "mismatch_metrics"]
