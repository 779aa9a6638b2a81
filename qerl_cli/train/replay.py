"""Routing replay in the update (docs/moe.md): the training forwards of a mixture of experts route each token with
the experts the rollout engine recorded for it, so the update's network is the one the samples came from.

The recorded routing rides in ``RolloutBatch.routing`` laid out like ``input_ids`` (padded); a forward that packs
its rows (``--pack-sequences``) gets it packed by the same ``packed_rows`` that packs the input_ids."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn

from qerl_cli.moe import replay_routing
from qerl_cli.train.batch import RolloutBatch
from qerl_cli.train.logprobs import runs_packed
from qerl_cli.train.packing import packed_rows


def forward_routing(model: nn.Module, batch: RolloutBatch, chunk_tokens: int, packed: bool) -> torch.Tensor | None:
    """``batch.routing`` in the layout the log-prob forward of ``model`` with these settings feeds its decoder."""
    if batch.routing is None:
        return None
    if runs_packed(model, chunk_tokens, packed):
        return packed_rows(batch.routing, batch.attention_mask.to(batch.routing.device))
    return batch.routing


def replaying(model: nn.Module, batch: RolloutBatch, *, chunk_tokens: int, packed: bool,
              replay: bool) -> AbstractContextManager[None]:
    """Within: the forwards of ``batch`` through ``model`` take the recorded experts (``replay``) or only measure how
    their own routing differs (``router/replay_disagreement``); nothing without a recorded routing. A backward whose
    checkpointed layers recompute their forward must run within too."""
    return replay_routing(model, forward_routing(model, batch, chunk_tokens, packed), replay)
