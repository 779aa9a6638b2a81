"""GSPO: GRPO on the sequence ratio s_i = exp(mean_t(logp - old_logp)), clipped in [1-3e-4, 1+4e-4] (the paper's).

The token-wise form of the paper: s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)], whose value is s_i and whose gradient is
s_i * grad log pi(y_t), so the clip acts on the sequence while gradients flow per token. The clip metrics are
fractions of sequences, as TRL reports them for sequence-level ratios."""

from __future__ import annotations

import torch

from qerl_cli.train.algos.base import TokenView
from qerl_cli.train.algos.grpo import GRPO


class GSPO(GRPO):
    name = "gspo"
    default_clip = (3e-4, 4e-4)
    symmetric = False

    def ratio(self, t: TokenView) -> torch.Tensor:
        seq_log_ratio = ((t.lp - t.old) * t.m).sum(-1) / t.n_tok.clamp(min=1.0)
        return torch.exp(seq_log_ratio.detach())[:, None] * torch.exp(t.lp - t.lp.detach())

    def clip_fractions(self, low: torch.Tensor, high: torch.Tensor,
                       t: TokenView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fractions of the sequences that have a token: the ratio is one value per sequence."""
        has_tok = (t.n_tok > 0).to(t.dt)
        denom = has_tok.sum().clamp(min=1.0)
        return ((low[:, 0].to(t.dt) * has_tok).sum() / denom, (high[:, 0].to(t.dt) * has_tok).sum() / denom,
                ((low | high)[:, 0].to(t.dt) * has_tok).sum() / denom)
