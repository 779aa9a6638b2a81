"""Where the parts of an RL step that depend on the process layout run: one process, or data-parallel ranks.

`Trainer.train_step` is written once against :class:`StepBackend`; the backend is chosen once, in
`Trainer.setup` (train/distributed.py's ``make_backend``): :class:`LocalBackend` on one process,
`DistributedBackend` (train/distributed.py) under torchrun. A backend asks the two sides of the step only through
the public methods of :class:`RolloutWorker` (generate, score: train/rollouter.py's ``Rollouter``) and
:class:`UpdateWorker` (forward_no_grad: train/updater.py's ``PolicyUpdater``), so no module reaches into
another. This module imports no other backend module (distributed.py imports it, not the other way round).

What differs between the two, and nothing else:

* a rollout round: generate + score the round's prompts here, or split them over the ranks and gather;
* the pi_old / reference forward: the whole batch here, or each rank's row shard then gathered;
* pi_old and entropies from the update's own forward (no pi_old pass): kept here, or gathered from the ranks;
* the policy update's micro-batches: all rows here, or this rank's contiguous shard (with a sharded model,
  padded with stand-in micro-batches so that every rank runs the same number of forward/backward passes);
* after backward: nothing here, or the sum of every rank's gradients and loss metrics;
* the step's dist/* metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from qerl_cli.train.batch import RolloutBatch

LogProbs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]  # pi_old, reference (beta > 0), entropies


@dataclass(frozen=True)
class MicroBatch:
    """Batch rows one forward/backward pass trains on. ``counts`` False marks a stand-in: a pass a rank runs
    only so that its collectives match the other ranks' (FSDP gathers every layer in every pass); its loss is
    multiplied by 0 and its metrics are dropped."""

    rows: slice
    counts: bool = True


def micro_batches(rows: slice, size: int, passes: int | None = None) -> list[MicroBatch]:
    """``rows`` in micro-batches of at most ``size`` rows, then stand-ins (the batch's row 0) up to ``passes``."""
    out = [MicroBatch(slice(i, min(i + size, rows.stop))) for i in range(rows.start, rows.stop, size)]
    while passes is not None and len(out) < passes:
        out.append(MicroBatch(slice(0, 1), counts=False))
    return out


@dataclass
class RolloutRound:
    """One round's result in global prompt order, as the 1-process trainer would have it."""

    samples: list[Any]
    raw: torch.Tensor
    shaped: torch.Tensor
    timings: dict[str, float]
    busy_s: list[float] = field(default_factory=list)  # per rank: seconds generating + scoring
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (rank, start, end)


class RolloutWorker(Protocol):
    """What a backend needs from the rollout side (the ``Rollouter`` implements it)."""

    rollout_step: int  # the step the rounds being generated are for
    prompt_ids: list[list[int]]

    def generate(self, indices: list[int], round_: int, norm_overrides: dict[str, torch.Tensor] | None,
                 prompt_offset: int = 0) -> Any: ...

    def score(self, indices: list[int], samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]: ...


class UpdateWorker(Protocol):
    """What a backend needs from the update side (the ``PolicyUpdater`` implements it)."""

    @property
    def micro_batch_size(self) -> int: ...  # sequences per forward pass

    def forward_no_grad(self, batch: RolloutBatch, with_ref: bool, with_old: bool = True) -> LogProbs: ...


@dataclass(frozen=True)
class StepSides:
    """The two sides of the step whose layout-dependent parts a backend runs."""

    rollout: RolloutWorker
    update: UpdateWorker


class StepBackend(Protocol):
    world_size: int

    def rollout_round(self, indices: list[int], round_: int, overrides: Any) -> RolloutRound:
        """Generate and score one round of one step; every caller gets all of it, in prompt order."""

    def old_logprobs(self, batch: RolloutBatch, with_ref: bool, with_old: bool = True) -> LogProbs:
        """pi_old (and reference) log-probs and entropies of the whole batch."""

    def gather_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]],
                    batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's micro-batches' (log-probs, entropies), in row order -> the whole batch's."""

    def update_micro_batches(self, n: int, size: int) -> list[MicroBatch]:
        """The forward/backward passes this process runs over a batch of ``n`` rows, in order."""

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Make every process hold the whole batch's gradient (after backward, before clipping)."""

    def reduce_loss_metrics(self, total_loss: float, agg: dict[str, float]) -> tuple[float, dict[str, float]]:
        """The whole batch's loss and loss metrics from this process's part."""

    def step_metrics(self, busy_s: list[float]) -> dict[str, float]:
        """The step's layout metrics from each process's busy rollout seconds."""


class LocalBackend:
    """One process: everything on the whole batch, nothing to exchange."""

    world_size = 1

    def __init__(self, sides: StepSides) -> None:
        self.sides = sides

    def rollout_round(self, indices: list[int], round_: int, overrides: Any) -> RolloutRound:
        res = self.sides.rollout.generate(indices, round_, overrides)
        raw, shaped = self.sides.rollout.score(indices, res.samples)
        timings = {**res.timings, "decode_steps": float(res.stats.get("decode_steps", 0))}
        return RolloutRound(res.samples, raw, shaped, timings, busy_s=[0.0])

    def old_logprobs(self, batch: RolloutBatch, with_ref: bool, with_old: bool = True) -> LogProbs:
        return self.sides.update.forward_no_grad(batch, with_ref, with_old)

    def gather_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]],
                    batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def update_micro_batches(self, n: int, size: int) -> list[MicroBatch]:
        return micro_batches(slice(0, n), size)

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        return None

    def reduce_loss_metrics(self, total_loss: float, agg: dict[str, float]) -> tuple[float, dict[str, float]]:
        return total_loss, agg

    def step_metrics(self, busy_s: list[float]) -> dict[str, float]:
        return {}
