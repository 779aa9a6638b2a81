"""qerl's CUDA C++ W4A16 FP4 GEMM for Hopper (`kernels/cuda/fp4_gemm.cu`), and its exact CPU emulation.

The kernel reads the FP4 weight in the byte order qerl already keeps resident (`fp4.repack_fp4`, row or
tiled), and the checkpoint block scales as they are: no second copy of anything. It is built on first
use with nvcc (`-arch=sm_90a`) into a shared library under `~/.cache/qerl/cuda/` (or `QERL_CUDA_CACHE`),
named by the hash of its source, the headers it includes and its flags (`nvcc_build`), and called through
ctypes on torch's current stream (so CUDA graphs capture it). docs/kernels.md says why it is a plain shared
library rather than a torch extension.

`emulate_*` reproduce, with torch integer ops and 16-bit multiplies on the CPU, what each thread of the
kernel computes from the same bytes: which 16 bytes a lane loads, how it decodes them, which scale pair
it applies, and which activation element each tensor-core operand slot is paired with. The CPU tests
check them bit for bit against the checkpoint bytes and the reference dequantization.

Plans (`launch_plan`, a fixed rule: the summation order and so the bits depend on the plan): the legacy
kernels (`CONFIGS`, any M), and for decode sizes the stream kernels (`DECODE_CONFIGS` M <= 16, `WIDE_CONFIGS`
M <= 64): persistent CTAs sized to the SM count over (K segment, row group, chunk) units, weights through a
cp.async ring, programmatic dependent launch under graph capture, a fixed-order fix-up of cut portions
(`StreamSplit` mirrors the kernel's assignment; `emulate_plan` replays it). `fp4_gemm(..., lora_h, lora_b)`
adds the LoRA expand `lora_h @ lora_b^T` in the epilogue (`emulate_lora` is its fragment layout).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from qerl_kernels._common import num_sms
from qerl_kernels.nvcc_build import CudaLibrary, hopper_available
from qerl_kernels.options import kernel_options

SRC = Path(__file__).parent / "cuda" / "fp4_gemm.cu"
# --split-compile=0: the device code of its 95 kernels optimised in parallel on every core (same SASS, checked)
NVCC_FLAGS = ("-O3", "-std=c++17", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", "--split-compile=0")
LIBRARY = CudaLibrary("qerl_fp4_gemm", SRC, NVCC_FLAGS)
source_hash, library_path, build = LIBRARY.source_hash, LIBRARY.library_path, LIBRARY.build  # names callers use
# The built kernel configurations (keep in step with QERL_FP4_CONFIGS in fp4_gemm.cu): (MT 8-token tiles per
# CTA, WN warps along N each on its own 16-row block, WK warps splitting K, PERM reads the permuted
# activation copy made by a small first kernel instead of gathering 4-byte pairs from x).
CONFIGS = ((1, 4, 1, False), (1, 4, 2, False), (1, 1, 8, False), (1, 4, 1, True), (1, 4, 2, True), (1, 1, 8, True),
           (2, 4, 1, True), (2, 4, 2, True), (2, 1, 8, True), (4, 4, 1, True), (4, 1, 8, True), (8, 4, 1, True))
MTS = (1, 2, 4, 8)
WARPS_PER_SM = 16  # resident warps per SM the plan aims to fill (registers allow ~16 at 120 per thread)
F_NVFP4 = -8  # w' = code * scale * 2**F in the kernel; the fp32 result is multiplied by 2**-F (/ G)
# The stream plans (keep in step with QERL_DECODE_CONFIGS / QERL_WIDE_CONFIGS in fp4_gemm.cu): the decode kernel
# (MT, S ring stages, PERM), 8 warps on one 16-row block; the wide kernel (MT, WN warps, RBW 16-row blocks per
# warp, S ring stages), the activation slice of each chunk shared through shared memory.
DECODE_CONFIGS = ((1, 4, False), (1, 8, False), (1, 4, True), (1, 8, True), (2, 4, True), (2, 8, True))
WIDE_CONFIGS = ((4, 8, 1, 4), (4, 4, 2, 4), (8, 8, 1, 4), (8, 4, 2, 4))
DECODE_WARPS = 8
STREAM_CTAS_PER_SM = 2  # resident CTAs per SM of the stream kernels (registers <= 128 at 256 threads; smem)
DECODE_MAX_M, WIDE_MAX_M = 16, 64
PMODE_IMBALANCE = 1.06  # whole portions per CTA when the busiest CTA has at most 6% more than the average
MAX_SEGS = 32  # K segments the fix-up kernel takes (MAX_SEGS in fp4_gemm.cu)
XSEG_BYTES = 96 * 1024  # decode kernel: activation bytes per K segment that the L1 of an SM is meant to keep
MAX_LORA_RANK = 256
POISON_WORKSPACE = False  # the self-check sets it: fp32 workspaces start as NaN, so a piece nobody wrote shows

_failed: list[str] = []
_available: dict[int, bool] = {}  # device index -> usable (asked on every auto forward: keep it a lookup)


# ---- build and load ------------------------------------------------------------------------------------
@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.qerl_fp4_gemm.argtypes = [vp] * 11 + [ci] * 16 + [vp]
    lib.qerl_fp4_gemm.restype = ci
    lib.qerl_fp4_has.argtypes = [ci] * 4
    lib.qerl_fp4_has.restype = ci
    lib.qerl_fp4_stream.argtypes = [vp] * 11 + [ci] * 24 + [vp]
    lib.qerl_fp4_stream.restype = ci
    lib.qerl_fp4_has_stream.argtypes = [ci] * 6
    lib.qerl_fp4_has_stream.restype = ci
    lib.qerl_fp4_stream_smem.argtypes = [ci] * 6
    lib.qerl_fp4_stream_smem.restype = ci
    lib.qerl_fp4_preload.restype = ci
    if torch.cuda.is_available():
        torch.cuda.init()  # the primary context torch uses, so the kernels load into it
        err = lib.qerl_fp4_preload()
        if err:
            raise RuntimeError(f"loading the CUDA FP4 kernels failed: cudaError {err}")
    return lib


def available(device: torch.device | None = None) -> bool:
    """Hopper (sm_90) and the library builds/loads here; a failure is logged once and counts as absent."""
    return hopper_available(device, _available, _failed, _lib, "qerl CUDA FP4 kernel")


def unavailable_reason() -> str:
    """Why the kernel is absent here (the build/load error, or not Hopper), for reports."""
    return _failed[0] if _failed else "not an sm_90 GPU"


def supports(n: int, k: int) -> bool:
    """Shapes the kernel covers: whole 16-row blocks and whole 128-wide K chunks (the repacked layout's unit)."""
    return n % 16 == 0 and k % 128 == 0 and n > 0 and k > 0


def supports_lora_epilogue(n: int, k: int, r: int) -> bool:
    """Whether `fp4_gemm(..., lora_h=[M, r], lora_b=[N, r])` fuses the LoRA expand for this shape: the kernel covers
    [N, K] and the rank is a multiple of 8 up to `MAX_LORA_RANK` (every plan, legacy and stream, has the epilogue)."""
    return supports(n, k) and 0 < r <= MAX_LORA_RANK and r % 8 == 0


def default_mt(m: int) -> int:
    return 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8


# ---- launch plans --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """One launch of the CUDA kernel. kind "legacy": `fp4_gemm_kernel` (mt, wn, wk, perm; K split `splits` ways of
    `cps` chunks, summed by a second kernel). kind "decode"/"wide": the stream kernels (mt, stages, perm / wn, rbw)
    on `ctas` persistent CTAs per M group over `nseg` K segments of `kcs` chunks, whole portions per CTA when
    `pmode`, a fix-up kernel when some output is left to sum (`fixup`)."""

    kind: str
    mt: int
    wn: int = 1
    wk: int = 1
    perm: bool = True
    splits: int = 1
    cps: int = 0
    stages: int = 0
    rbw: int = 1
    ctas: int = 0
    nseg: int = 1
    kcs: int = 0
    pmode: bool = False
    fixup: bool = False

    @property
    def grows(self) -> int:
        """Rows of one row group (the unit of the stream plans' portions)."""
        return 16 * self.wn * self.rbw if self.kind == "wide" else 16

    def key(self) -> str:
        if self.kind == "legacy":
            return f"legacy-mt{self.mt}-{self.wn}x{self.wk}-perm{int(self.perm)}-s{self.splits}"
        shape = f"{self.wn}x{self.rbw}" if self.kind == "wide" else f"perm{int(self.perm)}"
        return (f"{self.kind}-mt{self.mt}-{shape}-S{self.stages}-c{self.ctas}-seg{self.nseg}"
                f"-{'p' if self.pmode else 'u'}{'-fix' if self.fixup else ''}")

    def split(self, n: int, k: int) -> StreamSplit:
        return StreamSplit(k // 128, self.kcs, self.nseg, -(-n // self.grows))


@dataclass(frozen=True)
class StreamSplit:
    """The unit order of a stream plan, as the kernel computes it (`Split` in fp4_gemm.cu): K segment s of `kcs`
    chunks (the last may be shorter), row group, chunk of the segment. Portion pi = (s, group) holds the units one
    output sums within a segment; CTA c of C takes units [c U / C, (c+1) U / C) or, with pmode, the units of
    portions [c P / C, (c+1) P / C)."""

    kc: int
    kcs: int
    nseg: int
    rg: int

    @property
    def units(self) -> int:
        return self.rg * self.kc

    @property
    def seg_units(self) -> int:
        return self.rg * self.kcs

    def seg_len(self, s: int) -> int:
        return min(self.kcs, self.kc - s * self.kcs)

    def pstart(self, pi: int) -> int:
        if pi >= self.nseg * self.rg:
            return self.units
        s = pi // self.rg
        return s * self.seg_units + (pi - s * self.rg) * self.seg_len(s)

    def portion(self, u: int) -> int:
        s = min(u // self.seg_units, self.nseg - 1)
        return s * self.rg + (u - s * self.seg_units) // self.seg_len(s)

    def chunk(self, u: int) -> int:
        s = min(u // self.seg_units, self.nseg - 1)
        return s * self.kcs + (u - s * self.seg_units) % self.seg_len(s)

    def range(self, c: int, ctas: int, pmode: bool) -> tuple[int, int]:
        if pmode:
            n_portions = self.nseg * self.rg
            return self.pstart(c * n_portions // ctas), self.pstart((c + 1) * n_portions // ctas)
        return c * self.units // ctas, (c + 1) * self.units // ctas

    def owner(self, u: int, ctas: int) -> int:
        return ((u + 1) * ctas - 1) // self.units

    def any_cut(self, ctas: int, pmode: bool) -> bool:
        """Whether some portion is shared by two CTAs (then the fix-up kernel sums its pieces)."""
        if pmode:
            return False
        return any(self.pstart(self.portion(u)) != u for u in (self.range(c, ctas, False)[0] for c in range(1, ctas)))


def legacy_plan(m: int, n: int, k: int, sms: int, mt: int | None = None, splits: int | None = None,
                wn: int | None = None, wk: int | None = None, perm: bool | None = None) -> Plan:
    """The legacy kernels' rule (any M). Up to 32 tokens, CTAs of 8 warps splitting one 16-row block's K, never
    split further (many short CTAs measured faster than few long ones, and a split across CTAs slower: the config
    sweep in docs/benchmarks.md); 64-token tiles use 4 warps on 4 row blocks, and split K across CTAs (fixed-order
    second pass, at most 4 ways, >= 2 chunks per warp) only when M is one tile and the grid has fewer than
    WARPS_PER_SM warps per SM. Activations are gathered per lane at M <= 2 and read from a permuted copy above
    that (one 16-byte load per lane per 32-wide slice)."""
    mt = mt or default_mt(m)
    perm = (m > 2 or mt > 1) if perm is None else perm
    if wn is None or wk is None:
        wn, wk = (1, 8) if mt <= 4 else (4, 1)
    if (mt, wn, wk, perm) not in CONFIGS:
        raise ValueError(f"no CUDA FP4 kernel for MT={mt}, WN={wn}, WK={wk}, perm={perm}; built: {CONFIGS}")
    kc = k // 128
    mtiles = -(-m // (8 * mt))
    warps = -(-(n // 16) // wn) * mtiles * wn * wk
    if splits is None:
        splits = 1
        if wk == 1 and mtiles == 1:
            splits = max(1, min(4, -(-WARPS_PER_SM * sms // warps), kc // 2))
    splits = max(1, min(splits, kc))
    cps = -(-kc // splits)
    return Plan("legacy", mt, wn, wk, perm, -(-kc // cps), cps)


def ctas_per_sm(plan: Plan) -> int:
    """Resident CTAs per SM a stream configuration is built for (its __launch_bounds__; registers and shared
    memory): 3 for the decode kernel at MT = 1 from the permuted copy with 4 stages (79 registers), else 2."""
    if plan.kind == "decode" and (plan.mt, plan.stages, plan.perm) == (1, 4, True):
        return 3
    return STREAM_CTAS_PER_SM


def _finish(plan: Plan, n: int, k: int, sms: int, ctas: int | None, pmode: bool | None, min_units: int) -> Plan:
    """Fill ctas (`ctas_per_sm` per SM, at most one per `min_units` units), the range mode (whole portions per CTA
    when that costs at most PMODE_IMBALANCE over an even split of the units: no cut portion, no fix-up; else unit
    ranges, every CTA the same units to within one) and whether a fix-up runs."""
    sp = plan.split(n, k)
    if ctas is None:
        ctas = min(ctas_per_sm(plan) * sms, max(1, sp.units // max(1, min_units)))
    ctas = max(1, min(ctas, sp.units))
    portions = sp.nseg * sp.rg
    if pmode is None:
        pmode = -(-portions // ctas) * ctas <= PMODE_IMBALANCE * portions
    if pmode:
        ctas = min(ctas, sp.nseg * sp.rg)
    if sp.units * ctas >= 2**31 - sp.units:
        raise ValueError(f"stream plan too large for 32-bit unit arithmetic: {sp.units} units x {ctas} CTAs")
    if sp.nseg > MAX_SEGS:
        raise ValueError(f"stream plan with {sp.nseg} K segments; the fix-up kernel takes at most {MAX_SEGS}")
    return replace(plan, ctas=ctas, pmode=pmode, fixup=sp.nseg > 1 or sp.any_cut(ctas, pmode))


def decode_plan(m: int, n: int, k: int, sms: int, *, stages: int | None = None, perm: bool | None = None,
                ctas: int | None = None, nseg: int | None = None, pmode: bool | None = None) -> Plan:
    """The decode kernel (M <= 16 per M group; MT = 1 to 8 tokens, 2 to 16): every SM gets `ctas_per_sm` CTAs
    of 8 warps (3 with 4 ring stages at M 3..8, 2 with 8 stages at M <= 2 and with 4 at M 9..16). The activations
    are gathered from x at M <= 2 and read from the permuted copy above; their K range is cut into segments of
    about XSEG_BYTES so that an SM's L1 keeps the slice its CTAs re-read for every row block (the segments' sums
    then go through the fix-up; the CTAs of one SM get neighbouring ranges, so they share a segment)."""
    mt = 1 if m <= 8 else 2
    perm = (m > 2 or mt > 1) if perm is None else perm
    stages = stages or (4 if mt == 1 and perm else 8 if mt == 1 else 4)
    if (mt, stages, perm) not in DECODE_CONFIGS:
        raise ValueError(f"no decode kernel for MT={mt}, S={stages}, perm={perm}; built: {DECODE_CONFIGS}")
    kc = k // 128
    rows = 8 * mt if perm else min(m, 8 * mt)
    if nseg is None:
        nseg = min(MAX_SEGS, max(1, -(-(rows * k * 2) // XSEG_BYTES)))
    kcs = -(-kc // max(1, min(nseg, kc)))
    plan = Plan("decode", mt, 1, DECODE_WARPS, perm, stages=stages, kcs=kcs, nseg=-(-kc // kcs))
    return _finish(plan, n, k, sms, ctas, pmode, min_units=DECODE_WARPS)


def wide_plan(m: int, n: int, k: int, sms: int, *, mt: int | None = None, wn: int | None = None,
              rbw: int | None = None, stages: int = 4, ctas: int | None = None, pmode: bool | None = None) -> Plan:
    """The wide kernel (M <= 64 per M group; MT = 4 to 32 tokens, 8 to 64): 8 warps on one 16-row block each at
    MT = 4, 4 warps on two blocks each at MT = 8 (halves the shared-memory reads of the activation slice, which
    every warp reads whole). At least KC/2 units per CTA, so a row group is cut into at most ~3 pieces (the
    pieces' fp32 values are M x rows each: at M = 64 they cost more than at decode)."""
    mt = mt or (4 if m <= 32 else 8)
    if wn is None or rbw is None:
        wn, rbw = (8, 1) if mt <= 4 else (4, 2)
    if (mt, wn, rbw, stages) not in WIDE_CONFIGS:
        raise ValueError(f"no wide kernel for MT={mt}, WN={wn}, RBW={rbw}, S={stages}; built: {WIDE_CONFIGS}")
    kc = k // 128
    plan = Plan("wide", mt, wn, 1, True, stages=stages, rbw=rbw, kcs=kc, nseg=1)
    return _finish(plan, n, k, sms, ctas, pmode, min_units=max(4, kc // 2))


def launch_plan(m: int, n: int, k: int, sms: int, mt: int | None = None, splits: int | None = None,
                wn: int | None = None, wk: int | None = None, perm: bool | None = None) -> Plan:
    """The plan for an [m, k] x [n, k]^T product: a fixed rule (the summation order, and so the bits, depend on the
    plan; a timed choice could differ between processes). M <= 16: the decode kernel; M <= 64: the wide kernel;
    above, or when legacy arguments are given or the `cuda_fp4_plans` option (QERL_CUDA_FP4_PLANS) is legacy: the
    legacy kernels."""
    forced = any(v is not None for v in (mt, splits, wn, wk, perm))
    if forced or m > WIDE_MAX_M or kernel_options().cuda_fp4_plans == "legacy":
        return legacy_plan(m, n, k, sms, mt, splits, wn, wk, perm)
    if m <= DECODE_MAX_M:
        return decode_plan(m, n, k, sms)
    return wide_plan(m, n, k, sms)


def check_plan(plan: Plan) -> None:
    built = {"legacy": (plan.mt, plan.wn, plan.wk, plan.perm) in CONFIGS,
             "decode": (plan.mt, plan.stages, plan.perm) in DECODE_CONFIGS,
             "wide": (plan.mt, plan.wn, plan.rbw, plan.stages) in WIDE_CONFIGS}.get(plan.kind, False)
    if not built:
        raise ValueError(f"no CUDA FP4 kernel for {plan}")


def use_pdl(pdl: bool | None) -> bool:
    """Programmatic dependent launch: on while a CUDA graph is captured (the weights a kernel prefetches before
    griddepcontrol.wait are then constant), never with the `cuda_pdl` option off (QERL_CUDA_PDL=0). Eagerly a
    kernel right before the GEMM may have written the weight (the in-place repack), so there it is off unless
    asked for."""
    if not kernel_options().cuda_pdl:
        return False
    return torch.cuda.is_current_stream_capturing() if pdl is None else pdl


def check_lora_args(lora_h: torch.Tensor, lora_b: torch.Tensor, x: torch.Tensor, m: int, n: int) -> int:
    r = lora_b.shape[-1] if lora_b.dim() == 2 else -1
    if lora_h.dim() != 2 or lora_b.dim() != 2 or lora_h.shape != (m, r) or lora_b.shape[0] != n:
        raise ValueError(f"LoRA epilogue needs lora_h [M={m}, R] and lora_b [N={n}, R], got {tuple(lora_h.shape)} "
                         f"and {tuple(lora_b.shape)}")
    if not 0 < r <= MAX_LORA_RANK or r % 8:
        raise ValueError(f"LoRA epilogue needs R % 8 == 0 and R <= {MAX_LORA_RANK}, got R = {r}")
    if lora_h.dtype != x.dtype or lora_b.dtype != x.dtype:
        raise ValueError(f"lora_h/lora_b must be in the activation dtype {x.dtype}, got {lora_h.dtype}/{lora_b.dtype}")
    if lora_h.stride(1) != 1 or lora_h.stride(0) % 2 or lora_h.data_ptr() % 4 or not lora_b.is_contiguous() \
            or lora_b.data_ptr() % 4:
        raise ValueError("lora_h needs unit column stride, an even row stride and 4-byte alignment; lora_b contiguous")
    return r


def fp4_gemm(x: torch.Tensor, repacked: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
             fmt: str, *, tiled: bool, shift: int = 0, bias: torch.Tensor | None = None, mt: int | None = None,
             splits: int | None = None, wn: int | None = None, wk: int | None = None,
             perm: bool | None = None, lora_h: torch.Tensor | None = None, lora_b: torch.Tensor | None = None,
             plan: Plan | None = None, pdl: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) (+ lora_h @ lora_b^T) on the GPU. `repacked` is `repack_fp4(weight_packed,
    tiled)` [N, K/2]; `scale` the checkpoint block scales; `shift` MXFP4's `mxfp4_shift`; `bias` fp32 [N] or None;
    `lora_h` [M, R] and `lora_b` [N, R] in x's dtype (lora_b already scaled by the LoRA scaling), both or neither:
    the expand is added in fp32 before the one rounding of y. `plan` (else `launch_plan`; mt/splits/wn/wk/perm
    force a legacy configuration); `pdl` programmatic dependent launch (default: while a graph is captured);
    `out` a contiguous [M, N] tensor of x's dtype to write y into."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the CUDA FP4 kernel takes bf16/fp16 activations, got {x.dtype}")
    n, k = repacked.shape[0], repacked.shape[1] * 2
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        raise ValueError("x must be [M, K] with unit column stride, even row stride and 4-byte alignment")
    if not supports(n, k) or (tiled and n % 64) or repacked.data_ptr() % 16:
        raise ValueError(f"the CUDA FP4 kernel needs N % 16 == 0 and K % 128 == 0 (tiled: N % 64), got {n}x{k}")
    nv = fmt == "nvfp4"
    if nv and global_scale is None:
        raise ValueError("NVFP4 needs weight_global_scale")
    if scale.data_ptr() % (8 if nv else 4):
        raise ValueError("the block scales must be 8-byte (NVFP4) / 4-byte (MXFP4) aligned")
    if (lora_h is None) != (lora_b is None):
        raise ValueError("the LoRA epilogue takes lora_h and lora_b together")
    r = check_lora_args(lora_h, lora_b, x, m, n) if lora_h is not None else 0
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    sms = num_sms(x.device)
    if plan is None:
        plan = launch_plan(m, n, k, sms, mt, splits, wn, wk, perm)
    check_plan(plan)
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    tiles = -(-m // (8 * plan.mt)) * plan.mt
    xp = torch.empty((tiles * 8, k), dtype=x.dtype, device=x.device) if plan.perm else None
    gs = global_scale.float() if nv else None

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    stream = torch.cuda.current_stream(x.device).cuda_stream
    common = (m, n, k, x.stride(0), int(nv), int(x.dtype == torch.bfloat16), int(tiled), int(shift), r,
              lora_h.stride(0) if lora_h is not None else 0)
    def scratch(*shape: int) -> torch.Tensor:  # fp32 workspace; NaN-poisoned for the self-check
        if POISON_WORKSPACE:
            return torch.full(shape, float("nan"), dtype=torch.float32, device=x.device)
        return torch.empty(shape, dtype=torch.float32, device=x.device)

    if plan.kind == "legacy":
        ws = scratch(plan.splits, m, n) if plan.splits > 1 else None
        wsl = scratch(m, n) if plan.splits > 1 and r else None
        err = _lib().qerl_fp4_gemm(ptr(x), ptr(xp), ptr(repacked), ptr(scale.view(torch.uint8)), ptr(gs), ptr(bias),
                                   ptr(y), ptr(ws), ptr(lora_h), ptr(lora_b), ptr(wsl), *common, plan.mt, plan.wn,
                                   plan.wk, int(plan.perm), plan.splits, plan.cps, stream)
    else:
        slots = scratch(plan.ctas, 2, m, plan.grows) if plan.fixup and not plan.pmode else None
        wseg = scratch(plan.nseg, m, n) if plan.nseg > 1 else None
        kind = 1 if plan.kind == "decode" else 2
        err = _lib().qerl_fp4_stream(ptr(x), ptr(xp), ptr(repacked), ptr(scale.view(torch.uint8)), ptr(gs),
                                     ptr(bias), ptr(y), ptr(slots), ptr(wseg), ptr(lora_h), ptr(lora_b), *common, kind,
                                     plan.mt, plan.wn, plan.rbw, plan.stages, int(plan.perm), plan.ctas, plan.nseg,
                                     plan.kcs, int(plan.pmode), plan.grows, ctas_per_sm(plan), int(plan.fixup),
                                     int(use_pdl(pdl)), stream)
    if err:
        raise RuntimeError(f"qerl CUDA FP4 kernel launch failed ({plan.key()}): cudaError {err}")
    return y


# ---- the exact CPU emulation -----------------------------------------------------------------------------
# For lane q (0..3) of a 16-row block, u32 word i (0..3) of the 16 bytes it loads per row and chunk, and
# the four shifts the kernel decodes it with: the K offsets (inside the chunk) of the low and high 16-bit
# halves. Shift 12 and 4 feed the first mma of slice i (operand slots k 2q,2q+1 and 2q+8,2q+9), 8 and 0
# the second.
SHIFTS = (12, 4, 8, 0)


def k_of(q: int, i: int, shift: int) -> tuple[int, int]:
    base = {12: 0, 4: 8, 8: 1, 0: 9}[shift]
    return 32 * i + base + 2 * q, 32 * i + base + 16 + 2 * q


def lane_words(repacked: torch.Tensor, tiled: bool) -> torch.Tensor:
    """The u32 words each lane loads, as the kernel addresses them: int64 [N, K/128, 4 lanes q, 4 words i]."""
    n, kb = repacked.shape
    kc = kb // 64
    flat = repacked.reshape(-1).to(torch.int64)
    r = torch.arange(n).view(n, 1, 1, 1)
    c = torch.arange(kc).view(1, kc, 1, 1)
    q = torch.arange(4).view(1, 1, 4, 1)
    b = torch.arange(16).view(1, 1, 1, 16)
    if tiled:
        off = (r // 64) * kc * 4096 + c * 4096 + (r % 64) * 64 + q * 16 + b
    else:
        off = r * kb + c * 64 + q * 16 + b
    by = flat[off].view(n, kc, 4, 4, 4)  # [.., word i, byte]
    return by[..., 0] | (by[..., 1] << 8) | (by[..., 2] << 16) | (by[..., 3] << 24)


def checkpoint_from_lanes(words: torch.Tensor) -> torch.Tensor:
    """Inverse view: put every nibble the lanes hold back at its K position -> [N, K/2] checkpoint bytes."""
    n, kc = words.shape[:2]
    codes = torch.zeros(n, kc * 128, dtype=torch.int64)
    for q in range(4):
        for i in range(4):
            w = words[:, :, q, i]
            for s in SHIFTS:
                v = (w << s) & 0xFFFFFFFF
                lo, hi = k_of(q, i, s)
                cols = torch.arange(kc) * 128
                codes[:, cols + lo] = (v >> 12) & 0xF
                codes[:, cols + hi] = (v >> 28) & 0xF
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def _bits16(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 holding a 16-bit pattern -> that 16-bit float."""
    return ((v + 2**15) % 2**16 - 2**15).to(torch.int16).view(dtype)


def _decode2(word: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's decode2 on a u32 (int64): (q & 0x80008000) | ((q & 0x70007000) >> 6 or 3) -> halves."""
    d = (word & 0x80008000) | ((word & 0x70007000) >> (6 if bf16 else 3))
    return d & 0xFFFF, (d >> 16) & 0xFFFF


def scale_pairs(scale: torch.Tensor, fmt: str, bf16: bool, shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's packed scale pair per (row, chunk, slice i): (low, high) 16-bit floats, [N, K/128, 4] each."""
    dt = torch.bfloat16 if bf16 else torch.float16
    s = scale.view(torch.uint8)
    n = s.shape[0]
    if fmt == "nvfp4":
        f = s.view(torch.float8_e4m3fn).float().view(n, -1, 4, 2)  # exact, like cvt.rn.f16x2.e4m3x2
        f = f * 2.0**118 if bf16 else (f.half() * 64.0).float()  # fp32 multiply (bf16) / fp16 multiply
        f = f.to(dt)  # exact: 4 significant bits, in range
        return f[..., 0], f[..., 1]
    e = s.to(torch.int64).view(n, -1, 4) + shift
    bits = ((e + 126).clamp(0, 254) << 7) if bf16 else ((e - 98).clamp(0, 30) << 10)
    v = _bits16(bits, dt)
    return v, v


def place_pairs(words: torch.Tensor, dtype: torch.dtype,
                pair: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[N, K] of `dtype` from each lane's words ([N, K/128, 4 lanes q, 4 words i], `lane_words`): `pair(word, i,
    s)` gives the two 16-bit values the kernel decodes from lane q's word i at decode shift s (each [N, K/128]),
    placed at their true K (`k_of`). The tile decodes differ only in `pair`."""
    n, kc = words.shape[:2]
    out = torch.zeros(n, kc * 128, dtype=dtype)
    cols = torch.arange(kc) * 128
    for q in range(4):
        for i in range(4):
            for s in SHIFTS:
                lo, hi = pair(words[:, :, q, i], i, s)
                klo, khi = k_of(q, i, s)
                out[:, cols + klo] = lo
                out[:, cols + khi] = hi
    return out


def emulate_decode(repacked: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype, *, tiled: bool,
                   shift: int = 0) -> torch.Tensor:
    """The 16-bit weight tile the tensor cores see, code * scale * 2**F, placed at its true K: [N, K] (dtype)."""
    bf16 = dtype == torch.bfloat16
    slo, shi = scale_pairs(scale, fmt, bf16, shift)

    def pair(word: torch.Tensor, i: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo_b, hi_b = _decode2((word << s) & 0xFFFFFFFF, bf16)
        # one rounding of an exact product, as fma.rn
        return _bits16(lo_b, dtype) * slo[:, :, i], _bits16(hi_b, dtype) * shi[:, :, i]

    return place_pairs(lane_words(repacked, tiled), dtype, pair)


def b_fragments(x: torch.Tensor) -> torch.Tensor:
    """Activation operand of lane (g, q) per 32-wide slice: the kernel's prmt of the pairs x[32i+8j+2q..+1]
    -> [M, K/32, 4 lanes q, 4 regs, 2 halves] (x's dtype), regs = (V0.b0, V0.b1, V1.b0, V1.b1)."""
    m, k = x.shape
    pairs = x.reshape(m, k // 32, 4, 4, 2)  # [.., j, q, half]: element 8j + 2q + half
    xj = pairs.permute(0, 1, 3, 2, 4)  # [m, slice, q, j, half]
    b0v0 = torch.stack([xj[:, :, :, 0, 0], xj[:, :, :, 2, 0]], -1)
    b1v0 = torch.stack([xj[:, :, :, 1, 0], xj[:, :, :, 3, 0]], -1)
    b0v1 = torch.stack([xj[:, :, :, 0, 1], xj[:, :, :, 2, 1]], -1)
    b1v1 = torch.stack([xj[:, :, :, 1, 1], xj[:, :, :, 3, 1]], -1)
    return torch.stack([b0v0, b1v0, b0v1, b1v1], 3)


def output_alpha(fmt: str, global_scale: torch.Tensor | None, shift: int = 0) -> float:
    """The factor the kernel's fp32 sum is multiplied by: 2**-F / G (NVFP4) or 2**-F (MXFP4), computed in fp32."""
    if fmt == "nvfp4":
        return float(torch.tensor(2.0 ** -F_NVFP4, dtype=torch.float32) / global_scale.float().reshape(()))
    return 2.0 ** -shift


def emulate_chunks(x: torch.Tensor, repacked: torch.Tensor, scale: torch.Tensor, fmt: str, *, tiled: bool,
                   shift: int = 0) -> torch.Tensor:
    """The kernel's per-chunk products before the output factor: [K/128, M, N] float64, chunk c holding every mma
    operand pair (decoded weight slot, prmt'd activation slot) of its 128 K, multiplied in float64 and summed.
    Pairs the two sides slot by slot, so a mismatch between the weight's and the activations' K permutation
    shows up as a wrong result."""
    bf16 = x.dtype == torch.bfloat16
    words = lane_words(repacked, tiled)
    n, kc = words.shape[:2]
    slo, shi = scale_pairs(scale, fmt, bf16, shift)
    bfr = b_fragments(x).double()  # [m, K/32, q, reg, half]
    out = torch.zeros(kc, x.shape[0], n, dtype=torch.float64)
    # operand A register of (q, i, shift) meets activation register (V0.b0, V0.b1, V1.b0, V1.b1)[reg]
    reg_of = {12: 0, 4: 1, 8: 2, 0: 3}
    for c in range(kc):
        for i in range(4):
            for q in range(4):
                for s in SHIFTS:
                    lo_b, hi_b = _decode2((words[:, c, q, i] << s) & 0xFFFFFFFF, bf16)
                    wl = (_bits16(lo_b, x.dtype) * slo[:, c, i]).double()
                    wh = (_bits16(hi_b, x.dtype) * shi[:, c, i]).double()
                    xb = bfr[:, c * 4 + i, q, reg_of[s]]
                    out[c] += xb[:, 0:1] * wl[None, :] + xb[:, 1:2] * wh[None, :]
    return out


# The LoRA epilogue's fragments (lora_mma in fp4_gemm.cu), per lane (g, q) and 16-wide r block r0:
# what each register LOADS (kernel addresses): A reg -> (row offset, r offset), B reg -> r offset (token g) ...
LORA_A_LOADS = {0: (0, 0), 1: (8, 0), 2: (0, 8), 3: (8, 8)}  # + (g, r0 + 2q + half)
LORA_B_LOADS = {0: 0, 1: 8}  # lora_h[token g][r0 + 2q + half + this]
# ... and where the mma puts it (PTX m16n8k16 fragments): A reg -> (row offset, k offset), B reg -> k offset,
# C reg -> (row offset, token offset) with row g + offset, k 2q + half + offset, token 2q + offset
MMA_A_SLOTS = {0: (0, 0), 1: (8, 0), 2: (0, 8), 3: (8, 8)}
MMA_B_SLOTS = {0: 0, 1: 8}
MMA_C_SLOTS = {0: (0, 0), 1: (0, 1), 2: (8, 0), 3: (8, 1)}


def emulate_lora(lora_h: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """The epilogue's LoRA product [M, N] (float64), built the way its mma fragments pair elements: every
    register's load is placed at the mma operand slot the fragment layout gives it, the 16x16 by 16x8 products are
    taken slot by slot and the C fragment is stored where the kernel stores it. A register loading the wrong r
    (or a wrong slot table) shows up as a wrong product. A last block of 8 (R % 16 == 8) has its upper half zero."""
    m, r = lora_h.shape
    n = lora_b.shape[0]
    mp = -(-m // 8) * 8
    h = torch.zeros(mp, r + 16, dtype=torch.float64)
    h[:m, :r] = lora_h.double()
    bw = torch.zeros(n, r + 16, dtype=torch.float64)
    bw[:, :r] = lora_b.double()
    y = torch.zeros(mp, n, dtype=torch.float64)
    nb, tiles = n // 16, mp // 8
    for r0 in range(0, r, 16):
        hi = r0 + 8 < r
        a_mat = torch.zeros(nb, 16, 16, dtype=torch.float64)  # [block, row, mma k]
        b_mat = torch.zeros(tiles, 16, 8, dtype=torch.float64)  # [tile, mma k, token]
        for g in range(8):
            for q in range(4):
                for half in range(2):
                    for reg, (dr, dk) in LORA_A_LOADS.items():
                        if dk and not hi:
                            continue
                        srow, sk = MMA_A_SLOTS[reg]
                        a_mat[:, g + srow, 2 * q + half + sk] = bw[torch.arange(nb) * 16 + g + dr,
                                                                   r0 + 2 * q + half + dk]
                    for reg, dk in LORA_B_LOADS.items():
                        if dk and not hi:
                            continue
                        b_mat[:, 2 * q + half + MMA_B_SLOTS[reg], g] = h[torch.arange(tiles) * 8 + g,
                                                                         r0 + 2 * q + half + dk]
        c = torch.einsum("brk,tkc->btrc", a_mat, b_mat)  # [block, tile, row, token]
        for g in range(8):
            for q in range(4):
                for drow, dtok in MMA_C_SLOTS.values():
                    rows = torch.arange(nb) * 16 + g + drow
                    toks = torch.arange(tiles) * 8 + 2 * q + dtok
                    y[toks[None, :], rows[:, None]] += c[:, :, g + drow, 2 * q + dtok]
    return y[:m]


def emulate_epilogue(acc: torch.Tensor, alpha: float, dtype: torch.dtype, bias: torch.Tensor | None = None,
                     lora: torch.Tensor | None = None) -> torch.Tensor:
    """The rounding of y where it is written whole: fp32 (acc * alpha), plus the LoRA term (fp32), plus the bias
    (fp32), rounded once to the activation dtype. `acc`, `lora` fp32 [M, N]; exact where the kernel's sums are
    (the self-check feeds it values whose sums are representable)."""
    v = acc.float() * torch.tensor(alpha, dtype=torch.float32)
    if lora is not None:
        v = v + lora.float()
    if bias is not None:
        v = v + bias.float()[None, :]
    return v.to(dtype)


def emulate_gemm(x: torch.Tensor, repacked: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                 fmt: str, *, tiled: bool, shift: int = 0, bias: torch.Tensor | None = None,
                 lora_h: torch.Tensor | None = None, lora_b: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] (float64) computed the kernel's way (`emulate_chunks` summed, times 2**-F (/ G)), plus the LoRA
    expand of the epilogue (`emulate_lora`) and the bias."""
    y = emulate_chunks(x, repacked, scale, fmt, tiled=tiled, shift=shift).sum(0)
    alpha = 2.0 ** -F_NVFP4 / global_scale.double().item() if fmt == "nvfp4" else 2.0 ** -shift
    y = y * alpha
    if lora_h is not None:
        y = y + emulate_lora(lora_h, lora_b)
    if bias is not None:
        y = y + bias.double()[None, :]
    return y


def emulate_plan(plan: Plan, chunks: torch.Tensor, alpha: float = 1.0, bias: torch.Tensor | None = None,
                 lora: torch.Tensor | None = None) -> torch.Tensor:
    """Replay a stream plan's assignment on per-chunk products `chunks` [K/128, M, N] (float64, e.g. from
    `emulate_chunks`): every CTA sums the units of each portion part it holds (times alpha, plus the LoRA term
    [M, N] in the part holding the row group's first chunk) and puts the value where the kernel puts it (y with
    the bias, the segment buffer, or slot A/B of a cut portion); then the fix-up sums segments and pieces in
    order. Outputs nothing wrote stay NaN, so a lost or doubled unit shows up against the plain sum."""
    kc, m, n = chunks.shape
    sp = plan.split(n, kc * 128)
    gr_rows = plan.grows
    mgroup = 8 * plan.mt
    y = torch.full((m, n), float("nan"), dtype=torch.float64)
    wseg = torch.full((sp.nseg, m, n), float("nan"), dtype=torch.float64)
    slots = torch.full((plan.ctas, 2, m, gr_rows), float("nan"), dtype=torch.float64)
    bias64 = None if bias is None else bias.double()
    for m0 in range(0, m, mgroup):  # the M groups run the same CTAs on their own tokens
        toks = slice(m0, min(m, m0 + mgroup))
        for c in range(plan.ctas):
            u0, u1 = sp.range(c, plan.ctas, plan.pmode)
            if u0 >= u1:
                continue
            for pi in range(sp.portion(u0), sp.portion(u1 - 1) + 1):
                s, gr = divmod(pi, sp.rg)
                ps, pe = sp.pstart(pi), sp.pstart(pi + 1)
                a, b = max(u0, ps), min(u1, pe)
                cols = slice(gr * gr_rows, min(n, (gr + 1) * gr_rows))
                v = sum(chunks[sp.chunk(u), toks, cols] for u in range(a, b)) * alpha
                if lora is not None and s == 0 and a == ps:
                    v = v + lora[toks, cols].double()
                if a == ps and b == pe:
                    if sp.nseg == 1:
                        y[toks, cols] = v + (bias64[cols] if bias64 is not None else 0.0)
                    else:
                        wseg[s, toks, cols] = v
                else:
                    ab = 1 if (a == ps or b != pe) else 0
                    slots[c, ab, toks, : cols.stop - cols.start] = v
    if not plan.fixup:
        return y
    for gr in range(sp.rg):
        cols = slice(gr * gr_rows, min(n, (gr + 1) * gr_rows))
        width = cols.stop - cols.start
        total = torch.zeros(m, width, dtype=torch.float64)
        direct = False
        for s in range(sp.nseg):
            pi = s * sp.rg + gr
            ps, pe = sp.pstart(pi), sp.pstart(pi + 1)
            cf, cl = (0, 0) if plan.pmode else (sp.owner(ps, plan.ctas), sp.owner(pe - 1, plan.ctas))
            if cf == cl:
                if sp.nseg == 1:
                    direct = True
                    break
                total = total + wseg[s, :, cols]
            else:
                piece = sum(slots[cc, 1, :, :width] for cc in range(cf, cl)) + slots[cl, 0, :, :width]
                total = total + piece
        if not direct:
            y[:, cols] = total + (bias64[cols] if bias64 is not None else 0.0)
    return y
