"""`--finetune full`: train every weight of a full-precision model except the embeddings and lm_head.

Embeddings (and the lm_head tied to them in the small models) stay frozen: they are the largest single
tensors (49152 x 576 of SmolLM2's 135M), RL barely moves them, and a frozen embedding keeps the
vocabulary rows of tokens never sampled untouched by weight decay. Everything else (projections, norms)
trains.

In bf16/fp16 the optimizer runs on an fp32 master copy: an AdamW step of lr * ~1 on a weight near 0.05
is below bf16's spacing there (2**-12), so updating the 16-bit weights directly would drop most steps.
Each parameter's gradient is moved into its master's fp32 `.grad` as soon as backward has accumulated it
(a post-accumulate-grad hook), so the 16-bit gradients do not outlive the layer; `sync_()` copies the
masters back into the model after the step. In fp32 the parameters are their own masters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.train.checkpointing import read_full_weights, trained_names


class FullFinetune:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.trained: dict[str, nn.Parameter] = {}
        trained = trained_names(model)
        for name, p in model.named_parameters():
            p.requires_grad_(name in trained)
            if name in trained:
                self.trained[name] = p
        if not self.trained:
            raise QerlError("--finetune full found no trainable parameter outside the embeddings")
        self.masters: dict[str, nn.Parameter] = {}
        for name, p in self.trained.items():
            if p.dtype == torch.float32:
                self.masters[name] = p
            else:
                m = nn.Parameter(p.detach().float().clone())
                self.masters[name] = m
                p.register_post_accumulate_grad_hook(_move_grad_to(m))

    @property
    def params(self) -> list[nn.Parameter]:
        """What the optimizer and gradient clipping see (fp32)."""
        return list(self.masters.values())

    @torch.no_grad()
    def sync_(self) -> None:
        """Copy the updated masters into the model's 16-bit weights (after the optimizer step)."""
        for name, p in self.trained.items():
            m = self.masters[name]
            if m is not p:
                p.copy_(m)

    def weights(self) -> dict[str, torch.Tensor]:
        """What a FULL checkpoint saves (train/checkpointing.py writes it): the fp32 masters by name."""
        return dict(self.masters)

    @torch.no_grad()
    def load(self, ckpt: Path) -> None:
        """Restore the masters (and the model's weights) from a FULL checkpoint (`--resume`)."""
        for name, t in read_full_weights(ckpt, set(self.masters)).items():
            self.masters[name].copy_(t)
        self.sync_()


def _move_grad_to(master: nn.Parameter):  # noqa: ANN202 - a hook
    def hook(p: torch.Tensor) -> None:
        g = p.grad.float()
        master.grad = g if master.grad is None else master.grad.add_(g)
        p.grad = None

    return hook
