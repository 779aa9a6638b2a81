"""The MoE training backward as grouped kernels (``qerl_kernels.moe.grouped_linear_t`` and ``segment_outer`` on the
forward's sorted rows) against the per-expert loop it replaces and against plain autograd on dequantized weights,
under the Triton interpreter: dense, NVFP4 and MXFP4 experts, LoRA on and off, uneven and empty expert groups,
top-2 with x_div 1 (the down projection: one row per assignment) and 2 (gate_up: two assignments read one token);
then a tiny Qwen3-MoE trained forward+backward with kernels on and off. docs/moe.md, "The grouped backward".

Tolerances. Everything here is fp32 (the interpreter computes the kernels in fp32, ``_common``): the grouped and
the looped backward do the same products and differ only in the order fp32 sums them (the kernels sum over N in
tiles of 64 and over an expert's rows block by block, torch's matmul in its own blocking). Sums of at most a few
hundred terms of size ~1: the difference is a few ulps of the largest partial sum, so ``atol = 1e-5 * max|ref|``
and ``rtol = 1e-5`` (about 80 fp32 ulps: loose enough for any order, tight enough that one dropped or doubled
term, which moves a gradient by ~1e-2 relative, fails)."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.moe import DOWN, GATE_UP, ExpertProjection, MoeExperts, Routing, quantize_experts

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch intra-op thread

E, H, I_, K_TOP, R = 6, 64, 32, 2, 4


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    torch.testing.assert_close(got, ref, rtol=rel, atol=rel * float(ref.abs().max().clamp(min=1e-30)))


def _experts(fmt: str) -> MoeExperts:
    g = torch.Generator().manual_seed(0)
    return quantize_experts(torch.randn(E, 2 * I_, H, generator=g) * 0.1, torch.randn(E, H, I_, generator=g) * 0.1,
                            fmt, dtype=torch.float32)


def _index(tokens: int) -> torch.Tensor:
    """Top-2 routing of ``tokens`` tokens with uneven groups and empty experts: expert 0 takes every token's first
    slot, the second slot cycles over experts 1, 2, 4 (3 and 5 get nothing), so the groups are [T, ~T/3, ...]."""
    second = torch.tensor([1, 2, 4, 1, 1, 2, 4])[torch.arange(tokens) % 7]
    return torch.stack([torch.zeros(tokens, dtype=torch.long), second], 1)


def _grads(experts: MoeExperts, proj: str, x_div: int, kernels: bool, lora: bool, tokens: int = 11,
           seed: int = 1) -> tuple[torch.Tensor, ...]:
    """(y, dx, dA, dB) of one ExpertProjection under a random cotangent (dA, dB empty without LoRA)."""
    _, n, k = experts.projection_shape(proj)
    g = torch.Generator().manual_seed(seed)
    index = _index(tokens)
    rows_in = tokens if x_div == K_TOP else tokens * K_TOP
    x = torch.randn(rows_in, k, generator=g).requires_grad_(True)
    a = (torch.randn(E, R, k, generator=g) * 0.1).requires_grad_(True)
    b = (torch.randn(E, n, R, generator=g) * 0.1).requires_grad_(True)
    cot = torch.randn(tokens * K_TOP, n, generator=g)
    routing = Routing(index.reshape(-1), E, kernels=kernels)
    y = ExpertProjection.apply(x, a if lora else None, b if lora else None, experts, proj, routing, x_div, 2.0)
    (y * cot).sum().backward()
    empty = torch.empty(0)
    return (y.detach(), x.grad, a.grad if lora else empty, b.grad if lora else empty)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("proj,x_div", [(GATE_UP, K_TOP), (DOWN, 1)])
@pytest.mark.parametrize("lora", [True, False])
def test_grouped_backward_equals_the_per_expert_loop(fmt: str, proj: str, x_div: int, lora: bool) -> None:
    experts = _experts(fmt)
    experts.use_kernels = True  # kernel_kind: run the grouped kernels on the CPU (interpreter)
    ref = _grads(experts, proj, x_div, kernels=False, lora=lora)
    got = _grads(experts, proj, x_div, kernels=True, lora=lora)
    for r, g in zip(ref, got, strict=True):
        if r.numel():
            _close(g, r)
    assert ref[1].abs().max() > 0.1
    if lora:  # the empty experts' factors get exactly zero gradient, the routed ones not
        for grad in ref[2:]:
            assert grad[[3, 5]].abs().max() == 0 and grad[[0, 1, 2, 4]].abs().amin(dim=(1, 2)).min() > 0
        for grad in got[2:]:
            assert grad[[3, 5]].abs().max() == 0


def _autograd_reference(experts: MoeExperts, proj: str, x_div: int, tokens: int = 11,
                        seed: int = 1) -> tuple[torch.Tensor, ...]:
    """The same (y, dx, dA, dB) by plain autograd in float64 on the dequantized weights: every assignment gathers
    its expert's W, A, B (no grouping, no custom backward)."""
    _, n, k = experts.projection_shape(proj)
    g = torch.Generator().manual_seed(seed)
    index = _index(tokens).reshape(-1)
    rows_in = tokens if x_div == K_TOP else tokens * K_TOP
    x = torch.randn(rows_in, k, generator=g).double().requires_grad_(True)
    a = (torch.randn(E, R, k, generator=g) * 0.1).double().requires_grad_(True)
    b = (torch.randn(E, n, R, generator=g) * 0.1).double().requires_grad_(True)
    cot = torch.randn(tokens * K_TOP, n, generator=g).double()
    w = torch.stack([experts.expert_weight(proj, e, torch.float64) for e in range(E)])
    xin = x[torch.arange(tokens * K_TOP) // x_div]
    h = torch.einsum("mk,mrk->mr", xin, a[index])
    y = torch.einsum("mk,mnk->mn", xin, w[index]) + 2.0 * torch.einsum("mr,mnr->mn", h, b[index])
    (y * cot).sum().backward()
    return y.detach(), x.grad, a.grad, b.grad


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("proj,x_div", [(GATE_UP, K_TOP), (DOWN, 1)])
def test_grouped_backward_equals_autograd_on_dequantized_weights(fmt: str, proj: str, x_div: int) -> None:
    experts = _experts(fmt)
    experts.use_kernels = True
    want = _autograd_reference(experts, proj, x_div)
    got = _grads(experts, proj, x_div, kernels=True, lora=True)
    for r, gv in zip(want, got, strict=True):
        _close(gv.double(), r)


def test_grouped_backward_is_deterministic_and_handles_one_expert_and_no_tokens() -> None:
    experts = _experts("nvfp4")
    experts.use_kernels = True
    first = _grads(experts, GATE_UP, K_TOP, kernels=True, lora=True, tokens=40)  # 80 rows: several blocks
    again = _grads(experts, GATE_UP, K_TOP, kernels=True, lora=True, tokens=40)
    assert all(torch.equal(p, q) for p, q in zip(first, again, strict=True))  # fixed order, no atomics
    loop = _grads(experts, GATE_UP, K_TOP, kernels=False, lora=True, tokens=40)
    for r, g in zip(loop, first, strict=True):
        _close(g, r)
    # no tokens at all: empty dx, zero LoRA gradients
    for kernels in (True, False):
        x = torch.zeros(0, H, requires_grad=True)
        a = torch.randn(E, R, H, requires_grad=True)
        b = torch.randn(E, 2 * I_, R, requires_grad=True)
        routing = Routing(torch.zeros(0, dtype=torch.long), E, kernels=kernels)
        ExpertProjection.apply(x, a, b, experts, GATE_UP, routing, K_TOP, 2.0).sum().backward()
        assert x.grad.shape == (0, H) and a.grad.abs().max() == 0 and b.grad.abs().max() == 0


def test_tiny_qwen3_moe_training_step_with_kernels_equals_kernels_off() -> None:
    """A tiny random Qwen3-MoE (the bench's tiny-moe shape, NVFP4 experts, fp32) with qerl's LoRA on attention and
    every expert: loss and every LoRA gradient with the grouped forward+backward equal the per-expert loop's."""
    from qerl_cli.bench.shapes import build_random_model
    from qerl_cli.lora import attach_lora, make_lora_config
    from qerl_cli.moe import moe_blocks

    model = build_random_model("tiny-moe", "nvfp4", "cpu", dtype=torch.float32, seed=0)
    model = attach_lora(model, make_lora_config(4, 8), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    blocks = moe_blocks(model)
    assert blocks
    out = []
    for kernels in (False, True):
        for blk in blocks:
            blk.experts.use_kernels = kernels
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        loss = torch.log_softmax(logits.float(), -1)[..., :-1, :].gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((loss.detach(), grads))
    assert any("experts" in n for n in out[0][1]), "no expert LoRA gradient"
    assert out[0][1].keys() == out[1][1].keys()
    _close(out[1][0], out[0][0])
    for n, ref in out[0][1].items():
        assert ref.abs().max() > 0, n
        _close(out[1][1][n], ref, rel=1e-4)  # through 2 layers of attention/norms: fp32 order effects compound
