"""Outcome-reward advantages (GRPO, Dr.GRPO), DAPO overlong shaping and DAPO dynamic sampling.

Rewards are a flat tensor of B = prompts x G entries, grouped contiguously: group g is rows
g*G .. g*G+G-1 (the order the rollout engine returns the G samples of each prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import torch

from qerl_cli.errors import QerlError

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise QerlError(
            f"rewards must be a 1-D tensor of prompts x group_size values, got {tuple(rewards.shape)}"
        )
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise QerlError(
            f"{rewards.numel()} rewards cannot be split into groups of {group_size}: "
            "pass num_generations that divides the batch"
        )
    return rewards.view(-1, group_size)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_rewards: ScaleRewards = "group",
    eps: float = 1e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-relative advantages with TRL GRPOTrainer semantics.

    A_i = R_i - mean(R of its group), then divided by (std + eps) where std is
    - "group": the unbiased (Bessel-corrected, torch.std) std of the sample's own group (GRPO),
    - "batch": the unbiased std of all rewards of the batch (the mean is still the group mean),
    - "none":  no division (Dr.GRPO).
    As in TRL, group_size == 1 (or a one-element batch for "batch") gives std 0 instead of NaN.

    Stats (TRL names): ``reward`` mean reward; ``reward_std`` the mean over samples of the std used for
    scaling (for "none" the group std, which TRL logs too); ``frac_reward_zero_std`` the fraction of
    samples whose std is 0 (torch.isclose). With "batch" the latter is 0 or 1 exactly as in TRL, so
    ``frac_group_zero_std`` (fraction of groups whose rewards are all equal, independent of the
    scaling) is reported as well: it is what DAPO's dynamic sampling drops.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise QerlError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}; got {scale_rewards!r}")
    rewards = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    grouped = _grouped(rewards, group_size)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)
    advantages = rewards - mean

    if group_size > 1:
        group_std = grouped.std(dim=1)
    else:
        group_std = torch.zeros(grouped.shape[0], dtype=rewards.dtype, device=rewards.device)
    if scale_rewards == "batch":
        batch_std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        std = batch_std.expand_as(rewards)
    else:
        std = group_std.repeat_interleave(group_size)

    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    if scale_rewards != "none":
        advantages = advantages / (std + eps)

    stats = {
        "reward": rewards.mean().item(),
        "reward_std": std.mean().item(),
        "frac_reward_zero_std": is_std_zero.float().mean().item(),
        "frac_group_zero_std": (~dynamic_sampling_keep(rewards, group_size)).float().mean().item(),
    }
    return advantages, stats


def dapo_overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward.

    0 if |y| <= L - B;  ((L - B) - |y|) / B if L - B < |y| <= L;  -1 if |y| > L.
    ``buffer`` 0 degenerates to a hard cut (0 up to L, -1 beyond).
    """
    if max_len < 1 or buffer < 0 or buffer > max_len:
        raise QerlError(
            f"overlong shaping needs 0 <= buffer <= max_len and max_len >= 1; got {buffer=}, {max_len=}"
        )
    lengths = torch.as_tensor(lengths)
    y = lengths.to(torch.float64 if lengths.dtype == torch.float64 else torch.float32)
    start = float(max_len - buffer)
    inside = (y > start) & (y <= max_len)
    ramp = (start - y) / buffer if buffer > 0 else torch.zeros_like(y)
    return torch.where(y <= start, torch.zeros_like(y), torch.where(inside, ramp, torch.full_like(y, -1.0)))


def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: bool [num_groups], True for groups whose rewards are not all equal.

    Equality is exact (max == min): rewards are outcome scores, and a group whose rewards differ by
    rounding noise still has a non-zero (if tiny) advantage signal.
    """
    grouped = _grouped(rewards.detach(), group_size)
    return grouped.amax(dim=1) != grouped.amin(dim=1)


T = TypeVar("T")


@dataclass
class DynamicSampler(Generic[T]):
    """Fill a batch of ``batch_prompts`` groups with informative groups across repeated rollouts.

    Each call to :meth:`add` hands in one rollout round: the flat rewards [n x G] and one item per group
    (whatever the trainer keeps per group: a dict of tensors, a list of completions ...). Groups whose
    rewards are all equal are dropped; kept groups are appended in order until the batch is full, and
    kept groups beyond that are discarded as surplus (as verl's DAPO recipe truncates). The first
    round is a normal rollout; at most ``max_refill_rounds`` further rounds follow. If the batch is
    still not full then, :meth:`result` returns the partial batch and ``dynamic/filled`` is 0: the
    trainer decides whether to train on it. If no group was informative in any round (a policy that solves,
    or fails, every prompt), the last round's groups come back instead with ``dynamic/uninformative`` 1:
    their advantages are all zero, so the step updates nothing, but the run goes on (and keeps its
    checkpoints) rather than stopping on a policy that has saturated the task.
    """

    batch_prompts: int
    group_size: int
    max_refill_rounds: int = 3
    groups: list[T] = field(default_factory=list)
    rounds: int = 0
    generated: int = 0
    dropped: int = 0
    surplus: int = 0
    last_round: list[T] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.batch_prompts < 1 or self.group_size < 1 or self.max_refill_rounds < 0:
            raise QerlError(
                "DynamicSampler needs batch_prompts >= 1, group_size >= 1 and max_refill_rounds >= 0"
            )

    @property
    def needed(self) -> int:
        """Groups still missing from the batch."""
        return self.batch_prompts - len(self.groups)

    @property
    def full(self) -> bool:
        return self.needed == 0

    @property
    def done(self) -> bool:
        """Full, or out of refill rounds."""
        return self.full or self.rounds > self.max_refill_rounds

    def add(self, rewards: torch.Tensor, groups: Sequence[T]) -> int:
        """Add one rollout round; returns how many groups of it were kept in the batch."""
        if self.done:
            raise QerlError("DynamicSampler.add called after the batch was full or the refill rounds ran out")
        keep = dynamic_sampling_keep(rewards, self.group_size).tolist()
        if len(keep) != len(groups):
            raise QerlError(f"{len(keep)} reward groups but {len(groups)} group items were passed")
        self.rounds += 1
        self.generated += len(keep)
        self.last_round = list(groups)
        taken = 0
        for item, k in zip(groups, keep, strict=True):
            if not k:
                self.dropped += 1
            elif self.needed > 0:
                self.groups.append(item)
                taken += 1
            else:
                self.surplus += 1
        return taken

    def fill(
        self, generate: Callable[[int], tuple[torch.Tensor, Sequence[T]]], prompts_per_round: int
    ) -> None:
        """Run ``generate(prompts_per_round) -> (rewards, groups)`` until :attr:`done`."""
        while not self.done:
            rewards, groups = generate(prompts_per_round)
            self.add(rewards, groups)

    def stats(self) -> dict[str, float]:
        return {
            "dynamic/rounds": float(self.rounds),
            "dynamic/groups_generated": float(self.generated),
            "dynamic/groups_dropped": float(self.dropped),
            "dynamic/groups_surplus": float(self.surplus),
            "dynamic/groups_kept": float(len(self.groups)),
            "dynamic/filled": float(self.full),
            "dynamic/uninformative": float(not self.groups),
        }

    def result(self) -> tuple[list[T], dict[str, float]]:
        return list(self.groups or self.last_round[: self.batch_prompts]), self.stats()


__all__ = [
    "SCALE_REWARDS",
    "DynamicSampler",
    "dapo_overlong_penalty",
    "dynamic_sampling_keep",
    "group_advantages",
]
