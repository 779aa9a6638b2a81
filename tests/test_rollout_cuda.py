"""The builtin rollout engine on CUDA: CUDA-graph decode equals eager decode and transformers.

Skipped without a GPU (CI has none); run on a GPU machine with ``pytest tests/test_rollout_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from qerl_cli.rollout import BuiltinEngine, SamplingParams
from tests.helpers import random_decoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 17, 3], [9, 9, 40, 2, 77, 13, 8], [60], list(range(1, 40)), [300, 301, 302, 303, 304]]


def random_model(kind: str, dtype: torch.dtype, head_dim: int | None = None) -> nn.Module:
    common = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.08, rope_theta=10000.0)
    if kind == "qwen3":
        model = random_decoder(Qwen3Config, Qwen3ForCausalLM, head_dim=32, tie_word_embeddings=False, **common)
    else:
        extra = {} if head_dim is None else {"head_dim": head_dim}
        model = random_decoder(LlamaConfig, LlamaForCausalLM, tie_word_embeddings=True, **extra, **common)
    return model.to("cuda", dtype).eval()


def hf_greedy(model: nn.Module, ids: list[int], new: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids], device="cuda"),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
        do_sample=False,
        max_new_tokens=new,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def run(engine: BuiltinEngine, sampling: SamplingParams, prompts: list[list[int]] | None = None,
        **kw) -> tuple[list[list[int]], list[torch.Tensor]]:
    result = engine.generate(prompts or PROMPTS, sampling, **kw)
    return [s.token_ids for s in result.samples], [s.logprobs for s in result.samples]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_graph_decode_equals_eager_and_transformers(kind: str) -> None:
    model = random_model(kind, torch.float32)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[])
    graphs = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=256, gpu_memory_utilization=0.9)
    eager = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=256, cuda_graphs=False)
    assert graphs.use_graphs and not eager.use_graphs
    g_tokens, g_lps = run(graphs, greedy)
    assert graphs._graphs is not None and graphs._graphs.graphs  # decode really replayed graphs
    e_tokens, e_lps = run(eager, greedy)
    assert g_tokens == e_tokens
    for ids, tokens in zip(PROMPTS, g_tokens, strict=True):
        assert tokens == hf_greedy(model, ids, 24)
    for a, b in zip(g_lps, e_lps, strict=True):
        assert torch.allclose(a, b, atol=1e-4)

    sampled = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_tokens=20, seed=5, stop_token_ids=[7])
    g_tokens, _ = run(graphs, sampled)
    e_tokens, _ = run(eager, sampled)
    assert g_tokens == e_tokens
    # After release() the cache has a new address: graphs must be recaptured, results unchanged.
    graphs.release()
    assert run(graphs, sampled)[0] == g_tokens


def test_graphs_see_norm_swaps_and_overrides() -> None:
    model = random_model("qwen3", torch.float32)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    graphs = BuiltinEngine(model, None, max_batch_slots=4, max_model_len=128)
    eager = BuiltinEngine(model, None, max_batch_slots=4, max_model_len=128, cuda_graphs=False)
    base = run(graphs, greedy)[0]
    norm = model.model.layers[1].post_attention_layernorm
    noisy = norm.weight.detach() + 0.5 * torch.randn_like(norm.weight)
    overrides = {"model.layers.1.post_attention_layernorm": noisy}
    over = run(graphs, greedy, norm_overrides=overrides)[0]
    assert over == run(eager, greedy, norm_overrides=overrides)[0]
    assert over != base
    original = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.copy_(noisy)
    assert run(graphs, greedy)[0] == over  # in-place swap seen by the captured graphs
    with torch.no_grad():
        norm.weight.copy_(original)
    assert run(graphs, greedy)[0] == base


def lora_graph_and_eager_engines():  # noqa: ANN201 - (peft model, greedy params, graph engine, eager engine)
    """A bf16 random Llama with a non-zero LoRA, and the CUDA-graph and eager engines over it (also used by
    scripts/rollout_tie_check.py)."""
    from peft import LoraConfig, get_peft_model

    model = random_model("llama", torch.bfloat16)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora).eval()
    greedy = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    graphs = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=128)
    eager = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=128, cuda_graphs=False)
    return peft_model, greedy, graphs, eager


def test_graphs_follow_lora_toggles_and_bf16() -> None:
    peft_model, greedy, graphs, eager = lora_graph_and_eager_engines()
    # 8 prompts = a graph batch bucket, so both engines run the same GEMM shapes (bf16 rounding depends on M).
    # On an H200 (2026-11-24, scripts/rollout_tie_check.py) greedy runs parted at fp32 logit gaps of 0.017 and
    # 0.021 (near-ties), with fused projections on and off alike, and with 8 prompts too, until the fused
    # RoPE/KV-write first-use check stopped leaving torch-rounded K/V rows in the eager engine's cache.
    prompts = PROMPTS + [[7, 8, 9], [400, 12], [33] * 6]
    with_lora = run(graphs, greedy, prompts=prompts)[0]
    with peft_model.disable_adapter():
        without = run(graphs, greedy, prompts=prompts)[0]
        assert without == run(eager, greedy, prompts=prompts)[0]
    assert without != with_lora
    assert run(graphs, greedy, prompts=prompts)[0] == with_lora == run(eager, greedy, prompts=prompts)[0]


def _default_switches(use_options) -> None:  # noqa: ANN001
    """The default decode path, whatever switches the process was started with (`scripts/gpu.sh gputests` runs
    this file under each decode switch in QERL_GPU_TEST_ENVS; tests of the defaults test the defaults)."""
    use_options(fused_lora=True, fused_sampling=True, cuda_fp4_plans="stream", cuda_pdl=True, fast_decode=True,
                decode_attn="auto")


def test_fast_decode_path_on_cuda(use_options) -> None:  # noqa: ANN001
    """The fused Triton kernels build, pass their first-use check and, with LoRA shadows, give the module
    path's greedy tokens (fp32) inside CUDA graphs; QERL_FAST_DECODE=0 turns the whole path off."""
    _default_switches(use_options)
    from peft import LoraConfig, get_peft_model
    from qerl_kernels import decode as decode_kernels

    model = random_model("qwen3", torch.float32)
    lora = LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora).eval()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[])
    before = sum(decode_kernels.LAUNCHES.values())
    fast = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=256)
    f_tokens, f_lps = run(fast, greedy)
    assert fast.runner.ops.triton and not fast.runner.ops.fell_back, fast.runner.ops.fell_back
    assert sum(decode_kernels.LAUNCHES.values()) > before and fast._graphs is not None and fast._graphs.graphs
    slow = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=256, fast_lora=False,
                         fused_kernels=False)
    s_tokens, s_lps = run(slow, greedy)
    assert f_tokens == s_tokens
    for a, b in zip(f_lps, s_lps, strict=True):
        assert torch.allclose(a, b, atol=1e-4)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5, stop_token_ids=[])
    assert run(fast, sampled)[0] == run(slow, sampled)[0]
    assert fast.noise.fused  # the Triton sampling noise passed its bit-exact first-use check
    use_options(fast_decode=False)
    off = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=256)
    assert not off.runner.fast_lora and not off.runner.ops.triton and not off.noise.fused
    assert run(off, greedy)[0] == s_tokens


