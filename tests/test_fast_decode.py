"""The rollout runner's fast decode path (qerl_cli/rollout/fast_layers.py) against the module path.

fp32 tiny models with LoRA (qerl's QuantLoraLinear over QuantLinear and peft's lora.Linear over
nn.Linear, nonzero B): greedy tokens must be equal and log-probs within 1e-5 (only GEMM order and the
scaling folded into B differ); the fused Triton kernels run under the interpreter here. A CPU proxy of
the GPU win: aten ops (views excluded) plus Triton launches in one decode step, per layer.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from peft import LoraConfig, get_peft_model
from qerl_kernels import decode as decode_kernels
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from qerl_cli.lora import attach_lora, make_lora_config
from qerl_cli.qlinear import QuantLinear
from qerl_cli.rollout import BuiltinEngine, SamplingParams
from qerl_cli.rollout.fast_layers import resolve
from tests.helpers import OpCounter

PROMPTS = [[5, 17, 3], [9, 9, 40, 2, 77, 13, 8], [60], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[])
SAMPLED = SamplingParams(n=2, temperature=1.0, max_tokens=8, stop_token_ids=[], seed=3)
LP_TOL = 1e-5  # fp32: shadows are fp32, so only GEMM ordering and the scaling fold differ
# CPU proxy bounds (aten non-view ops + Triton launches per layer): measured 67 before this work, 64 on the
# module path (the additive mask is built once per step), 50 there since the LoRA layers run qerl's one-node LoRA
# linear (qerl_cli/lora_linear.py: no casts, no scale), 23 on the fast path of issue 5, 17 on the default
# (issue 25: 4 base GEMMs, 4 in-place expands, 2 norms, 3 Triton shrinks, SiLU + down's cuBLAS shrink, RoPE/KV
# write, SDPA; on the GPU each Triton shrink is one kernel where a skinny cuBLAS shrink is often two: GEMM +
# split-K reduce), 14 with the one-launch norm/SiLU shrink forms
OPS_BEFORE_MIN, OPS_AFTER_MAX = 45, 17


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch intra-op thread


def tiny(kind: str = "qwen2", layers: int = 2, quant: bool = True, rank: int = 4) -> nn.Module:
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, initializer_range=0.15, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None, rope_theta=10000.0)
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    if quant:  # QuantLoraLinear on these, peft's lora.Linear on the rest
        for layer in model.model.layers:
            layer.self_attn.k_proj = QuantLinear.from_linear(layer.self_attn.k_proj, "nvfp4", dtype=torch.float32)
            layer.mlp.up_proj = QuantLinear.from_linear(layer.mlp.up_proj, "int4", group_size=32, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    if not rank:
        return model.eval()
    peft_model = attach_lora(model, make_lora_config(rank=rank), seed=0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return peft_model.eval()


def run(model: nn.Module, sampling: SamplingParams = GREEDY, **kw) -> tuple[list[list[int]], torch.Tensor]:
    result = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64, **kw).generate(PROMPTS, sampling)
    return [s.token_ids for s in result.samples], torch.cat([s.logprobs for s in result.samples])


def assert_same(a: tuple[list[list[int]], torch.Tensor], b: tuple[list[list[int]], torch.Tensor]) -> None:
    assert a[0] == b[0]
    assert (a[1] - b[1]).abs().max().item() < LP_TOL


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_fast_paths_equal_module_path(kind: str) -> None:
    model = tiny(kind)
    ref = run(model, fast_lora=False, fused_kernels=False)
    assert_same(run(model, fast_lora=True, fused_kernels=False), ref)
    before = sum(decode_kernels.LAUNCHES.values())
    engine = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64, fast_lora=True, fused_kernels=True)
    result = engine.generate(PROMPTS, GREEDY)
    assert_same(([s.token_ids for s in result.samples], torch.cat([s.logprobs for s in result.samples])), ref)
    assert engine.runner.ops.triton and not engine.runner.ops.fell_back  # no kernel fell back
    assert sum(decode_kernels.LAUNCHES.values()) > before
    plan = engine.runner.plan
    assert plan is not None and all(g.has_lora for g in plan.groups())
    # sampled: same tokens from the same noise, log-probs within fp32 rounding
    assert_same(run(model, SAMPLED, fast_lora=True, fused_kernels=False), run(model, SAMPLED, fast_lora=False))


def test_shadows_follow_optimizer_steps_and_adapter_switches() -> None:
    model = tiny()
    engine = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64)
    first = engine.generate(PROMPTS, GREEDY)
    shadows = [t.data_ptr() for g in engine.runner.plan.groups() for t in g.shadows()]
    with torch.no_grad():  # an "optimizer step" in place on the fp32 masters
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn_like(p))
    stepped = engine.generate(PROMPTS, GREEDY)
    # refreshed in place: same shadow addresses (captured CUDA graphs stay valid), new values
    assert [t.data_ptr() for g in engine.runner.plan.groups() for t in g.shadows()] == shadows
    assert [s.token_ids for s in stepped.samples] != [s.token_ids for s in first.samples]
    assert_same(run(model, fast_lora=True), run(model, fast_lora=False))
    with model.disable_adapter():
        off = engine.generate(PROMPTS, GREEDY)
        assert not any(g.has_lora for g in engine.runner.plan.groups())
        base = run(model.get_base_model(), fast_lora=False)
    assert [s.token_ids for s in off.samples] == base[0]
    again = engine.generate(PROMPTS, GREEDY)
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in stepped.samples]


def test_unusual_adapters_fall_back_to_the_module() -> None:
    base = tiny(quant=False, rank=0)
    dora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True,
                                           init_lora_weights=False)).eval()
    q = dora.get_base_model().model.layers[0].self_attn.q_proj
    assert resolve(q) is None  # DoRA: only peft's own forward is exact
    assert_same(run(dora, fast_lora=True), run(dora, fast_lora=False))
    # two active adapters at once
    model = tiny(quant=False, rank=0)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False))
    peft_model.add_adapter("second", LoraConfig(r=2, target_modules=["v_proj"], init_lora_weights=False))
    peft_model.base_model.set_adapter(["default", "second"])
    v = peft_model.get_base_model().model.layers[0].self_attn.v_proj
    assert resolve(v) is None
    assert_same(run(peft_model.eval(), fast_lora=True), run(peft_model, fast_lora=False))


class _OpCounter(OpCounter):
    """aten ops (views excluded: they launch nothing) plus Triton launches (their interpreter's own
    tensor work is not counted)."""


class _CountingKernels:
    def __init__(self, counts: Counter[str]) -> None:
        self.counts = counts

    def __getattr__(self, name: str):  # noqa: ANN204
        fn = getattr(decode_kernels, name)

        def call(*args, **kwargs):  # noqa: ANN202
            self.counts[f"triton.{name}"] += 1
            with _disable_current_modes():
                return fn(*args, **kwargs)

        return call


def decode_step_ops(layers: int, fast: bool) -> Counter[str]:
    engine = BuiltinEngine(tiny(layers=layers, quant=False), None, max_batch_slots=2, max_model_len=64,
                           fast_lora=fast, fused_kernels=fast)
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=2, stop_token_ids=[]))
    with torch.no_grad(), _OpCounter() as counter:
        if fast:
            engine.runner.ops._k = _CountingKernels(counter.counts)
        engine.runner.decode_step(torch.tensor([5, 6]), torch.tensor([3, 2]), 64)
    return counter.counts


def test_decode_step_op_count_per_layer(monkeypatch, use_options) -> None:  # noqa: ANN001
    """LoRA on all 7 linears (nn.Linear bases): per layer, the difference of a 3- and a 1-layer model."""
    from qerl_kernels import decode as kd

    use_options(fused_lora=True)  # the default: Triton shrinks
    per_layer = {}
    for fast in (False, True):
        c1, c3 = decode_step_ops(1, fast), decode_step_ops(3, fast)
        per_layer[fast] = (sum(c3.values()) - sum(c1.values())) / 2
    assert per_layer[False] >= OPS_BEFORE_MIN, per_layer
    assert per_layer[True] <= OPS_AFTER_MAX, per_layer
    ops = decode_step_ops(1, True)
    # q/k/v's and gate/up's shrinks are the plain Triton shrink after the norm kernel, o's on the attention output;
    # down's is cuBLAS after the SiLU kernel (the measured rule: kd.NORM/SILU_SHRINK_MAX_ROWS = 0)
    assert ops["triton.add_rmsnorm"] == 3 and ops["triton.lora_shrink"] == 3 and ops["triton.silu_mul"] == 1
    assert "triton.rmsnorm_shrink" not in ops and "triton.silu_mul_shrink" not in ops
    # 4 base GEMMs (q/k/v's bias makes one an addmm), the lm_head, down's shrink; 4 in-place expands
    assert ops["aten.mm.default"] + ops["aten.addmm.default"] == 6 and ops["aten.addmm_.default"] == 4
    assert "aten.index_put_.default" not in ops and "aten.pow.Tensor_Scalar" not in ops
    # the one-launch producer forms (used up to NORM/SILU_SHRINK_MAX_ROWS rows): the shrinks ride in the norms
    # and the SiLU, o's is its own launch; no mm shrink left
    monkeypatch.setattr(kd, "NORM_SHRINK_MAX_ROWS", 256)
    monkeypatch.setattr(kd, "SILU_SHRINK_MAX_ROWS", 256)
    ops = decode_step_ops(1, True)
    assert ops["triton.rmsnorm_shrink"] == 2 and ops["triton.add_rmsnorm"] == 1  # the final norm has no LoRA
    assert ops["triton.silu_mul_shrink"] == 1 and ops["triton.lora_shrink"] == 1 and ops["triton.rope_kv_write"] == 1
    assert ops["aten.mm.default"] + ops["aten.addmm.default"] == 5 and ops["aten.addmm_.default"] == 4
    use_options(fused_lora=False)  # the A/B path: one cuBLAS shrink GEMM per group
    ops = decode_step_ops(1, True)
    assert ops["triton.add_rmsnorm"] == 3 and ops["triton.silu_mul"] == 1 and "triton.lora_shrink" not in ops
    assert ops["aten.mm.default"] + ops["aten.addmm.default"] == 9  # + the 4 shrink GEMMs


def _all_quantized(model: nn.Module) -> nn.Module:
    """Every decoder linear NVFP4, q/k/v and gate/up each sharing one global scale (as qerl quantize
    writes them), so the plan can run each group as one fused GEMM."""
    from qerl_cli.formats import nvfp4_global_scale

    def quant(lins: list[nn.Linear]) -> list[QuantLinear]:
        gs = nvfp4_global_scale(torch.stack([lin.weight.abs().max() for lin in lins]).max())
        return [QuantLinear.from_linear(lin, "nvfp4", global_scale=gs, dtype=torch.float32) for lin in lins]

    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.q_proj, a.k_proj, a.v_proj = quant([a.q_proj, a.k_proj, a.v_proj])
        (a.o_proj,) = quant([a.o_proj])
        m.gate_proj, m.up_proj = quant([m.gate_proj, m.up_proj])
        (m.down_proj,) = quant([m.down_proj])
    return model


def _teacher_forced(model: nn.Module, result) -> tuple[list[list[int]], torch.Tensor]:  # noqa: ANN001
    """Greedy tokens and their log-probs recomputed by the peft model's own forward (fp32)."""
    tokens, lps = [], []
    with torch.no_grad():
        for s in result.samples:
            ids = torch.tensor([s.prompt_token_ids + s.token_ids])
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            rows = logp[len(s.prompt_token_ids) - 1 : -1]
            tokens.append(rows.argmax(-1).tolist())
            lps.append(rows.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0])
    return tokens, torch.cat(lps)


