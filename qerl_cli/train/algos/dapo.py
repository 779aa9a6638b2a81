"""DAPO: clip-higher (upper epsilon 0.28), a token-level mean (every completion token weighs the same), dynamic
sampling and the soft overlong punishment on by default."""

from __future__ import annotations

import torch

from qerl_cli.train.algos.clipped import ClippedAlgorithm


class DAPO(ClippedAlgorithm):
    name = "dapo"
    default_clip = (0.2, 0.28)
    symmetric = False
    default_dynamic_sampling = True
    overlong_penalty = True

    def normalizer(self, mask: torch.Tensor, max_completion_length: int | None) -> float:
        """The batch's completion tokens."""
        return float(mask.bool().sum().clamp(min=1).item())