def _all_lora(model: nn.Module, rank: int = 8) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"], init_lora_weights=False)
    return get_peft_model(model, lora).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lora_and_sampler_on_cuda(use_options, dtype: torch.dtype) -> None:  # noqa: ANN001
    """Issue 25's default decode path on the GPU: one-launch Triton LoRA shrinks (q/k/v, gate/up after the norm
    kernel, o's on the attention output), the one-pass sampler captured in the decode graphs. Kernels build and
    pass their first-use checks; fp32 greedy and sampled tokens equal the QERL_FUSED_LORA=0 /
    QERL_FUSED_SAMPLING=0 path (log-probs to 1e-4); bf16 runs with no fallback."""
    _default_switches(use_options)
    use_options(fused_lora=True)  # the default (Triton shrinks, expands in the FP4 epilogue)
    from qerl_kernels import decode as decode_kernels

    peft_model = _all_lora(random_model("qwen3", dtype))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[])
    sampled = SamplingParams(n=2, temperature=0.8, max_tokens=16, seed=5, stop_token_ids=[])
    names = ("rmsnorm_shrink", "silu_mul_shrink", "lora_shrink", "sample_tokens")
    before = {n: decode_kernels.LAUNCHES[n] for n in names}
    fused = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=256)
    f_greedy, f_greedy_lp = run(fused, greedy)
    f_sampled, f_sampled_lp = run(fused, sampled)
    assert all(fused.runner.ops.enabled.values()), fused.runner.ops.enabled
    assert fused.noise.fused_sampling and fused.runner.ops.fused_lora
    # the measured rule: Triton shrinks after the norm kernel and on the attention output (the one-launch
    # norm/SiLU forms are off: decode_kernels.NORM/SILU_SHRINK_MAX_ROWS = 0)
    assert decode_kernels.LAUNCHES["lora_shrink"] > before["lora_shrink"]
    if decode_kernels.NORM_SHRINK_MAX_ROWS == 0:
        assert decode_kernels.LAUNCHES["rmsnorm_shrink"] == before["rmsnorm_shrink"]
    # the sampler ran inside the decode graphs (graph keys carry the sampler's signature in their fourth place;
    # the last is the W4A8 option's)
    assert any(key[3] is not None for key in fused._graphs.graphs), list(fused._graphs.graphs)
    if dtype != torch.float32:
        return
    use_options(fused_lora=False, fused_sampling=False)
    plain = BuiltinEngine(peft_model, None, max_batch_slots=8, max_model_len=256)
    assert not plain.runner.ops.fused_lora and not plain.noise.fused_sampling
    p_greedy, p_greedy_lp = run(plain, greedy)
    p_sampled, p_sampled_lp = run(plain, sampled)
    assert f_greedy == p_greedy and f_sampled == p_sampled
    for a, b in zip(f_greedy_lp + f_sampled_lp, p_greedy_lp + p_sampled_lp, strict=True):
        assert torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_kernels_at_model_sizes_on_cuda(dtype: torch.dtype) -> None:
    """The compiled kernels on Qwen2.5-7B sizes (hidden 3584, intermediate 18944, r = 32 per projection, vocab
    152064) at batches 1, 8, 64 and 256, against torch: shrinks to one rounding of their output, the sampler's
    tokens equal to the torch path's (up to near-ties) and inside a CUDA graph equal to eager."""
    from qerl_kernels.decode import lora_shrink, rmsnorm_shrink, silu_mul_shrink

    from qerl_cli.rollout.fast_layers import rms_norm_ref
    from qerl_cli.rollout.sampling import StepSampler, TokenNoise, torch_sample

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    hidden, inter = 3584, 18944
    for m in (1, 8, 64, 256):
        a3 = (0.02 * torch.randn(96, hidden, device=dev, generator=g)).to(dtype)
        ad = (0.02 * torch.randn(32, inter, device=dev, generator=g)).to(dtype)
        h = torch.randn(m, 1, hidden, device=dev, generator=g).to(dtype)
        d = torch.randn(m, 1, hidden, device=dev, generator=g).to(dtype)
        w = (1 + 0.3 * torch.randn(hidden, device=dev, generator=g)).to(dtype)
        s, x, hl = rmsnorm_shrink(h, d, w, 1e-6, a3)
        want_x = rms_norm_ref(h + d, w, 1e-6)
        assert torch.equal(s, h + d)
        assert ((x.float() - want_x.float()).norm() / want_x.float().norm()).item() < tol
        want = x.reshape(m, hidden).double() @ a3.double().T
        assert ((hl.double() - want).norm() / want.norm()).item() < tol
        gu = torch.randn(m, 2 * inter, device=dev, generator=g).to(dtype)
        act, hl = silu_mul_shrink(gu[:, :inter], gu[:, inter:], ad)
        want = act.double() @ ad.double().T
        assert ((hl.double() - want).norm() / want.norm()).item() < tol
        o = torch.randn(m, 1, hidden, device=dev, generator=g).to(dtype)
        want = o.reshape(m, hidden).double() @ a3[:32].double().T
        assert ((lora_shrink(o, a3[:32].contiguous()).double() - want).norm() / want.norm()).item() < tol
    vocab = 152064
    fused = TokenNoise(vocab, dev, fused=True, fused_sampling=True)
    plain = TokenNoise(vocab, dev, fused=True, fused_sampling=False)
    for b in (8, 64, 256):
        logits = (3 * torch.randn(b, vocab, device=dev, generator=g)).to(dtype)
        uids, steps = torch.arange(b, device=dev), torch.full((b,), 3, device=dev)
        for temp in (1.0, 0.7, 0.0):
            params = SamplingParams(temperature=temp)
            sampler = StepSampler(params, fused, 42, dev)
            tok, lp = sampler(logits, uids, steps)
            assert fused.fused_sampling, "the fused sampler fell back"
            want_tok, want_lp = torch_sample(logits, params, plain, sampler.key, uids, steps)
            assert (tok == want_tok).float().mean().item() >= 0.99  # near-ties may resolve either way
            same = tok == want_tok
            assert (lp[same] - want_lp[same]).abs().max().item() < 1e-4
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                g_tok, g_lp = sampler(logits, uids, steps)
            graph.replay()
            assert torch.equal(g_tok, tok) and torch.equal(g_lp, lp)


