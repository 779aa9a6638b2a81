"""`--finetune full --sharding fsdp2`: full fine-tuning with PyTorch's FSDP2 (``fully_shard``), under torchrun
or on one process (sharding degree 1).

What is sharded: every trained parameter (all but the embeddings and lm_head, as ``--finetune full``
trains; train/full_finetune.py), its gradient and its AdamW moments, along dim 0 over the ranks. The
sharded parameters are fp32 and ARE the master weights: with ``--precision bf16`` a
``MixedPrecisionPolicy`` all-gathers them in bf16 for the forward/backward of one decoder layer at a time
and reduce-scatters the gradients in fp32, so no rank ever holds the whole model in fp32 and no second
bf16 copy of it exists. ``fully_shard`` wraps each decoder layer and then the decoder (``model.model``,
which holds the final norm); the frozen embeddings and lm_head are ``ignored_params``: plain tensors in the
compute dtype on every rank, shared with the rollout copy, never gathered. The reduce-scatter SUMS the
ranks' gradients (divide factor 1): the loss normaliser is the whole batch's (train/distributed.py), so
the sum is the 1-process gradient.

``fsdp_offload`` adds ``CPUOffloadPolicy``: sharded weights, gradients and AdamW state live in pinned host
memory and the optimizer step runs on the CPU (fused AdamW); each layer is copied to the GPU for its
all-gather. The optimizer is fused AdamW in every case (foreach AdamW would allocate whole-model temporaries).

Rollouts come from the quantized copy (train/rollout_quant.py), built before sharding; ``gather_units``
tells it how to see the full weights afterwards: each FSDP unit is unsharded (all-gathered in the compute
dtype), re-quantized into the copy and resharded before the next, so the full-precision model never exists
twice. Each rank rolls out its own prompts from its own copy.

Checkpoints (``write_checkpoint`` / ``load``): each rank writes its rows of the weights and of the AdamW
moments (train/sharded_checkpoint.py: safetensors + JSON index, no pickle), from
``get_model_state_dict`` / ``get_optimizer_state_dict`` (sharded DTensors keyed by parameter name); on
resume each rank reads the rows of ITS shard under the current world size and loads them through
``set_model_state_dict`` / ``set_optimizer_state_dict``, so N ranks resume on M.

torch 2.13 on CPU: FSDP2 runs on gloo (reduce-scatter and all-gather are implemented there), including
mixed precision and fused AdamW; the CPU tests use it. One limitation: a custom gradient divide factor
makes FSDP reduce with ``ReduceOp.PREMUL_SUM``, which gloo refuses; ``set_force_sum_reduction_for_comms``
makes it a plain SUM (and with factor 1 no division at all). A single process gets a 1-rank process group
(``ensure_process_group``), as FSDP2 needs one even at degree 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.train.checkpointing import trained_names
from qerl_cli.train.distributed import DistContext
from qerl_cli.train.sharded_checkpoint import RowShard, ShardReader, chunk_rows, write_index, write_rank

WEIGHTS_STEM = "weights"  # train/checkpointing.py: a FULL_SHARDED checkpoint holds weights.index.json
OPTIMIZER_STEM = "optimizer"
TUPLE_TAG = "__tuple__"


def ensure_process_group(device: torch.device) -> None:
    """FSDP2 needs a default process group: one process outside torchrun gets a 1-rank group of its own."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", index))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def decoder_parts(model: nn.Module) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """(decoder, [(name, decoder layer)]) of a *ForCausalLM whose decoder is ``model`` with ``layers``."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if decoder is None or not isinstance(layers, nn.ModuleList) or not len(layers):
        raise QerlError(f"--sharding fsdp2 needs a decoder-only model with model.layers (Llama, Qwen2/3, Mistral), "
                        f"not {type(model).__name__}")
    return decoder, [(f"model.layers.{i}", layer) for i, layer in enumerate(layers)]


def rollout_private_names(model: nn.Module) -> set[str]:
    """Trained parameters the rollout copy must hold its own copy of (FSDP shards them): every trained
    parameter but the Linear weights, which the copy replaces by quantized ones (norms, biases)."""
    linear_weights = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return trained_names(model) - linear_weights


class ShardedFullFinetune:
    """The model's trained parameters sharded with FSDP2 (the module docstring says how)."""

    def __init__(self, model: nn.Module, device: torch.device, *, compute_dtype: torch.dtype, offload: bool = False,
                 ctx: DistContext | None = None) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.model = model
        self.ctx = ctx or DistContext()
        self.device = device
        ensure_process_group(device)
        decoder, layers = decoder_parts(model)
        trained = trained_names(model)
        if not trained:
            raise QerlError("--finetune full found no trainable parameter outside the embeddings")
        in_decoder = {f"model.{n}" for n, _ in decoder.named_parameters()}
        outside = sorted(trained - in_decoder)
        if outside:
            raise QerlError(f"--sharding fsdp2 shards the decoder, but {outside[0]} (outside it) would train: use "
                            "--sharding none on one process")
        frozen: set[nn.Parameter] = set()
        for name, p in model.named_parameters():
            if name in trained:
                p.requires_grad_(True)
            else:  # embeddings / lm_head: replicated in the compute dtype, never gathered
                p.requires_grad_(False)
                p.data = p.data.to(device=device, dtype=compute_dtype)
                frozen.add(p)
        for b_name, b in model.named_buffers():
            if b.device != device:
                model.get_submodule(b_name.rpartition(".")[0]).register_buffer(
                    b_name.rpartition(".")[2], b.to(device), persistent=b_name in model.state_dict())
        world = dist.get_world_size()
        self.mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                  reduce_dtype=torch.float32)
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
        self.offload = offload
        self.units: list[tuple[str, Any]] = []
        for name, layer in layers:
            _to_fp32(layer)  # the masters: one layer at a time, so the peak is the model plus one fp32 layer
            fully_shard(layer, mesh=self.mesh, mp_policy=mp, offload_policy=policy)
            self.units.append((name, layer))
        _to_fp32(decoder)
        # the root unit (final norm) reshards after forward too: a no-grad forward must not leave it gathered
        fully_shard(decoder, mesh=self.mesh, mp_policy=mp, offload_policy=policy, reshard_after_forward=True,
                    ignored_params={p for p in decoder.parameters() if p in frozen})
        self.units.append(("model", decoder))
        for _, unit in self.units:
            # sum, not mean: the loss normaliser is the whole batch's. A divide factor alone makes FSDP reduce
            # with PREMUL_SUM, which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); forcing plain SUM
            # with factor 1 skips the division altogether, on NCCL and gloo alike.
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        self.names = [n for n, _ in model.named_parameters() if n in trained]
        params = dict(model.named_parameters())
        self.trained = {n: params[n] for n in self.names}

    # ---- what the trainer asks -------------------------------------------------------------------------
    @property
    def params(self) -> list[nn.Parameter]:
        """The sharded fp32 parameters (DTensors): what the optimizer and gradient clipping see."""
        return list(self.trained.values())

    @property
    def optimizer_options(self) -> dict[str, Any]:
        return {"fused": True}

    def sync_(self) -> None:
        """Nothing to copy: the sharded parameters are the masters (the compute copy is gathered per layer)."""

    def gather_units(self) -> list[tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]]:
        """(module prefix, context in which that unit's parameters are whole) per FSDP unit, in model order:
        what the rollout copy re-quantizes from. Every rank must enter them in the same order (all-gathers)."""
        return [(prefix, _unsharded_factory(unit)) for prefix, unit in self.units]

    # ---- checkpoints ------------------------------------------------------------------------------------
    def _row_shard(self, t: Any) -> RowShard:
        from torch.distributed.tensor import DTensor

        if not isinstance(t, DTensor):
            raise QerlError("a sharded checkpoint tensor is not an FSDP-sharded DTensor; report this")
        local = t.to_local()
        start, stop = chunk_rows(t.shape[0], self.mesh.get_local_rank(), self.mesh.size())
        if local.shape[0] != stop - start:
            raise QerlError(f"FSDP shard of {tuple(t.shape)} holds {local.shape[0]} rows where rows [{start}, {stop}) "
                            "were expected; report this")
        return RowShard(local, start, tuple(t.shape))

    def state_shards(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, RowShard], dict[str, RowShard],
                                                                       dict[str, Any]]:
        """This rank's rows of the weights and of the AdamW moments, and the optimizer's JSON part."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        from torch.distributed.tensor import DTensor

        # (a tied lm_head can still show up under its own name: only the trained names are kept)
        msd = get_model_state_dict(self.model, options=StateDictOptions(ignore_frozen_params=True))
        missing = [n for n in self.names if n not in msd]
        if missing:
            raise QerlError(f"the sharded state dict lacks the trained parameter {missing[0]}; report this")
        weights = {k: self._row_shard(msd[k]) for k in self.names}
        osd = get_optimizer_state_dict(self.model, optimizer)
        moments: dict[str, RowShard] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for fqn, st in osd["state"].items():
            for key, v in st.items():
                if isinstance(v, DTensor):
                    moments[f"{fqn}/{key}"] = self._row_shard(v)
                elif isinstance(v, torch.Tensor) and v.dim() == 0:  # AdamW's step count
                    scalars.setdefault(fqn, {})[key] = {"value": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
                else:
                    raise QerlError(f"optimizer state {fqn}/{key} is neither sharded nor a scalar; report this")
        meta = {"param_groups": encode_json(osd["param_groups"]), "scalars": scalars}
        return weights, moments, meta

    def write_checkpoint(self, directory: Path | None, optimizer: torch.optim.Optimizer) -> None:
        """Every rank, together: write this rank's rows of the weights and AdamW state into ``directory``
        (rank 0's staging directory, handed to the others here), then rank 0 writes the two indexes."""
        where = self.ctx.broadcast_object(None if directory is None else str(directory))
        if where is None:
            raise QerlError("rank 0 gave no checkpoint directory; report this")
        out = Path(where)
        weights, moments, meta = self.state_shards(optimizer)
        rank = self.mesh.get_local_rank()
        parts = (write_rank(out, WEIGHTS_STEM, rank, weights), write_rank(out, OPTIMIZER_STEM, rank, moments))
        gathered = self.ctx.gather_objects(parts)
        if self.ctx.is_main:
            write_index(out, WEIGHTS_STEM, [g[0] for g in gathered], {"dtype": "float32", "kind": "fsdp2 masters"})
            write_index(out, OPTIMIZER_STEM, [g[1] for g in gathered], meta)

    @torch.no_grad()
    def load(self, ckpt: Path, optimizer: torch.optim.Optimizer) -> None:
        """Every rank: read ITS rows (under the current world size) of the weights and AdamW state of a
        sharded checkpoint written on any number of ranks, and load them."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        with ShardReader(ckpt, WEIGHTS_STEM) as reader:
            saved = set(reader.keys())
            if saved != set(self.names):
                extra = sorted(saved ^ set(self.names))[0]
                raise QerlError(f"checkpoint {ckpt} was trained with other parameters than this model has ({extra}): "
                                "resume with the model it was trained on")
            sd = {n: self._like(p, reader, n) for n, p in self.trained.items()}
        set_model_state_dict(self.model, sd, options=StateDictOptions(strict=False))
        with ShardReader(ckpt, OPTIMIZER_STEM) as reader:
            groups = decode_json(reader.meta.get("param_groups"))
            scalars = reader.meta.get("scalars") or {}
            state: dict[str, dict[str, Any]] = {}
            for key in reader.keys():
                fqn, _, name = key.rpartition("/")
                if fqn not in self.trained:
                    raise QerlError(f"checkpoint {ckpt} has optimizer state for {fqn}, which this model does not train")
                state.setdefault(fqn, {})[name] = self._like(self.trained[fqn], reader, key)
            for fqn, vals in scalars.items():
                for name, v in vals.items():
                    state.setdefault(fqn, {})[name] = torch.tensor(v["value"], dtype=getattr(torch, v["dtype"]))
        if not isinstance(groups, list) or not groups:
            raise QerlError(f"checkpoint {ckpt} has no optimizer param groups: it is damaged")
        set_optimizer_state_dict(self.model, optimizer, {"state": state, "param_groups": groups})

    def _like(self, param: Any, reader: ShardReader, key: str) -> Any:
        """A DTensor sharded like ``param`` holding this rank's rows of ``key``."""
        from torch.distributed.tensor import DTensor

        e = reader.entry(key)
        if tuple(e.shape) != tuple(param.shape):
            raise QerlError(f"checkpoint tensor {key} has shape {list(e.shape)}, the model {list(param.shape)}: it "
                            "belongs to another model")
        start, stop = chunk_rows(param.shape[0], self.mesh.get_local_rank(), self.mesh.size())
        local = param.to_local()
        rows = reader.rows(key, start, stop).to(device=local.device, dtype=local.dtype)
        return DTensor.from_local(rows, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())


def _to_fp32(module: nn.Module) -> None:
    """The trained parameters directly in ``module`` (not in its FSDP sub-units) become fp32: the masters."""
    for p in module.parameters(recurse=True):
        if p.requires_grad and p.dtype != torch.float32 and not hasattr(p, "device_mesh"):
            p.data = p.data.float()


def _unsharded_factory(unit: Any) -> Callable[[], contextlib.AbstractContextManager[None]]:
    @contextlib.contextmanager
    def unsharded() -> Iterator[None]:
        unit.unshard()
        try:
            yield
        finally:
            unit.reshard()

    return unsharded


def encode_json(obj: Any) -> Any:
    """Optimizer param groups as JSON (tuples such as AdamW's betas tagged, so they come back as tuples). The
    same tag as the generic trainer-state serialiser (qerl_cli/statefile.py) uses for tuples: this
    pair of functions is what switches to its skeleton encoding once that module is on main."""
    if isinstance(obj, tuple):
        return {TUPLE_TAG: [encode_json(v) for v in obj]}
    if isinstance(obj, list):
        return [encode_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): encode_json(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise QerlError(f"optimizer param group value {obj!r} has no JSON form; report this")


def decode_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {TUPLE_TAG}:
            return tuple(decode_json(v) for v in obj[TUPLE_TAG])
        return {k: decode_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_json(v) for v in obj]
    return obj
