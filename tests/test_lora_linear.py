"""The training LoRA linear (qerl_cli/lora_linear.py) on both bases, against peft's own LoRA math.

fp32 on CPU: forward values and the gradients of x, A and B against peft's reference LoRA Linear (nn.Linear base)
and against the LoRA math written out over a QuantLinear (its torch reference, and qerl_kernels' forward and dx
under the Triton interpreter); bf16 within rounding. The op count of one forward + backward is the CPU proxy of
the GPU kernel count. The 16-bit shadows follow every optimizer step (fused AdamW too), and the layers keep peft's
parameter names and saved adapter format.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from qerl_cli.lora import DenseLoraLinear, QuantLoraLinear, attach_lora, load_adapter, make_lora_config
from qerl_cli.lora_linear import QUANT_KERNELS, QUANT_REFERENCE, AdapterShadows, lora_linear
from qerl_cli.qlinear import QuantLinear
from tests.helpers import OpCounter

# aten ops (views excluded) of one forward + backward, x requiring grad, no .grad yet: forward = base GEMM,
# shrink mm, in-place expand addmm_; backward = base dx, g = dy @ sB, dx.addmm_, dA mm, dB mm
FAST_OPS = 8
# qerl_kernels' NVFP4 base under the interpreter (aten ops + Triton launches): the forward's base is its output's
# allocation and the fused kernel (2 for 1), the backward's dx the transient dequantized weight's allocation, its
# kernel and the mm (3 for 1)
FAST_OPS_KERNELS = FAST_OPS + 3


def adapted(base: nn.Module, k: int, *, alpha: float = 8.0, dropout: float = 0.0, peft_reference: bool = False,
            seed: int = 0) -> nn.Module:
    """`base` as q_proj of a one-layer model with a rank-4 adapter (A and B random, fp32): qerl's layer, or peft's
    own LoRA Linear with the same weights."""
    model = nn.Sequential(nn.ModuleDict({"q_proj": base, "norm": nn.LayerNorm(k)}))  # peft places by a parameter
    if peft_reference:
        model.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj"],
                                                 lora_dropout=dropout))
    else:
        cfg = make_lora_config(4, alpha, ["q_proj"], dropout)
        cfg.task_type = None  # a bare module, not a causal LM
        model = attach_lora(model, cfg)
    layer = model.get_base_model()[0]["q_proj"]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.randn(4, k, generator=g) * 0.3)
        layer.lora_B["default"].weight.copy_(torch.randn(base.out_features, 4, generator=g) * 0.3)
    return layer


def dense_base(n: int = 24, k: int = 32, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(k, n, bias=True).to(dtype)


def quant_base(n: int = 64, k: int = 128) -> QuantLinear:
    torch.manual_seed(1)
    return QuantLinear.from_linear(nn.Linear(k, n, bias=True), "nvfp4", dtype=torch.float32)


def grads(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, fn=None) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Output, and the gradients of x, A and B, of one forward + backward (fresh .grad)."""
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    a.grad = b.grad = None
    x = x.detach().clone().requires_grad_(True)
    y = (fn or layer)(x)
    y.backward(dy)
    return {"y": y.detach(), "x": x.grad, "A": a.grad, "B": b.grad}


def lora_math(base: nn.Module, layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, scale: float) -> dict:
    """y = base(x) + scale * (x A^T) B^T with plain autograd ops on copies of the masters."""
    a = layer.lora_A["default"].weight.detach().clone().requires_grad_(True)
    b = layer.lora_B["default"].weight.detach().clone().requires_grad_(True)
    x = x.detach().clone().requires_grad_(True)
    y = base(x) + F.linear(F.linear(x, a), b) * scale
    y.backward(dy)
    return {"y": y.detach(), "x": x.grad, "A": a.grad, "B": b.grad}


def ran_fast(y: torch.Tensor) -> bool:
    fn = y.grad_fn
    while fn is not None and type(fn).__name__ == "ViewBackward0":
        fn = fn.next_functions[0][0]
    return type(fn).__name__ == "LoraLinearFunctionBackward"


def assert_close(got: dict, want: dict, tol: float = 1e-5) -> None:
    for key in ("y", "x", "A", "B"):
        assert got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key], want[key], rtol=tol, atol=tol, msg=key)


