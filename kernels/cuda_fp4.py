"""qerl's CUDA C++ W4A16 FP4 GEMM for Hopper (`kernels/cuda/fp4_gemm.cu`), and its exact CPU emulation.

The kernel reads the FP4 weight in the byte order qerl already keeps resident (`fp4.repack_fp4`, row or
tiled), and the checkpoint block scales as they are: no second copy of anything. It is built on first
use with nvcc (`-arch=sm_90a`) into a shared library under `~/.cache/qerl/cuda/` (or `QERL_CUDA_CACHE`),
named by the hash of its source and flags, and called through ctypes on torch's current stream (so CUDA
graphs capture it). docs/kernels.md says why it is a plain shared library rather than a torch extension.

`emulate_*` reproduce, with torch integer ops and 16-bit multiplies on the CPU, what each thread of the
kernel computes from the same bytes: which 16 bytes a lane loads, how it decodes them, which scale pair
it applies, and which activation element each tensor-core operand slot is paired with. The CPU tests
check them bit for bit against the checkpoint bytes and the reference dequantization.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch
from qerl_kernels._common import num_sms

log = logging.getLogger("qerl.kernels")

SRC = Path(__file__).parent / "cuda" / "fp4_gemm.cu"
NVCC_FLAGS = ("-O3", "-std=c++17", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")
CACHE_ENV = "QERL_CUDA_CACHE"
# The built kernel configurations (keep in step with QERL_FP4_CONFIGS in fp4_gemm.cu): (MT 8-token tiles per
# CTA, WN warps along N each on its own 16-row block, WK warps splitting K, PERM reads the permuted
# activation copy made by a small first kernel instead of gathering 4-byte pairs from x).
CONFIGS = ((1, 4, 1, False), (1, 4, 2, False), (1, 1, 8, False), (1, 4, 1, True), (1, 4, 2, True), (1, 1, 8, True),
           (2, 4, 1, True), (2, 4, 2, True), (2, 1, 8, True), (4, 4, 1, True), (4, 1, 8, True), (8, 4, 1, True))
MTS = (1, 2, 4, 8)
WARPS_PER_SM = 16  # resident warps per SM the plan aims to fill (registers allow ~16 at 120 per thread)
F_NVFP4 = -8  # w' = code * scale * 2**F in the kernel; the fp32 result is multiplied by 2**-F (/ G)

_failed: list[str] = []
_available: dict[int, bool] = {}  # device index -> usable (asked on every auto forward: keep it a lookup)


# ---- build and load ------------------------------------------------------------------------------------
def _nvcc() -> str | None:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def source_hash() -> str:
    h = hashlib.sha256(SRC.read_bytes())
    h.update(" ".join(NVCC_FLAGS).encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "qerl" / "cuda")
    return root / f"qerl_fp4_gemm-{source_hash()}.so"


def build() -> Path:
    """Compile the library if this source has not been built yet (atomic: concurrent builders are safe)."""
    path = library_path()
    if path.exists():
        return path
    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.so")
    cmd = [nvcc, *NVCC_FLAGS, "-o", str(tmp), str(SRC)]
    log.info("building %s: %s", path.name, " ".join(cmd))
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed ({res.returncode}): {res.stderr[-2000:]}")
    tmp.replace(path)
    return path


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.qerl_fp4_gemm.argtypes = [vp] * 8 + [ci] * 14 + [vp]
    lib.qerl_fp4_gemm.restype = ci
    lib.qerl_fp4_has.argtypes = [ci] * 4
    lib.qerl_fp4_has.restype = ci
    lib.qerl_fp4_preload.restype = ci
    if torch.cuda.is_available():
        torch.cuda.init()  # the primary context torch uses, so the kernels load into it
        err = lib.qerl_fp4_preload()
        if err:
            raise RuntimeError(f"loading the CUDA FP4 kernels failed: cudaError {err}")
    return lib


def available(device: torch.device | None = None) -> bool:
    """Hopper (sm_90) and the library builds/loads here; a failure is logged once and counts as absent."""
    if _failed or not torch.cuda.is_available():
        return False
    idx = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    ok = _available.get(idx)
    if ok is None:
        ok = torch.cuda.get_device_capability(idx) == (9, 0)
        if ok:
            try:
                _lib()
            except Exception as exc:  # no nvcc, or it failed: the other backends stay
                _failed.append(repr(exc)[:500])
                log.warning("qerl CUDA FP4 kernel unavailable: %s", _failed[0])
                ok = False
        _available[idx] = ok
    return ok


def unavailable_reason() -> str:
    """Why the kernel is absent here (the build/load error, or not Hopper), for reports."""
    return _failed[0] if _failed else "not an sm_90 GPU"


def supports(n: int, k: int) -> bool:
    """Shapes the kernel covers: whole 16-row blocks and whole 128-wide K chunks (the repacked layout's unit)."""
    return n % 16 == 0 and k % 128 == 0 and n > 0 and k > 0


def default_mt(m: int) -> int:
    return 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8


def launch_plan(m: int, n: int, k: int, sms: int, mt: int | None = None, splits: int | None = None,
                wn: int | None = None, wk: int | None = None,
                perm: bool | None = None) -> tuple[int, int, int, bool, int, int]:
    """(mt, wn, wk, perm, splits, chunks per split) for an [m, k] x [n, k]^T product: a fixed rule (the
    summation order, and so the bits, depend on the plan; a timed choice could differ between processes).

    Up to 32 tokens, CTAs of 8 warps splitting one 16-row block's K, never split further (many short CTAs
    measured faster than few long ones, and a split across CTAs slower: the config sweep in
    docs/benchmarks.md); 64-token tiles use 4 warps on 4 row blocks, and split K across CTAs (fixed-order
    second pass, at most 4 ways, >= 2 chunks per warp) only when M is one tile and the grid has fewer than
    WARPS_PER_SM warps per SM. Activations are gathered per lane at M <= 2 and read from a permuted copy
    above that (one 16-byte load per lane per 32-wide slice)."""
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
    return mt, wn, wk, perm, -(-kc // cps), cps


def fp4_gemm(x: torch.Tensor, repacked: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
             fmt: str, *, tiled: bool, shift: int = 0, bias: torch.Tensor | None = None, mt: int | None = None,
             splits: int | None = None, wn: int | None = None, wk: int | None = None,
             perm: bool | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) on the GPU. `repacked` is `repack_fp4(weight_packed, tiled)` [N, K/2];
    `scale` the checkpoint block scales; `shift` MXFP4's `mxfp4_shift`; `bias` fp32 [N] or None."""
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
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    sms = num_sms(x.device)
    mt, wn, wk, perm, splits, cps = launch_plan(m, n, k, sms, mt, splits, wn, wk, perm)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = -(-m // (8 * mt)) * mt
    xp = torch.empty((tiles * 8, k), dtype=x.dtype, device=x.device) if perm else None
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else None
    gs = global_scale.float() if nv else None

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    stream = torch.cuda.current_stream(x.device).cuda_stream
    err = _lib().qerl_fp4_gemm(ptr(x), ptr(xp), ptr(repacked), ptr(scale.view(torch.uint8)), ptr(gs), ptr(bias),
                               ptr(y), ptr(ws), m, n, k, x.stride(0), int(nv), int(x.dtype == torch.bfloat16),
                               int(tiled), int(shift), mt, wn, wk, int(perm), splits, cps, stream)
    if err:
        raise RuntimeError(f"qerl CUDA FP4 kernel launch failed: cudaError {err}")
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


def emulate_decode(repacked: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype, *, tiled: bool,
                   shift: int = 0) -> torch.Tensor:
    """The 16-bit weight tile the tensor cores see, code * scale * 2**F, placed at its true K: [N, K] (dtype)."""
    bf16 = dtype == torch.bfloat16
    words = lane_words(repacked, tiled)
    n, kc = words.shape[:2]
    slo, shi = scale_pairs(scale, fmt, bf16, shift)
    out = torch.zeros(n, kc * 128, dtype=dtype)
    cols = torch.arange(kc) * 128
    for q in range(4):
        for i in range(4):
            for s in SHIFTS:
                lo_b, hi_b = _decode2((words[:, :, q, i] << s) & 0xFFFFFFFF, bf16)
                lo = _bits16(lo_b, dtype) * slo[:, :, i]  # one rounding of an exact product, as fma.rn
                hi = _bits16(hi_b, dtype) * shi[:, :, i]
                klo, khi = k_of(q, i, s)
                out[:, cols + klo] = lo
                out[:, cols + khi] = hi
    return out


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


def emulate_gemm(x: torch.Tensor, repacked: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                 fmt: str, *, tiled: bool, shift: int = 0) -> torch.Tensor:
    """y [M, N] (float64) computed the kernel's way: every mma operand pair (decoded weight slot, prmt'd
    activation slot) multiplied in float64 and summed, times 2**-F (/ G). Pairs the two sides slot by slot,
    so a mismatch between the weight's and the activations' K permutation shows up as a wrong result."""
    bf16 = x.dtype == torch.bfloat16
    words = lane_words(repacked, tiled)
    n, kc = words.shape[:2]
    slo, shi = scale_pairs(scale, fmt, bf16, shift)
    bfr = b_fragments(x).double()  # [m, K/32, q, reg, half]
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
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
                    y += xb[:, 0:1] * wl[None, :] + xb[:, 1:2] * wh[None, :]
    alpha = 2.0 ** -F_NVFP4 / global_scale.double().item() if fmt == "nvfp4" else 2.0 ** -shift
    return y * alpha
