"""Mixtral: Llama's attention (no bias, no q/k norms) with every MLP a sparse block of a router (``gate``, weight
``[E, H]``) and stacked experts (``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]``), as
transformers 5 lays out ``MixtralForCausalLM``. Its loader fuses the original ``block_sparse_moe.experts.E.w1/w3/w2``
into those stacks; qerl writes and reads its checkpoints under those original names (``MoeSpec.disk_*``), which
transformers and vLLM read. The router always renormalises its top-k probabilities (there is no ``norm_topk_prob``
switch), and the expert size is the config's plain ``intermediate_size``. qerl_cli/moe.py computes the block as it
does Qwen3-MoE's (docs/moe.md, "Mixtral").

A Mixtral config may set ``sliding_window`` (Mistral's), which the builtin engine does not reproduce: it refuses such
a config and runs the rest (Mixtral 8x7B ships with none; an upcycled Llama has none).
"""

from __future__ import annotations

from qerl_cli.arch.dense import PROJECTIONS
from qerl_cli.arch.spec import ArchSpec, MoeSpec

MIXTRAL = ArchSpec(
    "mixtral", "mixtral", PROJECTIONS, sliding_window_key="sliding_window",
    moe=MoeSpec(router="gate", experts="experts", gate_up="gate_up_proj", down="down_proj",
                num_experts_key="num_local_experts", top_k_key="num_experts_per_tok",
                intermediate_key="intermediate_size", norm_topk_key=None,
                # Mixtral's own checkpoints (and transformers' save_pretrained): vLLM's Mixtral loader reads these
                disk_block="block_sparse_moe", disk_parts=("w1", "w3", "w2")),
)

SPECS = (MIXTRAL,)
