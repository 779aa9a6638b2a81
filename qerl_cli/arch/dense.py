"""The dense decoders qerl runs: Llama (and what ships as Llama: SmolLM2, Llama 3.x), Mistral, Qwen2/2.5, Qwen3.

They share one layer layout (pre-norm attention and a SiLU-gated MLP, transformers' names); they differ in a bias on
q/k/v (Qwen2), per-head q/k norms (Qwen3) and whether the builtin rollout engine runs them (Mistral: its sliding
window is not reproduced there; vLLM runs it, and its head is plain).
"""

from __future__ import annotations

from qerl_cli.arch.spec import ArchSpec, Projections

# transformers' names, which checkpoints, peft and vLLM use for every built-in architecture
PROJECTIONS = Projections(q="q_proj", k="k_proj", v="v_proj", o="o_proj",
                          gate="gate_proj", up="up_proj", down="down_proj")

LLAMA = ArchSpec("llama", "dense", PROJECTIONS, gated_mlps=("LlamaMLP",))
MISTRAL = ArchSpec("mistral", "dense", PROJECTIONS, engine=False, gated_mlps=("MistralMLP",))
QWEN2 = ArchSpec("qwen2", "dense", PROJECTIONS, qkv_bias=True, gated_mlps=("Qwen2MLP",))
QWEN3 = ArchSpec("qwen3", "dense", PROJECTIONS, qk_norm=("q_norm", "k_norm"), gated_mlps=("Qwen3MLP",))

SPECS = (LLAMA, MISTRAL, QWEN2, QWEN3)
