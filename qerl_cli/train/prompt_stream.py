"""The order the trainer takes the task's prompts in: seeded, resumable, a fresh permutation every epoch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PromptStream:
    """Seeded, resumable order over the task's examples: a fresh permutation every epoch."""

    size: int
    seed: int
    epoch: int = 0
    index: int = 0
    _perm: list[int] = field(default_factory=list)

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if not self._perm:
                self._perm = self._permutation()
            if self.index >= self.size:
                self.epoch += 1
                self.index = 0
                self._perm = self._permutation()
            out.append(self._perm[self.index])
            self.index += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._perm = self._permutation()

