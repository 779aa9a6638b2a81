"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, no bias) with every MLP a sparse block of a router (``gate``)
and stacked experts (``experts.gate_up_proj`` / ``experts.down_proj``); qerl_cli/moe.py computes it (docs/moe.md)."""

from __future__ import annotations

from qerl_cli.arch.dense import PROJECTIONS
from qerl_cli.arch.spec import ArchSpec, MoeSpec

QWEN3_MOE = ArchSpec(
    "qwen3_moe", "qwen3_moe", PROJECTIONS, qk_norm=("q_norm", "k_norm"),
    moe=MoeSpec(router="gate", experts="experts", gate_up="gate_up_proj", down="down_proj",
                num_experts_key="num_experts", top_k_key="num_experts_per_tok",
                intermediate_key="moe_intermediate_size"),
)

SPECS = (QWEN3_MOE,)
