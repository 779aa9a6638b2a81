"""Write and read quantized checkpoints in the formats vLLM and transformers load unchanged.

compressed-tensors formats (nvfp4, mxfp4, int4, int8, fp8): tensors named as compressed-tensors names them,
`quantization_config` written by compressed-tensors' own `ModelCompressor.update_config`.
nf4: bitsandbytes' serialisation (weight, weight.absmax, weight.quant_map, weight.quant_state...).
bf16: a plain checkpoint. `qerl_quant.json` beside them records qerl's own metadata.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from qerl_cli.arch import Projections, layout_of
from qerl_cli.errors import QerlError
from qerl_cli.formats import WeightFormat, dequantize, detect
from qerl_cli.qlinear import QuantLinear

QERL_META = "qerl_quant.json"
SHARD_BYTES = 4 * 2**30


def matches(name: str, patterns: list[str]) -> bool:
    """compressed-tensors style: exact name, `re:` regex, glob, or a trailing name component."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p):
            return True
    return False


def check_patterns(patterns: list[str], flag: str = "--ignore") -> None:
    """Refuse an `re:` pattern that is not a regular expression, in one line naming it, before any model loads."""
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as exc:
                raise QerlError(f"{flag} {p!r} is not a valid regular expression ({exc}): fix the pattern (after "
                                r"re: comes a Python regular expression, e.g. 're:.*mlp\.experts\..*')") from exc


def target_linears(model: nn.Module, ignore: list[str]) -> tuple[dict[str, nn.Linear], list[str]]:
    """The Linear layers to quantize, and the names of Linear layers left unquantized."""
    targets: dict[str, nn.Linear] = {}
    skipped: list[str] = []
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if matches(name, ignore) or (tied and name == "lm_head"):
            skipped.append(name)
        else:
            targets[name] = m
    return targets, skipped


def fused_global_scales(targets: dict[str, nn.Linear],
                        projections: Projections | None = None) -> dict[str, torch.Tensor]:
    """NVFP4 global scale per layer, shared (max amax) within each group the architecture fuses (q/k/v, gate/up):
    vLLM runs a fused group as one GEMM, which reads one global scale. ``projections``: the architecture's
    (``arch.layout_of(model).projections``); default the dense Llama/Qwen names."""
    from qerl_cli.arch.registry import DEFAULT_PROJECTIONS
    from qerl_cli.formats import nvfp4_global_scale

    projections = projections or DEFAULT_PROJECTIONS
    amax = {n: m.weight.detach().float().abs().max() for n, m in targets.items()}
    scales: dict[str, torch.Tensor] = {}
    for name in targets:
        parent, _, leaf = name.rpartition(".")
        group = projections.fused_group(leaf)
        members = [f"{parent}.{g}" if parent else g for g in group if (f"{parent}.{g}" if parent else g) in targets]
        scales[name] = nvfp4_global_scale(max(amax[m] for m in members))
    return scales


