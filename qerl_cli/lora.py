"""LoRA through peft, with qerl's own layer classes registered for its bases.

`QuantLoraLinear` wraps a `QuantLinear` (never merged into the packed 4-bit bytes: merging is refused) and
`DenseLoraLinear` a plain ``nn.Linear`` (peft's own LoRA Linear otherwise: merging, DoRA and the other variants
stay peft's). Both run the common case (one active adapter, no live dropout) through the training LoRA path of
`qerl_cli.lora_linear` (one autograd node, 16-bit tensor-core GEMMs, cached 16-bit shadows of the adapter); the
rest through the general forward. The adapter weights stay in fp32 (the master copy), so bf16/fp16 training
updates fp32 parameters. Parameter names are peft's, so adapters save and load in the standard peft format
(loadable by peft and by vLLM's LoRA loader).

Mixture-of-experts layers (`qerl_cli.moe.MoeExperts`): the MLP targets (gate/up/down) become peft's parameter
targets `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, and `ParamWrapper` (peft's own class for LoRA on a
stacked expert parameter, computing inside qerl's grouped experts instead of on a dense weight) holds the factors
exactly as peft lays them out on transformers' fused experts, so the saved adapter is the one peft makes there.
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
from peft.tuners.lora.layer import ParamWrapper as PeftParamWrapper
from torch import nn

from qerl_cli.arch import DEFAULT_LORA_TARGETS, find_spec, layout_of
from qerl_cli.errors import QerlError
from qerl_cli.lora_linear import FastLoraForward
from qerl_cli.manifest import read_regular_text
from qerl_cli.moe import CHECKPOINT_PARTS, PROJECTIONS, LoraFactors, MoeExperts
from qerl_cli.qlinear import QuantLinear

# the module targets that put a LoRA on a stacked expert projection: its own name or a per-expert linear it is
# written as (gate and up are one fused projection)
EXPERT_TARGETS = {p: (*parts, p) for p, parts in CHECKPOINT_PARTS.items()}


def _move_adapter(layer: nn.Module, adapter_name: str, target: torch.device) -> None:
    """Move one adapter's factors to `target` (device only: the fp32 master copy keeps its dtype)."""
    for layer_name in layer.adapter_layer_names:
        factors = getattr(layer, layer_name)
        if adapter_name in factors:
            factors[adapter_name].to(target)


def _refuse_merge(what: str) -> None:
    raise QerlError(f"LoRA cannot be merged into packed quantized {what}; keep the adapter separate")


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
        if target is not None:
            _move_adapter(self, adapter_name, target)

    def merge(self, *args: Any, **kwargs: Any) -> None:
        _refuse_merge("weights")

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


class ParamWrapper(PeftParamWrapper):
    """peft's LoRA on one stacked projection of qerl's `MoeExperts` (``gate_up_proj`` or ``down_proj``).

    The factors are peft's for a 3-D expert parameter: ``lora_A`` [r*E, K] (expert e's rows e*r..e*r+r-1) and
    ``lora_B`` [N, r*E] (expert e's columns e, E+e, 2E+e, ...), kept in fp32; the forward hands them, as views
    [E, r, K] and [E, N, r], to the experts' grouped computation instead of adding B@A to a dense weight (there is
    none). The class keeps peft's name: peft recognises the wrappers it nests around one module (one per targeted
    parameter, the first-registered innermost) by that name."""

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        experts = self.get_base_layer()
        e, n, k = experts.projection_shape(self.parameter_name)
        self.num_experts = e
        self._param_ndim = 3
        return n, k  # peft reads a 3-D parameter as (experts, dim 1, dim 2) and swaps them into (in K, out N)

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: torch.device | None = None) -> None:
        # the fp32 master copy moves, never to the packed dtype
        _move_adapter(self, adapter_name, device or self.get_param().device)

    def merge(self, *args: Any, **kwargs: Any) -> None:
        _refuse_merge("experts")

    def unmerge(self) -> None:
        return None

    def factors(self) -> dict[str, LoraFactors]:
        """The active adapter of this wrapper and of the wrappers it nests, per projection."""
        out: dict[str, LoraFactors] = {}
        m: nn.Module = self
        while isinstance(m, ParamWrapper):
            names = [] if m.disable_adapters else [a for a in m.active_adapters if a in m.lora_A]
            if len(names) > 1:
                raise QerlError("qerl's experts run one active LoRA adapter at a time")
            if names:
                a, b, e = m.lora_A[names[0]].weight, m.lora_B[names[0]].weight, m.num_experts
                out[m.parameter_name] = LoraFactors(a.view(e, -1, a.shape[1]),
                                                    b.view(b.shape[0], -1, e).permute(2, 0, 1),
                                                    float(m.scaling[names[0]]))
            m = m.base_layer
        return out

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.get_base_layer()(hidden, top_k_index, top_k_weights, lora=self.factors())


CUSTOM_LAYERS[MoeExperts] = ParamWrapper


def expert_parameters(model: nn.Module, targets: list[str] | tuple[str, ...]) -> list[str]:
    """peft ``target_parameters`` for the MLP ``targets`` of a model with qerl experts (empty for a dense model)."""
    if not any(isinstance(m, MoeExperts) for m in model.modules()):
        return []
    return [f"mlp.experts.{p}" for p in PROJECTIONS if any(t in EXPERT_TARGETS[p] for t in targets)]


