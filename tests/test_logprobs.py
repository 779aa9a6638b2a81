"""The chunked lm_head + log-softmax + gather + entropy path against the direct full-vocabulary computation
(fp32, CPU): log-probs, entropies and LoRA gradients to 1e-6, with chunks that split rows unevenly."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.lora import attach_lora, make_lora_config
from qerl_cli.train.batch import build_batch
from qerl_cli.train.batch import sampled_logprobs as full_logprobs
from qerl_cli.train.logprobs import chunked_token_logprobs, plain_head, sampled_logprobs


def tiny_model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = LlamaConfig if family == "llama" else Qwen2Config
    cfg = cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=97, max_position_embeddings=128, tie_word_embeddings=family == "qwen2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.requires_grad_(False)
    peft = attach_lora(model, make_lora_config(4, 8.0, ["q_proj", "v_proj", "down_proj"]), seed=1)
    with torch.no_grad():  # non-zero B so the adapters change the logits and get gradients on both factors
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    return peft


def batch_of(mask_truncated: bool = False):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 3, 7)]
    comps = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (6, 2, 4)]
    mu = [torch.full((len(c),), -1.0) for c in comps]
    return build_batch(prompts, comps, mu, [True, False, False], pad_id=0, mask_truncated=mask_truncated)


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_equals_full_logprobs_entropy_and_gradients(family: str, chunk: int) -> None:
    model = tiny_model(family)
    batch = batch_of()
    assert plain_head(model) is not None
    temperature = 0.7
    ref_lp, ref_ent = full_logprobs(model, batch, temperature, with_entropy=True)
    lp, ent = sampled_logprobs(model, batch, temperature, with_entropy=True, chunk_tokens=chunk)
    m = batch.mask > 0
    assert lp.shape == ref_lp.shape == batch.mask.shape
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent[m], ref_ent[m], rtol=0, atol=1e-6)
    assert (lp[~m] == 0).all() and (ent[~m] == 0).all()
    assert ref_lp[m].max() < 0 and ent[m].min() > 0  # real distributions, not zeros

    # a loss that weighs tokens differently, so gradients check the per-token Jacobian, not just its sum
    w = torch.linspace(-1.0, 2.0, lp.numel()).reshape(lp.shape)
    model.zero_grad()
    ((full_logprobs(model, batch, temperature)[0] * w).sum()).backward()
    want = lora_grads(model)
    model.zero_grad()
    ((sampled_logprobs(model, batch, temperature, chunk_tokens=chunk)[0] * w).sum()).backward()
    got = lora_grads(model)
    assert want.keys() == got.keys() and len(want) == 12
    for k in want:
        assert want[k].abs().max() > 1e-4, k
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)


def test_reference_pass_without_adapter_and_masked_truncation() -> None:
    model = tiny_model("llama")
    batch = batch_of(mask_truncated=True)
    assert batch.mask[0].sum() == 0  # the truncated row carries no loss
    with torch.no_grad(), model.disable_adapter():
        want = full_logprobs(model, batch, 1.0)[0]
        got = sampled_logprobs(model, batch, 1.0, chunk_tokens=2)[0]
        with_adapter = None
    with torch.no_grad():
        with_adapter = sampled_logprobs(model, batch, 1.0, chunk_tokens=2)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got[0] == 0).all() and (got - with_adapter).abs().max() > 1e-3


def test_hand_computed_chunk_and_its_jacobian() -> None:
    # one hidden row h = [1, 0], W rows e1, e2, e1 + e2 -> logits [1, 0, 1]; y = 2, T = 1
    h = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    lp, ent = chunked_token_logprobs(h, weight, None, torch.tensor([2]), 1.0, 1, with_entropy=True)
    z = 2 * math.e + 1
    assert lp.dtype == torch.float64 and lp.item() == pytest.approx(1 - math.log(z), abs=1e-12)
    p = [math.e / z, 1 / z, math.e / z]
    assert ent.item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-12)
    lp.sum().backward()
    # d log p_y / dh = W[y] - sum_v p_v W[v] = [1, 1] - [2e/z, (1 + e)/z]
    want = torch.tensor([1 - 2 * math.e / z, 1 - (1 + math.e) / z], dtype=torch.float64)
    torch.testing.assert_close(h.grad[0], want, rtol=0, atol=1e-12)
    with pytest.raises(QerlError, match="chunk"):
        chunked_token_logprobs(h, weight, None, torch.tensor([2]), 1.0, 0)


def test_models_outside_the_plain_head_list_take_the_direct_path() -> None:
    model = tiny_model("llama")
    model.get_base_model().lm_head.weight.requires_grad_(True)  # a trainable head: no Jacobian shortcut
    assert plain_head(model) is None
    batch = batch_of()
    torch.testing.assert_close(sampled_logprobs(model, batch, 1.0, chunk_tokens=2)[0],
                               full_logprobs(model, batch, 1.0)[0], rtol=0, atol=0)
