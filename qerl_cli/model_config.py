"""A model's `config.json` as untrusted input: every number in it is checked before anything is built from it.

transformers builds what a config says without asking whether it is sane: a billion layers or experts hang the
process (a per-layer list is built before any weight), a negative or zero size or a string fails deep inside
torch, and NaN flows into the model. Every stage that reads a model's config (quantize, train, eval, the benches)
reads it here, so the one line naming the field comes before any allocation.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.manifest import read_regular_text

CONFIG_NAME = "config.json"

# Whole-number fields: (smallest, largest). The largest are far above any released model (hidden 16384, 126
# layers, 128 heads, 512 experts, a 262144-token vocabulary) and far below what would hang or exhaust a machine.
SIZES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (0, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "max_position_embeddings": (1, 1 << 24),
    "num_experts": (0, 4096),
    "num_local_experts": (0, 4096),
    "n_routed_experts": (0, 4096),
    "num_experts_per_tok": (1, 4096),
    "decoder_sparse_step": (1, 1024),
    "sliding_window": (1, 1 << 24),
}
# Real-valued fields: (lowest, highest, whether the lowest itself is allowed).
REALS: dict[str, tuple[float, float, bool]] = {
    "rms_norm_eps": (0.0, 1.0, False),
    "layer_norm_eps": (0.0, 1.0, False),
    "rope_theta": (0.0, 1e12, False),
    "initializer_range": (0.0, 1e3, True),
    "attention_dropout": (0.0, 1.0, True),
}
# Weights a config may describe: past this many, no machine holds the model, and building it only ends in an
# allocation failure (10 trillion parameters; the largest released models have about one).
MAX_PARAMETERS = 10**13
NESTED = ("text_config",)  # a multimodal config keeps its decoder's numbers here


def _fix(where: str) -> str:
    return f"fix {where} or use another model"


def _not_finite(value: Any, path: str) -> str | None:
    """The first non-finite number anywhere in ``value`` (JSON allows NaN and Infinity in Python's reader)."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _not_finite(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _not_finite(v, f"{path}[{i}]")
            if found:
                return found
    return None


def _size(cfg: Mapping[str, Any], name: str, where: str) -> int | None:
    value = cfg.get(name)
    if value is None:
        return None
    lo, hi = SIZES[name]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise QerlError(f"{where}: {name} is {value!r}, not a whole number from {lo} to {hi}: {_fix(where)}")
    return value


def check_config_dict(cfg: Any, where: str) -> None:
    """Refuse a model config (the dict of its config.json) whose numbers no model can have, in one line naming the
    field and ``where`` (the file)."""
    if not isinstance(cfg, Mapping):
        raise QerlError(f"{where} holds {type(cfg).__name__}, not a JSON object: {_fix(where)}")
    bad = _not_finite(cfg, "")
    if bad:
        raise QerlError(f"{where}: {bad} is not a finite number: {_fix(where)}")
    for name in NESTED:
        if isinstance(cfg.get(name), Mapping):
            check_config_dict(cfg[name], f"{where} ({name})")
    sizes = {name: _size(cfg, name, where) for name in SIZES}
    for name, (lo, hi, closed) in REALS.items():
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value > hi or value < lo \
                or (value == lo and not closed):
            low = f"{'from' if closed else 'above'} {lo:g}"
            raise QerlError(f"{where}: {name} is {value!r}, not a number {low} up to {hi:g}: {_fix(where)}")
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    hidden = sizes["hidden_size"]
    if heads and kv and heads % kv:
        raise QerlError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}: "
                        f"{_fix(where)}")
    if heads and hidden and sizes["head_dim"] is None and hidden % heads:
        raise QerlError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and no "
                        f"head_dim is given): {_fix(where)}")
    experts = next((sizes[n] for n in ("num_experts", "num_local_experts", "n_routed_experts") if sizes[n]), 0)
    top_k = sizes["num_experts_per_tok"]
    if experts and top_k and top_k > experts:
        raise QerlError(f"{where}: num_experts_per_tok {top_k} is above the {experts} experts per layer: "
                        f"{_fix(where)}")
    params = _parameters(sizes, experts)
    if params > MAX_PARAMETERS:
        raise QerlError(f"{where} describes about {params:.2g} parameters, more than any machine holds "
                        f"(the limit is {MAX_PARAMETERS:.0e}): {_fix(where)}")


def _parameters(sizes: dict[str, int | None], experts: int) -> int:
    """The weights a config describes, roughly (attention, MLP or every expert, embeddings and head)."""
    hidden = sizes["hidden_size"] or 0
    heads = sizes["num_attention_heads"] or 1
    head_dim = sizes["head_dim"] or hidden // heads
    kv = sizes["num_key_value_heads"] or heads
    inter = (sizes["moe_intermediate_size"] if experts else None) or sizes["intermediate_size"] or 0
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = 3 * hidden * inter * max(1, experts)
    return (sizes["num_hidden_layers"] or 0) * (attention + mlp) + 2 * (sizes["vocab_size"] or 0) * hidden


def read_config_dict(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A model directory's config.json as a dict, checked (:func:`check_config_dict`); a FIFO or a damaged file is
    one line."""
    path = Path(directory) / CONFIG_NAME
    try:
        cfg = json.loads(read_regular_text(path))
    except FileNotFoundError as exc:
        raise QerlError(f"{Path(directory)} has no {CONFIG_NAME}: give a Hugging Face model directory") from exc
    except (ValueError, RecursionError) as exc:
        raise QerlError(f"{path} is not valid JSON ({type(exc).__name__}): {_fix(str(path))}") from exc
    check_config_dict(cfg, str(path))
    return cfg


def read_model_config(directory: str | os.PathLike[str]) -> Any:
    """A model directory's transformers config, built only after its numbers passed :func:`read_config_dict`."""
    from transformers import AutoConfig

    read_config_dict(directory)
    try:
        return AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise QerlError(f"{Path(directory) / CONFIG_NAME} is not a config transformers reads "
                        f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): "
                        f"{_fix(str(Path(directory) / CONFIG_NAME))}") from exc
