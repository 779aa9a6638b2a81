"""Does transformers (its compressed-tensors integration) compute the same logits as qerl on a qerl checkpoint?

Per format and dtype: the embedded SmolLM2 quantized by `qerl quantize`, loaded once by transformers'
`AutoModelForCausalLM` and once by `qerl_cli.models.load_model`, logits of one 4-shot arith prompt compared bit for
bit (the README states the result; tests/test_quantize.py keeps the cases that match).

    python scripts/transformers_logits_check.py [FORMAT ...]     # default: nvfp4 int4 bf16 int8
"""

from __future__ import annotations

import sys
import tempfile

import torch


def main(formats: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    from qerl_cli.models import load_model
    from qerl_cli.quantize import quantize_model

    base, tok = load_model(None, dtype=torch.float32)
    ids = tok(["2 + 3 = 5\n14 + 5 = 19\n7 * 6 = 42\n31 + 22 = 53\n4 + 3 ="], return_tensors="pt")
    for fmt in formats or ["nvfp4", "int4", "bf16", "int8"]:
        with tempfile.TemporaryDirectory() as d:
            res = quantize_model(d, None, fmt=fmt, loaded=(base, tok))
            for dtype in (torch.bfloat16, torch.float32):
                try:
                    hf = AutoModelForCausalLM.from_pretrained(str(res.model_dir), dtype=dtype)
                    with torch.no_grad():
                        a = hf(**ids).logits.float()
                except Exception as exc:  # noqa: BLE001 - what transformers raised is the result
                    print(fmt, dtype, "transformers fails:", type(exc).__name__, str(exc).splitlines()[0][:200])
                    continue
                ours, _ = load_model(str(res.model_dir), dtype=dtype)
                with torch.no_grad():
                    b = ours(**ids).logits.float()
                agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
                print(fmt, dtype, "identical" if torch.equal(a, b) else
                      f"differ: max |d| {(a - b).abs().max().item():.3g}, argmax agree {agree:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
