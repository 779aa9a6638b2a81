"""What every RL algorithm is: the `Algorithm` base class, and the loss inputs it reads (`TokenView`, `LossSettings`).

An algorithm owns its name, the config defaults it implies, the config rules it needs, its per-token loss and how
the per-token losses become one scalar (aggregation and normaliser). `losses.policy_loss` does the parts every
algorithm shares (input checks, importance weights, the k3 KL term, padding) and asks the object for the rest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from qerl_cli.errors import QerlError


class AlgorithmConfig(Protocol):
    """The TrainConfig fields an algorithm reads (a Protocol, so that this package needs nothing of config.py,
    which imports the registry)."""

    num_generations: int
    max_completion_length: int
    max_episode_tokens: int | None
    scale_rewards: str | None
    dynamic_sampling: bool | None
    overlong_buffer: int | None
    epsilon: float | None
    epsilon_high: float | None


@dataclass(frozen=True)
class TokenView:
    """The loss's inputs in its compute dtype (at least fp32), padding zeroed: ``lp`` (with gradient), ``old`` and
    ``adv`` (detached), the mask ``m`` and its token counts per sequence and in all; ``rollout_logp`` as given
    (only the algorithms that read it pay for its conversion)."""

    dt: torch.dtype
    valid: torch.Tensor
    m: torch.Tensor
    zero: torch.Tensor
    lp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    n_tok: torch.Tensor
    total_tok: torch.Tensor
    rollout_logp: torch.Tensor | None

    @classmethod
    def of(cls, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
           rollout_logp: torch.Tensor | None = None) -> TokenView:
        dt = torch.promote_types(logp.dtype, torch.float32)
        valid = mask.bool()
        m = valid.to(dt)
        zero = torch.zeros((), dtype=dt, device=logp.device)
        return cls(dt, valid, m, zero, torch.where(valid, logp.to(dt), zero),
                   torch.where(valid, old_logp.detach().to(dt), zero), advantages.detach().to(dt).reshape(-1),
                   m.sum(-1), m.sum().clamp(min=1.0), rollout_logp)


@dataclass(frozen=True)
class LossSettings:
    """The loss knobs a caller may leave to the algorithm (None: its default)."""

    epsilon: float | None = None
    epsilon_high: float | None = None
    seq_is_cap: float | None = None


class Algorithm(ABC):
    """One RL algorithm. Subclasses set ``name`` and implement :meth:`per_token`; the class attributes below are
    what the config and the trainer ask instead of comparing names."""

    name: ClassVar[str]
    clipped: ClassVar[bool] = False  # takes --epsilon/--epsilon-high (resolve_clip)
    group_advantages: ClassVar[bool] = True  # advantages are relative to a group: --num-generations >= 2
    default_scale_rewards: ClassVar[str] = "group"
    default_dynamic_sampling: ClassVar[bool] = False
    # DAPO's soft overlong punishment shapes the rewards; its buffer defaults to a quarter of the length
    overlong_penalty: ClassVar[bool] = False

    def defaults(self, cfg: AlgorithmConfig) -> dict[str, Any]:
        """The TrainConfig fields this algorithm fills in where ``cfg`` left them None (``TrainConfig.resolved``);
        ``cfg``'s episode length is already resolved."""
        length = cfg.max_episode_tokens or cfg.max_completion_length
        return {
            "scale_rewards": self.default_scale_rewards if cfg.scale_rewards is None else cfg.scale_rewards,
            "dynamic_sampling": self.default_dynamic_sampling if cfg.dynamic_sampling is None
            else cfg.dynamic_sampling,
            "overlong_buffer": cfg.overlong_buffer if cfg.overlong_buffer is not None
            else (length // 4 if self.overlong_penalty else 0),
        }

    def validate(self, cfg: AlgorithmConfig) -> None:
        """The rules between ``cfg``'s fields that this algorithm needs; a QerlError names the flag."""
        if self.group_advantages and cfg.num_generations < 2:
            raise QerlError("--num-generations must be >= 2: group-relative advantages need a group")

    @abstractmethod
    def per_token(self, t: TokenView, settings: LossSettings, metrics: dict[str, float]) -> torch.Tensor:
        """The [B, T] per-token loss before importance weights, KL and masking; adds the algorithm's metrics."""

    def aggregate(self, per_token: torch.Tensor, t: TokenView) -> torch.Tensor:
        """The sum that :meth:`normalizer` divides: here every token's loss."""
        return per_token.sum()

    def normalizer(self, mask: torch.Tensor, max_completion_length: int | None) -> float:
        """What :meth:`aggregate` of a batch with completion ``mask`` [B, T] is divided by: here its sequence count.
        The trainer takes it from the whole batch, so micro-batches (and ranks) sum to the whole batch's loss."""
        return float(mask.shape[0])
