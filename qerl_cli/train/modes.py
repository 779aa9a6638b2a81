"""The training mode: what trains, and how it is built, restored, saved and handed to the rollout engine.

One object per mode, chosen once from the resolved configuration (:func:`make_mode`), so the trainer never asks
which mode it runs:

* :class:`LoraMode`: peft adapters on the frozen (quantized) base; checkpoints may be written in the background;
* :class:`FullMode`: every weight but the embeddings trains, fp32 masters on one process (train/full_finetune.py);
* :class:`ShardedFullMode`: the same sharded with FSDP2 over the ranks (train/fsdp.py): sharded masters, gradients
  and AdamW state, sharded checkpoints every rank writes, the optimizer restored by the shards.

FlashRL's quantized rollout copy (``--rollout-quant``, train/rollout_quant.py) is a part any mode may have: built
beside the trained weights, re-quantized after every update, restored with them. The mode is handed what it works
on: the run's settings, device and process group at construction, the optimizer and the checkpoint sink
(train/checkpointing.py) where it loads or saves; it holds the model it built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.train import checkpointing as ck
from qerl_cli.train.phases import REQUANT, PhaseClock

if TYPE_CHECKING:
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.distributed import DistContext


class TrainingMode:
    """LoRA, full or sharded-full fine-tuning behind one interface (module docstring). The base class is what the
    unsharded modes share."""

    sharded = False  # the weights and AdamW state live in shards; every rank writes its part of a checkpoint
    full_weights = False  # every weight trains (not LoRA): the base must be unquantized

    def __init__(self, cfg: TrainConfig, device: torch.device, dtype: torch.dtype, dist: DistContext,
                 phases: PhaseClock) -> None:
        self.cfg, self.device, self.dtype, self.dist, self.phases = cfg, device, dtype, dist, phases
        self.model: nn.Module  # set by build()
        self.full: Any = None  # the full-weight trainer (FullFinetune / ShardedFullFinetune), if the mode has one
        self.rollout_quant: Any = None  # the FlashRL rollout copy, if any

    # ---- build ----------------------------------------------------------------------------------
    def check_base(self, base: nn.Module) -> None:
        """Full fine-tuning and FlashRL's rollout copy start from unquantized weights."""
        flag = "--finetune full" if self.full_weights else "--rollout-quant" if self.cfg.rollout_format is not None \
            else None
        if flag is not None:
            from qerl_cli.train.rollout_quant import check_full_precision_base

            check_full_precision_base(base, flag)

    def build(self, base: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        """The trained model (kept as :attr:`model`) and its trainable parameters, from the loaded base."""
        self.model, params = self.build_model(base)
        return self.model, params

    def build_model(self, base: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        raise NotImplementedError

    def attach_rollout_copy(self, model: nn.Module) -> None:
        """FlashRL: the quantized copy the rollout generates with (``--rollout-quant``)."""
        c = self.cfg
        if c.rollout_format is None or self.rollout_quant is not None:
            return
        from qerl_cli.train.rollout_quant import RolloutQuant

        self.rollout_quant = RolloutQuant(model, c.rollout_quant, scales=c.requant_scales or "dynamic",
                                          dtype=self.dtype)

    def rollout_model(self) -> nn.Module:
        """What the rollout engine generates with: the trained model, or its quantized copy."""
        return self.model if self.rollout_quant is None else self.rollout_quant.model

    def aqn_model(self) -> nn.Module:
        """Whose norms AQN reads (the engine overrides the same ones)."""
        return self.model

    def optimizer_options(self) -> dict[str, Any]:
        return {}

    def finite_ctx(self) -> DistContext | None:
        """The process group that must agree on a finite update (None: this process decides alone)."""
        return None

    # ---- resume ---------------------------------------------------------------------------------
    def check_checkpoint(self, ckpt: Path) -> None:
        """Refuse a checkpoint another mode wrote (before anything is loaded)."""

    def load(self, ckpt: Path, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """The trained weights (and the optimizer, the rollout copy) from a verified checkpoint."""
        self.load_weights(ckpt, optimizer)
        if self.rollout_quant is not None:  # the rollout copy follows the restored weights (and INT8 scales)
            self.rollout_quant.load_state_dict(ck.rollout_quant_state(state))
            self.rollout_quant.requantize_()
        self.load_optimizer(state, optimizer)

    def load_weights(self, ckpt: Path, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    def load_optimizer(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        optimizer.load_state_dict(state["optimizer"])

    # ---- step -----------------------------------------------------------------------------------
    def after_update(self) -> dict[str, float]:
        """Bring what the rollout reads up to the updated weights; the requant metrics when there is a copy."""
        if self.full is not None:
            self.full.sync_()
        if self.rollout_quant is None:
            return {}
        self.phases.enter(REQUANT)
        metrics = dict(self.rollout_quant.requantize_())  # timing/requant_s, rollout_quant/*
        self.phases.record_peak(metrics, REQUANT)  # sharded: one gathered layer at a time on top of the rest
        return metrics

    # ---- save -----------------------------------------------------------------------------------
    def can_write_in_background(self) -> bool:
        return False

    def save(self, sink: ck.CheckpointSink, step: int, optimizer: torch.optim.Optimizer,
             trainer_state: Callable[[], dict[str, Any]], background: bool) -> Path:
        """Checkpoint ``step`` on rank 0 (the others wait for it), in the background where allowed; what it cost
        goes to the sink. ``trainer_state``: what the checkpoint holds besides the weights and the optimizer."""
        if not self.dist.is_main:
            self.dist.barrier()
            return ck.checkpoint_path(sink.run, step)
        t0 = self.phases.clock()
        sink.wait()  # the previous write, which may still read the snapshot buffers
        marks = {"wait": time.perf_counter()}
        state = {"optimizer": optimizer.state_dict(), **trainer_state()}
        marks["state"] = time.perf_counter()
        if background and self.can_write_in_background() and not self.dist.enabled:
            path = self.save_in_background(sink, step, state, marks, optimizer)
        else:
            path = ck.save_checkpoint(sink.run, step, self.model, state, self.cfg.to_dict(), self.cfg.keep_checkpoints,
                                      full_weights=self.full.weights() if self.full is not None else None)
            marks["write"] = self.phases.clock()
        sink.last_checkpoint_s = list(marks.values())[-1] - t0
        edges = [t0, *marks.values()]
        sink.last_checkpoint_parts = {k: b - a for k, a, b in zip(marks, edges[:-1], edges[1:], strict=True)}
        self.dist.barrier()
        return path

    def save_in_background(self, sink: ck.CheckpointSink, step: int, state: dict[str, Any],
                           marks: dict[str, float], optimizer: torch.optim.Optimizer) -> Path:
        raise NotImplementedError

    def prepare_snapshot(self, sink: ck.CheckpointSink, optimizer: torch.optim.Optimizer) -> None:
        """Once the optimizer exists: let the background checkpoint's pinned buffers be allocated off the step's
        critical path (:meth:`HostSnapshot.prepare`); nothing where checkpoints are written synchronously."""


class LoraMode(TrainingMode):
    """peft adapters on the frozen base (qerl_cli/lora.py); only they train and only they are saved."""

    def build_model(self, base: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        from qerl_cli.lora import attach_lora, make_lora_config  # peft: imported only when LoRA trains

        c = self.cfg
        model = attach_lora(base, make_lora_config(c.lora_rank, c.lora_alpha, c.lora_targets, c.lora_dropout),
                            seed=c.seed)
        params = [p for n, p in model.named_parameters() if p.requires_grad]
        if not params or any("lora_" not in n for n, p in model.named_parameters() if p.requires_grad):
            raise QerlError("only LoRA adapters may be trainable; check --lora-targets")
        self.attach_rollout_copy(model)
        return model, params

    def load_weights(self, ckpt: Path, optimizer: torch.optim.Optimizer) -> None:
        ck.load_adapter_weights(self.model, ckpt)

    def can_write_in_background(self) -> bool:
        return True

    def prepare_snapshot(self, sink: ck.CheckpointSink, optimizer: torch.optim.Optimizer) -> None:
        from qerl_cli.lora import lora_state_dict

        if self.cfg.async_checkpoint and not self.dist.enabled and self.device.type == "cuda":
            sink.snapshot.prepare(ck.snapshot_specs(lora_state_dict(self.model), optimizer))

    def save_in_background(self, sink: ck.CheckpointSink, step: int, state: dict[str, Any],
                           marks: dict[str, float], optimizer: torch.optim.Optimizer) -> Path:
        """Host copies queued on the device (never waited for here: the step's critical path pays for launching
        them), written by the writer thread once they have landed. Offloaded AdamW moments are lent, not copied:
        the optimizer's next step waits until the writer has serialised them (train/host_offload.py)."""
        from qerl_cli.lora import lora_state_dict
        from qerl_cli.train.host_offload import lend_host_state

        loan = lend_host_state(optimizer)
        try:
            state = sink.snapshot.take(state, "state", loan.ids if loan is not None else frozenset())
            adapter = sink.snapshot.take(lora_state_dict(self.model), "adapter")
            marks["snapshot"] = time.perf_counter()
            rng, ready = ck.rng_state(), sink.snapshot.ready()
            run, model, config, keep = sink.run, self.model, self.cfg.to_dict(), self.cfg.keep_checkpoints
            marks["rng"] = time.perf_counter()
            release = loan.release if loan is not None else None

            def write() -> Path:
                try:
                    ready()
                    return ck.save_checkpoint(run, step, model, state, config, keep, adapter_state=adapter, rng=rng,
                                              state_written=release)
                finally:  # a failed write must not leave the next optimizer step waiting forever
                    if release is not None:
                        release()

            sink.writer.submit(write)
        except BaseException:
            if loan is not None:  # no writer took the loan: nothing else would release it
                loan.release()
            raise
        marks["submit"] = time.perf_counter()
        return ck.checkpoint_path(run, step)


class FullMode(TrainingMode):
    """Every weight but the embeddings trains in fp32 masters on one process (train/full_finetune.py)."""

    full_weights = True

    def build_model(self, base: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        from qerl_cli.train.full_finetune import FullFinetune

        self.full = FullFinetune(base)
        self.attach_rollout_copy(base)
        return base, self.full.params

    def check_checkpoint(self, ckpt: Path) -> None:
        if ck.checkpoint_kind(ckpt) == ck.FULL_SHARDED:
            raise QerlError(f"checkpoint {ckpt} was written by --sharding fsdp2 (sharded weights and optimizer): "
                            "resume it with --sharding fsdp2 on any number of processes")

    def load_weights(self, ckpt: Path, optimizer: torch.optim.Optimizer) -> None:
        self.full.load(ckpt)


class ShardedFullMode(TrainingMode):
    """Full fine-tuning sharded with FSDP2 (train/fsdp.py): the rollout copy is built first from the whole weights,
    which once sharded are only ever gathered one layer at a time."""

    sharded = True
    full_weights = True

    def build_model(self, base: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        from qerl_cli.train.fsdp import ShardedFullFinetune, rollout_private_names
        from qerl_cli.train.rollout_quant import RolloutQuant

        c = self.cfg
        self.rollout_quant = RolloutQuant(base, c.rollout_quant, scales=c.requant_scales or "dynamic",
                                          dtype=self.dtype, private=rollout_private_names(base))
        self.full = ShardedFullFinetune(base, self.device, compute_dtype=self.dtype, offload=c.fsdp_offload,
                                        ctx=self.dist)
        self.rollout_quant.bind_gather(self.full.gather_units())
        return base, self.full.params

    def aqn_model(self) -> nn.Module:
        return self.rollout_quant.model  # the engine overrides the rollout copy's own norms

    def optimizer_options(self) -> dict[str, Any]:
        return self.full.optimizer_options

    def finite_ctx(self) -> DistContext | None:
        return self.dist

    def check_checkpoint(self, ckpt: Path) -> None:
        if ck.checkpoint_kind(ckpt) != ck.FULL_SHARDED:
            raise QerlError(f"checkpoint {ckpt} was written without sharding: resume it with --sharding none on one "
                            "process")

    def load_weights(self, ckpt: Path, optimizer: torch.optim.Optimizer) -> None:
        # with the optimizer: every rank reads the rows of its own shard, whatever world size wrote them
        self.full.load(ckpt, optimizer)

    def load_optimizer(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        pass  # restored with the weights' shards

    def save(self, sink: ck.CheckpointSink, step: int, optimizer: torch.optim.Optimizer,
             trainer_state: Callable[[], dict[str, Any]], background: bool) -> Path:
        """Every rank writes its rows of the weights and AdamW state into rank 0's staging directory, rank 0 the
        rest; `latest` moves when all of it is there. Synchronous."""
        t0 = self.phases.clock()
        if self.dist.is_main:
            path = ck.save_checkpoint(sink.run, step, self.model, trainer_state(), self.cfg.to_dict(),
                                      self.cfg.keep_checkpoints,
                                      weights_writer=lambda tmp: self.full.write_checkpoint(tmp, optimizer))
        else:
            self.full.write_checkpoint(None, optimizer)
            path = ck.checkpoint_path(sink.run, step)
        sink.last_checkpoint_s = self.phases.clock() - t0
        self.dist.barrier()
        return path


def make_mode(cfg: TrainConfig, sharding: str, device: torch.device, dtype: torch.dtype, dist: DistContext,
              phases: PhaseClock) -> TrainingMode:
    """The mode of this run's resolved configuration and sharding engine (``resolve_sharding``)."""
    mode = ShardedFullMode if sharding == "fsdp2" else FullMode if cfg.finetune == "full" else LoraMode
    return mode(cfg, device, dtype, dist, phases)


__all__ = ["FullMode", "LoraMode", "ShardedFullMode", "TrainingMode", "make_mode"]
