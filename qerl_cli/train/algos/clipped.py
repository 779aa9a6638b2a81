"""The clipped surrogate shared by GRPO, Dr. GRPO, DAPO and GSPO: -min(r A, clip(r, 1-eps_low, 1+eps_high) A)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from qerl_cli.errors import QerlError
from qerl_cli.train.algos.base import Algorithm, AlgorithmConfig, LossSettings, TokenView


class ClippedAlgorithm(Algorithm):
    """A clipped-ratio algorithm. ``default_clip`` is (epsilon_low, epsilon_high) when the caller gives none; with
    ``symmetric`` an explicit epsilon alone clips both sides (TRL: epsilon_high defaults to epsilon), otherwise the
    upper bound keeps its own default."""

    clipped = True
    default_clip: ClassVar[tuple[float, float]]
    symmetric: ClassVar[bool] = True

    def resolve_clip(self, epsilon: float | None, epsilon_high: float | None) -> tuple[float, float]:
        lo_default, hi_default = self.default_clip
        lo = lo_default if epsilon is None else float(epsilon)
        if epsilon_high is not None:
            hi = float(epsilon_high)
        elif self.symmetric:
            hi = lo
        else:
            hi = hi_default
        if not (0.0 <= lo < 1.0) or hi < 0.0:
            raise QerlError(f"clip range must satisfy 0 <= epsilon < 1 and epsilon_high >= 0; got {lo}, {hi}")
        return lo, hi

    def defaults(self, cfg: AlgorithmConfig) -> dict[str, Any]:
        epsilon, epsilon_high = self.resolve_clip(cfg.epsilon, cfg.epsilon_high)
        return {**super().defaults(cfg), "epsilon": epsilon, "epsilon_high": epsilon_high}

    def ratio(self, t: TokenView) -> torch.Tensor:
        """pi_theta / pi_old per token."""
        return torch.exp(t.lp - t.old)

    def clip_fractions(self, low: torch.Tensor, high: torch.Tensor,
                       t: TokenView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(low, high, either) as fractions of the completion tokens."""
        return ((low.to(t.dt) * t.m).sum() / t.total_tok, (high.to(t.dt) * t.m).sum() / t.total_tok,
                ((low | high).to(t.dt) * t.m).sum() / t.total_tok)

    def per_token(self, t: TokenView, settings: LossSettings, metrics: dict[str, float]) -> torch.Tensor:
        """The clipped surrogate and TRL's clip metrics: low counts r < 1-eps_low with A < 0, high r > 1+eps_high
        with A > 0 (the clipped side that changes the gradient)."""
        eps_lo, eps_hi = self.resolve_clip(settings.epsilon, settings.epsilon_high)
        A = t.adv[:, None]
        ratio = self.ratio(t)
        per_token = -torch.minimum(ratio * A, ratio.clamp(1.0 - eps_lo, 1.0 + eps_hi) * A)
        r = ratio.detach()
        low_f, high_f, region_f = self.clip_fractions((r < 1.0 - eps_lo) & (A < 0), (r > 1.0 + eps_hi) & (A > 0), t)
        metrics["clip_ratio"] = region_f.item()
        metrics["clip_ratio/region_mean"] = region_f.item()
        metrics["clip_ratio/low_mean"] = low_f.item()
        metrics["clip_ratio/high_mean"] = high_f.item()
        return per_token

