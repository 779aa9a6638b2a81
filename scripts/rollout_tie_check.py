"""Why graph and eager bf16 greedy runs part (tests/test_rollout_cuda.py::test_graphs_follow_lora_toggles_and_bf16).

Same model, prompts and engines as that test, adapters disabled; for each prompt whose greedy tokens differ
between the CUDA-graph engine (batch padded to a bucket) and the eager engine, print the first differing
step and, from a float32 forward of the model on the eager tokens, the logit gap between the two engines'
choices there: a gap at bf16 rounding level is a near-tie that GEMM rounding may flip; a large gap is a
bug. Usage: python3 rollout_tie_check.py (run with QERL_FUSED_PROJ=0 for the unfused projections).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from qerl_cli.options import options

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_rollout_cuda import PROMPTS, lora_graph_and_eager_engines  # noqa: E402


def main() -> None:
    peft_model, greedy, graphs, eager = lora_graph_and_eager_engines()
    graphs.generate(PROMPTS, greedy)
    with peft_model.disable_adapter():
        g = [s.token_ids for s in graphs.generate(PROMPTS, greedy).samples]
        e = [s.token_ids for s in eager.generate(PROMPTS, greedy).samples]
        differ = sum(a != b for a, b in zip(g, e, strict=True))
        print(f"fused_proj={options().fused_proj}: {differ} of {len(PROMPTS)} prompts differ")
        base = peft_model.get_base_model().float()
        for i, (a, b) in enumerate(zip(g, e, strict=True)):
            if a == b:
                continue
            step = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            ids = torch.tensor([PROMPTS[i] + b[:step]], device="cuda")
            with torch.no_grad():
                logits = base(ids).logits[0, -1].float()
            top = torch.topk(logits, 2)
            print(f"prompt {i}: first difference at step {step}: graph {a[step]} eager {b[step]}; fp32 logits "
                  f"{logits[a[step]].item():.5f} vs {logits[b[step]].item():.5f} (gap "
                  f"{abs(logits[a[step]] - logits[b[step]]).item():.2e}; fp32 top-2 {top.indices.tolist()} "
                  f"gap {(top.values[0] - top.values[1]).item():.2e}; logit scale {logits.abs().max().item():.2f})")
        base.to(torch.bfloat16)


if __name__ == "__main__":
    main()
