"""Dr. GRPO (TRL loss type "dr_grpo"): the token losses summed and divided by a constant, sequences x the
maximum completion length, so neither a sequence's length nor the batch's token count scales its gradient;
advantages unscaled (--scale-rewards none)."""

from __future__ import annotations

import torch

from qerl_cli.errors import QerlError
from qerl_cli.train.algos.clipped import ClippedAlgorithm


class DrGRPO(ClippedAlgorithm):
    name = "dr_grpo"
    default_clip = (0.2, 0.2)
    default_scale_rewards = "none"

    def normalizer(self, mask: torch.Tensor, max_completion_length: int | None) -> float:
        batch, positions = mask.shape
        if max_completion_length is None or max_completion_length < 1:
            raise QerlError("dr_grpo needs max_completion_length (its constant loss normaliser)")
        if positions > max_completion_length:
            raise QerlError(f"completions have {positions} positions but max_completion_length is "
                            f"{max_completion_length}")
        return float(batch * max_completion_length)