@pytest.mark.parametrize("alpha", [8.0, 6.0])  # scaling 2 (exact) and 1.5
def test_dense_equals_peft_lora_fp32(alpha: float) -> None:
    ours = adapted(dense_base(), 32, alpha=alpha)
    ref = adapted(dense_base(), 32, alpha=alpha, peft_reference=True)
    assert type(ours) is DenseLoraLinear and type(ref).__name__ == "Linear"
    x, dy = torch.randn(3, 5, 32), torch.randn(3, 5, 24)
    want = grads(ref, x, dy)
    assert_close(grads(ours, x, dy), want)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), want["y"], rtol=1e-5, atol=1e-5)  # the no-graph forward
    # recomputed in backward (activation checkpointing): the same
    ckpt = grads(ours, x, dy, lambda t: torch.utils.checkpoint.checkpoint(ours, t, use_reentrant=False))
    assert_close(ckpt, want)
    xin = x.clone().requires_grad_(True)
    assert ran_fast(ours(xin))


def test_quant_reference_equals_lora_math_fp32() -> None:
    base = quant_base()
    layer = adapted(base, 128, alpha=6.0)
    assert type(layer) is QuantLoraLinear
    x, dy = torch.randn(2, 3, 128), torch.randn(2, 3, 64)
    want = lora_math(base, layer, x, dy, 1.5)
    assert_close(grads(layer, x, dy), want, tol=1e-4)
    assert layer.cached_base_ops(base, x) is QUANT_REFERENCE
    assert ran_fast(layer(x.clone().requires_grad_(True)))


def test_quant_kernels_equal_lora_math_under_the_interpreter() -> None:
    """The CUDA route (qerl_kernels' linear_forward and linear_backward_dx) run by the Triton interpreter."""
    base = quant_base()
    layer = adapted(base, 128, alpha=6.0)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x, dy = torch.randn(6, 128), torch.randn(6, 64)
    want = lora_math(base, layer, x, dy, 1.5)
    got = grads(layer, x, dy, lambda t: lora_linear(t, base, QUANT_KERNELS, a, b, 1.5, AdapterShadows()))
    assert_close(got, want, tol=1e-4)


def test_bf16_differs_from_peft_by_rounding_only() -> None:
    ours = adapted(dense_base(dtype=torch.bfloat16), 32)
    ref = adapted(dense_base(dtype=torch.bfloat16), 32, peft_reference=True)
    for p in ref.parameters():  # peft's layer keeps the adapter in fp32 (as qerl's masters)
        if p.requires_grad:
            p.data = p.data.float()
    x, dy = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(4, 24, dtype=torch.bfloat16)
    got, want = grads(ours, x, dy), grads(ref, x, dy)
    assert got["A"].dtype == got["B"].dtype == torch.float32 and got["y"].dtype == torch.bfloat16
    for key in ("y", "x", "A", "B"):
        err = (got[key].float() - want[key].float()).norm() / want[key].float().norm()
        assert err < 1e-2, (key, err.item())


def op_count(layer: nn.Module, fn, x: torch.Tensor, dy: torch.Tensor) -> Counter[str]:  # noqa: ANN001
    layer.lora_A["default"].weight.grad = layer.lora_B["default"].weight.grad = None
    fn(x.clone().requires_grad_(True)).backward(dy)  # warm: shadows and cached weights built
    layer.lora_A["default"].weight.grad = layer.lora_B["default"].weight.grad = None
    xin = x.clone().requires_grad_(True)
    with OpCounter() as counter:
        fn(xin).backward(dy)
    return counter.counts


@pytest.mark.parametrize("kind", ["dense", "quant"])
def test_op_count_of_one_forward_backward(kind: str) -> None:
    """8 aten ops for fast path on either base (peft's Linear: 12; the previous QuantLoraLinear: 12)."""
    base = dense_base() if kind == "dense" else quant_base()
    base.cache_dequantized = True  # the CPU trainer's setting: the base is one GEMM each way
    layer = adapted(base, base.in_features)
    x, dy = torch.randn(2, 3, base.in_features), torch.randn(2, 3, base.out_features)
    fast = op_count(layer, layer, x, dy)
    general = op_count(layer, layer.general_forward, x, dy)
    assert sum(fast.values()) == FAST_OPS, fast
    assert fast["aten.mm.default"] + fast["aten.addmm.default"] == 6 and fast["aten.addmm_.default"] == 2
    assert sum(general.values()) >= 12, general


