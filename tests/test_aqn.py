"""AQN schedule and noise injection on a tiny randomly initialised Llama (no download)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from qerl_cli.errors import QerlError
from qerl_cli.statefile import read_state, write_state
from qerl_cli.train.aqn import AQN, aqn_sigma, aqn_stage

NORMS = [
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.1.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight",
]


def _tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial clean norm weights, so restore-exactness means something
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_schedule_k10_over_100_steps():
    ratio = 0.6876560219  # (5e-4 / 1e-2) ** (1 / 8)
    for step in range(100):
        stage = step // 10
        assert aqn_stage(step, 100, 10) == stage
        sigma = aqn_sigma(step, 100)
        if stage == 0:
            assert sigma == 0.0
        else:
            assert sigma == pytest.approx(1e-2 * ratio ** (stage - 1), rel=1e-9)
    assert aqn_sigma(10, 100) == pytest.approx(1e-2, rel=1e-12)
    assert aqn_sigma(19, 100) == pytest.approx(1e-2, rel=1e-12)
    assert aqn_sigma(50, 100) == pytest.approx(2.2360679775e-3, rel=1e-9)  # stage 5: 1e-2 * 0.05 ** 0.5
    assert aqn_sigma(90, 100) == pytest.approx(5e-4, rel=1e-12)
    assert aqn_sigma(99, 100) == pytest.approx(5e-4, rel=1e-12)
    assert aqn_sigma(150, 100) == pytest.approx(5e-4, rel=1e-12)  # past the end: last stage
    # geometric: constant ratio between consecutive stages
    sig = [aqn_sigma(10 * k, 100) for k in range(1, 10)]
    assert [b / a for a, b in zip(sig, sig[1:], strict=False)] == pytest.approx([ratio] * 8, rel=1e-9)


def test_schedule_guards():
    assert aqn_sigma(99, 100, stages=1) == 0.0
    assert aqn_sigma(49, 100, stages=2) == 0.0
    assert aqn_sigma(50, 100, stages=2) == 1e-2
    assert aqn_sigma(99, 100, stages=3) == pytest.approx(5e-4)  # stages 1, 2 -> start, end
    assert aqn_sigma(40, 100, stages=3) == pytest.approx(1e-2)
    with pytest.raises(QerlError):
        aqn_sigma(0, 0)


def test_noise_goes_into_exactly_the_two_norms_per_layer_and_is_restored():
    model = _tiny_llama()
    aqn = AQN(model, total_steps=100, seed=0)
    assert aqn.names == NORMS
    before = _snapshot(model)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        clean_out = model(ids).logits

    noisy = aqn.noisy_norm_weights(15)  # stage 1: sigma 1e-2
    with aqn.apply(model, noisy):
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
        assert changed == NORMS  # not model.norm, not o_proj/down_proj or any other parameter
        diffs = torch.cat([(model.get_parameter(n) - before[n]).flatten() for n in NORMS])
        assert 0.7e-2 < diffs.std().item() < 1.3e-2  # 128 draws of N(0, 1e-4)
        with torch.no_grad():
            noisy_out = model(ids).logits
        assert not torch.equal(noisy_out, clean_out)
        assert aqn.last_metrics["aqn/model_noise_norm"] == pytest.approx(diffs.norm().item(), rel=1e-6)

    after = _snapshot(model)
    assert all(torch.equal(after[n], before[n]) for n in before)  # bit-exact restore
    with torch.no_grad():
        assert torch.equal(model(ids).logits, clean_out)  # the training forward sees clean weights

    m = aqn.last_metrics
    assert m["aqn/sigma"] == pytest.approx(1e-2) and m["aqn/stage"] == 1.0 and m["aqn/num_norms"] == 4.0
    assert m["aqn/noise_norm"] == pytest.approx(diffs.norm().item(), rel=1e-5)
    per_norm = [(noisy[n].float() - before[n]).norm().item() for n in NORMS]
    assert m["aqn/noise_norm_mean"] == pytest.approx(sum(per_norm) / 4, rel=1e-5)
    assert m["aqn/applied_noise_norm"] == pytest.approx(m["aqn/noise_norm"], rel=1e-5)


def test_restored_after_exception():
    model = _tiny_llama()
    aqn = AQN(model, total_steps=100)
    before = _snapshot(model)
    with pytest.raises(RuntimeError), aqn.noisy(20):
        with pytest.raises(QerlError):
            aqn.noisy_norm_weights(21)  # drawing from noisy weights is refused
        raise RuntimeError("rollout failed")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_stage_zero_adds_nothing():
    model = _tiny_llama()
    aqn = AQN(model, total_steps=100)
    noisy = aqn.noisy_norm_weights(3)
    assert all(torch.equal(noisy[n], model.get_parameter(n)) for n in NORMS)
    assert aqn.last_metrics["aqn/sigma"] == 0.0 and aqn.last_metrics["aqn/noise_norm"] == 0.0
    assert aqn.last_metrics["aqn/stage"] == 0.0


def test_redrawn_per_step_cached_within_step_and_seeded():
    model = _tiny_llama()
    a = AQN(model, total_steps=100, seed=7)
    s10 = a.noisy_norm_weights(10)
    again = a.noisy_norm_weights(10)  # refill round of the same step: same rollout policy
    s11 = a.noisy_norm_weights(11)
    assert all(torch.equal(s10[n], again[n]) for n in NORMS)
    assert all(not torch.equal(s10[n], s11[n]) for n in NORMS)
    z = [s10[n] - model.get_parameter(n).detach() for n in NORMS]
    assert all(not torch.equal(z[0], zi) for zi in z[1:])  # one Z per norm, not a shared draw

    b = AQN(_tiny_llama(), total_steps=100, seed=7)
    assert all(torch.equal(b.noisy_norm_weights(10)[n], s10[n]) for n in NORMS)
    c = AQN(_tiny_llama(), total_steps=100, seed=8)
    assert not torch.equal(c.noisy_norm_weights(10)[NORMS[0]], s10[NORMS[0]])


def test_resume_from_state_dict_is_reproducible(tmp_path):
    a = AQN(_tiny_llama(), total_steps=100, seed=1)
    a.noisy_norm_weights(10)
    a.noisy_norm_weights(11)
    write_state(tmp_path, "aqn", a.state_dict())  # how a checkpoint stores it (qerl_cli/statefile.py)
    ref12, ref13 = a.noisy_norm_weights(12), a.noisy_norm_weights(13)

    b = AQN(_tiny_llama(), total_steps=100, seed=999)
    b.load_state_dict(read_state(tmp_path, "aqn"))
    got12, got13 = b.noisy_norm_weights(12), b.noisy_norm_weights(13)
    assert all(torch.equal(ref12[n], got12[n]) and torch.equal(ref13[n], got13[n]) for n in NORMS)

    with pytest.raises(QerlError):
        AQN(_tiny_llama(), total_steps=200).load_state_dict(a.state_dict())


def test_bf16_rounds_small_noise_away_and_metrics_say_so():
    model = _tiny_llama().to(torch.bfloat16)
    with torch.no_grad():
        for n in NORMS:
            model.get_parameter(n).fill_(1.0)
    aqn = AQN(model, total_steps=100)
    aqn.noisy_norm_weights(95)  # sigma 5e-4: below half the bf16 spacing around 1.0 (2^-9)
    assert aqn.last_metrics["aqn/noise_norm"] > 0.0
    assert aqn.last_metrics["aqn/applied_noise_norm"] == 0.0
    aqn.noisy_norm_weights(15)  # sigma 1e-2 survives (partly)
    assert aqn.last_metrics["aqn/applied_noise_norm"] > 0.0


class _OddNorm(nn.Module):
    """Not an RMSNorm class by name: AQN must still find it through the layer's structure."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class _Layer(nn.Module):
    def __init__(self, d: int, gemma_style: bool) -> None:
        super().__init__()
        self.input_layernorm = _OddNorm(d)
        self.self_attn = nn.Linear(d, d)
        self.post_attention_layernorm = _OddNorm(d)
        if gemma_style:
            self.pre_feedforward_layernorm = _OddNorm(d)
        self.mlp = nn.Linear(d, d)


def test_structure_matching_and_errors():
    plain = nn.ModuleDict({"layers": nn.ModuleList([_Layer(8, False)])})
    assert AQN(plain, 10).names == ["layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"]
    gemma = nn.ModuleDict({"layers": nn.ModuleList([_Layer(8, True)])})
    assert AQN(gemma, 10).names == ["layers.0.input_layernorm.weight", "layers.0.pre_feedforward_layernorm.weight"]
    with pytest.raises(QerlError, match="no input_layernorm"):
        AQN(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), 10)


def test_math_sanity_of_ratio_literal():
    assert (5e-4 / 1e-2) ** (1 / 8) == pytest.approx(0.6876560219, rel=1e-9)
    assert math.sqrt(0.05) * 1e-2 == pytest.approx(2.2360679775e-3, rel=1e-9)
