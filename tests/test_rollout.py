"""The builtin rollout engine against transformers: greedy tokens, log-probs, batching invariance."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from qerl_cli.errors import QerlError
from qerl_cli.qlinear import QuantLinear
from qerl_cli.rollout import BuiltinEngine, Engine, SamplingParams, make_engine
from qerl_cli.rollout.sampling import TokenNoise, process_logits, sample_tokens, seed_key
from tests.helpers import random_decoder

PROMPTS = [
    "2 + 3 = 5\n14 + 5 = 19\n7 * 6 = 42\n31 + 22 = 53\n8 + 9 =",
    "The capital of France is",
    "Hi",
    "Write a short poem about the sea. The sea is",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch intra-op thread


@pytest.fixture(scope="module")
def smol() -> tuple[nn.Module, object]:
    """The embedded SmolLM2 in fp32, a transformers LlamaForCausalLM of this module's own: read from the session's
    dequantized-GGUF cache (~1 s), which tests/test_model_cache.py proves equal to transformers' GGUF load bit for
    bit (converting the GGUF file again here cost ~37 s)."""
    from qerl_cli.models import load_model

    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="module")
def smol_ids(smol) -> list[list[int]]:
    _, tokenizer = smol
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def hf_greedy(model: nn.Module, ids: list[int], new: int, eos: int | None) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=new,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def teacher_forced_logprobs(model: nn.Module, prompt: list[int], completion: list[int], t: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    steps = logits[len(prompt) - 1 : len(prompt) + len(completion) - 1]
    logp = torch.log_softmax(steps / t, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


# ----- sampling on hand-built logits (no model) --------------------------------------------------------


def test_top_k_top_p_on_hand_built_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    # probs at T=1: .5630 .2071 .1256 .0762 .0280 (sum of exp = 13.1237)
    full = process_logits(logits, 1.0, -1, 1.0)
    assert torch.allclose(full.exp(), torch.tensor([[0.56303, 0.20713, 0.12563, 0.07620, 0.02803]]), atol=1e-5)
    # top-k 2: renormalise over {2.0, 1.0}: p = e/(e+1) with e = e^1.
    k2 = process_logits(logits, 1.0, 2, 1.0)
    p0 = math.e / (math.e + 1.0)
    assert torch.allclose(k2[0, :2].exp(), torch.tensor([p0, 1 - p0]), atol=1e-6)
    assert torch.isinf(k2[0, 2:]).all()
    # top-p 0.8: the two largest hold .7702 < .8, so three tokens stay; 0.7 keeps two.
    p8 = process_logits(logits, 1.0, -1, 0.8)
    assert torch.isfinite(p8[0, :3]).all() and torch.isinf(p8[0, 3:]).all()
    expected = logits[0, :3] - torch.logsumexp(logits[0, :3], 0)
    assert torch.allclose(p8[0, :3], expected, atol=1e-6)
    assert torch.isfinite(process_logits(logits, 1.0, -1, 0.7)[0]).sum() == 2
    # temperature 0.5 doubles the logit gaps: top-2 probs become e^2/(e^2+1).
    t5 = process_logits(logits, 0.5, 2, 1.0)
    assert math.isclose(t5[0, 0].exp().item(), math.e**2 / (math.e**2 + 1), rel_tol=1e-6)
    # top-k ties: every token equal to the k-th value stays (transformers' rule).
    tied = process_logits(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), 1.0, 2, 1.0)
    assert torch.isfinite(tied[0, :3]).all() and torch.isinf(tied[0, 3])


def test_process_logits_equals_transformers_warpers() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=g) * 3
    for t, k, p in [(0.7, 20, 1.0), (1.0, -1, 0.9), (1.3, 50, 0.8), (0.6, -1, 1.0)]:
        scores = TemperatureLogitsWarper(t)(None, logits.clone()) if t != 1.0 else logits.clone()
        if k > 0:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1.0:
            scores = TopPLogitsWarper(p)(None, scores)
        ours = process_logits(logits, t, k, p)
        ref = torch.log_softmax(scores, dim=-1)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))
        finite = torch.isfinite(ref)
        assert torch.allclose(ours[finite], ref[finite], atol=1e-5)


def test_sampler_frequencies_determinism_and_batch_invariance() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    rows = 40000
    logits = probs.log().expand(rows, -1)
    cpu = torch.device("cpu")
    noise = TokenNoise(5, cpu)
    params = SamplingParams(temperature=1.0)
    uids = torch.arange(rows)
    steps = torch.full((rows,), 3)
    tokens, lps = sample_tokens(logits, params, noise, seed_key(1234, cpu), uids, steps)
    freq = torch.bincount(tokens, minlength=5).float() / rows
    assert torch.allclose(freq, probs, atol=0.01), freq  # 4 sigma of a binomial at p=.5 is 0.01
    assert torch.allclose(lps, probs.log()[tokens], atol=1e-6)
    again, _ = sample_tokens(logits, params, noise, seed_key(1234, cpu), uids, steps)
    assert torch.equal(tokens, again)
    other_seed, _ = sample_tokens(logits, params, noise, seed_key(1235, cpu), uids, steps)
    assert not torch.equal(tokens, other_seed)
    # A row's draw depends only on (seed, uid, step): any sub-batch, in any order, draws the same.
    pick = torch.tensor([39999, 7, 123, 7000])
    sub, _ = sample_tokens(logits[pick], params, noise, seed_key(1234, cpu), uids[pick], steps[pick])
    assert torch.equal(sub, tokens[pick])
    # Greedy: argmax, log-prob under the temperature-1 processed distribution.
    g_tok, g_lp = sample_tokens(
        logits[:2], SamplingParams(temperature=0.0), noise, seed_key(0, cpu), uids[:2], steps[:2]
    )
    assert g_tok.tolist() == [0, 0] and torch.allclose(g_lp, probs.log()[0].expand(2), atol=1e-6)


# ----- SmolLM2-135M (Llama, tied lm_head), fp32 ---------------------------------------------------------


def test_greedy_equals_transformers_generate(smol, smol_ids) -> None:
    model, tokenizer = smol
    engine = BuiltinEngine(model, tokenizer, max_batch_slots=4, max_model_len=256)
    result = engine.generate(smol_ids, SamplingParams(temperature=0.0, max_tokens=16))
    assert [s.prompt_index for s in result.samples] == [0, 1, 2, 3]
    assert result.stats["prefill_batches"] == 1  # four prompts of different lengths in one padded pass
    for ids, sample in zip(smol_ids, result.samples, strict=True):
        expected = hf_greedy(model, ids, 16, tokenizer.eos_token_id)
        assert sample.token_ids == expected
        assert sample.finish_reason == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")
        assert sample.logprobs.dtype == torch.float32 and sample.logprobs.shape == (len(expected),)
        # Greedy log-probs are those of the temperature-1 distribution.
        tf = teacher_forced_logprobs(model, ids, sample.token_ids, 1.0)
        assert torch.allclose(sample.logprobs, tf, atol=1e-4)
    assert result.timings["tokens"] == sum(len(s.token_ids) for s in result.samples)
    assert set(result.timings) >= {"prefill_s", "decode_s", "tokens", "tokens_per_s", "ttft"}


def test_sampled_logprobs_equal_teacher_forced_forward(smol, smol_ids) -> None:
    model, tokenizer = smol
    engine = BuiltinEngine(model, tokenizer, max_batch_slots=4, max_model_len=256)
    t = 0.7
    result = engine.generate(smol_ids[:2], SamplingParams(n=2, temperature=t, max_tokens=12, seed=7))
    worst = 0.0
    for sample in result.samples:
        tf = teacher_forced_logprobs(model, smol_ids[sample.prompt_index], sample.token_ids, t)
        worst = max(worst, (sample.logprobs - tf).abs().max().item())
    assert worst < 1e-4, worst  # fp32: decode-with-cache vs one full forward differ by ~1e-6
    # Reproducible from the seed.
    again = engine.generate(smol_ids[:2], SamplingParams(n=2, temperature=t, max_tokens=12, seed=7))
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in result.samples]


def test_continuous_batching_equals_one_at_a_time(smol) -> None:
    model, tokenizer = smol
    prompts = ["One", "Two plus two is", "The weather today", "import numpy as", "Dear John,\nI"]
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3)
    alone = BuiltinEngine(model, tokenizer, max_batch_slots=1, max_model_len=64).generate(prompts, sampling)
    batched = BuiltinEngine(model, tokenizer, max_batch_slots=2, max_model_len=64).generate(prompts, sampling)
    # 3 slots with n=2 leaves one sample of a prompt waiting in the stash; 3 steps per host sync
    # exercises truncation after a stop inside a window.
    windowed = BuiltinEngine(model, tokenizer, max_batch_slots=3, max_model_len=64, sync_every=3).generate(
        prompts, sampling
    )
    assert len(alone.samples) == 10
    for other in (batched, windowed):
        assert other.stats["prefill_prompts"] == 5  # one prefill per prompt, shared by its 2 samples
        for a, b in zip(alone.samples, other.samples, strict=True):
            assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
            assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)
    # The two samples of a prompt are different draws.
    assert any(alone.samples[2 * i].token_ids != alone.samples[2 * i + 1].token_ids for i in range(5))


def test_stop_tokens_stop_strings_and_lengths(smol, smol_ids) -> None:
    model, tokenizer = smol
    engine = BuiltinEngine(model, tokenizer, max_batch_slots=2, max_model_len=128, sync_every=4)
    ids = smol_ids[3]
    ref = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[]))
    tokens = ref.samples[0].token_ids
    assert len(tokens) == 12 and ref.samples[0].finish_reason == "length"

    stop = tokens[5]
    first = tokens.index(stop)
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]))
    assert out.samples[0].token_ids == tokens[: first + 1]  # the stop token is kept
    assert out.samples[0].finish_reason == "stop"
    assert torch.allclose(out.samples[0].logprobs, ref.samples[0].logprobs[: first + 1])

    short = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[]))
    assert short.samples[0].token_ids == tokens[:5] and short.samples[0].finish_reason == "length"

    # max_model_len bounds prompt + completion.
    tight = BuiltinEngine(model, tokenizer, max_batch_slots=1, max_model_len=len(ids) + 3)
    capped = tight.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[]))
    assert capped.samples[0].token_ids == tokens[:3] and capped.samples[0].finish_reason == "length"

    # A stop string ends the sample at the token that completes it.
    text = tokenizer.decode(tokens)
    word = text.split()[2]
    cut = next(i for i in range(1, 13) if word in tokenizer.decode(tokens[:i]))
    by_str = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[], stop=[word]))
    assert by_str.samples[0].token_ids == tokens[:cut] and by_str.samples[0].finish_reason == "stop"


def test_n_samples_share_one_prefill_and_release(smol, smol_ids) -> None:
    model, tokenizer = smol
    engine = BuiltinEngine(model, tokenizer, max_batch_slots=6, max_model_len=128)
    model.train()  # the engine must switch to eval for the rollout and restore the flags
    try:
        result = engine.generate(smol_ids[1:3], SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=11))
        assert model.training and model.model.layers[0].training
    finally:
        model.eval()
    assert result.stats["prefill_prompts"] == 2 and result.stats["prefill_batches"] == 1
    assert [(s.prompt_index, s.sample_index) for s in result.samples] == [(p, j) for p in range(2) for j in range(3)]
    engine.release()
    assert engine.runner.cache is None
    again = engine.generate(smol_ids[1:3], SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=11))
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in result.samples]


def bf16_logit_tolerance(top: float) -> float:
    """Four bf16 rounding steps (ulps) at the magnitude of the top logit: two bf16 forwards that sum in a
    different order may disagree by this much, so a margin below it is a tie (measured: 0.3 at 32.7)."""
    return 4 * 2.0 ** (math.floor(math.log2(max(abs(top), 1e-3))) - 7)


def test_bf16_greedy_tracks_transformers(smol, smol_ids) -> None:
    """bf16 (8-bit mantissa): the engine's attention/matmul order differs from transformers', so logits
    differ by bf16 rounding and a greedy path may part from transformers' at a near-tie (on an AVX2 EPYC
    at 32.69 vs 32.39). So the engine's tokens are checked against transformers' bf16 forward of the
    engine's own sequence: where transformers' top-1 margin exceeds bf16 rounding, the engine must pick
    transformers' top-1; where it does not, the engine's token must lie within that rounding of the top
    logit. Log-probs must stay within bf16 error of the teacher-forced forward."""
    model, tokenizer = smol
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    engine = BuiltinEngine(bf16, tokenizer, max_batch_slots=2, max_model_len=128)
    result = engine.generate(smol_ids[:2], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[]))
    decisive = 0
    for ids, sample in zip(smol_ids[:2], result.samples, strict=True):
        with torch.no_grad():
            full = bf16(torch.tensor([ids + sample.token_ids])).logits[0].float()
        steps = full[len(ids) - 1 : len(ids) + len(sample.token_ids) - 1]
        for pos, (row, tok) in enumerate(zip(steps, sample.token_ids, strict=True)):
            top2 = row.topk(2).values
            tol = bf16_logit_tolerance(top2[0].item())
            if (top2[0] - top2[1]).item() > tol:
                decisive += 1
                assert tok == row.argmax().item(), (pos, tok, row.argmax().item(), top2.tolist(), tol)
            else:
                assert row[tok].item() >= top2[0].item() - tol, (pos, tok, row[tok].item(), top2.tolist(), tol)
        tf = teacher_forced_logprobs(bf16, ids, sample.token_ids, 1.0)
        # bf16 logits of magnitude 10-30 carry rounding steps of 0.06-0.125 on their own.
        assert (sample.logprobs - tf).abs().max().item() < 0.3
    # not vacuous: half the 12 positions or more have a clear winner (7 here), where the engine must match
    assert decisive >= 6, decisive


# ----- tiny random Qwen2 (q/k/v bias, untied head) and Qwen3 (q_norm/k_norm) ---------------------------


def tiny_model(kind: str) -> nn.Module:
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                  initializer_range=0.15, rope_theta=10000.0, noisy_bias=True)
    if kind == "qwen3":
        return random_decoder(Qwen3Config, Qwen3ForCausalLM, head_dim=16, **common)
    return random_decoder(Qwen2Config, Qwen2ForCausalLM, **common)


TINY_PROMPTS = [[5, 17, 3], [9, 9, 40, 2, 77, 13, 8], [60], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def assert_tiny_greedy_matches(model: nn.Module, engine_model: nn.Module | None = None, **kw) -> None:
    engine = BuiltinEngine(engine_model or model, None, max_batch_slots=3, max_model_len=64)
    result = engine.generate(TINY_PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[]), **kw)
    for ids, sample in zip(TINY_PROMPTS, result.samples, strict=True):
        assert sample.token_ids == hf_greedy(model, ids, 10, None)
        assert torch.allclose(sample.logprobs, teacher_forced_logprobs(model, ids, sample.token_ids, 1.0), atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_tiny_qwen_greedy_equals_transformers(kind: str) -> None:
    model = tiny_model(kind)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    else:
        assert hasattr(model.model.layers[0].self_attn, "q_norm")
    assert_tiny_greedy_matches(model)


def test_quantized_modules_and_lora_are_applied() -> None:
    from peft import LoraConfig, get_peft_model

    model = tiny_model("qwen2")
    for layer in model.model.layers:  # qerl's QuantLinear is not an nn.Linear: the engine must call it
        layer.self_attn.q_proj = QuantLinear.from_linear(layer.self_attn.q_proj, "nvfp4", dtype=torch.float32)
        layer.mlp.down_proj = QuantLinear.from_linear(layer.mlp.down_proj, "int4", group_size=32, dtype=torch.float32)
    before = BuiltinEngine(model, None, max_batch_slots=2, max_model_len=64).generate(
        TINY_PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[])
    )
    assert_tiny_greedy_matches(model)
    # LoRA with non-zero B on attention and MLP projections (init_lora_weights=False draws both).
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["k_proj", "v_proj", "o_proj", "up_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(model, lora).eval()
    assert_tiny_greedy_matches(peft_model, peft_model)
    after = BuiltinEngine(peft_model, None, max_batch_slots=2, max_model_len=64).generate(
        TINY_PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[])
    )
    assert [s.token_ids for s in before.samples] != [s.token_ids for s in after.samples]


def test_norm_weights_read_live_and_overrides() -> None:
    model = tiny_model("qwen3")
    engine = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[])
    base = engine.generate(TINY_PROMPTS, greedy)
    norm = model.model.layers[0].input_layernorm
    original = norm.weight.detach().clone()
    noisy = original + 0.5 * torch.randn(original.shape, generator=torch.Generator().manual_seed(5))
    # Override for one call: same as transformers with the weight swapped in, model untouched.
    overridden = engine.generate(TINY_PROMPTS, greedy, norm_overrides={"model.layers.0.input_layernorm": noisy})
    assert torch.equal(norm.weight, original)
    with torch.no_grad():
        norm.weight.copy_(noisy)  # AQN style: in place, before the rollout
    try:
        assert_tiny_greedy_matches(model)
        live = engine.generate(TINY_PROMPTS, greedy)
    finally:
        with torch.no_grad():
            norm.weight.copy_(original)
    assert [s.token_ids for s in live.samples] == [s.token_ids for s in overridden.samples]
    assert [s.token_ids for s in live.samples] != [s.token_ids for s in base.samples]
    restored = engine.generate(TINY_PROMPTS, greedy)
    assert [s.token_ids for s in restored.samples] == [s.token_ids for s in base.samples]
    # q_norm names and the peft/.weight spellings resolve too; unknown names are refused.
    engine.generate(
        [[1, 2]], greedy, norm_overrides={"base_model.model.model.layers.1.self_attn.q_norm.weight": torch.ones(16)}
    )
    with pytest.raises(QerlError, match="not a norm module"):
        engine.generate([[1, 2]], greedy, norm_overrides={"model.layers.0.mlp": torch.ones(64)})


def test_make_engine_kinds_and_refusals() -> None:
    model = tiny_model("qwen2")
    engine = make_engine("builtin", model, None, max_batch_slots=1, max_model_len=32)
    assert isinstance(engine, BuiltinEngine) and isinstance(engine, Engine)
    with pytest.raises(QerlError, match="needs model_dir|needs vLLM"):
        make_engine("vllm", model)
    with pytest.raises(QerlError, match="unknown rollout engine"):
        make_engine("sglang", model)
    with pytest.raises(QerlError, match="leaves no room"):
        engine.generate([list(range(1, 33))], SamplingParams(temperature=0.0))
    with pytest.raises(QerlError, match="max_position_embeddings"):
        BuiltinEngine(model, None, max_model_len=4096)
    sliding = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=11,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
        )
    )
    with pytest.raises(QerlError, match="sliding-window"):
        BuiltinEngine(sliding, None, max_model_len=32)
    with pytest.raises(QerlError, match="top_p"):
        SamplingParams(top_p=0.0)