def test_op_count_on_qerl_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    base = quant_base()
    layer = adapted(base, 128)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    shadows = AdapterShadows()
    run = InterpretedFunction.run
    launches = Counter()

    def counted(fn_self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        launches["triton"] += 1
        with _disable_current_modes():  # the interpreter's own tensor work is the kernel, not host ops
            return run(fn_self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    ops = op_count(layer, lambda t: lora_linear(t, base, QUANT_KERNELS, a, b, 2.0, shadows),
                   torch.randn(4, 128), torch.randn(4, 64))
    launches.clear()
    ops = op_count(layer, lambda t: lora_linear(t, base, QUANT_KERNELS, a, b, 2.0, shadows),
                   torch.randn(4, 128), torch.randn(4, 64))
    assert launches["triton"] == 2 * 2  # warm-up and counted call: one fused forward, one dequantize each
    assert sum(ops.values()) + launches["triton"] // 2 == FAST_OPS_KERNELS, ops


def step_and_check(layer: nn.Module, fused: bool, x: torch.Tensor) -> None:
    """One optimizer step on the adapter, then the forward must use the new weights."""
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    opt = torch.optim.AdamW([a, b], lr=0.1, fused=fused, foreach=None if fused else False)
    layer(x).square().sum().backward()
    assert layer.shadows_of("default").sa is not None
    opt.step()
    assert layer.shadows_of("default").sa is None  # dropped by the step: no memory until the next forward
    want = layer.base_layer(x) + F.linear(F.linear(x, a), b) * 2.0
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_shadows_follow_the_masters(fused: bool) -> None:
    """After an optimizer step (fused AdamW writes without a version bump), a load, or a new tensor behind a master,
    the forward uses the new weights; the step frees the shadows; a deep copy of the layer trains on its own."""
    import copy

    layer = adapted(dense_base(), 32)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(5, 32)

    def check() -> None:
        want = layer.base_layer(x) + F.linear(F.linear(x, a), b) * 2.0
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)

    check()
    step_and_check(layer, fused, x)
    with torch.no_grad():
        b.copy_(torch.randn_like(b))  # what load_state_dict does
    check()
    a.data = torch.randn_like(a)  # a new tensor behind the parameter
    check()
    clone = copy.deepcopy(layer)
    step_and_check(clone, fused, x)
    check()  # the original is untouched


def tiny_qwen() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def test_registration_keeps_peft_names_and_adapter_format(tmp_path) -> None:  # noqa: ANN001
    from safetensors import safe_open

    model = tiny_qwen()
    model.model.layers[0].self_attn.k_proj = QuantLinear.from_linear(model.model.layers[0].self_attn.k_proj, "nvfp4",
                                                                     dtype=torch.float32)
    peft_model = attach_lora(model, make_lora_config(4), seed=0)
    attn = peft_model.get_base_model().model.layers[0].self_attn
    assert type(attn.q_proj) is DenseLoraLinear and type(attn.k_proj) is QuantLoraLinear
    names = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in names and len(names) == 14
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    ids = torch.tensor([[3, 14, 15, 9, 2]])
    with torch.no_grad():
        logits = peft_model(ids).logits
    peft_model.save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 14
    fresh = tiny_qwen()
    fresh.model.layers[0].self_attn.k_proj = QuantLinear.from_linear(fresh.model.layers[0].self_attn.k_proj, "nvfp4",
                                                                     dtype=torch.float32)
    loaded = load_adapter(fresh, tmp_path)
    assert type(loaded.get_base_model().model.layers[0].mlp.down_proj) is DenseLoraLinear
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits, rtol=1e-5, atol=1e-5)
        with loaded.disable_adapter():
            assert not torch.allclose(loaded(ids).logits, logits, atol=1e-3)


def test_linear_subclasses_and_unusual_states_keep_the_general_path() -> None:
    class Sub(nn.Linear):
        pass

    torch.manual_seed(1)
    assert type(adapted(Sub(32, 24), 32)).__name__ == "Linear"  # peft's own layer for nn.Linear subclasses
    layer = adapted(dense_base(), 32, dropout=0.5)
    x = torch.randn(4, 32, requires_grad=True)
    assert not ran_fast(layer.train()(x))  # live dropout: peft's forward
    assert ran_fast(layer.eval()(x))  # dropout off in eval
    layer.update_layer("second", 2, lora_alpha=2, config=LoraConfig(r=2, target_modules=["q_proj"]))
    layer.set_adapter(["default", "second"])
    assert not ran_fast(layer(x))
    layer.set_adapter("default")
    with torch.no_grad():
        base_y = layer.base_layer(x)
        layer.enable_adapters(False)
        torch.testing.assert_close(layer(x), base_y)