def test_flashinfer_decode_matches_sdpa_on_cuda() -> None:
    """FlashInfer's paged batch decode over qerl's cache (the page table attention.py builds) against SDPA, for
    the 7B and 32B head layouts, eager and inside a CUDA graph planned per replay. Skipped without flashinfer."""
    pytest.importorskip("flashinfer")
    from qerl_cli.rollout.attention import DecodeAttention, sdpa_decode
    from qerl_cli.rollout.model_runner import decode_mask

    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    for heads, kvh in ((28, 4), (40, 8)):
        slots, max_len, d = 16, 2048, 128
        k_cache = torch.randn(slots, max_len, kvh, d, device=dev, dtype=dtype, generator=g)
        v_cache = torch.randn(slots, max_len, kvh, d, device=dev, dtype=dtype, generator=g)
        att = DecodeAttention(num_heads=heads, num_kv_heads=kvh, head_dim=d, scale=d**-0.5, max_len=max_len,
                              dtype=dtype, device=dev, backend="flashinfer")
        assert att.backend == "flashinfer"
        positions = [0, 15, 16, 700, 2047, 1023, 64, 5]
        pos = torch.tensor(positions, device=dev)
        q = torch.randn(len(positions), heads, d, device=dev, dtype=dtype, generator=g)
        want = sdpa_decode(q, k_cache, v_cache, max_len, decode_mask(pos, max_len, dtype), d**-0.5)
        att.select(8, max_len)
        att.plan(positions)
        got = att(q, k_cache, v_cache, max_len, None)
        assert att.current == "flashinfer", "FlashInfer failed and fell back"
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2
        att.plan(positions, bucket=8)  # the CUDA-graph wrapper of batch bucket 8
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = att(q, k_cache, v_cache, max_len, None)
        shorter = [max(p - 1, 0) for p in positions]
        att.plan(shorter, bucket=8)  # a new step's plan, then replay: the captured kernels read the new table
        graph.replay()
        want = sdpa_decode(q, k_cache, v_cache, max_len, decode_mask(torch.tensor(shorter, device=dev), max_len,
                                                                      dtype), d**-0.5)
        assert ((out.float() - want.float()).norm() / want.float().norm()).item() < 2e-2


