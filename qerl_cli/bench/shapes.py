"""Randomly initialised models of real architectures, built on the device one layer at a time.

``build_random_model("qwen2.5-7b", "nvfp4", device)`` constructs the model skeleton on the meta device
(no memory), then for each decoder layer draws random bf16 weights on ``device``, quantizes them to
:class:`~qerl_cli.qlinear.QuantLinear` (or keeps the ``nn.Linear`` for bf16) and frees the bf16 copy
before the next layer. The whole model never exists in bf16 unless bf16 is the format asked for, so a
32B model in NVFP4 can be built on one 80 GB GPU without a download.

What stays bf16, as ``qerl quantize`` leaves it: embeddings, ``lm_head`` (ignored by default), norms,
biases, the routers of a mixture of experts. Weights are N(0, 0.02) (the usual initializer range of these
configs), norms 1; q/k/v and gate/up share one NVFP4 global scale, as vLLM's fused GEMMs need and ``qerl quantize``
writes. A mixture-of-experts shape (``experts`` > 0, family ``qwen3_moe``) draws each layer's experts as two stacks
``[E, 2I, H]`` and ``[E, H, I]`` and quantizes them expert by expert into qerl's ``moe.MoeExperts``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qerl_cli.arch import Projections, spec_for
from qerl_cli.errors import QerlError

WEIGHT_STD = 0.02


@dataclass(frozen=True)
class ModelShape:
    """An architecture's size; ``family`` picks the transformers config class (qwen2 | llama)."""

    name: str
    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool
    max_positions: int = 32768
    rope_theta: float = 1_000_000.0
    experts: int = 0  # a mixture of experts: experts per layer (``intermediate`` is one expert's), 0: dense MLP
    top_k: int = 0  # experts per token
    head_size: int | None = None  # where it is not hidden / heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, out N, in K) of one decoder layer's linears, as the model holds them (unfused); of a mixture of
        experts, one expert's projections (``linear_counts`` says how many)."""
        d, kv = self.head_dim, self.kv_heads * self.head_dim
        spec = spec_for(self.family)
        p = spec.projections
        mlp = f"mlp.{spec.moe.experts}" if self.experts and spec.moe is not None else "mlp"
        return [
            (f"self_attn.{p.q}", self.heads * d, self.hidden),
            (f"self_attn.{p.k}", kv, self.hidden),
            (f"self_attn.{p.v}", kv, self.hidden),
            (f"self_attn.{p.o}", self.hidden, self.heads * d),
            (f"{mlp}.{p.gate}", self.intermediate, self.hidden),
            (f"{mlp}.{p.up}", self.intermediate, self.hidden),
            (f"{mlp}.{p.down}", self.hidden, self.intermediate),
        ]

    def linear_counts(self) -> list[tuple[str, int, int, int]]:
        """(name, N, K, copies per layer): every expert holds its own MLP projections."""
        return [(name, n, k, self.experts if self.experts and name.startswith("mlp.") else 1)
                for name, n, k in self.linear_shapes()]

    def linear_params(self) -> int:
        """Weights of every decoder-layer linear (what gets quantized)."""
        return self.layers * sum(c * n * k for _, n, k, c in self.linear_counts())

    def kv_bytes_per_token(self, elem: int = 2) -> int:
        """K and V of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def config(self) -> Any:
        from transformers import AutoConfig

        common = dict(
            hidden_size=self.hidden,
            intermediate_size=self.intermediate * (self.top_k or 1),
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            vocab_size=self.vocab,
            tie_word_embeddings=self.tie_embeddings,
            max_position_embeddings=self.max_positions,
            rms_norm_eps=1e-6,
            initializer_range=WEIGHT_STD,
        )
        moe = spec_for(self.family).moe  # an unknown family is the registry's error
        if self.experts and moe is not None:
            common |= {moe.num_experts_key: self.experts, moe.top_k_key: self.top_k,
                       moe.intermediate_key: self.intermediate, "norm_topk_prob": True}
        # the family is the transformers model_type; Qwen2's attention ignores head_dim (it is hidden / heads there)
        cfg = AutoConfig.for_model(self.family, **common, rope_theta=self.rope_theta, head_dim=self.head_dim,
                                   use_sliding_window=False)
        cfg.eos_token_id = self.vocab - 1
        cfg.architectures = [type(cfg).__name__.removesuffix("Config") + "ForCausalLM"]  # as the models' config.json
        return cfg


# Sizes from the models' own config.json (Qwen2.5 Instruct releases).
SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape("tiny", "llama", 64, 128, 2, 4, 2, 256, False, max_positions=4096, rope_theta=10000.0),
    "qwen2.5-0.5b": ModelShape("qwen2.5-0.5b", "qwen2", 896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", "qwen2", 3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": ModelShape("qwen2.5-14b", "qwen2", 5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-32b": ModelShape("qwen2.5-32b", "qwen2", 5120, 27648, 64, 40, 8, 152064, False),
    "qwen2.5-72b": ModelShape("qwen2.5-72b", "qwen2", 8192, 29568, 80, 64, 8, 152064, False),
    # mixtures of experts: intermediate is one expert's (moe_intermediate_size)
    "tiny-moe": ModelShape("tiny-moe", "qwen3_moe", 64, 32, 2, 4, 2, 256, False, max_positions=4096,
                           rope_theta=10000.0, experts=8, top_k=2, head_size=16),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", "qwen3_moe", 2048, 768, 48, 32, 4, 151936, False,
                                max_positions=40960, experts=128, top_k=8, head_size=128),
}


def get_shape(name: str) -> ModelShape:
    shape = SHAPES.get(name)
    if shape is None:
        raise QerlError(f"unknown model shape {name!r}; choose one of {', '.join(SHAPES)}")
    return shape


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _quantized(linears: dict[str, nn.Linear], fmt: str, dtype: torch.dtype,
               projections: Projections) -> dict[str, nn.Module]:
    """Quantize a layer's freshly drawn linears (nvfp4: one global scale per fused q/k/v and gate/up).

    Off CUDA there are no kernels: each frozen weight is dequantized once and cached, as
    ``checkpoint.load_quantized`` does on CPU."""
    from qerl_cli.formats import get_format

    spec = get_format(fmt)
    if not spec.quantized:
        return dict(linears)
    from qerl_cli.checkpoint import fused_global_scales
    from qerl_cli.qlinear import QuantLinear

    scales = fused_global_scales(linears, projections) if spec.global_scale else {}
    out: dict[str, nn.Module] = {}
    for name, lin in linears.items():
        ql = QuantLinear.from_linear(lin, spec, global_scale=scales.get(name), dtype=dtype)
        ql.cache_dequantized = lin.weight.device.type == "cpu"
        out[name] = ql
    return out


def _materialize_rest(model: nn.Module, config: Any, device: torch.device, dtype: torch.dtype,
                      gen: torch.Generator) -> None:
    """Everything outside the decoder linears: embeddings N(0, 0.02), norms 1, rotary tables rebuilt."""
    for mod_name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            # Non-persistent buffers (rotary inv_freq) are computed in __init__: rebuild the module for real.
            with torch.device(device):
                set_module(model, mod_name, type(module)(config=config))
            continue
        for p_name, p in list(module.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            if isinstance(module, nn.Embedding) or (isinstance(module, nn.Linear) and p_name == "weight"):
                t = torch.empty(p.shape, dtype=dtype, device=device).normal_(0.0, WEIGHT_STD, generator=gen)
            elif p.ndim == 1:  # RMSNorm weight
                t = torch.ones(p.shape, dtype=dtype, device=device)
            else:
                raise QerlError(f"cannot initialise {mod_name}.{p_name} of shape {tuple(p.shape)}")
            setattr(module, p_name, nn.Parameter(t, requires_grad=False))
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise QerlError(f"random model left tensors on the meta device: {left[:3]}")


def _random_experts(model: nn.Module, prefix: str, spec: ModelShape, fmt: str, device: torch.device,
                    dtype: torch.dtype, gen: torch.Generator) -> None:
    """Layer ``prefix``'s sparse MLP as qerl's: a random router and random experts quantized to ``fmt``."""
    from qerl_cli.moe import MoeBlock, quantize_experts

    block = model.get_submodule(f"{prefix}.mlp")
    e, i, h = spec.experts, spec.intermediate, spec.hidden
    gate = block.gate
    gate.weight = nn.Parameter(torch.empty((e, h), dtype=dtype, device=device).normal_(0.0, WEIGHT_STD, generator=gen),
                               requires_grad=False)
    gate_up = torch.empty((e, 2 * i, h), dtype=dtype, device=device).normal_(0.0, WEIGHT_STD, generator=gen)
    down = torch.empty((e, h, i), dtype=dtype, device=device).normal_(0.0, WEIGHT_STD, generator=gen)
    experts = quantize_experts(gate_up, down, fmt, dtype=dtype)
    experts.cache_dequantized = device.type == "cpu"  # as QuantLinear on CPU
    del gate_up, down
    set_module(model, f"{prefix}.mlp", MoeBlock(gate, experts, spec.top_k, bool(model.config.norm_topk_prob)))


def build_random_model(shape: str | ModelShape, fmt: str, device: str | torch.device, *,
                       dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    """A randomly initialised ``*ForCausalLM`` of ``shape`` on ``device`` with its decoder linears in ``fmt``.

    Peak memory: the final model plus one layer's bf16 weights (and the quantizer's temporaries).
    """
    from transformers import AutoModelForCausalLM

    from qerl_cli.formats import FORMATS

    spec = get_shape(shape) if isinstance(shape, str) else shape
    if fmt not in FORMATS:
        raise QerlError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    device = torch.device(device)
    config = spec.config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for i in range(spec.layers):
        prefix = f"model.layers.{i}"
        layer = model.get_submodule(prefix)
        fresh: dict[str, nn.Linear] = {}
        for sub, m in layer.named_modules():
            if not isinstance(m, nn.Linear):
                continue
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=device, dtype=dtype)
            lin.requires_grad_(False)
            lin.weight.normal_(0.0, WEIGHT_STD, generator=gen)
            if lin.bias is not None:
                lin.bias.normal_(0.0, WEIGHT_STD, generator=gen)
            fresh[f"{prefix}.{sub}"] = lin
        for name, module in _quantized(fresh, fmt, dtype, spec_for(config).projections).items():
            set_module(model, name, module)
        del fresh  # the bf16 draws of this layer are garbage now (unless the format is bf16)
        if spec.experts:
            _random_experts(model, prefix, spec, fmt, device, dtype, gen)
    _materialize_rest(model, config, device, dtype, gen)
    model.eval()
    model.qerl_format = fmt
    return model
