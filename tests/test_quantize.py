"""Round trip on the embedded model: quantize -> checkpoint -> reload, for every format.

Tolerances were measured on SmolLM2-135M (fp32 logits of two prompts vs the unquantized model) on
2026-11-21 and set with headroom; a 135M model is far more sensitive to 4-bit weights than a 7B.
Measured: KL(base||quant) nvfp4 0.27, mxfp4 0.60, int4 0.46, int8 0.042 (W8A8: per-token int8 activations;
0.004 with the weights alone), fp8 0.020, nf4 0.35, bf16 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from qerl_cli.models import load_model
from qerl_cli.qlinear import QuantLinear

PROMPTS = ["2 + 3 = 5\n14 + 5 = 19\n7 * 6 = 42\n31 + 22 = 53\n4 + 3 =",
           "The capital of France is Paris. The capital of Germany is"]
# format: (max KL(base || quantized) per token, min top-1 agreement, max mean relative weight error)
TOLERANCE = {
    "nvfp4": (0.6, 0.6, 0.11),
    "mxfp4": (1.2, 0.6, 0.13),
    "int4": (1.0, 0.45, 0.125),
    "int8": (0.08, 0.9, 0.01),
    "fp8": (0.06, 0.9, 0.03),
    "nf4": (0.8, 0.6, 0.11),
    "bf16": (0.002, 0.99, 0.002),
}


@pytest.fixture(scope="module")
def base_logits(embedded):
    model, tok = embedded
    ids = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return ids, model(**ids).logits


@pytest.mark.parametrize("fmt", list(TOLERANCE))
def test_round_trip_logits_close(fmt: str, quantized_runs, base_logits) -> None:
    ids, ref = base_logits
    res = quantized_runs[fmt]
    model, tok = load_model(str(res.model_dir), dtype=torch.float32)
    qlayers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(qlayers) == (0 if fmt == "bf16" else 210)  # 30 layers x 7 linears; lm_head stays (tied)
    if fmt != "bf16":
        assert not any(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if ".layers." in n)
    with torch.no_grad():
        logits = model(**ids).logits
    mask = ids.attention_mask.bool()
    kl = F.kl_div(logits.log_softmax(-1)[mask], ref.log_softmax(-1)[mask], log_target=True,
                  reduction="batchmean").item()
    agree = (logits.argmax(-1) == ref.argmax(-1))[mask].float().mean().item()
    max_kl, min_agree, max_wrel = TOLERANCE[fmt]
    assert kl < max_kl, f"{fmt}: KL {kl:.4f}"
    assert agree >= min_agree, f"{fmt}: top-1 agreement {agree:.3f}"
    assert res.summary()["rel_fro_mean"] < max_wrel
    # greedy generation still produces text
    prompt = tok(PROMPTS[1], return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    text = tok.decode(out[0, prompt.input_ids.shape[1]:], skip_special_tokens=True)
    assert text.strip()


def test_nvfp4_checkpoint_layout(quantized_runs) -> None:
    res = quantized_runs["nvfp4"]
    cfg = json.loads((res.model_dir / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert qc["ignore"] == ["lm_head"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"]) == (4, "float", "tensor_group", 16)
    assert qc["config_groups"]["group_0"]["format"] == "nvfp4-pack-quantized"  # explicit, as llm-compressor writes
    with safe_open(str(res.model_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        p = "model.layers.0.self_attn.q_proj"
        assert {f"{p}.weight_packed", f"{p}.weight_scale", f"{p}.weight_global_scale"} <= keys
        assert f"{p}.weight" not in keys and "lm_head.weight" not in keys
        assert f.get_tensor(f"{p}.weight_packed").dtype == torch.uint8
        assert tuple(f.get_tensor(f"{p}.weight_packed").shape) == (576, 288)
        assert f.get_tensor(f"{p}.weight_scale").dtype == torch.float8_e4m3fn
        assert tuple(f.get_tensor(f"{p}.weight_scale").shape) == (576, 36)
        g = {n: f.get_tensor(f"model.layers.3.{n}.weight_global_scale").item()
             for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
        assert g["self_attn.q_proj"] == g["self_attn.k_proj"] == g["self_attn.v_proj"]
        assert g["mlp.gate_proj"] == g["mlp.up_proj"]
    assert (res.model_dir / "tokenizer.json").is_file()
    assert (res.model_dir / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (res.model_dir / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("fmt", ["nvfp4", "int4", "int8", "fp8"])
def test_compressed_tensors_decompresses_within_format_error(fmt: str, quantized_runs, embedded) -> None:
    """transformers' compressed-tensors integration loads the checkpoint unchanged and decompresses it
    to the same weights qerl's loader gives, within the format's error of the original weights."""
    from transformers import AutoModelForCausalLM

    base, tok = embedded
    res = quantized_runs[fmt]
    # compressed-tensors unpacks FP4/INT4 to bf16 only; the 8-bit W8A8 schemes also run in fp32, where
    # its per-token activation quantization and ours agree to the bit.
    dtype = torch.float32 if fmt in ("int8", "fp8") else torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(str(res.model_dir), dtype=dtype)
    ids = tok(PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():
        hf_logits = hf(**ids).logits.float()  # the first forward decompresses
    qerl_model, _ = load_model(str(res.model_dir), dtype=dtype)
    with torch.no_grad():
        ours = qerl_model(**ids).logits.float()
    assert torch.equal(hf_logits, ours), (hf_logits - ours).abs().max()
    max_wrel = TOLERANCE[fmt][2]
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj"):
        w_ct = hf.get_submodule(name).weight.float()
        w0 = base.get_submodule(name).weight.float()
        assert ((w_ct - w0).norm() / w0.norm()).item() < max_wrel * 1.2


def test_manifest_records_quantize(quantized_runs) -> None:
    from qerl_cli.manifest import RunDir, sha256_file

    res = quantized_runs["nvfp4"]
    run = RunDir(res.run)
    rec = run.require("quantize")
    assert rec["status"] == "completed" and rec["config"]["format"] == "nvfp4"
    files = rec["outputs"]["model"]["files"]
    assert files["model.safetensors"] == sha256_file(res.model_dir / "model.safetensors")
    assert rec["outputs"]["model"]["path"] == "model"
    assert len(rec["extra"]["layers"]) == 210
    assert rec["metrics"]["bytes_after"] < rec["metrics"]["bytes_before_bf16"] / 2
    assert "torch" in rec["env"]["packages"] and rec["inputs"]["model"]["sha256"]
    assert rec["seeds"] == {"torch": 0}
