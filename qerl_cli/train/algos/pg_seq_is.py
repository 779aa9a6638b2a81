"""PG-Seq-IS and PG-Seq-TIS (the FP16-vs-BF16 paper): a plain policy gradient weighted by the sequence-level
importance ratio rho(y) = pi_old(y) / mu(y) = exp(sum_t(old_logp - rollout_logp)), detached.

Per token -sg(rho) A log pi(y_t); the token losses are summed per sequence (the sequence log-prob, so a long
sequence weighs more) and averaged over sequences. PG-Seq-TIS truncates rho at 3 unless told another cap;
PG-Seq-IS caps it only when given one, and, without group advantages of its own, runs with one completion per
prompt."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from qerl_cli.errors import QerlError
from qerl_cli.train.algos.base import Algorithm, LossSettings, TokenView


class PGSeqIS(Algorithm):
    name = "pg_seq_is"
    group_advantages = False
    default_cap: ClassVar[float | None] = None

    def per_token(self, t: TokenView, settings: LossSettings, metrics: dict[str, float]) -> torch.Tensor:
        """-sg(rho(y)) A log pi(y_t), and rho's statistics after the cap (``seq_is/*``)."""
        if t.rollout_logp is None:
            raise QerlError(f"{self.name} needs rollout_logp (the rollout engine's sampled-token log-probs)")
        cap = self.default_cap if settings.seq_is_cap is None else settings.seq_is_cap
        if cap is not None and cap <= 0:
            raise QerlError(f"seq_is_cap must be positive, got {cap}")
        mu = torch.where(t.valid, t.rollout_logp.detach().to(t.dt), t.zero)
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


class PGSeqTIS(PGSeqIS):
    name = "pg_seq_tis"
    group_advantages = True
    default_cap = 3.0
