"""`sampling/entropy`: the entropy of the distribution the builtin engine sampled each token from, reported as it
samples -- under AQN the noisy policy's -- checked against teacher-forced logits of the same model (with the noisy
norm weights applied for the AQN case), and logged by the trainer next to the clean policy's `entropy`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qerl_cli.bench.shapes import get_shape
from qerl_cli.bench.step import _synthetic_task, build_shape_model, synthetic_prompts, synthetic_reward
from qerl_cli.manifest import RunDir
from qerl_cli.rollout import BuiltinEngine, SamplingParams
from qerl_cli.train.aqn import AQN
from qerl_cli.train.config import TrainConfig
from qerl_cli.train.trainer import Trainer, sampling_entropy

PROMPTS = [[5, 17, 3, 9], [9, 9, 40, 2, 77, 13, 8], [60, 1]]


def _model():
    return build_shape_model(get_shape("tiny"), "bf16", torch.device("cpu"), torch.float32, seed=0).eval()


def _teacher_forced_entropy(model, prompt, completion, temperature, top_k):
    """Per completion token: the entropy of softmax(top-k of logits / T), from one full forward (no engine)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    x = logits[len(prompt) - 1: len(prompt) + len(completion) - 1] / temperature
    kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
    p = torch.softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)
    return -(p * torch.log(p.clamp_min(1e-300))).sum(-1)


def _params(**kw):
    return SamplingParams(n=2, temperature=0.7, top_k=20, max_tokens=6, stop_token_ids=[], seed=3, **kw)


def test_engine_reports_the_sampled_distributions_entropy():
    model = _model()
    engine = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64)  # 3 slots: continuous batching
    res = engine.generate(PROMPTS, _params(entropy=True))
    for s in res.samples:
        ref = _teacher_forced_entropy(model, PROMPTS[s.prompt_index], s.token_ids, 0.7, 20)
        assert s.entropies is not None and s.entropies.shape == (len(s.token_ids),)
        assert torch.allclose(s.entropies.double(), ref, atol=1e-4)
        assert (s.entropies > 0).all() and (s.entropies < torch.log(torch.tensor(20.0))).all()
    plain = engine.generate(PROMPTS, _params())
    assert all(s.entropies is None for s in plain.samples)
    # asking for entropies changes nothing that is sampled
    assert [s.token_ids for s in plain.samples] == [s.token_ids for s in res.samples]


def test_aqn_sampling_entropy_is_the_noisy_policys():
    """With AQN's noisy norm weights passed to the engine, the reported entropies are those of the model with the
    noise applied (teacher-forced), not of the clean model the trainer's `entropy` measures."""
    model = _model()
    aqn = AQN(model, 2, sigma_start=1.0, sigma_end=1.0, stages=2, seed=1)
    noisy = aqn.noisy_norm_weights(1)  # stage 1: sigma 1, large enough to move the entropy visibly
    engine = BuiltinEngine(model, None, max_batch_slots=4, max_model_len=64)
    res = engine.generate(PROMPTS, _params(entropy=True), norm_overrides=noisy)
    moved = 0.0
    for s in res.samples:
        with aqn.apply(model, noisy):
            ref_noisy = _teacher_forced_entropy(model, PROMPTS[s.prompt_index], s.token_ids, 0.7, 20)
        ref_clean = _teacher_forced_entropy(model, PROMPTS[s.prompt_index], s.token_ids, 0.7, 20)
        assert torch.allclose(s.entropies.double(), ref_noisy, atol=1e-4)
        moved = max(moved, float((ref_noisy - ref_clean).abs().max()))
    assert moved > 1e-3  # the noise is in what was measured (10x the tolerance above)


def test_sampling_entropy_metric_hand_computed():
    @dataclasses.dataclass
    class S:
        entropies: torch.Tensor | None

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    samples = [S(torch.tensor([0.5, 1.5, 9.0])), S(torch.tensor([2.0]))]
    # masked tokens (the 9.0) do not count: (0.5 + 1.5 + 2.0) / 3
    assert sampling_entropy(samples, mask) == pytest.approx(4.0 / 3)
    assert sampling_entropy([S(None), S(torch.tensor([2.0]))], mask) is None  # an engine without entropies


def test_trainer_logs_sampling_entropy_next_to_entropy(tmp_path):
    spec = get_shape("tiny")
    cfg = TrainConfig(batch_prompts=2, num_generations=2, max_completion_length=4, lora_rank=4, precision="fp32",
                      lr=1e-2, steps=1, aqn=False, log_rollouts=False, seed=2, log_sampling_entropy=True)
    t = Trainer(RunDir(tmp_path / "r"), cfg, device="cpu")
    t.setup(model=build_shape_model(spec, "bf16", torch.device("cpu"), torch.float32, seed=0), tokenizer=None,
            task=_synthetic_task(2, 4, 4), prompt_ids=synthetic_prompts(2, 4, spec.vocab, 0),
            reward_fn=synthetic_reward(0))
    m = t.train_step()
    # no AQN, fp32: the engine sampled from the very policy the training forward recomputes
    assert m["sampling/entropy"] == pytest.approx(m["entropy"], abs=1e-4) and m["sampling/entropy"] > 0
    # off by default: the rollouts keep the fused sampler and the metric is absent
    assert TrainConfig().log_sampling_entropy is False


def test_stop_strings_keep_entropies_aligned(embedded):
    """A stop string cuts a sample inside a decode window: its entropies are cut with its tokens, and each still
    equals the teacher-forced entropy of its own position (the embedded model, arith prompts, stop at a newline)."""
    model, tok = embedded
    prompts = [tok("2 + 3 = 5\n14 + 5 = 19\n7 + 1 =").input_ids, tok("6 * 7 = 42\n3 * 3 =").input_ids]
    engine = BuiltinEngine(model, tok, max_batch_slots=4, max_model_len=64)
    res = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, stop=["\n"], seed=5,
                                                  entropy=True))
    assert any(s.finish_reason == "stop" for s in res.samples)
    for s in res.samples:
        assert s.entropies.shape == (len(s.token_ids),)
        with torch.no_grad():
            logits = model(torch.tensor([prompts[s.prompt_index] + s.token_ids])).logits[0].double()
        n = len(prompts[s.prompt_index])
        ref = torch.distributions.Categorical(logits=logits[n - 1: n - 1 + len(s.token_ids)]).entropy()
        assert torch.allclose(s.entropies.double(), ref, atol=1e-3)
