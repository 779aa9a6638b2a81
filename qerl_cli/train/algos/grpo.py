"""GRPO (TRL's GRPOTrainer, loss type "grpo"): the token-level clipped surrogate, each sequence's mean token loss
summed over sequences and divided by the sequence count. Expects group-std-normalised advantages."""

from __future__ import annotations

import torch

from qerl_cli.train.algos.base import TokenView
from qerl_cli.train.algos.clipped import ClippedAlgorithm


class GRPO(ClippedAlgorithm):
    name = "grpo"
    default_clip = (0.2, 0.2)  # TRL's epsilon

    def aggregate(self, per_token: torch.Tensor, t: TokenView) -> torch.Tensor:
        return (per_token.sum(-1) / t.n_tok.clamp(min=1.0)).sum()