def save_tensors(state: dict[str, torch.Tensor], out_dir: Path) -> list[str]:
    """Write safetensors shards (and an index when there is more than one); returns file names."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return names


def write_config(model: nn.Module, out_dir: Path, fmt: WeightFormat, ignore: list[str],
                 group_size: int | None, dtype: torch.dtype) -> None:
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = str(dtype).removeprefix("torch.")
    cfg.save_pretrained(str(out_dir))
    fmt.write_quantization_config(out_dir, ignore, group_size, dtype)


# ---- reading -------------------------------------------------------------------------------------
def verify_files(directory: Path, expected: dict[str, str]) -> None:
    """Check each weight file against the sha256 the manifest recorded when it was written.

    A file corrupted in place at the same size loads without any error from safetensors, so the hash is
    the only way to notice it."""
    from qerl_cli.manifest import sha256_file

    if not expected:
        raise QerlError(f"no sha256 recorded for the weight files of {directory}: run `qerl quantize` again")
    for name, digest in sorted(expected.items()):
        f = directory / name
        if not f.is_file():
            raise QerlError(f"{f} is missing though the manifest lists it: run `qerl quantize` again")
        if sha256_file(f) != digest:
            raise QerlError(f"{f} does not match the sha256 the manifest recorded for it (corrupted or replaced "
                            "since it was written): run `qerl quantize` again")


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise QerlError(f"{directory} has no .safetensors files: run `qerl quantize` again")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    out[k] = sf.get_tensor(k)
        except Exception as exc:
            raise QerlError(f"{f} is unreadable or truncated ({exc}): run `qerl quantize` again") from exc
    return out


def detect_format(config: dict[str, Any]) -> tuple[str, int | None, str | None]:
    """(format name, group size, activation quantization) of a checkpoint's config.json."""
    fmt, gs, act_quant = detect(config)
    return fmt.name, gs, act_quant


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def load_quantized(directory: Path, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                   expected_sha256: dict[str, str] | None = None):  # noqa: ANN201
    """Build the model with `QuantLinear` layers holding the packed tensors of a qerl checkpoint.

    `expected_sha256` (file name -> digest, as the manifest records them) verifies the files first."""
    from transformers import AutoModelForCausalLM

    from qerl_cli.model_config import read_config_dict, read_model_config

    if expected_sha256 is not None:
        verify_files(directory, expected_sha256)

    spec, group_size, act_quant = detect(read_config_dict(directory))
    fmt = spec.name
    config = read_model_config(directory)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # the checkpoint's names as the in-memory model has them (Mixtral's block_sparse_moe / w1 w3 w2: its spec)
    memory = layout_of(config).memory_name
    state = {memory(k): v for k, v in read_tensors(directory).items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)

    experts = _adopt_experts(model, config, state, spec, dtype, device, group_size, act_quant)
    quantized = spec.quantized_layers(state)
    for name in sorted(quantized):
        linear = model.get_submodule(name)
        n, k = linear.out_features, linear.in_features
        tensors = spec.pop_layer_tensors(name, state)
        bias = state.pop(f"{name}.bias", None)
        ql = QuantLinear(k, n, fmt, {kk: v.to(device) for kk, v in tensors.items()}, dtype, group_size,
                         bias.to(device) if bias is not None else None, act_quant)
        # No kernels off CUDA: dequantize each frozen weight once rather than on every forward
        ql.cache_dequantized = torch.device(device).type == "cpu"
        _set_module(model, name, ql)

    missing, unexpected = model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                                                 for k, v in state.items()}, strict=False, assign=True)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight") and m.rsplit(".", 1)[0] not in quantized
               and m.rsplit(".", 1)[0] not in experts]
    if unexpected or missing:
        raise QerlError(
            f"checkpoint {directory} does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]}): "
            "run `qerl quantize` again"
        )
    if tied:
        model.tie_weights()
    _materialize_meta_buffers(model, config, device)
    model.to(device)
    model.eval()
    model.qerl_format = fmt
    return model


def _adopt_experts(model: nn.Module, config: Any, state: dict[str, torch.Tensor], spec: WeightFormat,
                   dtype: torch.dtype, device: str | torch.device, group_size: int | None,
                   act_quant: str | None) -> set[str]:
    """A MoE model's sparse layers become qerl's (``moe.MoeBlock``), their experts taken out of ``state``; the
    names of the experts modules (their tensors are in place, not missing)."""
    from qerl_cli import moe

    if not moe.is_moe_config(config):
        return set()

    def make(name: str, block: nn.Module) -> nn.Module:
        experts = moe.experts_from_checkpoint(state, f"{name}.experts", config, spec, dtype, group_size, act_quant)
        experts.cache_dequantized = torch.device(device).type == "cpu"  # as QuantLinear on CPU
        return experts

    return set(moe.adopt(model, make))


def _materialize_meta_buffers(model: nn.Module, config: Any, device: str | torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in the file: rebuild those modules for real."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            try:
                with torch.device(device):
                    fresh = type(module)(config=config)
            except TypeError as exc:
                raise QerlError(f"cannot rebuild {name} ({type(module).__name__}) after loading: {exc}") from exc
            _set_module(model, name, fresh)


def dequantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full-precision weights of every QuantLinear (for tests and reports)."""
    return {f"{n}.weight": dequantize(m.quantized_weight, torch.float32) for n, m in model.named_modules()
            if isinstance(m, QuantLinear)}
