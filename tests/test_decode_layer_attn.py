"""The persistent decode layer's attention half (kernels/cuda/decode_attn.cu, decode_layer.attn_half) on the CPU: its
emulation equals the present decode step's math (add_rmsnorm, the q/k/v GEMM with LoRA and bias, rope_kv_write) on a
tiny GQA layer with and without bias and LoRA, the KV cache is written at each token's (slot, position) and nowhere
else, the RoPE is bit-equal to the engine's, the schedule covers every weight tile once with both halves of a head's
rotation in one pair, the sources build for sm_90a without spills, and the engine's wiring falls back cleanly."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from qerl_kernels import decode_layer as dl

from qerl_cli.formats import dequantize, quantize
from qerl_cli.rollout.fast_layers import FusedOps

gemm = dl.checkpoint_args  # the kernels' view of a quantized weight's checkpoint tensors

H, HQ, HK, D = 256, 4, 2, 64  # GQA: 2 query heads per KV head; q/k/v rows (4 + 2 x 2) x 64 = 512
N = (HQ + 2 * HK) * D
SLOTS, MAXLEN = 8, 40


def _layer(dtype: torch.dtype, rank: int, bias: bool, seed: int = 0, fmt: str = "nvfp4") -> dict:
    g = torch.Generator().manual_seed(200 + seed)
    w = torch.randn(N, H, generator=g) * H**-0.5
    qw = quantize(w, fmt, dtype=dtype)  # INT4: scales in the activation dtype
    a = b = None
    if rank:
        a = (torch.randn(rank, H, generator=g) * H**-0.5).to(dtype)
        b = (torch.randn(N, rank, generator=g) * 0.3).to(dtype)
    args = gemm(qw, a, b)
    # the module stores its bias in the dtype; the cuda GEMM adds it in fp32 (attn_gemm_args)
    bvec = (torch.randn(N, generator=g) * 0.5).to(dtype).float() if bias else None
    # the engine's tables: transformers' default RoPE evaluated in fp32, then cast to the dtype
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(MAXLEN).float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return dict(args=args, weight=dequantize(qw, torch.float32), lora=None if a is None else (a, b), bias=bvec,
                norm_w=(1 + 0.1 * torch.randn(H, generator=g)).to(dtype), cos=emb.cos().to(dtype),
                sin=emb.sin().to(dtype), gen=g)


def _inputs(lay: dict, m: int, dtype: torch.dtype, delta: bool) -> tuple:
    g = lay["gen"]
    h = (torch.randn(m, H, generator=g) * 2).to(dtype)
    d = (torch.randn(m, H, generator=g)).to(dtype) if delta else None
    pos = torch.randperm(MAXLEN, generator=g)[:m].to(torch.int64)
    ck = torch.randn(SLOTS, MAXLEN, HK, D, generator=g).to(dtype)
    cv = torch.randn(SLOTS, MAXLEN, HK, D, generator=g).to(dtype)
    return h, d, pos, ck, cv


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(lay: dict, h: torch.Tensor, d: torch.Tensor | None, pos: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
         ctas: int) -> tuple:
    ek, ev = ck.clone(), cv.clone()
    hn, q = dl.emulate_attn_half(h, d, lay["norm_w"], 1e-6, lay["args"], lay["bias"], lay["cos"], lay["sin"], pos,
                                 ek, ev, HQ, ctas)
    rk, rv = ck.clone(), cv.clone()
    rhn, rq = dl.reference_attn_half(h, d, lay["norm_w"], 1e-6, lay["weight"], lay["lora"], lay["bias"], lay["cos"],
                                     lay["sin"], pos, rk, rv, HQ)
    return (hn, q, ek, ev), (rhn, rq, rk, rv)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize(("rank", "bias", "ctas"), [(0, False, 3), (24, False, 1), (24, True, 7), (0, True, 5)])
def test_emulation_equals_the_present_path_math(dtype: torch.dtype, m: int, rank: int, bias: bool, ctas: int,
                                                fmt: str) -> None:
    """Llama (no bias) and Qwen2 (q/k/v bias), LoRA on/off; 1 CTA: each warp holds whole pairs; 3-7: pairs cut
    between warps, inside their first or second half; NVFP4 and MXFP4 scales."""
    lay = _layer(dtype, rank, bias, fmt=fmt)
    assert dl.attn_check_shapes(lay["args"], m, HQ, HK, D) is None
    h, d, pos, ck, cv = _inputs(lay, m, dtype, delta=True)
    (hn, q, ek, ev), (rhn, rq, rk, rv) = _run(lay, h, d, pos, ck, cv, ctas)
    assert hn.dtype == q.dtype == dtype and hn.shape == (m, H) and q.shape == (m, HQ, D)
    assert torch.equal(hn, rhn)  # the residual add is one rounding on both paths
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    rows = torch.arange(m)
    assert _rel(q, rq) < tol
    assert _rel(ek[rows, pos], rk[rows, pos]) < tol and _rel(ev[rows, pos], rv[rows, pos]) < tol
    if rank or bias:  # the LoRA term and the bias are really in: without them the output moves by far more
        bare = dl.reference_attn_half(h, d, lay["norm_w"], 1e-6, lay["weight"], None, None, lay["cos"], lay["sin"],
                                      pos, ck.clone(), cv.clone(), HQ)[1]
        assert _rel(bare, rq) > 5 * tol


def test_no_delta_is_the_first_layer() -> None:
    """Layer 0 has no previous MLP output: hn is h itself and the norm reads it."""
    lay = _layer(torch.bfloat16, 16, True, seed=1)
    h, _, pos, ck, cv = _inputs(lay, 5, torch.bfloat16, delta=False)
    (hn, q, ek, ev), (rhn, rq, rk, rv) = _run(lay, h, None, pos, ck, cv, 4)
    assert torch.equal(hn, h) and _rel(q, rq) < 1e-2
    rows = torch.arange(5)
    assert _rel(ek[rows, pos], rk[rows, pos]) < 1e-2 and _rel(ev[rows, pos], rv[rows, pos]) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_written_at_each_position_and_nothing_else(dtype: torch.dtype) -> None:
    lay = _layer(dtype, 8, True, seed=2)
    m = 6
    h, d, pos, ck, cv = _inputs(lay, m, dtype, delta=True)
    (_, _, ek, ev), (_, _, rk, rv) = _run(lay, h, d, pos, ck, cv, 3)
    touched = torch.zeros(SLOTS, MAXLEN, dtype=torch.bool)
    touched[torch.arange(m), pos] = True
    for got, want, before in ((ek, rk, ck), (ev, rv, cv)):
        assert torch.equal(got[~touched], before[~touched])  # slots >= M and other positions untouched
        assert torch.equal(want[~touched], before[~touched])
        assert not torch.equal(got[touched], before[touched])
    # v is the GEMM output as it is (no rotation): the emulation's and the reference's differ by GEMM order only
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert _rel(ev[touched], rv[touched]) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_is_bit_equal_to_the_engines(dtype: torch.dtype) -> None:
    """rope_pairs (the kernel's roundings) against FusedOps.rope_kv_write's torch path on the same q/k/v: every bit."""
    lay = _layer(dtype, 0, False, seed=3)
    g = torch.Generator().manual_seed(7)
    b = 5
    q = (torch.randn(b, 1, HQ, D, generator=g) * 3).to(dtype)
    k = (torch.randn(b, 1, HK, D, generator=g) * 3).to(dtype)
    v = torch.randn(b, 1, HK, D, generator=g).to(dtype)
    pos = torch.randperm(MAXLEN, generator=g)[:b].to(torch.int64)
    rows = torch.arange(b)
    ck, cv = torch.zeros(SLOTS, MAXLEN, HK, D, dtype=dtype), torch.zeros(SLOTS, MAXLEN, HK, D, dtype=dtype)
    cos, sin = lay["cos"], lay["sin"]
    want_q = FusedOps(triton=False).rope_kv_write(q, k, v, pos, rows, cos[pos][:, None, None, :],
                                                  sin[pos][:, None, None, :], cos, sin, ck, cv)
    c, s = cos.float()[pos][:, None, :], sin.float()[pos][:, None, :]
    half = D // 2
    for x, want in ((q[:, 0].float(), want_q), (k[:, 0].float(), ck[rows, pos])):
        o1, o2 = dl.rope_pairs(x[..., :half], x[..., half:], c[..., :half], s[..., :half], c[..., half:],
                               s[..., half:], dtype)
        assert torch.equal(torch.cat([o1, o2], -1).to(dtype), want)


def test_emulation_follows_each_input() -> None:
    """Perturbing the residual, the delta, the norm weight, the bias or a position must move q (a wrong wire would
    leave it equal)."""
    lay = _layer(torch.bfloat16, 8, True, seed=4)
    h, d, pos, ck, cv = _inputs(lay, 4, torch.bfloat16, delta=True)

    def q_of(**kw: object) -> torch.Tensor:
        a = dict(h=h, d=d, norm_w=lay["norm_w"], bias=lay["bias"], pos=pos) | kw
        return dl.emulate_attn_half(a["h"], a["d"], a["norm_w"], 1e-6, lay["args"], a["bias"], lay["cos"], lay["sin"],
                                    a["pos"], ck.clone(), cv.clone(), HQ, 3)[1]

    base = q_of()
    for name, val in (("h", (h.float() * 1.5).bfloat16()), ("d", (d.float() * -1).bfloat16()),
                      ("norm_w", (lay["norm_w"].float() * 1.5).bfloat16()), ("bias", lay["bias"] + 1.0),
                      ("pos", (pos + 1) % MAXLEN)):
        assert _rel(q_of(**{name: val}), base) > 1e-2, name


SEVEN_B = dict(h=3584, hq=28, hk=4, d=128)


@pytest.mark.parametrize("ctas", [264, 132, 7])
@pytest.mark.parametrize("m", [1, 8])
def test_schedule_covers_every_weight_tile_once(ctas: int, m: int) -> None:
    sch = dl.AttnSchedule(m=m, rank=96, ctas=ctas, **SEVEN_B)
    n, kc = sch.n, sch.h // 128
    nb, u, _ = sch.geo()
    ranges = [sch.range(0, v) for v in range(sch.warps)]
    assert ranges[0][0] == 0 and ranges[-1][1] == sch.units() == n // 16 * kc
    assert all(ranges[v][1] == ranges[v + 1][0] for v in range(sch.warps - 1))
    assert max(e - f for f, e in ranges) - min(e - f for f, e in ranges) <= 1
    seen = torch.zeros(n // 16, kc, dtype=torch.int64)
    for b in range(nb):
        parts = sch.parts(0, b)
        assert parts[0][1] == b * u and parts[-1][2] == (b + 1) * u and len(parts) <= sch.pmax()
        assert all(parts[k][2] == parts[k + 1][1] and parts[k][0] + 1 == parts[k + 1][0] for k in range(len(parts) - 1))
        r1, r2 = sch.block_rows(0, b)
        # both halves of the pair in one head, D/2 apart: the rotation's partners
        assert r2 - r1 == sch.d // 2 and r1 // sch.d == r2 // sch.d and r1 % sch.d < sch.d // 2
        for x in range(b * u, (b + 1) * u):
            row, ch = sch.unit(0, x)
            assert row == (r1 if x - b * u < kc else r2)
            seen[row // 16, ch] += 1
    assert bool((seen == 1).all()), "tiles missed or doubled"
    # every (token, block) residual item and every h value by exactly one CTA; a shrink unit per LoRA warp at most
    shares = [sch.residual_share(c) for c in range(ctas)]
    assert shares[0][0] == 0 and shares[-1][1] == m * sch.h // 16
    assert all(shares[c][1] == shares[c + 1][0] for c in range(ctas - 1))
    hs = [sch.h_share(0, c) for c in range(ctas)]
    assert hs[0][0] == 0 and hs[-1][1] == m * 96 and all(hs[c][1] == hs[c + 1][0] for c in range(ctas - 1))
    assert sorted((rk, s) for _, rk, s in sch.shrink_units()) == sorted((rk, s) for s in range(kc) for rk in range(6))


def test_schedule_by_hand() -> None:
    """7B q/k/v at 264 CTAs: (28 + 2 x 4) heads x 128 = 4608 rows, 144 pairs of 2 x 28 units = 8064 units over 1848
    GEMM warps (4.36 each): warp v starts at floor(8064 v / 1848); pair 0 (rows 0 and 64 of q head 0) is units 0..55,
    warps 0..12 (warp 12 = [52, 56) ends it exactly), so 13 partials; pair 4 is q head 1's rows 128 and 192; the k heads
    start at pair 28 x 4 = 112 (row 3584), the v heads at pair 128 (row 4096)."""
    sch = dl.AttnSchedule(m=8, rank=0, ctas=264, **SEVEN_B)
    assert sch.warps == 1848 and sch.geo() == (144, 56, 28) and sch.units() == 8064
    assert sch.range(0, 0) == (0, 4) and sch.range(0, 2) == (8, 13) and sch.range(0, 12) == (52, 56)
    assert len(sch.parts(0, 0)) == 13 and sch.parts(0, 0)[-1] == (12, 52, 56)
    assert sch.block_rows(0, 0) == [0, 64] and sch.block_rows(0, 3) == [48, 112] and sch.block_rows(0, 4) == [128, 192]
    assert sch.block_rows(0, 112) == [3584, 3648] and sch.block_rows(0, 128) == [4096, 4160]
    assert sch.unit(0, 27) == (0, 27) and sch.unit(0, 28) == (64, 0) and sch.unit(0, 56) == (16, 0)
    for_pmax = [len(sch.parts(0, b)) for b in range(144)]
    assert sch.pmax() == max(for_pmax) == 14


def test_check_shapes_refuses_what_the_kernel_cannot_take() -> None:
    lay = _layer(torch.bfloat16, 16, False)
    qkv = lay["args"]
    assert dl.attn_check_shapes(qkv, 8, HQ, HK, D) is None
    assert "tokens" in dl.attn_check_shapes(qkv, 17, HQ, HK, D)
    assert "head_dim" in dl.attn_check_shapes(qkv, 1, HQ + 1, HK, D)  # rows do not match the heads
    assert "head_dim" in dl.attn_check_shapes(qkv, 1, 16, 8, 16)  # 512 rows, but a pair needs 32 | head_dim
    assert "rank" in dl.attn_check_shapes(dl.GemmArgs(qkv.repacked, qkv.scale, qkv.global_scale, True,
                                                       qkv.a[:12], qkv.b[:, :12]), 1, HQ, HK, D)


def _ptxas_report(folder: Path, lib: object) -> str:
    path = folder / f"ptxas-attn-{lib.source_hash()}.txt"
    if not path.exists():
        cubin = path.with_suffix(".cubin")
        res = subprocess.run(lib.compile_command(cubin, cubin=True), capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        path.write_text(res.stdout + res.stderr)
    return path.read_text()


def test_attention_half_builds_for_hopper_without_spills() -> None:
    if dl._nvcc() is None:
        pytest.skip("nvcc not installed")
    from qerl_kernels.options import kernel_options

    folder = kernel_options().cuda_cache
    folder.mkdir(parents=True, exist_ok=True)
    report = _ptxas_report(folder, dl.ATTN_LIBRARY)
    kernels = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'", report)
    # (1 or 2 token tiles) x (bf16 or fp16) x (NVFP4, MXFP4 or INT4)
    assert len(kernels) == 12 and all("decode_attn_kernel" in k for k in kernels), report[-2000:]
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(frames) == 12 and all(f == ("0", "0", "0") for f in frames), frames
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 128  # two CTAs of 256 threads per SM


# ---- the engine's wiring --------------------------------------------------------------------------------------
def _tiny_runner(**kernel_opts: object) -> object:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qerl_cli.options import options
    from qerl_cli.rollout.model_runner import ModelRunner

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = Qwen2ForCausalLM(cfg).eval()
    opts = options()
    import dataclasses

    opts = dataclasses.replace(opts, kernels=dataclasses.replace(opts.kernels, **kernel_opts))
    return ModelRunner(model, max_len=32, dtype=torch.float32, opts=opts)


def test_engine_option_defaults_to_int4_only_and_cpu_falls_back() -> None:
    """The option is `auto` by default (the attention half for INT4 only: the FP4 pair measured even with their
    per-op kernels); on, a CPU runner (no sm_90, no kernel) keeps the per-op path: no attention-half arguments, and a
    decode step's logits equal those with the option off."""
    from qerl_kernels.options import KernelOptions

    from qerl_cli.rollout.kv_cache import CacheShape, KVCache

    assert KernelOptions().decode_layer_attn == "auto"
    assert [dl.attn_half_wanted(mode, f) for mode in ("auto", "1", "0") for f in ("nvfp4", "int4")] == [
        False, True, True, True, False, False]
    logits = []
    for on in ("0", "1"):
        runner = _tiny_runner(decode_layer_attn=on)
        assert runner.decode_layer_attn is False  # CPU: never taken
        runner.prepare()
        assert runner._attn_args == {}
        runner.bind_norms(None, static=False)
        runner.cache = KVCache(CacheShape(runner.num_layers, runner.num_kv_heads, runner.head_dim, 32,
                                          runner.dtype), 2, runner.device)
        tokens, positions = torch.tensor([3, 7]), torch.tensor([0, 0])
        logits.append(runner.decode_step(tokens, positions, 8))
    assert torch.equal(logits[0], logits[1])


def test_engine_attn_half_declines_without_arguments() -> None:
    """With no kernel arguments for a layer (unavailable, or a q/k/v the kernel cannot take), `_attn_half` returns
    None before touching anything, and `_attn_half_args` refuses a plan without a fused NVFP4 q/k/v."""
    from qerl_kernels import decode_layer

    runner = _tiny_runner(decode_layer_attn="1")
    runner.prepare()
    h = torch.zeros(2, 1, 64)
    assert runner._attn_half(0, h, None, torch.zeros(2, dtype=torch.int64)) is None
    runner._attn_args = {0: None}
    assert runner._attn_half(0, h, None, torch.zeros(2, dtype=torch.int64)) is None
    if runner.plan is not None:  # fp32 nn.Linear q/k/v: not NVFP4
        assert runner._attn_half_args(runner.plan.layers[0], decode_layer) is None
