"""Packed training forwards (train/packing.py) against the padded computation, fp32 on CPU: the same log-probs,
entropies and LoRA gradients, on rows of different lengths (so the padded batch has padding to skip)."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.train.logprobs import sampled_logprobs
from qerl_cli.train.packing import VARLEN_IMPL, pack, varlen_attention
from tests.test_logprobs import batch_of, lora_grads, tiny_model


def test_pack_layout_by_hand() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    mask = (ids != 0).long()
    mask[2] = 1
    p = pack(ids, mask)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 9] and p.offsets.tolist() == [0, 3, 5]
    assert (p.max_len, p.tokens, p.padded_tokens) == (4, 9, 12)


def test_varlen_attention_is_per_sequence_causal_attention() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(7, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, 4, scale=None)
    # by hand for the second sequence's first token: it sees only itself, so the output is its own value row
    torch.testing.assert_close(out[3], v[3].repeat_interleave(2, dim=0), rtol=0, atol=1e-6)
    # and the first sequence never sees the second: changing the second's keys leaves it alone
    k2 = k.clone()
    k2[3:] += 1.0
    torch.testing.assert_close(varlen_attention(q, k2, v, cu, 4, scale=None)[:3], out[:3], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_equals_padded_logprobs_entropy_and_gradients(family: str) -> None:
    model = tiny_model(family)
    batch = batch_of()
    assert batch.attention_mask.sum() < batch.attention_mask.numel()  # there is padding to skip
    temperature = 0.7
    ref_lp, ref_ent = sampled_logprobs(model, batch, temperature, with_entropy=True, chunk_tokens=3)
    lp, ent = sampled_logprobs(model, batch, temperature, with_entropy=True, chunk_tokens=3, packed=True)
    assert model.config._attn_implementation == VARLEN_IMPL
    m = batch.mask > 0
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[m], ref_ent[m], rtol=0, atol=1e-5)
    assert ref_lp[m].max() < 0

    w = torch.linspace(-1.0, 2.0, lp.numel()).reshape(lp.shape)
    model.zero_grad()
    ((sampled_logprobs(model, batch, temperature, chunk_tokens=3)[0] * w).sum()).backward()
    want = lora_grads(model)
    model.zero_grad()
    ((sampled_logprobs(model, batch, temperature, chunk_tokens=3, packed=True)[0] * w).sum()).backward()
    got = lora_grads(model)
    assert want.keys() == got.keys() and len(want) == 12
    for k in want:
        assert want[k].abs().max() > 1e-4, k
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5)


def test_padded_forward_still_works_after_switching() -> None:
    """The switched model's ordinary forwards (padded, with a 2D mask; or none) are the previous implementation's."""
    model = tiny_model("qwen2")
    batch = batch_of()
    before = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    plain_before = model(input_ids=batch.input_ids[:1]).logits
    sampled_logprobs(model, batch, 1.0, packed=True)  # switches the implementation
    after = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    keep = batch.attention_mask.bool()
    torch.testing.assert_close(after[keep], before[keep], rtol=0, atol=1e-6)
    torch.testing.assert_close(model(input_ids=batch.input_ids[:1]).logits, plain_before, rtol=0, atol=1e-6)


def test_packed_with_gradient_checkpointing() -> None:
    """The recompute in the backward must see the packed attention too (the switch is permanent, not scoped)."""
    model = tiny_model("llama")
    batch = batch_of()
    w = torch.linspace(-1.0, 2.0, batch.mask.numel()).reshape(batch.mask.shape)
    model.zero_grad()
    ((sampled_logprobs(model, batch, 1.0, chunk_tokens=4)[0] * w).sum()).backward()
    want = lora_grads(model)
    base = model.get_base_model()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    model.train()
    model.zero_grad()
    ((sampled_logprobs(model, batch, 1.0, chunk_tokens=4, packed=True)[0] * w).sum()).backward()
    got = lora_grads(model)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5)


def test_liger_logprob_backend_matches_chunked() -> None:
    """--logprob-backend liger (Liger-Kernel's fused linear + cross-entropy, Triton under TRITON_INTERPRET=1 here)
    gives the chunked path's log-probs and per-token gradients; skipped where liger-kernel is not installed."""
    pytest.importorskip("liger_kernel")
    from qerl_cli.train.logprobs import chunked_token_logprobs, liger_token_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g) * 0.3
    y = torch.randint(0, 40, (6,), generator=g)
    ref = chunked_token_logprobs(h, w, None, y, 0.7, 4)[0]
    h2 = h.detach().clone().requires_grad_(True)
    got = liger_token_logprobs(h2, w, None, y, 0.7)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    weights = torch.linspace(-1.0, 1.0, 6)
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(h2.grad, h.grad, rtol=0, atol=1e-5)


def test_cpu_packed_attention_is_one_padded_sdpa_and_equals_the_per_sequence_loop(monkeypatch) -> None:
    # 5 sequences of uneven length (one of 1 token), grouped-query heads: the padded batch gives every sequence's
    # rows and gradients as the per-sequence loop does, in one SDPA call instead of one per sequence
    from qerl_cli.train import packing

    g = torch.Generator().manual_seed(1)
    lengths = [6, 1, 9, 4, 7]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q, k, v = (torch.randn(cu[-1], h, 8, generator=g).requires_grad_(True) for h in (4, 2, 2))
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    out = varlen_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), max(lengths), scale=None)
    assert calls == [torch.Size([5, 4, 9, 8])]
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = packing._per_sequence(q, k, v, cu, None)
    (ref * torch.linspace(-1, 1, ref.numel()).reshape(ref.shape)).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for a, b in zip(got, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert packing.varlen_kernel(torch.device("cpu"), torch.float32, 4, 2, 8) == "padded SDPA"
