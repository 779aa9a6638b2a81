"""qerl_kernels.decode under the Triton interpreter against the rollout runner's torch reference.

Outputs are NaN-poisoned before each call (an unwritten element fails). fp32 must match the torch
reference to reduction order; fp16 to one rounding of the output (the intermediate roundings are
reproduced, so most elements are bit-equal). Ragged sizes: hidden 40 and 72 (not powers of two), 3 query
heads over 1 KV head, head_dim 12 (half 6, padded to 8 lanes), rows not a multiple of anything.
"""

from __future__ import annotations

import pytest
import torch
from qerl_kernels import INTERPRET
from qerl_kernels.decode import add_rmsnorm, rope_kv_write, silu_mul

from qerl_cli.rollout.fast_layers import FusedOps, apply_rope_ref, rms_norm_ref

TOL = {torch.float32: 2e-6, torch.float16: 1e-3}
DTYPES = [torch.float32, torch.float16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= TOL[dtype] * max(scale, 1.0), (err, scale)


def test_interpreter_is_on() -> None:
    assert INTERPRET


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 40), (5, 72), (3, 64)])
def test_add_rmsnorm_matches_reference(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    h = (torch.randn(rows, 1, hidden, generator=g) * 2).to(dtype)
    d = torch.randn(rows, 1, hidden, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    eps = 1e-6
    h_out = torch.full_like(h, float("nan"))
    x_out = torch.full_like(h, float("nan"))
    got_h, got_x = add_rmsnorm(h, d, w, eps, h_out=h_out, x_out=x_out)
    assert got_h is h_out and got_x is x_out
    want_h = h + d
    assert torch.equal(got_h, want_h)  # one rounded add, as torch does it
    _close(got_x, rms_norm_ref(want_h, w, eps), dtype)
    # plain norm (delta None): per-head q/k norm shape [B, T, heads, D]
    q = torch.randn(rows, 1, 3, 16, generator=g).to(dtype)
    wq = (1 + 0.3 * torch.randn(16, generator=g)).to(dtype)
    x_out = torch.full_like(q, float("nan"))
    _, got = add_rmsnorm(q, None, wq, 1e-5, x_out=x_out)
    _close(got, rms_norm_ref(q, wq, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 12)])
def test_rope_kv_write_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(heads * head_dim)
    b, slots, max_len = 3, 5, 20
    # q/k/v as views of one fused projection output (row stride > packed width), as a GEMM would give
    qkv = torch.randn(b, (heads + 2 * kv_heads) * head_dim + 7, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(b, 1, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(b, 1, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim : (heads + 2 * kv_heads) * head_dim].view(b, 1, kv_heads, head_dim)
    theta = torch.arange(max_len)[:, None] / (100.0 ** (torch.arange(head_dim // 2) / (head_dim // 2)))[None, :]
    cos = torch.cat([theta.cos(), theta.cos()], -1).to(dtype)
    sin = torch.cat([theta.sin(), theta.sin()], -1).to(dtype)
    positions = torch.tensor([7, 0, 19])
    cache_k = torch.full((slots, max_len, kv_heads, head_dim), float("nan"), dtype=dtype)
    cache_v = cache_k.clone()
    q_out = torch.full((b, heads, head_dim), float("nan"), dtype=dtype)
    got_q = rope_kv_write(q.reshape(b, -1), k.reshape(b, -1), v.reshape(b, -1), positions, cos, sin, cache_k,
                          cache_v, q_out=q_out)
    cg, sg = cos[positions][:, None, None, :], sin[positions][:, None, None, :]
    _close(got_q, apply_rope_ref(q, cg, sg)[:, 0], dtype)
    rows = torch.arange(b)
    _close(cache_k[rows, positions], apply_rope_ref(k, cg, sg)[:, 0], dtype)
    assert torch.equal(cache_v[rows, positions], v[:, 0])
    written = torch.zeros(slots, max_len, dtype=torch.bool)
    written[rows, positions] = True
    assert torch.isnan(cache_k[~written]).all() and torch.isnan(cache_v[~written]).all()  # nothing else touched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    gate = (torch.randn(3, 1, 1100, generator=g) * 4).to(dtype)  # 3300 elements: 4 blocks, last ragged
    up = torch.randn(3, 1, 1100, generator=g).to(dtype)
    out = torch.full_like(gate, float("nan"))
    got = silu_mul(gate, up, out=out)
    _close(got, torch.nn.functional.silu(gate) * up, dtype)


def test_fused_ops_first_use_check_falls_back(caplog) -> None:
    """A kernel that computes garbage is caught at first use: one warning, then the torch path."""
    ops = FusedOps(triton=True)
    assert ops.enabled["silu_mul"]

    class Broken:
        @staticmethod
        def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return gate * 0

    real = ops._k
    ops._k = Broken()
    gate, up = torch.randn(2, 8), torch.randn(2, 8)
    want = torch.nn.functional.silu(gate) * up
    with caplog.at_level("WARNING", logger="qerl.rollout"):
        assert torch.equal(ops.silu_mul(gate, up, torch.nn.SiLU()), want)
        assert torch.equal(ops.silu_mul(gate, up, torch.nn.SiLU()), want)
    assert not ops.enabled["silu_mul"] and ops.enabled["add_rmsnorm"]
    assert sum("silu_mul disabled" in r.message for r in caplog.records) == 1
    ops._k = real
    # an exception at first use (e.g. a compile error on the GPU) also falls back, once

    class Raising:
        @staticmethod
        def add_rmsnorm(*args, **kwargs):
            raise RuntimeError("PTX assembly failed")

    ops2 = FusedOps(triton=True)
    ops2._k = Raising()
    h, d, w = torch.randn(2, 8), torch.randn(2, 8), torch.rand(8)
    caplog.clear()
    with caplog.at_level("WARNING", logger="qerl.rollout"):
        for _ in range(2):
            got_h, got_x = ops2.add_rms_norm(h, d, w, 1e-6)
            assert torch.equal(got_h, h + d) and torch.equal(got_x, rms_norm_ref(h + d, w, 1e-6))
    assert [r.message.count("PTX assembly failed") for r in caplog.records] == [1]


def test_token_uniform_is_bit_identical_to_the_sampler() -> None:
    from qerl_kernels.decode import token_uniform

    from qerl_cli.rollout.sampling import TokenNoise, row_keys, seed_key

    cpu = torch.device("cpu")
    torch_noise = TokenNoise(1500, cpu, fused=False)  # 1500: one full 1024 block and a ragged one
    fused_noise = TokenNoise(1500, cpu, fused=True)
    assert fused_noise.fused and not torch_noise.fused
    # keys over the whole 32-bit range, the hashed ones the sampler really uses among them
    keys = torch.cat([row_keys(seed_key(99, cpu), torch.arange(5), torch.tensor([0, 3, 7, 100, 2**20])),
                      torch.tensor([0, 2**32 - 1, 2**31, 12345])])
    u = token_uniform(keys, torch_noise.vocab_hash)
    assert torch.equal(u, torch_noise.uniform(keys))
    assert torch.equal(fused_noise.exponential(keys), torch_noise.exponential(keys))
    assert fused_noise.fused  # the first-use bit check passed


def test_rope_kv_write_first_use_check_leaves_the_kernels_cache_rows() -> None:
    """The first call is checked against the torch reference, which re-writes the same cache rows; afterwards
    the rows must hold the kernel's values (bf16: the kernel rounds once from fp32, torch after every op), as
    every later call and a CUDA graph's replay write them."""
    from qerl_cli.rollout.fast_layers import FusedOps

    dtype, b, heads, kvh, d, slots, max_len = torch.bfloat16, 3, 4, 2, 16, 4, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, 1, heads, d, generator=g).to(dtype)
    k = torch.randn(b, 1, kvh, d, generator=g).to(dtype)
    v = torch.randn(b, 1, kvh, d, generator=g).to(dtype)
    theta = torch.arange(max_len)[:, None] / (100.0 ** (torch.arange(d // 2) / (d // 2)))[None, :]
    cos = torch.cat([theta.cos(), theta.cos()], -1).to(dtype)
    sin = torch.cat([theta.sin(), theta.sin()], -1).to(dtype)
    positions, rows = torch.tensor([3, 9, 15]), torch.arange(b)
    cg, sg = cos[positions][:, None, None, :], sin[positions][:, None, None, :]
    want_k, want_v = torch.zeros(slots, max_len, kvh, d, dtype=dtype), torch.zeros(slots, max_len, kvh, d, dtype=dtype)
    rope_kv_write(q.reshape(b, -1), k.reshape(b, -1), v.reshape(b, -1), positions, cos, sin, want_k, want_v)
    # the test is only meaningful where kernel and torch round differently
    assert not torch.equal(want_k[rows, positions], apply_rope_ref(k, cg, sg)[:, 0])
    ops = FusedOps(triton=True)
    cache_k, cache_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    ops.rope_kv_write(q, k, v, positions, rows, cg, sg, cos, sin, cache_k, cache_v)
    assert "rope_kv_write" in ops.checked and ops.enabled["rope_kv_write"]
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)


# ---- LoRA shrinks inside the kernel that makes their input (issue 25) --------------------------------------------
def _hl_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """A shrink output: fp32 to reduction order; fp16 to one rounding of the output (the sum has K terms)."""
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= {torch.float32: 1e-5, torch.float16: 2e-3}[dtype] * max(scale, 1.0), (err, scale)


# (rows, K, R): ragged everywhere; K=1100 splits K across programs (the in-kernel fixed-order reduction);
# R=96 is q/k/v's r=32 x 3; 37 rows span 3 row tiles
SHRINK_SHAPES = [(1, 40, 3), (5, 1100, 20), (37, 200, 96)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,r", SHRINK_SHAPES)
def test_lora_shrink_kernels_match_reference(dtype: torch.dtype, rows: int, k: int, r: int) -> None:
    from qerl_kernels.decode import lora_shrink, rmsnorm_shrink, shrink_plan, silu_mul_shrink

    g = torch.Generator().manual_seed(rows * k + r)
    a = (0.1 * torch.randn(r, k, generator=g)).to(dtype)
    nan = float("nan")
    # plain (o_proj): x as rows of a [rows, 1, K] attention output
    x = torch.randn(rows, 1, k, generator=g).to(dtype)
    out = torch.full((rows, r), nan, dtype=dtype)
    assert lora_shrink(x, a, out=out) is out
    _hl_close(out, x.reshape(rows, k).double() @ a.double().T, dtype)
    # add + RMSNorm + shrink: h' and x as add_rmsnorm makes them, and x @ A^T from the rounded x
    h = (2 * torch.randn(rows, 1, k, generator=g)).to(dtype)
    d = torch.randn(rows, 1, k, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype)
    h_out, x_out, hl = (torch.full_like(h, nan), torch.full_like(h, nan), torch.full((rows, r), nan, dtype=dtype))
    got_h, got_x, got_hl = rmsnorm_shrink(h, d, w, 1e-6, a, h_out=h_out, x_out=x_out, out=hl)
    assert got_h is h_out and got_x is x_out and got_hl is hl
    assert torch.equal(got_h, h + d)
    want_x = rms_norm_ref(h + d, w, 1e-6)
    _close(got_x, want_x, dtype)
    _hl_close(got_hl, got_x.reshape(rows, k).double() @ a.double().T, dtype)
    _hl_close(got_hl, want_x.reshape(rows, k).double() @ a.double().T, dtype)
    # no residual (the first layer's input norm)
    got_h, got_x, got_hl = rmsnorm_shrink(h, None, w, 1e-6, a)
    assert got_h is h
    _close(got_x, rms_norm_ref(h, w, 1e-6), dtype)
    _hl_close(got_hl, got_x.reshape(rows, k).double() @ a.double().T, dtype)
    # SiLU * up + shrink, gate and up as the column halves of one fused gate/up output (row stride 2K + 5)
    gu = (3 * torch.randn(rows, 2 * k + 5, generator=g)).to(dtype)
    gate, up = gu[:, :k], gu[:, k:2 * k]
    act = torch.full((rows, k), nan, dtype=dtype)
    got_act, got_hl = silu_mul_shrink(gate, up, a, out=act)
    assert got_act is act
    _close(got_act, torch.nn.functional.silu(gate) * up, dtype)
    _hl_close(got_hl, got_act.double() @ a.double().T, dtype)
    if k == 1100:  # the split-K path really ran
        assert shrink_plan(rows, k, r, 0)[3] > 1 and shrink_plan(rows, k, r, 1)[3] > 1


def test_every_swept_shrink_plan_computes_the_same_product() -> None:
    """The GPU sweep (qerl_cli.bench.lora_shrinks) times plan variants of K tile, K splits (one tile per program
    up to several), rows per program and the norm pass's block width; each must compute the same x, h' and
    x @ A^T (fp32, reduction order only), so the sweep's fastest plan is a valid rule."""
    from qerl_kernels.decode import SHRINK_NORM, SHRINK_SILU, rmsnorm_shrink, silu_mul_shrink

    from qerl_cli.bench.lora_shrinks import plan_variants

    g = torch.Generator().manual_seed(5)
    rows, k, r = 33, 600, 20
    h, d = 2 * torch.randn(rows, k, generator=g), torch.randn(rows, k, generator=g)
    w, a = 1 + 0.3 * torch.randn(k, generator=g), 0.1 * torch.randn(r, k, generator=g)
    gu = torch.randn(rows, 2 * k, generator=g)
    want_x = rms_norm_ref(h + d, w, 1e-6)
    want_act = torch.nn.functional.silu(gu[:, :k]) * gu[:, k:]
    norm_plans = plan_variants(rows, k, r, SHRINK_NORM, 132)
    silu_plans = plan_variants(rows, k, r, SHRINK_SILU, 132)
    assert len(norm_plans) >= 10 and any(p.splits == -(-k // p.bk) for _, p in norm_plans)  # one tile each
    assert any(p.bm == 64 for _, p in silu_plans)  # all rows in one program
    for name, plan in norm_plans:
        s, x, hl = rmsnorm_shrink(h, d, w, 1e-6, a, plan=plan)
        assert torch.equal(s, h + d), name
        _close(x, want_x, torch.float32)
        _hl_close(hl, x.double() @ a.double().T, torch.float32)
    for _name, plan in silu_plans:
        act, hl = silu_mul_shrink(gu[:, :k], gu[:, k:], a, plan=plan)
        _close(act, want_act, torch.float32)
        _hl_close(hl, act.double() @ a.double().T, torch.float32)


def test_norm_shrink_beyond_one_launch_rows_runs_norm_then_shrink(monkeypatch) -> None:
    """Up to NORM_SHRINK_MAX_ROWS rows (0 by the H100 measurement, 4 here) the RMSNorm + shrink is one launch;
    above, FusedOps runs the norm kernel and the plain shrink kernel (two launches), same values."""
    from qerl_kernels import decode as kd
    from qerl_kernels.decode import LAUNCHES

    monkeypatch.setattr(kd, "NORM_SHRINK_MAX_ROWS", 4)
    ops = FusedOps(triton=True)
    g = torch.Generator().manual_seed(11)
    for rows in (4, 5):
        h, d = torch.randn(rows, 1, 48, generator=g), torch.randn(rows, 1, 48, generator=g)
        w, a = torch.rand(48, generator=g), torch.randn(6, 48, generator=g)
        before = LAUNCHES.copy()
        s, x, hl = ops.add_rms_norm_shrink(h, d, w, 1e-6, a)
        launched = {n: LAUNCHES[n] - before[n] for n in ("rmsnorm_shrink", "add_rmsnorm", "lora_shrink")}
        one = rows <= 4
        # the first call of each kernel is checked against the torch path; the kernel launches count once
        assert launched == ({"rmsnorm_shrink": 1, "add_rmsnorm": 0, "lora_shrink": 0} if one else
                            {"rmsnorm_shrink": 0, "add_rmsnorm": 1, "lora_shrink": 1}), (rows, launched)
        assert torch.equal(s, h + d)
        _close(x, rms_norm_ref(h + d, w, 1e-6), torch.float32)
        _hl_close(hl, x.reshape(rows, 48).double() @ a.double().T, torch.float32)


def test_fused_shrink_ops_fall_back_once(caplog, monkeypatch) -> None:
    """FusedOps' LoRA ops: the kernel result at first use, then on a wrong kernel one warning and the torch
    reference (norm + mm) from then on, the other kernels untouched."""
    from qerl_kernels import decode as kd

    monkeypatch.setattr(kd, "NORM_SHRINK_MAX_ROWS", 16)  # the one-launch form (off by the measured rule)
    ops = FusedOps(triton=True)
    assert ops.fused_lora and ops.enabled["rmsnorm_shrink"]
    g = torch.Generator().manual_seed(9)
    h, d, w, a = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g), torch.rand(8, generator=g), \
        torch.randn(4, 8, generator=g)
    s, x, hl = ops.add_rms_norm_shrink(h, d, w, 1e-6, a)
    assert "rmsnorm_shrink" in ops.checked
    _hl_close(hl, x.double() @ a.double().T, torch.float32)

    class Broken:
        @staticmethod
        def lora_shrink(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            return torch.zeros(x.shape[0], a.shape[0])

    ops._k = Broken()
    with caplog.at_level("WARNING", logger="qerl.rollout"):
        for _ in range(2):
            assert torch.equal(ops.lora_shrink(h, a), h @ a.T)
    assert not ops.enabled["lora_shrink"] and ops.enabled["rmsnorm_shrink"] and ops.fused_lora
    assert sum("lora_shrink disabled" in r.message for r in caplog.records) == 1
    assert not FusedOps(triton=True, fused_lora=False).fused_lora  # QERL_FUSED_LORA=0


# ---- the one-pass sampler (issue 25) ------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [1500, 9000])  # one program per row, and two (the in-kernel merge)
def test_fused_sampler_equals_the_torch_path(vocab: int) -> None:
    """Same tokens and log-probs (fp32 rounding) as the torch path for temperature 1, 0.7, greedy and top-p/top-k
    (torch filters, then the one pass); batch-invariant: a row alone samples what it samples in the batch."""
    from qerl_cli.rollout.sampling import SamplingParams, TokenNoise, sample_tokens, seed_key, torch_sample

    cpu = torch.device("cpu")
    fused = TokenNoise(vocab, cpu, fused=False, fused_sampling=True)
    plain = TokenNoise(vocab, cpu, fused=False, fused_sampling=False)
    assert fused.fused_sampling and not plain.fused_sampling
    g = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(3, vocab, generator=g)).to(torch.float16)
    key = seed_key(11, cpu)
    uids, steps = torch.tensor([0, 7, 2**40 + 3]), torch.tensor([0, 2**33 + 1, 12])
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7), SamplingParams(temperature=0.0),
                   SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=50)):
        tok, lp = sample_tokens(logits, params, fused, key, uids, steps)
        want_tok, want_lp = torch_sample(logits, params, plain, key, uids, steps)
        assert torch.equal(tok, want_tok), params
        assert (lp - want_lp).abs().max().item() < 1e-5, params
        alone = sample_tokens(logits[1:2], params, fused, key, uids[1:2], steps[1:2])
        assert torch.equal(alone[0], tok[1:2]) and torch.equal(alone[1], lp[1:2])
    assert fused.fused_sampling  # its first-use check passed
    assert fused.capturable(SamplingParams(temperature=0.7)) and not fused.capturable(SamplingParams(top_p=0.9))
