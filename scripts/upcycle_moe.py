"""Sparse upcycling: a dense Llama (default: the embedded SmolLM2-135M-Instruct) as a Mixtral checkpoint.

    python scripts/upcycle_moe.py --out DIR [--model SRC] [--experts 4] [--top-k 2] [--noise 0.0] [--seed 0]
                                  [--router-std 0.02] [--dtype fp32|bf16]

Every decoder layer keeps its attention and norms; its MLP becomes a sparse block of ``--experts`` copies of that
MLP (``experts.gate_up_proj[e] = [gate; up]``, ``experts.down_proj[e] = down``) and a router drawn N(0,
``router-std``) per weight (seeded), so the top-k experts vary from token to token. Mixtral's router renormalises
its top-k probabilities to sum to one, so with identical experts the block returns exactly the dense MLP's output
whatever the router picks: at step 0 the upcycled model computes the dense model's function (the logits agree to
fp32 rounding; tests/test_upcycle_moe.py). ``--noise`` adds ``noise * std(W) * N(0, 1)`` to each expert's weights
(each expert its own draw) so the experts are distinguishable from the first step; the router then matters a
little, and the equality holds only up to that noise.

Why Mixtral and not Qwen3-MoE: Qwen3's attention adds per-head q/k RMSNorms, which a Llama does not have, so only
Mixtral (Llama's attention with a sparse MLP) holds the dense model exactly.

Writes ``DIR`` in the Hugging Face layout (transformers' ``save_pretrained``: ``config.json``,
``model.safetensors`` with Mixtral's own tensor names, the generation config, the tokenizer files) and
``upcycle.json`` (source, settings). ``qerl quantize --run RUN DIR`` takes it like any model (docs/moe.md,
"The upcycled model").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixtral_config(dense: Any, experts: int, top_k: int, router_std: float) -> Any:
    """Mixtral's config holding ``dense`` (a Llama config) with ``experts`` experts of its MLP per layer, top-k
    ``top_k``; refuses what Mixtral cannot hold (biases, another activation)."""
    from transformers import MixtralConfig

    from qerl_cli.errors import QerlError

    if getattr(dense, "attention_bias", False) or getattr(dense, "mlp_bias", False):
        raise QerlError("the dense model has attention or MLP biases, which Mixtral's layers do not hold")
    if getattr(dense, "hidden_act", "silu") != "silu":
        raise QerlError(f"Mixtral's experts compute SiLU, the dense model {dense.hidden_act!r}")
    if not 1 <= top_k <= experts:
        raise QerlError(f"--top-k must lie in [1, --experts], got {top_k} of {experts}")
    heads = int(dense.num_attention_heads)
    return MixtralConfig(
        vocab_size=dense.vocab_size, hidden_size=dense.hidden_size, intermediate_size=dense.intermediate_size,
        num_hidden_layers=dense.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(dense, "num_key_value_heads", None) or heads,
        head_dim=getattr(dense, "head_dim", None) or dense.hidden_size // heads, hidden_act="silu",
        max_position_embeddings=dense.max_position_embeddings, rms_norm_eps=dense.rms_norm_eps,
        rope_parameters=dict(dense.rope_parameters), tie_word_embeddings=bool(dense.tie_word_embeddings),
        bos_token_id=dense.bos_token_id, eos_token_id=dense.eos_token_id, pad_token_id=dense.pad_token_id,
        num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None, router_jitter_noise=0.0,
        attention_dropout=0.0, initializer_range=router_std, output_router_logits=False)


@torch.no_grad()
def upcycle(dense: torch.nn.Module, *, experts: int = 4, top_k: int = 2, noise: float = 0.0, seed: int = 0,
            router_std: float = 0.02) -> torch.nn.Module:
    """The Mixtral (fp32, eval mode) whose every layer's experts are copies of ``dense``'s MLP (module docstring)."""
    from transformers import MixtralForCausalLM

    cfg = mixtral_config(dense.config, experts, top_k, router_std)
    with torch.device("meta"):
        moe = MixtralForCausalLM(cfg)
    moe = moe.to_empty(device="cpu").float()
    # everything but the MLPs has the same name and shape in both (embeddings, attention, norms, head)
    shared = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, unexpected = moe.load_state_dict(shared, strict=False)
    if unexpected or any(".mlp." not in k and k != "lm_head.weight" for k in missing):
        raise RuntimeError(f"the dense model does not match Mixtral's layout (missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]})")
    g = torch.Generator().manual_seed(seed)

    def jitter(w: torch.Tensor) -> torch.Tensor:
        return w + noise * w.std() * torch.randn(w.shape, generator=g) if noise else w

    for dl, ml in zip(dense.model.layers, moe.model.layers, strict=True):
        mlp, block = dl.mlp, ml.mlp
        gate, up, down = (m.weight.detach().float() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=g) * router_std)
        for e in range(experts):
            block.experts.gate_up_proj[e].copy_(torch.cat([jitter(gate), jitter(up)]))
            block.experts.down_proj[e].copy_(jitter(down))
    # non-persistent buffers (the rotary inv_freq) were left empty by the meta build: compute them
    moe.model.rotary_emb = type(moe.model.rotary_emb)(config=cfg)
    if cfg.tie_word_embeddings:
        moe.tie_weights()
    else:
        moe.lm_head.weight.copy_(dense.lm_head.weight)
    moe.generation_config = dense.generation_config
    return moe.eval()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    ap.add_argument("--model", default=None, help="the dense Llama (HF directory or .gguf; default: embedded)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--noise", type=float, default=0.0, help="relative noise on each expert's copy (0: identical)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-std", type=float, default=0.02, help="std of the random router weights")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the weights' dtype on disk")
    args = ap.parse_args(argv)

    from qerl_cli.models import load_model, resolve_model

    t0 = time.perf_counter()
    src = resolve_model(args.model)
    dense, tok = load_model(src, dtype=torch.float32)
    moe = upcycle(dense, experts=args.experts, top_k=args.top_k, noise=args.noise, seed=args.seed,
                  router_std=args.router_std)
    args.out.mkdir(parents=True, exist_ok=True)
    moe.to(DTYPES[args.dtype]).save_pretrained(str(args.out))
    tok.save_pretrained(str(args.out))
    record = {"source": src.to_json(), "experts": args.experts, "top_k": args.top_k, "noise": args.noise,
              "seed": args.seed, "router_std": args.router_std, "dtype": args.dtype,
              "parameters": sum(p.numel() for p in moe.parameters()), "wall_s": round(time.perf_counter() - t0, 1)}
    (args.out / "upcycle.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"upcycled {src.display} into {args.out}: {args.experts} experts, top-{args.top_k}, "
          f"{record['parameters'] / 1e6:.0f}M parameters, {record['wall_s']} s")
    return record


if __name__ == "__main__":
    main()
