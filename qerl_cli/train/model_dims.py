"""A decoder's dimensions, from its config: what the memory plan and the step's cost model are computed from.

Shapes only (no weight is built): the seven projections LoRA may target, their adapter and shadow sizes, the KV
bytes per token, what autograd keeps per token and layer, and the FLOPs of a forward and a backward
(multiply-add = 2 FLOPs). Lower than both ``memory_plan.py`` and ``step_cost.py``, which import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: Any) -> ModelDims:
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        return cls(int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_hidden_layers), heads,
                   int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim, int(cfg.vocab_size))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection LoRA may target."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def linear_weights(self) -> int:
        """Weights of every decoder linear (the frozen GEMMs of a forward)."""
        return self.layers * sum(i * o for i, o in self.linear_shapes().values())

    def lora_params(self, rank: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)

    def shadow_elems(self, rank: int, targets: list[str]) -> int:
        """Elements of the rollout engine's in-dtype LoRA shadows (rollout/fast_layers.py): per projection group
        the concatenated A [sum r, in] and, the group being one fused GEMM, the block-diagonal B [sum out, sum r]."""
        shapes = self.linear_shapes()
        per_layer = 0
        for group in PROJECTION_GROUPS:
            r = rank * sum(1 for t in group if t in targets)
            if r:
                per_layer += r * shapes[group[0]][0] + r * sum(shapes[t][1] for t in group)
        return self.layers * per_layer

    def kv_bytes_per_token(self, elem: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def act_bytes_per_token_layer(self, elem: int) -> int:
        return (11 * self.hidden + 4 * self.intermediate) * elem

    def fp32_input_bytes_per_token_layer(self, rank: int, targets: list[str], elem: int) -> int:
        """What autograd keeps beyond :meth:`act_bytes_per_token_layer` when peft's own LoRA layer runs an
        unquantized ``nn.Linear`` with fp32 adapters: it casts the input to fp32 once per adapted projection
        (q, k and v each keep their own copy), and the fp32 product feeds B. The in-dtype input a group shares
        is then kept by nobody. 0 in fp32, where the cast is the input itself."""
        if elem >= 4:
            return 0
        shapes = self.linear_shapes()
        per_target = sum((4 * shapes[t][0] + 4 * rank) for t in targets if t in shapes)
        shared = sum(elem * shapes[g[0]][0] + elem * rank * sum(1 for t in g if t in targets)
                     for g in PROJECTION_GROUPS if any(t in targets for t in g))
        return max(0, per_target - shared)

    def grad_bytes_per_token_layer(self, elem: int) -> int:
        """Gradients in flight inside one layer's backward (the MLP's three [I] ones, the residual's two [H])."""
        return (3 * self.intermediate + 2 * self.hidden) * elem

    def largest_linear(self) -> int:
        return max(i * o for i, o in self.linear_shapes().values())

    def forward_flops(self, *, tokens: float, attention_pairs: float, loss_tokens: float, lora_rank: int,
                      lora_targets: list[str]) -> dict[str, float]:
        """FLOPs of one forward over ``tokens`` (``attention_pairs`` = sum of n_i (n_i + 1) / 2, causal), split by
        what runs them: the frozen linears, the LoRA factors, attention, and lm_head over the loss tokens (the
        chunked log-probs project only those)."""
        lora = self.lora_params(lora_rank, lora_targets)
        return {"linear": 2.0 * self.linear_weights() * tokens, "lora": 2.0 * lora * tokens,
                "attention": self.layers * 4.0 * self.heads * self.head_dim * attention_pairs,
                "head": 2.0 * self.hidden * self.vocab * loss_tokens}

    def backward_flops(self, forward: dict[str, float]) -> dict[str, float]:
        """The backward of a forward's FLOPs: dx through every frozen linear (no weight gradient), dA, dB and dx
        of the LoRA factors, twice the attention forward, and the log-prob Jacobian rows (another lm_head pass
        over the loss tokens, made in the forward's chunk)."""
        return {"linear": forward["linear"], "lora": 3.0 * forward["lora"], "attention": 2.0 * forward["attention"],
                "head": forward["head"]}


__all__ = ["PROJECTION_GROUPS", "ModelDims"]
