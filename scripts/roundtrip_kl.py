"""Round-trip KL of the embedded model per format, as the README states it: KL(base || quantized) of the
next-token distributions over every position of two prompts (fp32 on CPU, tests/test_quantize.py's prompts),
each format quantized by `qerl quantize` and run through qerl's own QuantLinear:

  as run     the checkpoint as it runs: int8 (W8A8) and fp8 (FP8_DYNAMIC) quantize their activations per token
             on the fly (QuantLinear's act_quant), every other format is weights-only anyway
  weights    the same checkpoint with activation quantization switched off (weights-only)

    python scripts/roundtrip_kl.py [FORMAT ...]      # default: every format; prints one line per format
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.nn.functional as F

PROMPTS = ["2 + 3 = 5\n14 + 5 = 19\n7 * 6 = 42\n31 + 22 = 53\n4 + 3 =",
           "The capital of France is Paris. The capital of Germany is"]


def kl(logits: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    return F.kl_div(logits.log_softmax(-1)[mask], ref.log_softmax(-1)[mask], log_target=True,
                    reduction="batchmean").item()


def main(formats: list[str]) -> None:
    from qerl_cli.formats import FORMATS
    from qerl_cli.models import load_model
    from qerl_cli.qlinear import QuantLinear
    from qerl_cli.quantize import quantize_model

    torch.manual_seed(0)
    base, tok = load_model(None, dtype=torch.float32)
    ids = tok(PROMPTS, return_tensors="pt", padding=True)
    mask = ids.attention_mask.bool()
    with torch.no_grad():
        ref = base(**ids).logits
    for fmt in formats or list(FORMATS):
        with tempfile.TemporaryDirectory() as tmp:
            res = quantize_model(tmp, None, fmt=fmt, loaded=(base, tok))
            model, _ = load_model(str(res.model_dir), dtype=torch.float32)
            layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
            acts = sorted({str(m.act_quant) for m in layers}) or ["none"]
            with torch.no_grad():
                as_run = kl(model(**ids).logits, ref, mask)
                for m in layers:
                    m.act_quant = None
                weights = kl(model(**ids).logits, ref, mask)
        print(f"{fmt:6s} as run (activations {'/'.join(acts)}): KL {as_run:.4f}   weights only: KL {weights:.4f}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
