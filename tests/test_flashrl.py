"""FlashRL mode: quantized rollout copy re-quantized in place, full fine-tuning, TIS by default.

A tiny random Llama (2 layers, hidden 64) with the embedded model's tokenizer keeps this file fast; it is
written as a bf16 run dir by the real `quantize_model`. The in-place kernels run under the interpreter.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.formats import dequantize, quantize


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"bf16": run dir, "int8": run dir, "tok": tokenizer}: a tiny random Llama with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qerl_cli.models import load_tokenizer, resolve_model
    from qerl_cli.quantize import quantize_model

    tok = load_tokenizer(resolve_model(None))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    runs = {}
    for fmt in ("bf16", "int8"):
        path = tmp_path_factory.mktemp(f"flashrl_{fmt}")
        quantize_model(path, None, fmt=fmt, loaded=(model, tok))
        runs[fmt] = path
    runs["tok"] = tok
    return runs


def _load(run: Path, dtype: torch.dtype = torch.bfloat16):
    from qerl_cli.models import load_model

    return load_model(str(run / "model"), dtype=dtype)[0]


def _fresh(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns(".lock", "train", "eval"))
    return dst


# ---- kernels ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_kernel_is_bit_exact_with_the_reference(fmt: str, dtype: torch.dtype) -> None:
    from qerl_kernels.quantize import quantize_w8_

    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 300, generator=g) * 0.05
    w[3] = 0.0  # zero row: eps scale
    w[5, :6] = torch.tensor([1e-9, -1e-9, 1e-5, -0.0, 3.0, -3.0])  # E4M3 subnormals, -0, the row max
    w = w.to(dtype)
    ref = quantize(w, fmt, dtype=dtype).tensors
    q = torch.full_like(ref["weight"].view(torch.uint8), 0x55).view(ref["weight"].dtype)  # poisoned
    s = torch.full_like(ref["weight_scale"], 7.0)
    ptrs = (q.data_ptr(), s.data_ptr())
    quantize_w8_(w, q, s, fmt)
    assert (q.data_ptr(), s.data_ptr()) == ptrs
    assert torch.equal(s, ref["weight_scale"])
    assert torch.equal(q.view(torch.uint8), ref["weight"].view(torch.uint8))
    if fmt == "int8":  # fixed scales: the scale stays, out-of-range values clamp to -128/127
        w2 = w * 3
        quantize_w8_(w2, q, s, fmt, recompute_scale=False)
        assert torch.equal(s, ref["weight_scale"])
        expect = torch.round((w2.float() / s.float()).clamp(-128, 127)).to(torch.int8)
        assert torch.equal(q, expect) and int(q.max()) == 127 and int(q.min()) == -128


# ---- the rollout copy ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_rollout_copy_equals_a_regularly_quantized_model_and_shares_the_rest(tiny, tmp_path: Path, fmt: str) -> None:
    from qerl_cli.models import load_model
    from qerl_cli.qlinear import QuantLinear
    from qerl_cli.quantize import quantize_model
    from qerl_cli.train.rollout_quant import RolloutQuant

    trained = _load(tiny["bf16"])
    rq = RolloutQuant(trained, fmt, scales="dynamic")
    # the regular path: quantize_model + load_model, from the same (bf16) weights
    quantize_model(tmp_path / "reg", None, fmt=fmt, loaded=(_load(tiny["bf16"], torch.float32), tiny["tok"]))
    regular = load_model(str(tmp_path / "reg" / "model"), dtype=torch.bfloat16)[0]
    ids = torch.tensor([[1, 50, 900, 7, 3000, 12]])
    with torch.no_grad():
        assert torch.equal(rq.model(ids).logits, regular(ids).logits)
    assert len(rq.layers) == 14 and all(isinstance(m, QuantLinear) for m in rq.layers.values())
    # embeddings and norms are the trained model's own tensors; its Linear layers are untouched
    assert rq.model.model.embed_tokens.weight is trained.model.embed_tokens.weight
    assert rq.model.model.layers[1].input_layernorm.weight is trained.model.layers[1].input_layernorm.weight
    assert isinstance(trained.model.layers[0].self_attn.q_proj, torch.nn.Linear)


@pytest.mark.parametrize("fmt,scales", [("int8", "fixed"), ("int8", "dynamic"), ("fp8", "dynamic"),
                                        ("nvfp4", "dynamic"), ("mxfp4", "dynamic")])
def test_requantize_is_in_place_and_equals_quantizing_from_scratch(tiny, fmt: str, scales: str) -> None:
    from qerl_cli.train.rollout_quant import RolloutQuant

    trained = _load(tiny["bf16"])
    rq = RolloutQuant(trained, fmt, scales=scales)
    before = {n: {k: (t.data_ptr(), t.clone()) for k, t in ql.quantized_weight.tensors.items()}
              for n, ql in rq.layers.items()}
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1.5)  # every weight outgrows the calibrated INT8 range
    metrics = rq.requantize_()
    assert metrics["timing/requant_s"] > 0 and metrics["rollout_quant/rel_err"] > 0
    for name, ql in rq.layers.items():
        w = trained.get_submodule(name).weight.detach()
        tensors = ql.quantized_weight.tensors
        assert {k: t.data_ptr() for k, t in tensors.items()} == {k: p for k, (p, _) in before[name].items()}
        if scales == "fixed":
            old_scale = before[name]["weight_scale"][1]
            assert torch.equal(tensors["weight_scale"], old_scale)
            assert torch.equal(tensors["weight"], torch.round((w.float() / old_scale.float()).clamp(-128, 127))
                               .to(torch.int8))
            continue
        gs = tensors["weight_global_scale"] if fmt == "nvfp4" else None  # fused-group scale, checked below
        ref = quantize(w, fmt, global_scale=gs, dtype=torch.bfloat16).tensors
        for k, t in ref.items():
            assert torch.equal(tensors[k].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else tensors[k],
                               t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), (name, k)
    if fmt == "nvfp4":  # q/k/v share the max amax of the three
        attn = trained.model.layers[0].self_attn
        amax = max(getattr(attn, p).weight.float().abs().max() for p in ("q_proj", "k_proj", "v_proj"))
        assert torch.equal(rq.layers["model.layers.0.self_attn.k_proj"].weight_global_scale,
                           torch.tensor([448 * 6 / amax.item()], dtype=torch.float32))
    if fmt == "int8":
        frac = metrics["rollout_quant/outside_calib_frac"]
        assert (frac > 0.0) if scales == "fixed" else (frac == 0.0)


def test_kernel_requantize_matches_the_torch_path(tiny) -> None:
    from qerl_cli.train.rollout_quant import RolloutQuant

    for fmt, scales in (("int8", "fixed"), ("int8", "dynamic"), ("fp8", "dynamic")):
        trained = _load(tiny["bf16"])
        a = RolloutQuant(trained, fmt, scales=scales, use_kernels=True)
        b = RolloutQuant(trained, fmt, scales=scales, use_kernels=False)
        with torch.no_grad():
            trained.model.layers[0].mlp.up_proj.weight.mul_(1.3)
        a.requantize_()
        b.requantize_()
        for name in a.layers:
            for k, t in a.layers[name].quantized_weight.tensors.items():
                assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                                   getattr(b.layers[name], k).view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                                   else getattr(b.layers[name], k)), (fmt, name, k)


def test_lora_rollout_copy_holds_the_merged_weight(tiny) -> None:
    from qerl_cli.lora import attach_lora, make_lora_config
    from qerl_cli.train.rollout_quant import RolloutQuant

    model = attach_lora(_load(tiny["bf16"]), make_lora_config(4, 8.0), seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # fresh adapters have B = 0: make the merge matter
    rq = RolloutQuant(model, "fp8")
    assert not any("lora" in n for n, _ in rq.model.named_modules())
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    w = layer.base_layer.weight.float() + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    got = dequantize(rq.layers["model.layers.1.mlp.down_proj"].quantized_weight, torch.float32)
    assert torch.equal(got, dequantize(quantize(w.detach(), "fp8", dtype=torch.bfloat16), torch.float32))


def test_an_optimizer_step_reaches_the_rollout_copy(tiny) -> None:
    """bf16 full fine-tuning: grads land in fp32 masters, AdamW steps them, sync_ writes the bf16 weights,
    and the re-quantized rollout copy equals quantizing those new weights."""
    from qerl_cli.train.full_finetune import FullFinetune
    from qerl_cli.train.rollout_quant import RolloutQuant

    model = _load(tiny["bf16"])
    full = FullFinetune(model)
    assert not model.model.embed_tokens.weight.requires_grad
    assert all(p.dtype == torch.float32 for p in full.params) and len(full.params) == 2 * 9 + 1
    rq = RolloutQuant(model, "int8", scales="dynamic")
    opt = torch.optim.AdamW(full.params, lr=1e-2)
    w0 = model.model.layers[0].self_attn.o_proj.weight.detach().clone()
    model.train()
    model(torch.tensor([[1, 50, 900, 7]])).logits.float().pow(2).mean().backward()
    assert all(p.grad is None for p in model.parameters())  # moved to the masters
    opt.step()
    full.sync_()
    w1 = model.model.layers[0].self_attn.o_proj.weight.detach()
    assert not torch.equal(w0, w1)
    assert torch.equal(w1, full.masters["model.layers.0.self_attn.o_proj.weight"].detach().to(torch.bfloat16))
    rq.requantize_()
    ref = quantize(w1, "int8", dtype=torch.bfloat16).tensors
    ql = rq.layers["model.layers.0.self_attn.o_proj"]
    assert torch.equal(ql.weight, ref["weight"]) and torch.equal(ql.weight_scale, ref["weight_scale"])


# ---- config and training -------------------------------------------------------------------------------
def test_config_defaults_and_bad_combinations() -> None:
    from qerl_cli.train.config import TrainConfig, build_config

    c = TrainConfig(rollout_quant="int8").resolved()
    assert (c.correction, c.correction_cap, c.requant_scales) == ("token_tis", 2.0, "fixed")
    assert TrainConfig(rollout_quant="fp8").resolved().requant_scales == "dynamic"
    assert TrainConfig(rollout_quant="int8", correction="none").resolved().correction == "none"
    assert TrainConfig().resolved().correction == "none"
    with pytest.raises(QerlError, match="--requant-scales fixed is for --rollout-quant int8 only"):
        build_config(None, {"rollout_quant": "fp8", "requant_scales": "fixed"})
    with pytest.raises(QerlError, match="--finetune must be one of"):
        build_config(None, {"finetune": "partial"})
    with pytest.raises(QerlError, match="--beta > 0 needs a frozen reference model"):
        build_config(None, {"finetune": "full", "beta": 0.1})


def test_cli_refuses_fixed_scales_with_fp8_in_one_line() -> None:
    res = subprocess.run([sys.executable, "-m", "qerl_cli", "train", "--rollout-quant", "fp8", "--requant-scales",
                          "fixed", "--dry-run"], capture_output=True, text=True, cwd=tempfile.gettempdir(),
                         timeout=300)
    assert res.returncode == 2, res.stderr
    out = (res.stdout + res.stderr).strip()
    assert "--requant-scales fixed is for --rollout-quant int8 only" in out and "Traceback" not in out


SMALL = {"task_level": "1", "batch_prompts": 2, "num_generations": 2, "max_completion_length": 4, "aqn": True,
         "micro_batch_size": 8, "lr": 1e-3, "weight_decay": 0.1, "save_steps": 1, "seed": 5, "finetune": "full"}


def test_full_finetune_on_a_quantized_run_dir_is_refused(tiny, tmp_path: Path) -> None:
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    with pytest.raises(QerlError, match="holds a int8 model: make one with `qerl quantize --format bf16"):
        train(_fresh(tiny["int8"], tmp_path), build_config("quick_cpu", {**SMALL, "steps": 1}))


def test_full_finetune_trains_with_int8_and_fp8_rollouts_and_resumes_exactly(tiny, tmp_path: Path) -> None:
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    def comparable(m: dict) -> dict:
        return {k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}

    runs = {}
    for fmt, precision in (("int8", "bf16"), ("fp8", "fp32")):
        run = tmp_path / fmt
        shutil.copytree(tiny["bf16"], run, ignore=shutil.ignore_patterns(".lock"))
        cfg = build_config("quick_cpu", {**SMALL, "steps": 2, "rollout_quant": fmt, "precision": precision})
        res = train(run, cfg)
        assert res.steps_done == 2
        runs[fmt] = run
        for m in res.metrics:
            assert m["timing/requant_s"] > 0 and 0 < m["rollout_quant/rel_err"] < 0.1
            assert "sampling/is_weight_mean" in m and "sampling/k3" in m  # TIS on by default, mismatch logged
        ckpt = res.checkpoint
        assert ckpt is not None and (ckpt / "weights.safetensors").is_file() and not (ckpt / "adapter").exists()
        manifest = json.loads((run / "manifest.json").read_text())
        rec = manifest["stages"]["train"] if "stages" in manifest else manifest["train"]
        assert rec["config"]["correction"] == "token_tis" and rec["config"]["correction_cap"] == 2.0
        assert "weights_sha256" in rec["outputs"]

    # killed during step 2 (step 1's checkpoint written), resumed -> the same step-2 metrics as the
    # uninterrupted int8 run. A 1-step run extended to 2 would not do: it keeps its 1-step AQN schedule.
    run = tmp_path / "resumed"
    shutil.copytree(tiny["bf16"], run, ignore=shutil.ignore_patterns(".lock"))
    cfg = build_config("quick_cpu", {**SMALL, "rollout_quant": "int8", "precision": "bf16", "steps": 2})

    def kill_at_step_2(m: dict) -> None:
        if m["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(run, cfg, on_step=kill_at_step_2)
    res = train(run, cfg, resume=True)
    assert [m["step"] for m in res.metrics] == [2]  # continued at step 1's checkpoint, not from step 0
    full = [json.loads(x) for x in (runs["int8"] / "train" / "metrics.jsonl").read_text().splitlines()]
    assert comparable(res.metrics[-1]) == comparable(full[-1])
