"""The persistent decode layer (`kernels/cuda/decode_layer.cu`): the MLP half of a decoder layer's decode step -- o
+ residual, RMSNorm, gate/up + SiLU*mul, down, with the LoRA shrinks and expands inside -- as ONE launch of
persistent CTAs (NVFP4, MXFP4 or INT4 weights in qerl's resident repacked layout, or INT8 / FP8 in the checkpoint's
row-major layout; bf16/fp16 activations, M <= 16 tokens; the FP4 pair differ only in their block scales, converted
where a unit's scales land, INT4 -- the same nibbles in the same layout -- in its code decode and its one 16-bit
scale per 128-wide group, W8 in its 2 KiB units, 8-bit mma order and per-row scales); and the
attention half before the attention (`kernels/cuda/decode_attn.cu`: residual + RMSNorm, the fused q/k/v with LoRA and
bias, RoPE + KV-cache write) as one more (`attn_half`, `AttnSchedule`, `emulate_attn_half`, `reference_attn_half`; the
section at the end), on the same device machinery (`kernels/cuda/decode_common.cuh`).

Built on first use with nvcc into a shared library under the CUDA cache (`QERL_CUDA_CACHE`), named by the hash of its
source, its headers and flags (`nvcc_build`), called through ctypes on torch's current stream (CUDA graphs capture
it), as `cuda_fp4` is. It reads the weights the other FP4 kernels read (`backends.kernel_state`: the in-place repack
and the checkpoint block scales): no second copy. docs/decode.md ("The persistent decode layer") gives the design and
the floors.

`Schedule` mirrors the kernel's assignment (each warp's range of units per GEMM stage, the partials of every block,
shrink units, the stage counters); `emulate_mlp_half` computes what the kernel computes on the CPU in the kernel's
order (fp32 sums per 128-wide chunk, per warp range and across a block's warps in order, the LoRA term per 16-wide
rank block, the butterflies of the norm's sums) and rounds where it stores the activation dtype;
`reference_mlp_half` is the present decode path's math (dequantized weights, torch matmuls), which the emulation must
equal within the dtype's tolerance.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from qerl_kernels._common import device_index, num_sms
from qerl_kernels.backends import FP4_FORMATS
from qerl_kernels.nvcc_build import CudaLibrary, find_nvcc, hopper_available

SRC = Path(__file__).parent / "cuda" / "decode_layer.cu"
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
              "-lineinfo")
WARPS = 8  # NW in decode_layer.cu: per CTA, GEMM_WARPS GEMM warps and one LoRA warp
GEMM_WARPS = 7  # NG
MAX_M = 16  # two 8-token tiles
# the engine takes the kernel up to this many tokens: at 9-16 the dispatcher's Triton GEMMs measured faster in the
# 7B decode step (H200, 2026-11-29: graph step 5.73 vs 4.91 ms at batch 16; 4.43 vs 4.48 ms at batch 8)
ENGINE_MAX_M = 8
MAX_RANK = 256  # the partials' scratch is sized for it
# the formats the kernels take: both FP4 formats (MXFP4's one E8M0 scale byte per 32 weights instead of NVFP4's E4M3
# one per 16 is the only difference) and INT4 in groups of 128 (compressed-tensors' pack-quantized, whose int32 words
# hold the nibbles in FP4's order: the same repack, another code decode, one scale of the activation dtype per row
# and chunk). The engine hands both halves every format whose GPU exactness rows (scripts/decode_layer_bench.py,
# kernel against its CPU emulation) passed: the FP4 pair's MLP half (H200, 2026-11-29: 20 rows, bf16/fp16, M = 1-16,
# re-runs bit-equal) and attention half (`--attn`, H200, 2026-11-30: 16 MXFP4 rows per dtype, bf16 bit-equal, fp16
# <= 2.3e-5, re-runs bit-equal)
# The MLP half also takes the 8-bit formats (INT8, FP8 E4M3; per-channel scales in the activation dtype) from the
# checkpoint's row-major bytes, no repack (decode_common.cuh's w8_mma). Their GPU rows passed (H200, 2026-11-30: INT8
# bf16 bit-equal to the emulation, FP8 <= 7.4e-4; 7B at M = 1 / 8: 1.13-1.15x / 1.02-1.05x qerl's Triton W8 path,
# 0.77x at 16, so ENGINE_MAX_M holds for them too); the attention half takes the 4-bit formats only.
W8_FORMATS = ("int8", "fp8")
KERNEL_FORMATS = (*FP4_FORMATS, "int4", *W8_FORMATS)
ATTN_KERNEL_FORMATS = (*FP4_FORMATS, "int4")
ENGINE_FORMATS = KERNEL_FORMATS
# scale bytes per 128-wide chunk of a row (the FP4 pair's block scales, INT4's group; W8 scales each row after the
# sums) and the tile decode (decode_common.cuh's DEC_*): the kernels' format switches
SCALE_BYTES_PER_CHUNK = {"nvfp4": 8, "mxfp4": 4, "int4": 2, "int8": 0, "fp8": 0}
DECODE = {"nvfp4": 0, "mxfp4": 0, "int4": 1, "int8": 2, "fp8": 3}
NCNT = 10  # grid-wide counters: 3 GEMM phases, 3 shrinks' partials, 3 shrinks' h, the launch's end
SHRINK_SEGMENTS = 64  # a shrink's K is cut into at most this many segments (their partials are summed in order)
PHASES = ("o GEMM + residual", "norm (x2 in fragment order)", "gate/up GEMM + SiLU*mul", "down GEMM")
# the build's knobs (QERL_DL_S ring stages per warp, QERL_DL_MINB CTAs per SM the registers are budgeted for, and
# optionally QERL_DL_XPF: 1 loads gate/up's and down's x fragments ahead): the default is the variant measured fastest
# (docs/decode.md); others are built on demand for the bench
DEFAULT_VARIANT = (4, 2)
Variant = tuple[int, ...]


def _knobs(variant: Variant) -> tuple[int, int, int]:
    """(stages, CTAs per SM, x fragments ahead) of a variant given as (stages, CTAs per SM[, xpf])."""
    stages, minb, *rest = variant
    return int(stages), int(minb), int(rest[0]) if rest else 0

_failed: list[str] = []
_available: dict[int, bool] = {}
_counters: dict[int, torch.Tensor] = {}
_scratch: dict[tuple, Scratch] = {}


# ---- build and load ------------------------------------------------------------------------------------------
def library(variant: Variant = DEFAULT_VARIANT) -> CudaLibrary:
    """The shared library of one build variant (ring stages, CTAs per SM[, x fragments ahead])."""
    if _knobs(variant) == _knobs(DEFAULT_VARIANT):
        return CudaLibrary("qerl_decode_layer", SRC, NVCC_FLAGS)
    stages, minb, xpf = _knobs(variant)
    return CudaLibrary(f"qerl_decode_layer_s{stages}b{minb}" + (f"x{xpf}" if xpf else ""), SRC,
                       (*NVCC_FLAGS, f"-DQERL_DL_S={stages}", f"-DQERL_DL_MINB={minb}", f"-DQERL_DL_XPF={xpf}"))


LIBRARY = library()
# module-level names kept for callers and tests; the build itself is nvcc_build's
_nvcc = find_nvcc
source_hash = LIBRARY.source_hash
library_path = LIBRARY.library_path
compile_command = LIBRARY.compile_command
build = LIBRARY.build


@functools.cache
def _lib(variant: Variant = DEFAULT_VARIANT) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library(variant).build()))
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.qerl_dl_prepare.argtypes = [ci, ci, ctypes.POINTER(ci)]
    lib.qerl_dl_prepare.restype = ci
    lib.qerl_dl_smem.argtypes = [ci]
    lib.qerl_dl_smem.restype = ci
    lib.qerl_dl_stages.restype = ci
    lib.qerl_dl_minb.restype = ci
    lib.qerl_dl_xpf.restype = ci
    lib.qerl_dl_mlp.argtypes = [vp, vp] + [vp] * 9 + [ctypes.c_float] + [ci] * 9 + [vp]
    lib.qerl_dl_mlp.restype = ci
    if (lib.qerl_dl_stages(), lib.qerl_dl_minb(), lib.qerl_dl_xpf()) != _knobs(variant):
        raise RuntimeError(f"decode layer library {variant} reports another build")
    return lib


@functools.cache
def ctas_per_sm(mt: int, bf16: bool, variant: Variant = DEFAULT_VARIANT) -> int:
    """Resident CTAs per SM of a variant (sets its shared-memory limit first: call outside graph capture)."""
    n = ctypes.c_int(0)
    err = _lib(variant).qerl_dl_prepare(mt, int(bf16), ctypes.byref(n))
    if err:
        raise RuntimeError(f"decode layer kernel: cudaError {err} preparing it")
    return n.value


def default_ctas(device: torch.device, mt: int, bf16: bool, variant: Variant = DEFAULT_VARIANT) -> int:
    """The grid: every SM holds as many CTAs as the build budgets registers for (and shared memory allows)."""
    return num_sms(device) * min(variant[1], ctas_per_sm(mt, bf16, variant))


def _check_variants() -> None:
    torch.cuda.init()
    for mt in (1, 2):
        for bf16 in (True, False):
            if ctas_per_sm(mt, bf16) < 1:
                raise RuntimeError(f"no CTA of variant mt={mt} fits on an SM")


def available(device: torch.device | None = None) -> bool:
    """Hopper (sm_90) and the library builds/loads here; a failure is logged once and counts as absent (the per-GEMM
    path stays)."""
    return hopper_available(device, _available, _failed, _check_variants, "qerl persistent decode layer")


def unavailable_reason() -> str:
    return _failed[0] if _failed else "not an sm_90 GPU"


# ---- the schedule (mirror of the kernel's assignment) ----------------------------------------------------------
def shrink_chunks(k: int) -> int:
    """128-wide chunks per shrink segment: K cut into at most SHRINK_SEGMENTS segments."""
    kc = k // 128
    return max(1, -(-kc // SHRINK_SEGMENTS))


@dataclass(frozen=True)
class Schedule:
    """The kernel's work for one launch: hidden H, intermediate I, o's input width KO, LoRA ranks (0: none) of o,
    gate/up and down, `ctas` CTAs of WARPS warps."""

    m: int
    h: int
    i: int
    ko: int
    ranks: tuple[int, int, int]
    ctas: int

    def k(self, gi: int) -> int:
        return (self.ko, self.h, self.i)[gi]

    def n(self, gi: int) -> int:
        return (self.h, 2 * self.i, self.h)[gi]

    @property
    def warps(self) -> int:
        """The GEMM warps of the grid."""
        return self.ctas * GEMM_WARPS

    def geo(self, gi: int) -> tuple[int, int, int]:
        """geo_of: (blocks, units per block, K chunks); gate/up's blocks are the (gate j, up j) pairs."""
        kc = self.k(gi) // 128
        return (self.i // 16, 2 * kc, kc) if gi == 1 else (self.h // 16, kc, kc)

    def units(self, gi: int) -> int:
        nb, u, _ = self.geo(gi)
        return nb * u

    def sharing(self, gi: int) -> int:
        """The warps that share stage gi's units: all, or one per unit where it has fewer units than warps."""
        return min(self.warps, self.units(gi))

    def range(self, gi: int, v: int) -> tuple[int, int]:
        """range_first: warp v's units [first, end) of GEMM stage gi (empty past the sharing warps)."""
        t, w = self.units(gi), self.sharing(gi)
        if v >= w:
            return t, t
        return v * t // w, (v + 1) * t // w

    def warp_of(self, gi: int, x: int) -> int:
        """warp_of: the warp whose range holds unit x."""
        t, w = self.units(gi), self.sharing(gi)
        return ((x + 1) * w + t - 1) // t - 1

    def unit(self, gi: int, x: int) -> tuple[int, int]:
        """(first weight row of its 16, K chunk) of unit x (unit_row)."""
        nb, u, kc = self.geo(gi)
        b, within = divmod(x, u)
        if gi == 1:
            return ((self.i // 16 if within >= kc else 0) + b) * 16, within % kc
        return b * 16, within

    def block_rows(self, gi: int, b: int) -> list[int]:
        """First weight row of each half of block b (gate/up: the gate block's, then the up block's)."""
        _, u, kc = self.geo(gi)
        return [self.unit(gi, b * u)[0]] + ([self.unit(gi, b * u + kc)[0]] if gi == 1 else [])

    def parts(self, gi: int, b: int) -> list[tuple[int, int, int]]:
        """(warp, first unit, end unit) of each partial of block b, in the order the finishing warp sums them."""
        _, u, _ = self.geo(gi)
        out = []
        for v in range(self.warp_of(gi, b * u), self.warp_of(gi, b * u + u - 1) + 1):
            first, end = self.range(gi, v)
            out.append((v, max(first, b * u), min(end, (b + 1) * u)))
        return out

    def pmax(self, gi: int) -> int:
        """The most partials of any block of stage gi (the scratch's slots per block)."""
        nb, u, _ = self.geo(gi)
        return max(self.warp_of(gi, b * u + u - 1) - self.warp_of(gi, b * u) + 1 for b in range(nb))

    def shrink_units(self, gi: int) -> list[tuple[int, int, int]]:
        """(CTA whose LoRA warp computes it, 16-rank block, K segment) of every shrink unit of group gi."""
        r = self.ranks[gi]
        if r == 0:
            return []
        nrk = -(-r // 16)
        kseg = shrink_chunks(self.k(gi))
        nseg = -(-(self.k(gi) // 128) // kseg)
        return [(u % self.ctas, u % nrk, u // nrk) for u in range(nrk * nseg)]

    def h_share(self, gi: int, c: int) -> tuple[int, int]:
        """The [first, end) of the M x R values of group gi's h that CTA c's LoRA warp sums."""
        n = self.m * self.ranks[gi]
        return c * n // self.ctas, (c + 1) * n // self.ctas

    def counters_after(self, phase: int) -> list[int]:
        """The GEMM warps' three phase counters (o, x2, gate/up) once every CTA has finished `phase` (0..3) and none
        has started the next; after the last phase the last CTA has put every counter back to zero."""
        if phase >= len(PHASES) - 1:
            return [0] * 3
        return [self.ctas if s <= phase else 0 for s in range(3)]


# ---- the launch --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmArgs:
    """One GEMM of the kernel: the module's resident repack, checkpoint scales, NVFP4 global scale (None for MXFP4),
    layout, the LoRA group's A_cat [R, K] / B_blk [N, R] (activation dtype, scaling folded) or None, the format and
    MXFP4's per-tensor exponent shift (fp4.mxfp4_shift)."""

    repacked: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    tiled: bool
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    fmt: str = "nvfp4"
    shift: int = 0

    @property
    def scale_bytes_per_chunk(self) -> int:
        """Bytes of one row's scales per 128-wide chunk: the kernel's only format switch."""
        return SCALE_BYTES_PER_CHUNK[self.fmt]

    def alpha(self) -> torch.Tensor:
        """The fp32 factor the kernel applies to a block's summed partials: 2^8 / global scale (NVFP4), 2^-F
        (MXFP4), 1 (INT4; W8, whose rows' scales come after: `row_scale`)."""
        if self.global_scale is not None:
            return torch.tensor(256.0, dtype=torch.float32) / self.global_scale.float().cpu().reshape(())
        return torch.tensor(2.0 ** -self.shift, dtype=torch.float32)

    def ints(self) -> list[int]:
        """The launch's three format ints: scale bytes per chunk, exponent shift, tile decode."""
        return [self.scale_bytes_per_chunk, self.shift, DECODE[self.fmt]]

    def row_scale(self) -> torch.Tensor | None:
        """W8's per-channel scales as the fp32 factors [N] of the rows' sums (None: a 4-bit format)."""
        return self.scale.float().cpu().reshape(-1) if self.fmt in W8_FORMATS else None

    def global_scale_ptr(self) -> int | None:
        return None if self.global_scale is None else self.global_scale.data_ptr()

    @property
    def n(self) -> int:
        return self.repacked.shape[0]

    @property
    def k(self) -> int:
        return self.repacked.shape[1] * (1 if self.fmt in W8_FORMATS else 2)

    @property
    def rank(self) -> int:
        return 0 if self.a is None else self.a.shape[0]


def gemm_args(module: torch.nn.Module, a: torch.Tensor | None = None, b: torch.Tensor | None = None, *,
              formats: tuple[str, ...] = ENGINE_FORMATS) -> GemmArgs | None:
    """The kernel's view of a quantized `QuantLinear` (one of `formats`): a 4-bit one's in-place repack, an 8-bit
    one's stored codes (None: the kernel cannot take it)."""
    if getattr(module, "bias", None) is not None:
        return None
    return _kernel_args(module, a, b, formats)


def _kernel_args(module: torch.nn.Module, a: torch.Tensor | None, b: torch.Tensor | None,
              formats: tuple[str, ...]) -> GemmArgs | None:
    from qerl_kernels.backends import kernel_state

    if getattr(module, "fmt", None) not in formats:  # a subset of KERNEL_FORMATS
        return None
    st = kernel_state(module)
    if module.fmt in W8_FORMATS:  # the checkpoint's row-major codes as bytes, per-channel scales [N, 1]
        t = st.tensors
        return GemmArgs(t["weight"].view(torch.uint8), t["weight_scale"], None, False, a, b, module.fmt, 0)
    if st.repacked is None:
        return None
    t = st.tensors
    gs = t.get("weight_global_scale")
    # INT4's int32 words as the bytes the kernel streams (a view: the same storage)
    return GemmArgs(st.repacked.view(torch.uint8), t["weight_scale"], None if gs is None else gs.float().reshape(1),
                    bool(st.tiled), a, b, module.fmt, int(st.shift))


def checkpoint_args(qw, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> GemmArgs:  # noqa: ANN001
    """The kernels' view of a `QuantizedWeight`'s checkpoint tensors, as `kernel_state` builds a module's: 4-bit
    bytes repacked into a new tensor (tiled where N % 64 == 0; INT4's int32 words as their bytes), NVFP4's global
    scale, MXFP4's exponent shift; W8's row-major codes as they are. For benches and tests, which have no module."""
    from qerl_kernels.fp4 import mxfp4_shift, repack_fp4

    t = qw.tensors
    if qw.fmt in W8_FORMATS:
        return GemmArgs(t["weight"].view(torch.uint8), t["weight_scale"], None, False, a, b, qw.fmt, 0)
    tiled = qw.shape[0] % 64 == 0
    gs = t.get("weight_global_scale")
    shift = mxfp4_shift(t["weight_scale"]) if qw.fmt == "mxfp4" else 0
    return GemmArgs(repack_fp4(t["weight_packed"].view(torch.uint8), tiled=tiled), t["weight_scale"],
                    None if gs is None else gs.float().reshape(1), tiled, a, b, qw.fmt, shift)


def format_mismatch(gemms: tuple[GemmArgs, ...], dtype: torch.dtype | None) -> str | None:
    """Why one launch cannot take these GEMMs' formats with activations of `dtype` (None: it can): one tile decode
    for all of them (it is the kernel's template parameter), and INT4's and W8's 16-bit scales in the activation
    dtype (the kernel reads them as that dtype)."""
    if len({DECODE[g.fmt] for g in gemms}) > 1:
        return "one tile decode for every GEMM of the launch (FP4, INT4, INT8 or FP8)"
    if dtype is not None and any(g.fmt in ("int4", *W8_FORMATS) and g.scale.dtype != dtype for g in gemms):
        return f"INT4 and W8 scales in the activation dtype ({dtype})"
    return None


# The formats `QERL_DECODE_LAYER_ATTN=auto` hands the attention half: INT4, whose per-op q/k/v dequantizes its weight
# per call (7B, 256 + 128, H200, 2026-11-30: 11.4 -> 3.64 ms per decode step at batch 1, 11.76 -> 4.23 at batch 8);
# not the FP4 pair, even with their per-op kernels in the same run (3.81 -> 3.70 ms at batch 1, 4.28 -> 4.32 at 8)
ATTN_AUTO_FORMATS = ("int4",)


def attn_half_wanted(mode: str, fmt: str) -> bool:
    """Whether the engine runs a layer's attention half as the persistent kernel under the decode_layer_attn option
    `mode` ("auto", "1", "0") for a q/k/v in `fmt`."""
    return mode == "1" or (mode == "auto" and fmt in ATTN_AUTO_FORMATS)


def input_misfit(o: GemmArgs, attn: torch.Tensor) -> str | None:
    """Why o's input `attn` [M, KO] cannot be read as the kernel reads it (None: it can): W8 reads its rows 16 bytes
    at a time."""
    if o.fmt in W8_FORMATS and (attn.data_ptr() % 16 or attn.stride(0) % 8):
        return "W8 reads o's input rows 16 bytes at a time (16-byte aligned rows)"
    return None


def engine_max_m(fmt: str) -> int:
    """The most tokens the engine hands the kernels of a format: FP4 and W8 up to ENGINE_MAX_M (measured against
    their Triton GEMMs), INT4 up to MAX_M (its per-GEMM path dequantizes the whole weight per call)."""
    return MAX_M if fmt == "int4" else ENGINE_MAX_M


def check_shapes(o: GemmArgs, gate_up: GemmArgs, down: GemmArgs, m: int,
                 dtype: torch.dtype | None = None) -> str | None:
    """Why the kernel does not take these GEMMs at m tokens (and activations of `dtype`, where given; None: it
    does)."""
    h, i = o.n, down.k
    if not 1 <= m <= MAX_M:
        return f"{m} tokens (the kernel takes 1..{MAX_M})"
    if gate_up.n != 2 * i or gate_up.k != h or down.n != h:
        return "o/gate_up/down shapes do not chain"
    why = format_mismatch((o, gate_up, down), dtype)
    if why is not None:
        return why
    if h % 128 or i % 128 or o.k % 128:
        return "hidden, intermediate and o's input must be multiples of 128"
    if not all(g.tiled or g.fmt in W8_FORMATS for g in (o, gate_up, down)):
        return "4-bit weights in the tiled resident layout (rows a multiple of 64)"
    for g in (o, gate_up, down):
        if g.rank and (g.rank % 8 or g.rank > MAX_RANK or g.a.shape[1] != g.k or g.b.shape != (g.n, g.rank)):
            return f"LoRA rank {g.rank} (a multiple of 8 up to {MAX_RANK}, A [R, K], B [N, R])"
    return None


def _counter(device: torch.device) -> torch.Tensor:
    """The stage counters of a device: zero between launches (the kernel's last CTA resets them)."""
    idx = device_index(device)
    cnt = _counters.get(idx)
    if cnt is None:
        cnt = _counters[idx] = torch.zeros(16, dtype=torch.int32, device=device)
    return cnt


@dataclass(frozen=True)
class Scratch:
    """A launch shape's scratch: per GEMM stage its partials' slots and block counters (``parts``: slots, counters,
    slots, ...) and the slots per block (``pmax``), which the launch passes on."""

    parts: tuple[torch.Tensor, ...]
    pmax: tuple[int, int, int]


def scratch(device: torch.device, sch: Schedule, mt: int) -> Scratch:
    """Per GEMM stage: its partials' slots [blocks * pmax * halves * mt * 32 * 4] fp32 and its block counters
    (zero between launches: each block's finishing warp resets its own), kept per device and shape with the slots
    per block (counted once: a Python walk over every block). Made outside any graph capture (`prepare`): a capture
    replays what it saw, and these must outlive it."""
    key = (device_index(device), sch.h, sch.i, sch.ko, sch.ctas, mt)
    got = _scratch.get(key)
    if got is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode layer kernel: its scratch is made by decode_layer.prepare before graph capture")
        parts: list[torch.Tensor] = []
        pmax = tuple(sch.pmax(gi) for gi in range(3))
        for gi in range(3):
            nb = sch.geo(gi)[0]
            halves = 2 if gi == 1 else 1
            parts.append(torch.empty(nb * pmax[gi] * halves * mt * 32 * 4, dtype=torch.float32, device=device))
            parts.append(torch.zeros(nb, dtype=torch.int32, device=device))
        got = _scratch[key] = Scratch(tuple(parts), pmax)
    return got


def prepare(device: torch.device, o: GemmArgs, gate_up: GemmArgs, down: GemmArgs, dtype: torch.dtype,
            variant: Variant = DEFAULT_VARIANT) -> None:
    """Everything a launch needs that a graph capture must not make: the variant's library and shared-memory limit,
    and the scratch of both token tiles (1..8, 9..16 tokens)."""
    bf16 = dtype == torch.bfloat16
    for mt in (1, 2):
        ctas = default_ctas(device, mt, bf16, variant)
        scratch(device, Schedule(8 * mt, o.n, down.k, o.k, (o.rank, gate_up.rank, down.rank), ctas), mt)
    _counter(device)


def mlp_half(attn: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor, eps: float, o: GemmArgs, gate_up: GemmArgs,
             down: GemmArgs, *, pdl: bool | None = None, ctas: int | None = None,
             variant: Variant = DEFAULT_VARIANT) -> tuple[torch.Tensor, torch.Tensor]:
    """(h1, delta): h1 = h + o_proj(attn) (the residual stream after attention), delta = down(SiLU(gate) * up) of
    rmsnorm(h1) -- what the present path computes from `lp.o`, `add_norm` and the MLP -- in one launch. attn [M, KO],
    h [M, H] with unit column stride; returns new contiguous [M, H] tensors."""
    from qerl_kernels import cuda_fp4

    m = attn.shape[0]
    why = check_shapes(o, gate_up, down, m, attn.dtype)
    if why is not None:
        raise ValueError(f"decode layer kernel: {why}")
    if attn.dtype not in (torch.bfloat16, torch.float16) or h.dtype != attn.dtype or norm_w.dtype != attn.dtype:
        raise ValueError("decode layer kernel: bf16/fp16 activations and norm weight of one dtype")
    if attn.stride(1) != 1 or h.stride(1) != 1 or attn.stride(0) % 2 or h.stride(0) % 2:
        raise ValueError("decode layer kernel: rows with unit column stride and even row stride")
    why = input_misfit(o, attn)
    if why is not None:
        raise ValueError(f"decode layer kernel: {why}")
    hd, i = o.n, down.k
    dev, dt = attn.device, attn.dtype
    mt = 1 if m <= 8 else 2
    bf16 = dt == torch.bfloat16
    if ctas is None:
        ctas = default_ctas(dev, mt, bf16, variant)
    scr = scratch(dev, Schedule(m, hd, i, o.k, (o.rank, gate_up.rank, down.rank), ctas), mt)
    h1 = torch.empty((m, hd), dtype=dt, device=dev)
    # gate/up's and down's inputs in mma fragment order (the normed h1, act), 16 bytes per (tile, 32-wide slice, lane)
    xp = torch.empty((mt * (hd + i) // 32 * 32, 4), dtype=torch.int32, device=dev)
    act = torch.empty((m, i), dtype=dt, device=dev)
    out = torch.empty((m, hd), dtype=dt, device=dev)
    ss = torch.empty((hd // 16, m), dtype=torch.float32, device=dev)
    ptrs, ints, keep = [], [], []
    for gi, g in enumerate((o, gate_up, down)):
        kseg = shrink_chunks(g.k)
        nseg = -(-(g.k // 128) // kseg)
        hp = torch.empty((nseg, m, max(g.rank, 1)), dtype=torch.float32, device=dev)
        hg = torch.empty((m, max(g.rank, 1)), dtype=dt, device=dev)
        keep += [hp, hg]
        a = g.a.contiguous() if g.a is not None else None
        b = g.b.contiguous() if g.b is not None else None
        keep += [a, b]
        ptrs += [g.repacked.data_ptr(), g.scale.view(torch.uint8).data_ptr(), g.global_scale_ptr(),
                 a.data_ptr() if a is not None else None, b.data_ptr() if b is not None else None, hp.data_ptr(),
                 scr.parts[2 * gi].data_ptr(), scr.parts[2 * gi + 1].data_ptr(), hg.data_ptr()]
        ints += [g.n, g.k, g.rank, kseg, nseg, scr.pmax[gi], *g.ints()]
    gptr = (ctypes.c_void_p * 27)(*ptrs)
    gint = (ctypes.c_int * 27)(*ints)
    nw = norm_w.contiguous()
    stream = torch.cuda.current_stream(dev).cuda_stream
    err = _lib(variant).qerl_dl_mlp(gptr, gint, attn.data_ptr(), h.data_ptr(), nw.data_ptr(), h1.data_ptr(),
                                    xp.data_ptr(), act.data_ptr(), out.data_ptr(), ss.data_ptr(),
                                    _counter(dev).data_ptr(), float(eps), m, hd, i, attn.stride(0), h.stride(0), mt,
                                    int(bf16), ctas, int(cuda_fp4.use_pdl(pdl)), stream)
    if err:
        raise RuntimeError(f"decode layer kernel: cudaError {err}")
    _record((o, gate_up, down))
    return h1, out


def _record(gemms: tuple[GemmArgs, ...]) -> None:
    """The bench's account of what ran (`dispatch.record_shape`): these GEMMs ran inside the persistent kernel."""
    from qerl_kernels import dispatch

    for g in gemms:
        dispatch.record_shape(g.n, g.k, "decode-layer")


# ---- CPU: the kernel's computation in its order, and the present path's math -----------------------------------
def _rnd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


def emulate_int4_decode(repacked: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *,
                        tiled: bool) -> torch.Tensor:
    """The 16-bit INT4 weight the tensor cores see, [N, K] (dtype): each lane's u32 words as the kernel loads them
    (`cuda_fp4.lane_words`), the nibble at bit 12 - s of each half where FP4's decode2 reads q << s (so at FP4's true
    K, `cuda_fp4.place_pairs`), code - 8 times its row's scale of that 128-wide chunk, one rounding (fma.rn)."""
    from qerl_kernels.cuda_fp4 import lane_words, place_pairs

    words = lane_words(repacked.view(torch.uint8), tiled)
    s = scale.float().reshape(words.shape[0], words.shape[1])

    def pair(word: torch.Tensor, i: int, sh: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = ((word >> (12 - sh)) & 0xF) - 8
        hi = ((word >> (28 - sh)) & 0xF) - 8
        return (lo.float() * s).to(dtype), (hi.float() * s).to(dtype)  # exact in fp32 (4 x 11 bits), one rounding

    return place_pairs(words, dtype, pair)


def emulate_weight(g: GemmArgs, dtype: torch.dtype) -> torch.Tensor:
    """The 16-bit weight [N, K] a GEMM stage's tensor cores see for activations of `dtype`, from its resident bytes."""
    from qerl_kernels import cuda_fp4

    if g.fmt == "int4":
        return emulate_int4_decode(g.repacked.cpu(), g.scale.cpu(), dtype, tiled=g.tiled)
    if g.fmt in W8_FORMATS:  # the codes themselves, exact in 16 bits; the per-channel scale comes after the sums
        codes = g.repacked.cpu().view(torch.int8 if g.fmt == "int8" else torch.float8_e4m3fn)
        return codes.float().to(dtype)
    return cuda_fp4.emulate_decode(g.repacked.cpu(), g.scale.cpu(), g.fmt, dtype, tiled=g.tiled, shift=g.shift)


def _gemm_fp32(x: torch.Tensor, g: GemmArgs, hl: torch.Tensor | None, sch: Schedule, gi: int) -> torch.Tensor:
    """fp32 [M, N] as the kernel's GEMM stage sums it: per 16-row block, each warp's partial is the sum of its units'
    128-wide chunk products in order; the partials are summed in warp order, times alpha, then + the LoRA term one
    16-wide rank block at a time."""
    dt = x.dtype
    w16 = emulate_weight(g, dt).float()
    xf = x.float()
    kc = g.k // 128
    chunks = torch.stack([xf[:, c * 128:(c + 1) * 128] @ w16[:, c * 128:(c + 1) * 128].t() for c in range(kc)])
    v = torch.zeros(x.shape[0], g.n)
    for b in range(sch.geo(gi)[0]):
        halves: dict[int, torch.Tensor] = {}  # first row -> the block's sum of partials
        for _, first, end in sch.parts(gi, b):
            part: dict[int, torch.Tensor] = {}
            for unit in range(first, end):
                row, ch = sch.unit(gi, unit)
                prod = chunks[ch][:, row:row + 16]
                part[row] = prod if row not in part else part[row] + prod
            for row in sch.block_rows(gi, b):  # a partial that holds no unit of a half adds that half's zeros
                p = part.get(row, torch.zeros(x.shape[0], 16))
                halves[row] = p if row not in halves else halves[row] + p
        for row, total in halves.items():
            v[:, row:row + 16] = total
    v = v * g.alpha()
    rs = g.row_scale()
    if rs is not None:  # W8: each row's fp32 sum times its scale (row_scale in the kernel)
        v = v * rs
    if hl is not None:
        bf = g.b.float().cpu()
        for r0 in range(0, g.rank, 16):
            v = v + hl[:, r0:r0 + 16] @ bf[:, r0:r0 + 16].t()
    return v


def _shrink(x: torch.Tensor, g: GemmArgs) -> torch.Tensor | None:
    """h [M, R] (fp32 holding dtype values): per K segment, fp32 sums of 16-wide k steps; segments summed in order,
    then rounded as the kernel rounds h into shared memory."""
    if g.a is None:
        return None
    xf, af = x.float(), g.a.float().cpu()
    kseg = shrink_chunks(g.k) * 128
    h = torch.zeros(x.shape[0], g.rank)
    for s0 in range(0, g.k, kseg):
        acc = torch.zeros_like(h)
        for k0 in range(s0, min(s0 + kseg, g.k), 16):
            acc = acc + xf[:, k0:k0 + 16] @ af[:, k0:k0 + 16].t()
        h = h + acc
    return _rnd(h, x.dtype)


def _butterfly(v: torch.Tensor, offsets: tuple[int, ...]) -> torch.Tensor:
    """v[..., lanes] after `v += shfl_xor(v, off)` for each offset: every lane holds the same fixed-order sum."""
    idx = torch.arange(v.shape[-1])
    for off in offsets:
        v = v + v[..., idx ^ off]
    return v


def _inv_rms(ss: torch.Tensor, hd: int, eps: float) -> torch.Tensor:
    """inv_rms_of: per token, lane l sums the blocks' sums of squares ss [M, H/16] l, l+32, ... in order, then a
    butterfly over the 32 lanes; 1 / sqrt(total / H + eps), each step rounded in fp32."""
    m, nb = ss.shape
    lanes = torch.zeros(m, 32)
    for b in range(nb):
        lanes[:, b % 32] = lanes[:, b % 32] + ss[:, b]
    tot = _butterfly(lanes, (16, 8, 4, 2, 1))[:, 0]
    return 1.0 / torch.sqrt(tot / float(hd) + torch.tensor(eps, dtype=torch.float32))


def emulate_mlp_half(attn: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor, eps: float, o: GemmArgs,
                     gate_up: GemmArgs, down: GemmArgs, ctas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h1, delta) computed as a launch of `ctas` CTAs computes them, on the CPU (fp32 sums in the kernel's order, the
    dtype's rounding where the kernel stores it)."""
    dt = attn.dtype
    m, hd, i = attn.shape[0], o.n, down.k
    sch = Schedule(m, hd, i, o.k, (o.rank, gate_up.rank, down.rank), ctas)
    # stages 0-1: o's shrink, o GEMM with the expand, the residual, the per-block sums of squares
    yo = _rnd(_gemm_fp32(attn, o, _shrink(attn, o), sch, 0), dt)
    h1 = _rnd(h.float() + yo, dt)
    sq = (h1 * h1).view(m, hd // 16, 2, 8)  # [tok, block, half (row g / g+8), g]
    ss = _butterfly(sq[:, :, 0] + sq[:, :, 1], (1, 2, 4))[..., 0]  # [tok, block]
    rs = _inv_rms(ss, hd, eps)
    x2 = _rnd(norm_w.float() * _rnd(h1 * rs[:, None], dt), dt).to(dt)
    # stage 3: gate/up with SiLU * up
    gu = _rnd(_gemm_fp32(x2, gate_up, _shrink(x2, gate_up), sch, 1), dt)
    g_, u_ = gu[:, :i], gu[:, i:]
    act = _rnd(_rnd(g_ / (1.0 + torch.exp(-g_)), dt) * u_, dt).to(dt)
    # stages 4-5: down's shrink and GEMM
    out = _gemm_fp32(act, down, _shrink(act, down), sch, 2).to(dt)
    return h1.to(dt), out


def reference_mlp_half(attn: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor, eps: float,
                       weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                       loras: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...],
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The present decode path's math from dequantized fp32 weights (o, gate_up, down) and LoRA (A_cat, B_blk) per
    group: each shrink and GEMM output rounded to the activation dtype, the residual add and RMSNorm as
    `add_rmsnorm`, SiLU * up as `silu_mul`."""
    dt = attn.dtype

    def linear(x: torch.Tensor, w: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        y = x.float() @ w.t()
        if lora is not None:
            hl = _rnd(x.float() @ lora[0].float().t(), dt)
            y = y + hl @ lora[1].float().t()
        return y.to(dt)

    yo = linear(attn, weights[0], loras[0])
    h1 = (h.float() + yo.float()).to(dt)
    hf = h1.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    x2 = norm_w * n
    gu = linear(x2, weights[1], loras[1])
    i = gu.shape[1] // 2
    g_, u_ = gu[:, :i].float(), gu[:, i:].float()
    act = ((g_ / (1.0 + torch.exp(-g_))).to(dt).float() * u_).to(dt)
    return h1, linear(act, weights[2], loras[2])


# ==== the attention half (kernels/cuda/decode_attn.cu) ============================================================
# Residual add + RMSNorm, the fused q/k/v GEMM with its LoRA and bias, RoPE and the KV-cache write as ONE launch on the
# same machinery (decode_common.cuh). Its GEMM's "blocks" are RoPE pairs: rows [hd*D + 16j, +16) and the same + D/2
# of one head (q, k and v heads alike), so the warp that finishes a pair holds both halves rotate_half mixes.
ATTN_SRC = Path(__file__).parent / "cuda" / "decode_attn.cu"
ATTN_NCNT = 4  # residual written, shrink partials written, h summed, the launch's end
ATTN_PHASES = ("residual + sums of squares", "qkv GEMM + bias + RoPE + KV write")

_attn_failed: list[str] = []
_attn_available: dict[int, bool] = {}
_attn_counters: dict[int, torch.Tensor] = {}


def attn_library(variant: tuple[int, int] = DEFAULT_VARIANT) -> CudaLibrary:
    """The attention half's shared library of one build variant (ring stages, CTAs per SM)."""
    if tuple(variant) == DEFAULT_VARIANT:
        return CudaLibrary("qerl_decode_attn", ATTN_SRC, NVCC_FLAGS)
    stages, minb = variant
    return CudaLibrary(f"qerl_decode_attn_s{stages}b{minb}", ATTN_SRC,
                       (*NVCC_FLAGS, f"-DQERL_DL_S={stages}", f"-DQERL_DL_MINB={minb}"))


ATTN_LIBRARY = attn_library()


@functools.cache
def _attn_lib(variant: tuple[int, int] = DEFAULT_VARIANT) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(attn_library(variant).build()))
    vp, ci, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.qerl_da_prepare.argtypes = [ci, ci, ctypes.POINTER(ci)]
    lib.qerl_da_prepare.restype = ci
    lib.qerl_da_stages.restype = ci
    lib.qerl_da_minb.restype = ci
    lib.qerl_da_attn.argtypes = [vp] * 14 + [ll] * 4 + [vp, ctypes.c_float] + [ci] * 12 + [vp]
    lib.qerl_da_attn.restype = ci
    if (lib.qerl_da_stages(), lib.qerl_da_minb()) != tuple(variant):
        raise RuntimeError(f"decode attention-half library {variant} reports another build")
    return lib


@functools.cache
def attn_ctas_per_sm(mt: int, bf16: bool, variant: tuple[int, int] = DEFAULT_VARIANT) -> int:
    """Resident CTAs per SM of an attention-half variant (sets its shared-memory limit: call outside capture)."""
    n = ctypes.c_int(0)
    err = _attn_lib(variant).qerl_da_prepare(mt, int(bf16), ctypes.byref(n))
    if err:
        raise RuntimeError(f"decode attention-half kernel: cudaError {err} preparing it")
    return n.value


def attn_default_ctas(device: torch.device, mt: int, bf16: bool,
                      variant: tuple[int, int] = DEFAULT_VARIANT) -> int:
    return num_sms(device) * min(variant[1], attn_ctas_per_sm(mt, bf16, variant))


def _check_attn_variants() -> None:
    torch.cuda.init()
    for mt in (1, 2):
        for bf16 in (True, False):
            if attn_ctas_per_sm(mt, bf16) < 1:
                raise RuntimeError(f"no attention-half CTA of variant mt={mt} fits on an SM")


def attn_available(device: torch.device | None = None) -> bool:
    """Hopper and the attention half's library builds/loads here (a failure is logged once: the per-op path stays)."""
    return hopper_available(device, _attn_available, _attn_failed, _check_attn_variants,
                            "qerl persistent decode attention half")


def attn_unavailable_reason() -> str:
    return _attn_failed[0] if _attn_failed else "not an sm_90 GPU"


@dataclass(frozen=True)
class AttnSchedule:
    """The attention half's work for one launch: hidden H, hq query and hk KV heads of head_dim d, the q/k/v LoRA rank
    (0: none), `ctas` CTAs. One GEMM stage (gi 0 only: the methods keep `Schedule`'s signatures so that the emulation's
    GEMM order is computed by the same code) whose blocks are RoPE pairs."""

    m: int
    h: int
    hq: int
    hk: int
    d: int
    rank: int
    ctas: int

    @property
    def n(self) -> int:
        return (self.hq + 2 * self.hk) * self.d

    @property
    def warps(self) -> int:
        return self.ctas * GEMM_WARPS

    def k(self, gi: int = 0) -> int:
        return self.h

    def geo(self, gi: int = 0) -> tuple[int, int, int]:
        """attn_geo: (pairs, units per pair, K chunks)."""
        kc = self.h // 128
        return self.n // 32, 2 * kc, kc

    def units(self, gi: int = 0) -> int:
        nb, u, _ = self.geo()
        return nb * u

    def sharing(self, gi: int = 0) -> int:
        return min(self.warps, self.units())

    def range(self, gi: int, v: int) -> tuple[int, int]:
        t, w = self.units(), self.sharing()
        if v >= w:
            return t, t
        return v * t // w, (v + 1) * t // w

    def warp_of(self, gi: int, x: int) -> int:
        t, w = self.units(), self.sharing()
        return ((x + 1) * w + t - 1) // t - 1

    def pair_row(self, b: int, half: int) -> int:
        """pair_row: first weight row of half `half` of pair b (head b // (d/32), block b % (d/32) of its first
        half; the second half D/2 rows further)."""
        per = self.d // 32
        return (b // per) * self.d + (b % per) * 16 + half * (self.d // 2)

    def unit(self, gi: int, x: int) -> tuple[int, int]:
        _, u, kc = self.geo()
        b, within = divmod(x, u)
        return self.pair_row(b, int(within >= kc)), within % kc

    def block_rows(self, gi: int, b: int) -> list[int]:
        return [self.pair_row(b, 0), self.pair_row(b, 1)]

    def parts(self, gi: int, b: int) -> list[tuple[int, int, int]]:
        _, u, _ = self.geo()
        out = []
        for v in range(self.warp_of(gi, b * u), self.warp_of(gi, b * u + u - 1) + 1):
            first, end = self.range(gi, v)
            out.append((v, max(first, b * u), min(end, (b + 1) * u)))
        return out

    def pmax(self, gi: int = 0) -> int:
        nb, u, _ = self.geo()
        return max(self.warp_of(gi, b * u + u - 1) - self.warp_of(gi, b * u) + 1 for b in range(nb))

    def residual_share(self, c: int) -> tuple[int, int]:
        """The [first, end) of the M x H/16 (token, 16-column block) items whose residual CTA c writes."""
        n = self.m * (self.h // 16)
        return c * n // self.ctas, (c + 1) * n // self.ctas

    def shrink_units(self, gi: int = 0) -> list[tuple[int, int, int]]:
        if self.rank == 0:
            return []
        nrk = -(-self.rank // 16)
        kc = self.h // 128
        nseg = -(-kc // shrink_chunks(self.h))
        return [(u % self.ctas, u % nrk, u // nrk) for u in range(nrk * nseg)]

    def h_share(self, gi: int, c: int) -> tuple[int, int]:
        n = self.m * self.rank
        return c * n // self.ctas, (c + 1) * n // self.ctas


def attn_gemm_args(module: torch.nn.Module, a: torch.Tensor | None = None, b: torch.Tensor | None = None, *,
                   formats: tuple[str, ...] = ENGINE_FORMATS) -> tuple[GemmArgs, torch.Tensor | None] | None:
    """The attention-half kernel's view of the fused q/k/v FP4 `QuantLinear` (resident repack) and its bias as the
    cuda FP4 GEMM adds it (fp32, after the LoRA term), or None."""
    args = _kernel_args(module, a, b, formats)
    if args is None:
        return None
    bias = getattr(module, "bias", None)
    return args, None if bias is None else bias.detach().float().contiguous()


def attn_check_shapes(qkv: GemmArgs, m: int, hq: int, hk: int, d: int,
                      dtype: torch.dtype | None = None) -> str | None:
    """Why the attention-half kernel does not take this q/k/v GEMM at m tokens (and activations of `dtype`, where
    given; None: it does)."""
    if not 1 <= m <= MAX_M:
        return f"{m} tokens (the kernel takes 1..{MAX_M})"
    if d % 32 or hq < 1 or hk < 1 or qkv.n != (hq + 2 * hk) * d:
        return f"q/k/v rows {qkv.n} != ({hq} + 2 x {hk}) x head_dim {d} with head_dim a multiple of 32"
    if qkv.k % 128:
        return "hidden must be a multiple of 128"
    if qkv.fmt not in ATTN_KERNEL_FORMATS:
        return f"{qkv.fmt}: the attention half takes the 4-bit formats"
    if not qkv.tiled:
        return "weight in the tiled resident layout (rows a multiple of 64)"
    if qkv.rank and (qkv.rank % 8 or qkv.rank > MAX_RANK or qkv.a.shape[1] != qkv.k
                     or qkv.b.shape != (qkv.n, qkv.rank)):
        return f"LoRA rank {qkv.rank} (a multiple of 8 up to {MAX_RANK}, A [R, K], B [N, R])"
    return format_mismatch((qkv,), dtype)


def _attn_counter(device: torch.device) -> torch.Tensor:
    idx = device_index(device)
    cnt = _attn_counters.get(idx)
    if cnt is None:
        cnt = _attn_counters[idx] = torch.zeros(16, dtype=torch.int32, device=device)
    return cnt


def attn_scratch(device: torch.device, sch: AttnSchedule, mt: int) -> Scratch:
    """The GEMM's partials' slots [pairs * pmax * 2 halves * mt * 32 * 4] fp32 and its pair counters (zero between
    launches), per device and shape; made outside any graph capture (`attn_prepare`)."""
    key = ("attn", device_index(device), sch.h, sch.hq, sch.hk, sch.d, sch.ctas, mt)
    got = _scratch.get(key)
    if got is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode attention-half kernel: its scratch is made by attn_prepare before capture")
        pmax = sch.pmax()
        nb = sch.geo()[0]
        parts = (torch.empty(nb * pmax * 2 * mt * 32 * 4, dtype=torch.float32, device=device),
                 torch.zeros(nb, dtype=torch.int32, device=device))
        got = _scratch[key] = Scratch(parts, (pmax, 0, 0))
    return got


def attn_prepare(device: torch.device, qkv: GemmArgs, hq: int, hk: int, d: int, dtype: torch.dtype,
                 variant: tuple[int, int] = DEFAULT_VARIANT) -> None:
    """The library, shared-memory limit, scratch of both token tiles and the counters: before any graph capture."""
    bf16 = dtype == torch.bfloat16
    for mt in (1, 2):
        ctas = attn_default_ctas(device, mt, bf16, variant)
        attn_scratch(device, AttnSchedule(8 * mt, qkv.k, hq, hk, d, qkv.rank, ctas), mt)
    _attn_counter(device)


def attn_half(h: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, qkv: GemmArgs,
              bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
              cache_k: torch.Tensor, cache_v: torch.Tensor, hq: int, *, pdl: bool | None = None,
              ctas: int | None = None, variant: tuple[int, int] = DEFAULT_VARIANT,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(hn, q): hn = h + delta (h itself with no delta), q = RoPE(q part of qkv(rmsnorm(hn))) [M, hq, D]; k (rotated)
    and v written into the layer's cache [slots, max_len, hk, D] at (token m's slot m, positions[m]) -- what the
    present decode step computes with add_rmsnorm + the LoRA shrink, the q/k/v GEMM with its expand and bias, and
    rope_kv_write -- in one launch. h/delta [M, H] (unit column stride, even row stride), cos/sin [max_len, D] tables
    of the activation dtype, positions int64 [M], bias fp32 [N] or None."""
    from qerl_kernels import cuda_fp4

    m, hd = h.shape
    hk, d = cache_k.shape[-2], cache_k.shape[-1]
    why = attn_check_shapes(qkv, m, hq, hk, d, h.dtype)
    if why is None and qkv.k != hd:
        why = f"q/k/v input {qkv.k} != hidden {hd}"
    if why is not None:
        raise ValueError(f"decode attention-half kernel: {why}")
    dt = h.dtype
    if dt not in (torch.bfloat16, torch.float16) or norm_w.dtype != dt or cos.dtype != dt or sin.dtype != dt \
            or cache_k.dtype != dt or cache_v.dtype != dt or (delta is not None and delta.dtype != dt):
        raise ValueError("decode attention-half kernel: bf16/fp16 activations, norm weight, tables and cache of one "
                         "dtype")
    if h.stride(1) != 1 or h.stride(0) % 2 or (delta is not None and (delta.stride(1) != 1 or delta.stride(0) % 2)):
        raise ValueError("decode attention-half kernel: rows with unit column stride and even row stride")
    for c in (cache_k, cache_v):
        if c.dim() != 4 or c.stride(3) != 1 or c.stride(2) != d or c.shape[0] < m:
            raise ValueError("decode attention-half kernel: cache [slots >= M, max_len, hk, D] with packed heads")
    if cos.stride(1) != 1 or sin.stride(1) != 1 or cos.stride(0) != sin.stride(0) or cos.shape[1] != d:
        raise ValueError("decode attention-half kernel: cos/sin tables [max_len, D] of one row stride")
    if positions.dtype != torch.int64 or positions.shape != (m,):
        raise ValueError("decode attention-half kernel: positions int64 [M]")
    dev = h.device
    mt = 1 if m <= 8 else 2
    bf16 = dt == torch.bfloat16
    if ctas is None:
        ctas = attn_default_ctas(dev, mt, bf16, variant)
    scr = attn_scratch(dev, AttnSchedule(m, hd, hq, hk, d, qkv.rank, ctas), mt)
    hout = torch.empty((m, hd), dtype=dt, device=dev) if delta is not None else h
    q = torch.empty((m, hq, d), dtype=dt, device=dev)
    ss = torch.empty((hd // 16, m), dtype=torch.float32, device=dev)
    kseg = shrink_chunks(qkv.k)
    nseg = -(-(qkv.k // 128) // kseg)
    hp = torch.empty((nseg, m, max(qkv.rank, 1)), dtype=torch.float32, device=dev)
    hg = torch.empty((m, max(qkv.rank, 1)), dtype=dt, device=dev)
    a = qkv.a.contiguous() if qkv.a is not None else None
    b = qkv.b.contiguous() if qkv.b is not None else None
    gptr = (ctypes.c_void_p * 9)(qkv.repacked.data_ptr(), qkv.scale.view(torch.uint8).data_ptr(),
                                 qkv.global_scale_ptr(), a.data_ptr() if a is not None else None,
                                 b.data_ptr() if b is not None else None, hp.data_ptr(), scr.parts[0].data_ptr(),
                                 scr.parts[1].data_ptr(), hg.data_ptr())
    gint = (ctypes.c_int * 9)(qkv.n, qkv.k, qkv.rank, kseg, nseg, scr.pmax[0], *qkv.ints())
    nw = norm_w.contiguous()
    b32 = bias.float().contiguous() if bias is not None else None
    pos = positions.contiguous()
    stream = torch.cuda.current_stream(dev).cuda_stream
    err = _attn_lib(variant).qerl_da_attn(
        gptr, gint, b32.data_ptr() if b32 is not None else None, h.data_ptr(),
        delta.data_ptr() if delta is not None else None, nw.data_ptr(),
        hout.data_ptr() if delta is not None else None, ss.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        pos.data_ptr(), q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), cache_k.stride(0), cache_k.stride(1),
        cache_v.stride(0), cache_v.stride(1), _attn_counter(dev).data_ptr(), float(eps), m, hd, hq, hk, d,
        h.stride(0), delta.stride(0) if delta is not None else 0, cos.stride(0), mt, int(bf16), ctas,
        int(cuda_fp4.use_pdl(pdl)), stream)
    if err:
        raise RuntimeError(f"decode attention-half kernel: cudaError {err}")
    _record((qkv,))
    return hout, q


# ---- CPU: the attention half in the kernel's order, and the present path's math --------------------------------
def rope_pairs(y1: torch.Tensor, y2: torch.Tensor, c1: torch.Tensor, s1: torch.Tensor, c2: torch.Tensor,
               s2: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's (and rope_kv_write's) RoPE of element i (y1) and i + D/2 (y2): each product rounded to the
    activation dtype, their fp32 sum rounded (fp32 tensors holding dtype values in and out)."""
    o1 = _rnd(_rnd(y1 * c1, dtype) + _rnd(-y2 * s1, dtype), dtype)
    o2 = _rnd(_rnd(y2 * c2, dtype) + _rnd(y1 * s2, dtype), dtype)
    return o1, o2


def emulate_attn_half(h: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float, qkv: GemmArgs,
                      bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      cache_k: torch.Tensor, cache_v: torch.Tensor, hq: int, ctas: int,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(hn, q) and the cache writes as a launch of `ctas` CTAs computes them, on the CPU: the residual in the dtype,
    each block's sum of squares in column order, `inv_rms_of`'s order, x = rnd(w * rnd(hn * rs)), the shrink per
    segment, the GEMM's fp32 sums per warp range and across a pair's warps in order (`_gemm_fp32`), + bias in fp32,
    rounded once, RoPE with rope_kv_write's roundings. Writes k and v into cache_k/cache_v (in place, as the kernel)."""
    dt = h.dtype
    m, hd = h.shape
    hk, d = cache_k.shape[-2], cache_k.shape[-1]
    sch = AttnSchedule(m, hd, hq, hk, d, qkv.rank, ctas)
    hn = _rnd(h.float() + delta.float(), dt) if delta is not None else h.float()
    sq = (hn * hn).view(m, hd // 16, 16)
    ss = sq[..., 0]
    for k in range(1, 16):  # residual_share: one thread per (token, block), columns in order
        ss = ss + sq[..., k]
    rs = _inv_rms(ss, hd, eps)
    x = _rnd(norm_w.float() * _rnd(hn * rs[:, None], dt), dt).to(dt)
    v = _gemm_fp32(x, qkv, _shrink(x, qkv), sch, 0)
    if bias is not None:
        v = v + bias.float().cpu()[None, :]
    y = _rnd(v, dt).view(m, hq + 2 * hk, d)
    half = d // 2
    c = cos.float().cpu()[positions.cpu()]  # [M, D]
    s = sin.float().cpu()[positions.cpu()]
    rot = y[:, :hq + hk]
    o1, o2 = rope_pairs(rot[..., :half], rot[..., half:], c[:, None, :half], s[:, None, :half], c[:, None, half:],
                        s[:, None, half:], dt)
    rot = torch.cat([o1, o2], dim=-1)
    rows = torch.arange(m)
    cache_k[rows, positions.cpu()] = rot[:, hq:].to(dt)
    cache_v[rows, positions.cpu()] = y[:, hq + hk:].to(dt)
    return hn.to(dt), rot[:, :hq].to(dt).contiguous()


def reference_attn_half(h: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                        weight: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None,
                        bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                        cache_k: torch.Tensor, cache_v: torch.Tensor, hq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The present decode step's math from the dequantized fp32 q/k/v weight: `add_rms_norm` (h + delta in the dtype,
    transformers' RMSNorm), the shrink rounded to the dtype, the GEMM + expand + bias rounded once, and the torch form
    of rope_kv_write (`apply_rope_ref` on the tables at each position, `index_put_` into the cache)."""
    dt = h.dtype
    m = h.shape[0]
    hk, d = cache_k.shape[-2], cache_k.shape[-1]
    hn = (h.float() + delta.float()).to(dt) if delta is not None else h
    hf = hn.float()
    x = norm_w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    y = x.float() @ weight.float().t()
    if lora is not None:
        y = y + _rnd(x.float() @ lora[0].float().t(), dt) @ lora[1].float().t()
    if bias is not None:
        y = y + bias.float()[None, :]
    y = y.to(dt).view(m, 1, hq + 2 * hk, d)
    cg, sg = cos[positions][:, None, None, :], sin[positions][:, None, None, :]

    def rope(t: torch.Tensor) -> torch.Tensor:  # fast_layers.apply_rope_ref
        half = t.shape[-1] // 2
        return t * cg + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sg

    q = rope(y[:, :, :hq])[:, 0]
    rows = torch.arange(m, device=h.device)
    cache_k.index_put_((rows, positions), rope(y[:, :, hq:hq + hk])[:, 0])
    cache_v.index_put_((rows, positions), y[:, 0, hq + hk:])
    return hn, q
