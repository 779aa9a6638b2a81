"""What qerl needs to know about one model architecture, declared once: :class:`ArchSpec`.

Every layer of qerl that used to decide by ``config.model_type`` or spell a projection's name asks the spec instead
(the registry, ``qerl_cli.arch.spec_for``, finds it), so adding an architecture is one module here, not a hunt through
the engine, the memory plan, the checkpoint writer and the LoRA code (docs/DEVELOPING.md, "How to add an
architecture"). Declarations only: nothing here imports torch or transformers, so every floor of qerl may ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Projections:
    """The module names of a decoder layer's seven linears, by role: attention's q, k, v, o and the gated MLP's gate,
    up, down. The names are the checkpoint's and peft's (``lora_targets``), so they are never renamed on disk."""

    q: str
    k: str
    v: str
    o: str
    gate: str
    up: str
    down: str

    @property
    def names(self) -> tuple[str, ...]:
        """All seven, attention first: the default LoRA targets and what the cost model sizes."""
        return (self.q, self.k, self.v, self.o, self.gate, self.up, self.down)

    @property
    def qkv(self) -> tuple[str, str, str]:
        return (self.q, self.k, self.v)

    @property
    def gate_up(self) -> tuple[str, str]:
        return (self.gate, self.up)

    @property
    def mlp(self) -> tuple[str, str, str]:
        return (self.gate, self.up, self.down)

    @property
    def fused(self) -> tuple[tuple[str, ...], ...]:
        """The groups that read one input and run as one GEMM (the rollout engine's, vLLM's): they share one NVFP4
        global scale when quantized."""
        return (self.qkv, self.gate_up)

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        """Every projection in its group of one shared input: q/k/v, o, gate/up, down."""
        return (self.qkv, (self.o,), self.gate_up, (self.down,))

    def fused_group(self, leaf: str) -> tuple[str, ...]:
        """The fused group ``leaf`` belongs to, or ``(leaf,)`` alone."""
        return next((g for g in self.fused if leaf in g), (leaf,))


@dataclass(frozen=True)
class MoeSpec:
    """A sparse MLP: the block's router and experts attributes, the experts' two stacked parameters (transformers'
    fused names, which peft's ``target_parameters`` targets), and the config keys of its sizes."""

    router: str
    experts: str
    gate_up: str  # [E, 2I, H], gate rows first; on disk per expert as the dense gate and up projections
    down: str  # [E, H, I]; on disk per expert as the dense down projection
    num_experts_key: str
    top_k_key: str
    intermediate_key: str
    # the decoder layer's attribute holding the sparse block in memory (transformers 5's name for every family)
    block: str = "mlp"
    # the names on disk where they differ from the ones in memory (Mixtral's checkpoints, which transformers writes
    # and vLLM loads: ``block_sparse_moe`` for the block, ``w1``/``w3``/``w2`` for an expert's gate/up/down); None:
    # the checkpoint uses the in-memory block name and the dense projections' names (Qwen3-MoE)
    disk_block: str | None = None
    disk_parts: tuple[str, str, str] | None = None  # (gate, up, down)
    # the config key of whether the router renormalises its top-k probabilities to sum to one (Qwen3-MoE's switch);
    # None: it always does (Mixtral has no switch)
    norm_topk_key: str | None = "norm_topk_prob"

    @property
    def projections(self) -> tuple[str, str]:
        return (self.gate_up, self.down)

    def norm_topk(self, config: Any) -> bool:
        """Whether the router's top-k weights are renormalised over the k (transformers' default where the key is
        absent: on)."""
        return True if self.norm_topk_key is None else bool(getattr(config, self.norm_topk_key, True))


@dataclass(frozen=True)
class ArchDims:
    """A decoder's sizes read from its config: what the memory plan and the step's cost model compute from."""

    hidden: int
    intermediate: int  # one MLP's (one expert's, in a mixture of experts)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # 0: a dense MLP
    top_k: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_head: bool = False


@dataclass(frozen=True)
class ArchSpec:
    """One architecture (one transformers ``model_type``) as qerl sees it."""

    model_type: str
    family: str  # the module of qerl_cli/arch/ that declares it, for messages
    projections: Projections
    # the two norms whose outputs feed q/k/v and gate/up: AQN adds its noise to their weights
    aqn_norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")
    # attention's per-head RMSNorms on q and k before RoPE (Qwen3), as (q's, k's) attribute names; None: none
    qk_norm: tuple[str, str] | None = None
    # a bias on q/k/v (Qwen2 always has one); None: as the config's ``attention_bias`` says (Llama's option)
    qkv_bias: bool | None = None
    # logits are exactly lm_head(final hidden state): no soft-capping or scaling, so log-probs may be chunked
    plain_head: bool = True
    # the builtin rollout engine reproduces this architecture's forward (rollout/model_runner.py)
    engine: bool = True
    # transformers' MLP classes whose forward is exactly down(silu(gate(x)) * up(x)): the engine's fast path fuses them
    gated_mlps: tuple[str, ...] = ()
    moe: MoeSpec | None = None
    # the config key that, when set, makes every layer's attention a sliding window (Mixtral's ``sliding_window``);
    # the builtin engine does not reproduce one and refuses such a config. None: the architecture has no such key
    # (Qwen2/3 carry ``sliding_window`` but switch it with ``use_sliding_window`` / ``layer_types``, checked anyway)
    sliding_window_key: str | None = None

    def sliding_window(self, config: Any) -> bool:
        """Whether ``config`` turns on this architecture's all-layer sliding window."""
        return self.sliding_window_key is not None and getattr(config, self.sliding_window_key, None) is not None

    def has_qkv_bias(self, config: Any) -> bool:
        return self.qkv_bias if self.qkv_bias is not None else bool(getattr(config, "attention_bias", False))

    def experts(self, config: Any) -> int:
        """Experts per sparse layer (0: dense; a MoE config with none is run as dense by transformers too)."""
        return int(getattr(config, self.moe.num_experts_key, 0) or 0) if self.moe is not None else 0

    def dims(self, config: Any) -> ArchDims:
        heads = int(config.num_attention_heads)
        experts = self.experts(config)
        moe = self.moe if experts else None
        return ArchDims(
            hidden=int(config.hidden_size),
            intermediate=int(getattr(config, moe.intermediate_key) if moe else config.intermediate_size),
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            vocab=int(config.vocab_size),
            experts=experts,
            top_k=int(getattr(config, moe.top_k_key)) if moe else 0,
            qkv_bias=self.has_qkv_bias(config),
            qk_norm=self.qk_norm is not None,
            tied_head=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def disk_name(self, name: str) -> str:
        """A tensor or module name of qerl's in-memory model as the architecture's checkpoints spell it (the sparse
        block and its per-expert linears renamed where the spec declares disk names; anything else as it is)."""
        return self._rename(name, to_disk=True)

    def memory_name(self, name: str) -> str:
        """The inverse of :meth:`disk_name`: a checkpoint's name as qerl's in-memory model spells it."""
        return self._rename(name, to_disk=False)

    def _rename(self, name: str, to_disk: bool) -> str:
        moe = self.moe
        if moe is None or (moe.disk_block is None and moe.disk_parts is None):
            return name
        p = self.projections
        memory = (moe.block, p.gate, p.up, p.down)
        disk = (moe.disk_block or moe.block, *(moe.disk_parts or memory[1:]))
        (src_block, *src_parts), (dst_block, *dst_parts) = (memory, disk) if to_disk else (disk, memory)
        parts = dict(zip(src_parts, dst_parts, strict=True))
        t = name.split(".")
        # <...>.layers.<i>.<block>[.<experts>.<e>.<part>]...: only a decoder layer's sparse block is renamed
        for i in range(len(t) - 2):
            if t[i] == "layers" and t[i + 1].isdigit() and t[i + 2] == src_block:
                t[i + 2] = dst_block
                j = i + 3
                if j + 2 < len(t) and t[j] == moe.experts and t[j + 1].isdigit() and t[j + 2] in parts:
                    t[j + 2] = parts[t[j + 2]]
        return ".".join(t)

    def expert_parts(self) -> dict[str, tuple[str, ...]]:
        """Each stacked expert parameter -> the per-expert linears it is written as (llm-compressor's and vLLM's
        layout): gate_up as the dense gate and up (gate rows first), down as down."""
        if self.moe is None:
            return {}
        p = self.projections
        return {self.moe.gate_up: p.gate_up, self.moe.down: (p.down,)}


__all__ = ["ArchDims", "ArchSpec", "MoeSpec", "Projections"]