@pytest.mark.parametrize("quantized,fused,one_launch",
                         [(False, False, False), (True, False, False), (False, True, False), (True, True, False),
                          (True, True, True)],
                         ids=["dense", "nvfp4", "dense-fused-lora", "nvfp4-fused-lora", "nvfp4-one-launch-shrinks"])
def test_fused_projections_with_folded_lora_equal_peft(monkeypatch, use_options, quantized: bool,  # noqa: ANN001
                                                       fused: bool, one_launch: bool) -> None:
    """q/k/v and gate/up as one GEMM each, LoRA as one shrink + one block-diagonal expand per group
    (r = 8 on all seven linears), fp32 on CPU: greedy tokens equal to the peft model's own argmax and
    log-probs within 1e-5 of its teacher-forced forward, before and after an in-place optimizer step.
    ``fused`` (the default path, Triton under the interpreter): the shrinks by ``lora_shrink`` after the norm
    kernel and on the attention output, down's by cuBLAS after the SiLU kernel; ``one_launch``: the shrinks
    computed inside the RMSNorm / SiLU kernels (the forms the measured rule leaves off, kept exact)."""
    use_options(fused_lora=True)
    if one_launch:
        monkeypatch.setattr(decode_kernels, "NORM_SHRINK_MAX_ROWS", 256)
        monkeypatch.setattr(decode_kernels, "SILU_SHRINK_MAX_ROWS", 256)
    base = tiny(quant=False, rank=0)
    if quantized:
        base = _all_quantized(base)
    model = attach_lora(base, make_lora_config(rank=8), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.eval()
    before = decode_kernels.LAUNCHES.copy()
    engine = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64, fast_lora=True, fused_kernels=fused)
    result = engine.generate(PROMPTS, GREEDY)
    launched = {k: decode_kernels.LAUNCHES[k] - before[k] for k in ("rmsnorm_shrink", "silu_mul_shrink", "lora_shrink")}
    assert (launched["lora_shrink"] > 0) == fused, launched
    assert (launched["rmsnorm_shrink"] > 0) == (launched["silu_mul_shrink"] > 0) == one_launch, launched
    assert all(engine.runner.ops.enabled[n] == fused for n in engine.runner.ops.LORA_NAMES)
    plan = engine.runner.plan
    for lp in plan.layers:
        for group, parts in ((lp.qkv, 3), (lp.gate_up, 2)):
            assert group.fused is not None and len(group.calls) == parts
            assert group.b_blk is not None and group.b_blk.shape == (sum(group.sizes), 8 * parts)
            # the parts are views of the fused layer: no weight byte stored twice
            fused_t = group.fused.qweight if quantized else group.fused.weight
            for call in group.calls:
                part_t = call.qweight if quantized else call.weight
                assert part_t.untyped_storage().data_ptr() == fused_t.untyped_storage().data_ptr()
            # off-diagonal blocks of the expand stay zero
            r0 = group.sizes[0]
            assert not group.b_blk[:r0, 8:].any() and not group.b_blk[r0:, :8].any()
    want_tokens, want_lp = _teacher_forced(model, result)
    assert [s.token_ids for s in result.samples] == want_tokens
    assert (torch.cat([s.logprobs for s in result.samples]).double() - want_lp).abs().max().item() < LP_TOL
    shadows = plan.fingerprint()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an optimizer step on the fp32 masters: the shadows follow, in place
        for name, p in model.named_parameters():
            if "lora_" in name:
                # a step that moves log-probs far beyond the tolerance while keeping them a rounding-level
                # comparison (a 0.3-sized step grows the adapter output until fp32 noise nears 1e-5)
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    assert (_teacher_forced(model, result)[1] - want_lp).abs().max().item() > 100 * LP_TOL  # a stale shadow fails
    stepped = engine.generate(PROMPTS, GREEDY)
    assert engine.runner.plan is plan and plan.fingerprint() == shadows
    want_tokens, want_lp = _teacher_forced(model, stepped)
    assert [s.token_ids for s in stepped.samples] == want_tokens
    assert (torch.cat([s.logprobs for s in stepped.samples]).double() - want_lp).abs().max().item() < LP_TOL