def per_expert_adapter(model: nn.Module, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """An adapter's stacked expert factors (peft-named ``tensors`` of ``model``) as one LoRA per expert and checkpoint
    linear, ``<layer>.mlp.experts.<e>.{gate,up,down}_proj.lora_A|B.weight``: the layout of adapters trained on
    per-expert modules, which vLLM's fused-MoE LoRA reads. Exact: expert e's gate and up share its A, each takes its
    rows of B, same rank and scaling. Returns (tensors, the module names now targeted)."""
    out = dict(tensors)
    targets: set[str] = set()
    # the checkpoint's names (Mixtral's block_sparse_moe / w1 w3 w2): what vLLM's modules are called
    disk = layout_of(model).disk_name
    for name, m in model.named_modules():
        if not isinstance(m, ParamWrapper) or f"{name}.lora_A.weight" not in out:
            continue
        a, b = out.pop(f"{name}.lora_A.weight"), out.pop(f"{name}.lora_B.weight")
        e = m.num_experts
        a, b = a.view(e, -1, a.shape[1]), b.view(b.shape[0], -1, e).permute(2, 0, 1)
        prefix = name
        while prefix.endswith(".base_layer"):
            prefix = prefix.removesuffix(".base_layer")
        parts = CHECKPOINT_PARTS[m.parameter_name]
        rows = b.shape[1] // len(parts)
        for i in range(e):
            for j, part in enumerate(parts):
                module = disk(f"{prefix}.{i}.{part}")
                out[f"{module}.lora_A.weight"] = a[i].clone()
                out[f"{module}.lora_B.weight"] = b[i, j * rows:(j + 1) * rows].clone()
                targets.add(module.rpartition(".")[2])
    return out, targets


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under their ``model.state_dict()`` names, without calling ``state_dict()``.

    A full ``state_dict()`` hands every repacked quantized weight back in checkpoint order, a transient copy of the
    whole base on the GPU (31 GiB at 72B): what peft's save and state-dict helpers do unless given this.
    """
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def arch_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """``targets`` in the model's own projection names: lora_targets are written in the built-in architectures'
    names (the default, run configs, the CLI), which an architecture that names its projections otherwise maps by
    role (its q for q_proj, ...); any other name is a module name of its own and stays."""
    spec = find_spec(model)
    if spec is None:
        return targets
    own = dict(zip(DEFAULT_LORA_TARGETS, spec.projections.names, strict=True))
    return [own.get(t, t) for t in targets]


def make_lora_config(rank: int = 32, alpha: float | None = None, targets: list[str] | tuple[str, ...] | None = None,
                     dropout: float = 0.0) -> LoraConfig:
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                     target_modules=list(targets or DEFAULT_LORA_TARGETS), lora_dropout=dropout, bias="none",
                     task_type="CAUSAL_LM")
    cfg._register_custom_module(CUSTOM_LAYERS)
    return cfg


def attach_lora(model: nn.Module, config: LoraConfig, seed: int | None = None) -> PeftModel:
    """Wrap `model` with fresh adapters; only the adapters are trainable afterwards."""
    for p in model.parameters():
        p.requires_grad_(False)
    targets = arch_targets(model, list(config.target_modules or ()))
    if set(targets) != set(config.target_modules or ()):
        config.target_modules = set(targets)
    experts = expert_parameters(model, targets)
    if experts:
        if config.lora_dropout:
            raise QerlError("LoRA on mixture-of-experts layers takes no dropout (peft's parameter LoRA cannot apply "
                            "it): use --lora-dropout 0")
        # named as parameters, the MLP targets keep the rank asked for (peft would otherwise map gate and up to the
        # fused parameter at twice the rank, its conversion of transformers v4 adapters)
        mlp = {t for names in EXPERT_TARGETS.values() for t in names}
        config.target_modules = [t for t in targets if t not in mlp] or None
        config.target_parameters = experts
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
    params = json.loads(read_regular_text(adapter_dir / "adapter_config.json")).get("target_parameters") or []
    with safe_open(str(files[0]), framework="pt") as f:
        for key in f.keys():
            # base_model.model.<module>.lora_A.weight (a parameter target: <module>[.base_layer...].lora_A.weight)
            name = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
            depth = 0
            while name.endswith(".base_layer") and name not in modules:
                name, depth = name.removesuffix(".base_layer"), depth + 1
            mod = modules.get(name)
            if mod is None:
                raise QerlError(f"adapter {adapter_dir} targets {name}, which this base model does not have")
            shape = f.get_slice(key).get_shape()
            in_f, out_f = _features(mod, params, depth)
            if (".lora_A." in key and shape[1] != in_f) or (".lora_B." in key and shape[0] != out_f):
                raise QerlError(f"adapter {adapter_dir} was made for another base model: {key} has shape {shape}, "
                                f"the base layer is {in_f}->{out_f}")


def _features(mod: nn.Module, target_parameters: list[str], depth: int) -> tuple[int | None, int | None]:
    """(in, out) features of a module an adapter key names; for experts, of the projection of the wrapper ``depth``
    levels in (peft nests one wrapper per targeted parameter, the first-registered innermost)."""
    if not isinstance(mod, MoeExperts):
        return getattr(mod, "in_features", None), getattr(mod, "out_features", None)
    targeted = [p for p in PROJECTIONS if any(t.endswith(p) for t in target_parameters)]
    if depth >= len(targeted):
        return None, None
    _, n, k = mod.projection_shape(targeted[len(targeted) - 1 - depth])
    return k, n


def adapter_hash(adapter_dir: Path) -> str:
    from qerl_cli.manifest import sha256_file

    return sha256_file(adapter_dir / "adapter_model.safetensors")


def adapter_summary(adapter_dir: Path) -> dict[str, Any]:
    cfg = json.loads(read_regular_text(adapter_dir / "adapter_config.json"))
    return {"r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"), "target_modules": cfg.get("target_modules"),
            "target_parameters": cfg.get("target_parameters"), "sha256": adapter_hash(adapter_dir)}
