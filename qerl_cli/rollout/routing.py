"""The experts a mixture of experts' router picked during a rollout, kept for routing replay (docs/moe.md).

The training forward recomputes every token's routing; a ~10% share of those top-k decisions differ from what the
rollout engine computed (other kernels, other batch shapes, bf16), so the update trains a network the samples were
not drawn from. The engine therefore keeps, beside the KV cache and with its layout, each sparse layer's top-k
expert ids of every cached position: ``[slots, max_len, layers, k]`` in a small integer dtype. Each forward writes
its rows there on the device (the prefill into a per-prompt tensor copied to the prompt's slots like its K/V, the
decode step and an episode's resume at each row's slot and position), so nothing syncs with the host and the decode
step stays one CUDA graph; a finished sequence's positions are copied out once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RoutingShape:
    """Sparse layers, experts per token and experts per layer of a model's routing."""

    layers: int
    top_k: int
    experts: int

    @property
    def dtype(self) -> torch.dtype:
        # the expert ids 0..E-1: one byte up to 256 experts
        return torch.uint8 if self.experts <= 256 else torch.int16

    def bytes_per_token(self) -> int:
        return self.layers * self.top_k * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of_layers(cls, layers: list[nn.Module]) -> RoutingShape | None:
        """The routing of decoder ``layers`` whose MLPs are qerl's ``MoeBlock`` (None for a dense model)."""
        from qerl_cli.moe import MoeBlock

        blocks = [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), MoeBlock)]
        if not blocks:
            return None
        return cls(len(blocks), int(blocks[0].top_k), int(blocks[0].gate.weight.shape[0]))


class RoutingCache:
    """``buf`` [slots, max_len, layers, k]: the recorded top-k of each slot's cached positions (``KVCache`` moves it
    along with its K/V)."""

    def __init__(self, shape: RoutingShape, num_slots: int, max_len: int, device: torch.device) -> None:
        self.shape = shape
        self.buf = torch.zeros((num_slots, max_len, shape.layers, shape.top_k), dtype=shape.dtype, device=device)

    def write_prompt(self, slot: int, routing: torch.Tensor) -> None:
        """Positions 0..len-1 of ``slot`` from ``routing`` [len, layers, k]."""
        self.buf[slot, : routing.shape[0]].copy_(routing)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.buf[dst, :length].copy_(self.buf[src, :length])

    def read(self, slot: int, length: int) -> torch.Tensor:
        """A copy of positions 0..length-1 of ``slot`` [length, layers, k]."""
        return self.buf[slot, :length].clone()