@pytest.mark.parametrize("head_dim", [128])  # the real models' size (FlashInfer refuses 32: SDPA, CPU-tested)
def test_flashinfer_engine_runs_on_cuda(use_options, head_dim: int) -> None:  # noqa: ANN001
    """QERL_DECODE_ATTN=flashinfer end to end (CUDA graphs, per-step plans): no fallback, and greedy tokens
    follow the SDPA engine's (bf16; a near-tie may part them late, so only the first 4 of each prompt)."""
    pytest.importorskip("flashinfer")
    model = random_model("llama", torch.bfloat16, head_dim=head_dim)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    use_options(decode_attn="sdpa")
    want = run(BuiltinEngine(model, None, max_batch_slots=8, max_model_len=256), greedy)[0]
    use_options(decode_attn="flashinfer")
    engine = BuiltinEngine(model, None, max_batch_slots=8, max_model_len=256)
    got = run(engine, greedy)[0]
    assert engine.runner.attention.current == "flashinfer" and engine.runner.attention.backend == "flashinfer"
    assert all(a[:4] == b[:4] for a, b in zip(got, want, strict=True))


def test_split_kv_engine_runs_on_cuda(use_options) -> None:  # noqa: ANN001
    """QERL_DECODE_ATTN=split end to end (CUDA graphs: the lengths are read on the device, no host plan): greedy
    tokens follow the SDPA engine's (bf16; a near-tie may part them late, so only the first 4 of each prompt), and
    fp32 tokens are equal."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    for dtype, first in ((torch.bfloat16, 4), (torch.float32, 16)):
        model = random_model("llama", dtype, head_dim=128)
        use_options(decode_attn="sdpa")
        want = run(BuiltinEngine(model, None, max_batch_slots=8, max_model_len=256), greedy)[0]
        use_options(decode_attn="split")
        engine = BuiltinEngine(model, None, max_batch_slots=8, max_model_len=256)
        got = run(engine, greedy)[0]
        assert engine.runner.attention.backend == "split" and engine.use_graphs
        assert all(a[:first] == b[:first] for a, b in zip(got, want, strict=True))


def test_fp8_kv_cache_engine_runs_on_cuda(use_options) -> None:  # noqa: ANN001
    """QERL_KV_CACHE=fp8 end to end on the default path (CUDA graphs, split-KV attention reading E4M3, the fused
    RoPE/KV write rounding into it): the prompt rows are the bf16 engine's rounded, the first token (prefill) is the
    same, every log-prob finite, and the first-use check of the fused write passed (no fallback)."""
    _default_switches(use_options)
    model = random_model("llama", torch.bfloat16, head_dim=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[])
    plain = BuiltinEngine(model, None, max_batch_slots=8, max_model_len=256)
    want = run(plain, greedy, prompts=PROMPTS[:1])[0]
    use_options(kv_cache="fp8")
    engine = BuiltinEngine(model, None, max_batch_slots=8, max_model_len=256)
    tokens, logprobs = run(engine, greedy, prompts=PROMPTS[:1])
    assert engine.use_graphs and engine.runner.attention.current == "split"
    ck = engine.runner.cache.k
    assert ck.dtype == torch.float8_e4m3fn
    n = len(PROMPTS[0])
    assert torch.equal(ck[:, 0, :n].float(), plain.runner.cache.k[:, 0, :n].to(torch.float8_e4m3fn).float())
    assert tokens[0][0] == want[0][0] and all(torch.isfinite(lp).all() for lp in logprobs)
    assert "rope_kv_write" not in engine.runner.ops.fell_back and engine.runner.ops.enabled["rope_kv_write"]
