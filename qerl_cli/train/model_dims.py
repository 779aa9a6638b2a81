"""A decoder's dimensions, from its config: what the memory plan and the step's cost model are computed from.

Shapes only (no weight is built), read through the model's architecture spec (qerl_cli/arch): the seven projections
LoRA may target (under the architecture's names), their adapter and shadow sizes, the KV
bytes per token, what autograd keeps per token and layer, and the FLOPs of a forward and a backward
(multiply-add = 2 FLOPs). Lower than both ``memory_plan.py`` and ``step_cost.py``, which import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qerl_cli.arch import DEFAULT_PROJECTIONS, ArchDims, Projections, layout_of


@dataclass(frozen=True)
class ModelDims(ArchDims):
    """The architecture's sizes (:class:`~qerl_cli.arch.ArchDims`) and its projection names, with the derived counts
    the memory plan and the step's cost model use."""

    projections: Projections = DEFAULT_PROJECTIONS  # the architecture's names, which the LoRA targets use

    @classmethod
    def from_config(cls, cfg: Any) -> ModelDims:
        # a config without a spec is sized as a dense decoder (the plan of a model vLLM runs, a hand-written config)
        spec = layout_of(cfg)
        return cls(**dataclasses.asdict(spec.dims(cfg)), projections=spec.projections)

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token runs through: the top-k experts' together in a mixture of experts."""
        return self.intermediate * (self.top_k or 1)

    @property
    def moe_kept_extra(self) -> int:
        """Per token and sparse layer, in dtype elements: what a training forward of a mixture of experts keeps on
        the GPU beyond what the layer's autograd graph accounts for (with checkpointing: beyond each layer's input).
        Measured, not derived, in both modes: the Qwen3-30B-A3B step at micro-batch 16 with checkpointing peaked
        30 GiB above the layer inputs (H100, 2026-11-27), and at micro-batch 4 without it 7.2 GiB above the plan's
        activations (H200, 2026-11-29: 31.4 KB per token and layer against 32 KB for this count), each exactly one
        [tokens * k, hidden] tensor per sparse layer, while the CPU's per-expert path keeps nothing there; which
        tensor of the grouped path it is has not been found, so the plan counts it rather than run out of memory."""
        return self.top_k * self.hidden if self.experts else 0

    @property
    def moe_token_extra(self) -> int:
        """Per token and sparse layer, besides the MLP's width: the k expert outputs before they are summed and the
        router's logits and fp32 probabilities (in dtype elements, counted as 3 per expert)."""
        return self.top_k * self.hidden + 3 * self.experts if self.experts else 0

    def mlp_copies(self, target: str) -> int:
        """How many of a projection each layer holds: every expert's MLP projection, one of anything else."""
        return self.experts if self.experts and target in self.projections.mlp else 1

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection LoRA may target."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        p = self.projections
        return {p.q: (h, q), p.k: (h, kv), p.v: (h, kv), p.o: (q, h), p.gate: (h, i), p.up: (h, i), p.down: (i, h)}

    def linear_weights(self) -> int:
        """Weights of every decoder linear a token runs through (the frozen GEMMs of a forward: of a mixture of
        experts, its k experts' and the router)."""
        active = {t: self.top_k if self.mlp_copies(t) > 1 else 1 for t in self.linear_shapes()}
        router = self.experts * self.hidden
        return self.layers * (sum(active[t] * i * o for t, (i, o) in self.linear_shapes().items()) + router)

    def lora_params(self, rank: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        if self.experts:  # peft's LoRA on the stacked experts: gate and up are one fused projection
            mlp = self.projections.mlp
            attn = sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes and t not in mlp)
            gate_up = any(t in targets for t in self.projections.gate_up)
            down = self.projections.down in targets
            h, i = self.hidden, self.intermediate
            experts = self.experts * rank * ((h + 2 * i if gate_up else 0) + (i + h if down else 0))
            return self.layers * (attn + experts)
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)

    def shadow_elems(self, rank: int, targets: list[str]) -> int:
        """Elements of the rollout engine's in-dtype LoRA shadows (rollout/fast_layers.py): per projection group
        the concatenated A [sum r, in] and, the group being one fused GEMM, the block-diagonal B [sum out, sum r]."""
        shapes = self.linear_shapes()
        per_layer = 0
        if self.experts:  # the experts' copies are their factors in dtype, [E, r, K] and [E, N, r]
            per_layer = self.lora_params(rank, [t for t in targets if self.mlp_copies(t) > 1]) // self.layers
        for group in self.projections.groups:
            if self.experts and self.mlp_copies(group[0]) > 1:
                continue
            r = rank * sum(1 for t in group if t in targets)
            if r:
                per_layer += r * shapes[group[0]][0] + r * sum(shapes[t][1] for t in group)
        return self.layers * per_layer

    def kv_bytes_per_token(self, elem: int) -> int:
        """A cached token's K and V, and in a mixture of experts the top-k expert ids the engine records beside them
        for routing replay (one byte each up to 256 experts: rollout/routing.py)."""
        routing = self.layers * self.top_k * (1 if self.experts <= 256 else 2) if self.experts else 0
        return 2 * self.layers * self.kv_heads * self.head_dim * elem + routing

    def act_bytes_per_token_layer(self, elem: int) -> int:
        return (11 * self.hidden + 4 * self.active_intermediate + self.moe_token_extra) * elem

    def fp32_input_bytes_per_token_layer(self, rank: int, targets: list[str], elem: int) -> int:
        """What autograd keeps beyond :meth:`act_bytes_per_token_layer` when peft's own LoRA layer runs an
        unquantized ``nn.Linear`` with fp32 adapters: it casts the input to fp32 once per adapted projection
        (q, k and v each keep their own copy), and the fp32 product feeds B. The in-dtype input a group shares
        is then kept by nobody. 0 in fp32, where the cast is the input itself."""
        if elem >= 4:
            return 0
        if self.experts:  # the experts' LoRA runs in qerl's grouped computation, not peft's nn.Linear layer
            targets = [t for t in targets if self.mlp_copies(t) == 1]
        shapes = self.linear_shapes()
        per_target = sum((4 * shapes[t][0] + 4 * rank) for t in targets if t in shapes)
        shared = sum(elem * shapes[g[0]][0] + elem * rank * sum(1 for t in g if t in targets)
                     for g in self.projections.groups if any(t in targets for t in g))
        return max(0, per_target - shared)

    def grad_bytes_per_token_layer(self, elem: int) -> int:
        """Gradients in flight inside one layer's backward (the MLP's three [I] ones, the residual's two [H])."""
        return (3 * self.active_intermediate + 2 * self.hidden + self.moe_token_extra) * elem

    def expert_weights(self) -> int:
        """Of :meth:`linear_weights`: the routed experts' weights a token runs through (k experts per sparse layer,
        their gate, up and down), which the grouped expert kernels compute, not the dense GEMMs; 0 for a dense MLP."""
        if not self.experts:
            return 0
        h, i = self.hidden, self.intermediate
        return self.layers * self.top_k * 3 * h * i

    def active_lora_params(self, rank: int, targets: list[str]) -> tuple[int, int]:
        """(LoRA parameters a token runs through outside the experts, inside its k routed experts): what the FLOPs
        count. :meth:`lora_params` counts every expert's factors (the memory); a token reads only k of the E."""
        total = self.lora_params(rank, targets)
        if not self.experts:
            return total, 0
        experts = self.lora_params(rank, [t for t in targets if self.mlp_copies(t) > 1])
        return total - experts, experts * self.top_k // self.experts

    def touched_experts(self, batch: float) -> float:
        """Distinct experts a layer reads for ``batch`` tokens routed uniformly: ``E * (1 - (1 - k/E)^b)`` (8 of
        Qwen3-30B-A3B's 128 at b = 1, 125.9 at b = 64); the experts' count for a dense model."""
        if not self.experts:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** max(1.0, batch))

    def largest_linear(self) -> int:
        return max(i * o for i, o in self.linear_shapes().values())

    def forward_flops(self, *, tokens: float, attention_pairs: float, loss_tokens: float, lora_rank: int,
                      lora_targets: list[str]) -> dict[str, float]:
        """FLOPs of one forward over ``tokens`` (``attention_pairs`` = sum of n_i (n_i + 1) / 2, causal), split by
        what runs them: the frozen dense linears (the router included), the LoRA factors outside the experts,
        a mixture of experts' k routed experts and their LoRA factors (the grouped expert kernels; only the k
        experts' factors a token is routed to, not all E), attention, and lm_head over the loss tokens (the
        chunked log-probs project only those). The values add up to the whole forward."""
        lora, expert_lora = self.active_lora_params(lora_rank, lora_targets)
        experts = self.expert_weights()
        return {"linear": 2.0 * (self.linear_weights() - experts) * tokens, "lora": 2.0 * lora * tokens,
                "experts": 2.0 * experts * tokens, "expert_lora": 2.0 * expert_lora * tokens,
                "attention": self.layers * 4.0 * self.heads * self.head_dim * attention_pairs,
                "head": 2.0 * self.hidden * self.vocab * loss_tokens}

    def backward_flops(self, forward: dict[str, float]) -> dict[str, float]:
        """The backward of a forward's FLOPs: dx through every frozen linear and expert (no weight gradient), dA, dB
        and dx of the LoRA factors, twice the attention forward, and the log-prob Jacobian rows (another lm_head
        pass over the loss tokens, made in the forward's chunk)."""
        return {"linear": forward["linear"], "lora": 3.0 * forward["lora"], "experts": forward.get("experts", 0.0),
                "expert_lora": 3.0 * forward.get("expert_lora", 0.0), "attention": 2.0 * forward["attention"],
                "head": forward["head"]}


__all__ = ["ModelDims"]
