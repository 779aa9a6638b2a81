"""LoRA through peft, with qerl's own layer classes registered for its bases.

`QuantLoraLinear` wraps a `QuantLinear` (never merged into the packed 4-bit bytes: merging is refused) and
`DenseLoraLinear` a plain ``nn.Linear`` (peft's own LoRA Linear otherwise: merging, DoRA and the other variants
stay peft's). Both run the common case (one active adapter, no live dropout) through the training LoRA path of
`qerl_cli.lora_linear` (one autograd node, 16-bit tensor-core GEMMs, cached 16-bit shadows of the adapter); the
rest through the general forward. The adapter weights stay in fp32 (the master copy), so bf16/fp16 training
updates fp32 parameters. Parameter names are peft's, so adapters save and load in the standard peft format
(loadable by peft and by vLLM's LoRA loader).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.lora_linear import FastLoraForward
from qerl_cli.qlinear import QuantLinear

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class QuantLoraLinear(FastLoraForward, nn.Module, LoraLayer):
    """peft LoRA layer over a `QuantLinear` (never merged into the packed weights)."""

    adapter_layer_names = ("lora_A", "lora_B")

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs: Any) -> None:
        super().__init__()
        LoraLayer.__init__(self, base_layer, **kwargs)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        for name in (adapter_name,):
            self.lora_A[name].float()
            self.lora_B[name].float()

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: torch.device | None = None) -> None:
        # keep the fp32 master copy: move to the base layer's device only, never to its dtype
        base = self.get_base_layer()
        buf = next(iter(base.buffers()), None)
        target = device or (buf.device if buf is not None else None)
        if target is None:
            return
        for layer_name in self.adapter_layer_names:
            layer = getattr(self, layer_name)
            if adapter_name in layer:
                layer[adapter_name].to(target)

    def merge(self, *args: Any, **kwargs: Any) -> None:
        raise QerlError("LoRA cannot be merged into packed quantized weights; keep the adapter separate")

    def unmerge(self) -> None:  # nothing is ever merged
        return None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = self.fast_lora_forward(x)
        return y if y is not None else self.general_forward(x)

    def general_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Any adapter state (several adapters, live dropout, disabled): the base, then each adapter in x's dtype."""
        result = self.base_layer(x)
        if self.disable_adapters:
            return result
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            h = F.linear(self.lora_dropout[name](x), a.to(x.dtype))
            result = result + F.linear(h, b.to(x.dtype)) * self.scaling[name]
        return result

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


class _ExactLinearType(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return type(obj) is nn.Linear


class PlainLinear(metaclass=_ExactLinearType):
    """peft's custom-module key for an ``nn.Linear`` itself: ``isinstance(m, PlainLinear)`` is false for its
    subclasses (bitsandbytes' Linear4bit/Linear8bitLt and other quantized linears), which keep peft's own layers."""


class DenseLoraLinear(FastLoraForward, PeftLoraLinear):
    """peft's LoRA Linear over a plain ``nn.Linear``, with the training LoRA path for the common case."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = None if args or kwargs else self.fast_lora_forward(x)
        return y if y is not None else self.general_forward(x, *args, **kwargs)

    def general_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """peft's own forward (every adapter state and variant peft supports)."""
        return super().forward(x, *args, **kwargs)


CUSTOM_LAYERS: dict[type, type] = {QuantLinear: QuantLoraLinear, PlainLinear: DenseLoraLinear}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under their ``model.state_dict()`` names, without calling ``state_dict()``.

    A full ``state_dict()`` hands every repacked quantized weight back in checkpoint order, a transient copy of the
    whole base on the GPU (31 GiB at 72B): what peft's save and state-dict helpers do unless given this.
    """
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def make_lora_config(rank: int = 32, alpha: float | None = None, targets: list[str] | tuple[str, ...] | None = None,
                     dropout: float = 0.0) -> LoraConfig:
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                     target_modules=list(targets or DEFAULT_TARGETS), lora_dropout=dropout, bias="none",
                     task_type="CAUSAL_LM")
    cfg._register_custom_module(CUSTOM_LAYERS)
    return cfg


def attach_lora(model: nn.Module, config: LoraConfig, seed: int | None = None) -> PeftModel:
    """Wrap `model` with fresh adapters; only the adapters are trainable afterwards."""
    for p in model.parameters():
        p.requires_grad_(False)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as exc:
        raise QerlError(f"cannot attach LoRA ({exc}): check --lora-targets") from exc
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            p.requires_grad_(True)
        elif p.requires_grad:
            raise QerlError(f"non-adapter parameter {name} is trainable; refusing to train the base")
    return peft_model


def load_adapter(model: nn.Module, adapter_dir: Path, trainable: bool = False) -> PeftModel:
    """Load a saved adapter onto `model`, refusing one made for another base model."""
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.is_file():
        raise QerlError(f"{adapter_dir} has no adapter_config.json: not a LoRA checkpoint")
    cfg = LoraConfig.from_pretrained(str(adapter_dir))
    cfg._register_custom_module(CUSTOM_LAYERS)
    check_adapter_matches(model, adapter_dir)
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), config=cfg, is_trainable=trainable)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise QerlError(f"adapter {adapter_dir} does not fit this base model ({str(exc).splitlines()[0]})") from exc
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    return peft_model


def check_adapter_matches(model: nn.Module, adapter_dir: Path) -> None:
    """Every adapter tensor must target an existing module with matching in/out features."""
    from safetensors import safe_open

    files = list(adapter_dir.glob("adapter_model.safetensors"))
    if not files:
        raise QerlError(f"{adapter_dir} has no adapter_model.safetensors")
    modules = dict(model.named_modules())
    with safe_open(str(files[0]), framework="pt") as f:
        for key in f.keys():
            # base_model.model.<module>.lora_A.weight
            name = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
            mod = modules.get(name)
            if mod is None:
                raise QerlError(f"adapter {adapter_dir} targets {name}, which this base model does not have")
            shape = f.get_slice(key).get_shape()
            in_f = getattr(mod, "in_features", None)
            out_f = getattr(mod, "out_features", None)
            if (".lora_A." in key and shape[1] != in_f) or (".lora_B." in key and shape[0] != out_f):
                raise QerlError(f"adapter {adapter_dir} was made for another base model: {key} has shape {shape}, "
                                f"the base layer is {in_f}->{out_f}")


def adapter_hash(adapter_dir: Path) -> str:
    from qerl_cli.manifest import sha256_file

    return sha256_file(adapter_dir / "adapter_model.safetensors")


def adapter_summary(adapter_dir: Path) -> dict[str, Any]:
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    return {"r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"), "target_modules": cfg.get("target_modules"),
            "sha256": adapter_hash(adapter_dir)}
