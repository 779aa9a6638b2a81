"""The kernels' settings, read from the environment once, as one typed value (`KernelOptions`).

Every `QERL_*` variable that changes what a kernel computes or how it is chosen is a field here, with its default
and a one-line help; nothing else in `qerl_kernels` reads the environment for them. The current value is read on
first use (`kernel_options()`); an application reads it at its start-up (`reload_kernel_options()`, which qerl's
CLI calls through `qerl_cli.options.reload_options`), and code or tests that need other settings change them
through `update(...)` (for the rest of the process, as `dispatch.set_backend` does) or `override(...)` (for a
block). A value that cannot work fails with a `KernelSettingError` naming the variable and what it may be.

The module itself uses no torch, but importing it runs `qerl_kernels/__init__`, which loads torch and Triton.
docs/options.md lists every option of both layers (this one and `qerl_cli.options`) in one table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_kernels._common import KernelSettingError

LINEAR_BACKENDS = ("auto", "qerl", "triton", "humming", "cublas", "cuda")
DISPATCH_CANDIDATES = ("triton", "cublas", "cuda", "humming")
DECODE_LAYER_ATTN = ("auto", "1", "0")
CUDA_FP4_PLANS = ("stream", "legacy")
FP8_ACT_MODES = ("0", "1", "auto")
MOE_ALIGN_MODES = ("triton", "torch")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

Parser = Callable[[str, Any, type[Exception]], Any]


# ---- parsers: (variable, raw value, error class) -> typed value ---------------------------------------------
# The raw value is the environment's string, or a typed value handed to `override`/`update`; both are checked.
def parse_bool(env: str, raw: Any, err: type[Exception]) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise err(f"{env}={raw!r}: use 1 or 0 (or true/false, yes/no, on/off)")


def parse_int(env: str, raw: Any, err: type[Exception], minimum: int = 0) -> int:
    try:
        value = raw if isinstance(raw, int) and not isinstance(raw, bool) else int(str(raw).strip())
    except ValueError:
        raise err(f"{env}={raw!r}: use a whole number >= {minimum}") from None
    if value < minimum:
        raise err(f"{env}={raw!r}: use a whole number >= {minimum}")
    return value


def parse_float(env: str, raw: Any, err: type[Exception]) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise err(f"{env}={raw!r}: use a number of seconds > 0") from None
    if not value > 0:
        raise err(f"{env}={raw!r}: use a number of seconds > 0")
    return value


def choice(*allowed: str) -> Parser:
    def parse(env: str, raw: Any, err: type[Exception]) -> str:
        text = str(raw).strip()
        if text not in allowed:
            raise err(f"{env}={raw!r}: choose one of {', '.join(allowed)}")
        return text
    return parse


def parse_path(env: str, raw: Any, err: type[Exception]) -> Path:
    return Path(raw).expanduser()


def parse_candidates(env: str, raw: Any, err: type[Exception]) -> tuple[str, ...]:
    names = [w.strip() for w in raw.split(",")] if isinstance(raw, str) else [str(w).strip() for w in raw]
    names = [w for w in names if w]
    bad = [w for w in names if w not in DISPATCH_CANDIDATES]
    if bad or not names:
        raise err(f"{env}={raw!r}: name some of {', '.join(DISPATCH_CANDIDATES)} (comma-separated)")
    return tuple(names)


def option(env: str, default: Any, parse: Parser, help: str,  # noqa: A002 - the table's column
           factory: Callable[[], Any] | None = None) -> Any:
    """A field read from `env` (unset or empty: `default`, or `factory()`), checked by `parse`; `help` goes to
    docs/options.md."""
    meta = {"env": env, "parse": parse, "help": help}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


def parse_fields(cls: type, raw: Mapping[str, Any], err: type[Exception], by: str = "env") -> dict[str, Any]:
    """Typed values of `cls`'s option fields from `raw`, keyed by variable (`by="env"`) or by field name; a key
    that is absent, None or "" keeps the field's default."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if "env" not in f.metadata:
            continue
        value = raw.get(f.metadata[by] if by == "env" else f.name)
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        out[f.name] = f.metadata["parse"](f.metadata["env"], value, err)
    return out


def record(value: Any) -> dict[str, Any]:
    """A JSON-ready dict of an options dataclass (paths as strings, tuples as lists, nested options as dicts)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if dataclasses.is_dataclass(v):
            v = record(v)
        elif isinstance(v, Path):
            v = str(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def _default_cache(*parts: str) -> Path:
    return Path.home().joinpath(".cache", "qerl", *parts)


@dataclass(frozen=True)
class KernelOptions:
    """The kernel settings of this process (docs/options.md)."""

    linear_backend: str = option(
        "QERL_LINEAR_BACKEND", "auto", choice(*LINEAR_BACKENDS),
        "which FP4 GEMM every QuantLinear forward runs; auto measures per shape (kernels/dispatch.py)")
    dispatch_candidates: tuple[str, ...] | None = option(
        "QERL_DISPATCH_CANDIDATES", None, parse_candidates,
        "the backends auto may measure (comma-separated); default: every one available")
    kernel_cache: Path = option(
        "QERL_KERNEL_CACHE", None, parse_path,
        "where auto's measured plans are cached (default ~/.cache/qerl/kernel_plans)",
        factory=lambda: _default_cache("kernel_plans"))
    cuda_cache: Path = option(
        "QERL_CUDA_CACHE", None, parse_path,
        "where the nvcc-built CUDA FP4 kernel library is kept (default ~/.cache/qerl/cuda)",
        factory=lambda: _default_cache("cuda"))
    cuda_fp4_plans: str = option(
        "QERL_CUDA_FP4_PLANS", "stream", choice(*CUDA_FP4_PLANS),
        "the CUDA FP4 kernel's launch plans at M <= 64: stream kernels, or the legacy ones (A/B switch)")
    cuda_pdl: bool = option(
        "QERL_CUDA_PDL", True, parse_bool,
        "programmatic dependent launch of the CUDA FP4 kernel inside CUDA graphs; 0 never uses it")
    decode_layer: bool = option(
        "QERL_DECODE_LAYER", True, parse_bool,
        "the decode step's MLP half as one persistent kernel (kernels/cuda/decode_layer.cu) where it applies (Hopper; "
        "NVFP4/MXFP4/INT8/FP8 at <= 8 tokens, INT4 at <= 16); 0 keeps the per-GEMM path")
    decode_layer_attn: str = option(
        "QERL_DECODE_LAYER_ATTN", "auto", choice(*DECODE_LAYER_ATTN),
        "the decode step's attention half before the attention (residual + RMSNorm, q/k/v + LoRA + bias, RoPE + KV "
        "write) as one persistent kernel (kernels/cuda/decode_attn.cu) where it applies (Hopper): 1 for every "
        "4-bit format, auto for INT4 only (whose per-op q/k/v dequantizes its weight per call; the FP4 pair measured "
        "even with their per-op kernels, docs/decode.md), 0 never")
    fp4_dequant_m: int = option(
        "QERL_FP4_DEQUANT_M", 512, parse_int,
        "rows from which the `qerl` backend dequantizes the FP4 weight and calls cuBLAS instead of the fused kernel")
    fp4_dequant_t_m: int = option(
        "QERL_FP4_DEQUANT_T_M", 1024, parse_int,
        "rows from which the backward product (dx) dequantizes a transient weight copy for cuBLAS")
    fp8_act: str = option(
        "QERL_FP8_ACT", "0", choice(*FP8_ACT_MODES),
        "FP8 weights with FP8 activations (FP8xFP8 tensor cores): 0 never, 1 always, auto from QERL_FP8_ACT_MIN_M rows")
    fp8_act_min_m: int = option(
        "QERL_FP8_ACT_MIN_M", 64, parse_int,
        "rows from which QERL_FP8_ACT=auto quantizes the activations to FP8")
    fp4_repack: bool = option(
        "QERL_FP4_REPACK", True, parse_bool,
        "repack FP4 weights in place at load into the faster kernel layout; 0 keeps the checkpoint order")
    w4a8: bool = option(
        "QERL_W4A8", False, parse_bool,
        "NVFP4/MXFP4 forwards without autograd from QERL_W4A8_MIN_M rows on the FP8 tensor cores (W4A8: FP8 "
        "activations, weights rounded to E4M3; kernels/w4a8.py); 0 keeps W4A16")
    w4a8_min_m: int = option(
        "QERL_W4A8_MIN_M", 64, parse_int,
        "rows from which QERL_W4A8=1 runs the W4A8 kernel")
    moe_align: str = option(
        "QERL_MOE_ALIGN", "triton", choice(*MOE_ALIGN_MODES),
        "the MoE routing's padded block layout on CUDA: one Triton launch (within its size limits), or torch's "
        "sort and scatters (A/B switch)")

    @classmethod
    def from_env(cls, env: Mapping[str, str | None]) -> KernelOptions:
        """The options from a {variable: value} mapping; missing or empty variables keep their defaults."""
        return cls(**parse_fields(cls, env, KernelSettingError))

    def replace(self, **fields: Any) -> KernelOptions:
        """A copy with `fields` changed (typed values or the variables' strings), checked as the environment is."""
        unknown = set(fields) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown kernel option(s) {sorted(unknown)}")
        return dataclasses.replace(self, **parse_fields(type(self), fields, KernelSettingError, by="name"),
                                   **{k: v for k, v in fields.items() if v is None})

    def as_record(self) -> dict[str, Any]:
        return record(self)


def read_environment() -> dict[str, str | None]:
    """This process's value of every kernel variable. One literal read per variable, so a scan of the code finds
    each name (tests/test_env_record.py) and tests/test_options.py can check the list against the fields."""
    return {
        "QERL_LINEAR_BACKEND": os.environ.get("QERL_LINEAR_BACKEND"),
        "QERL_DISPATCH_CANDIDATES": os.environ.get("QERL_DISPATCH_CANDIDATES"),
        "QERL_KERNEL_CACHE": os.environ.get("QERL_KERNEL_CACHE"),
        "QERL_CUDA_CACHE": os.environ.get("QERL_CUDA_CACHE"),
        "QERL_CUDA_FP4_PLANS": os.environ.get("QERL_CUDA_FP4_PLANS"),
        "QERL_CUDA_PDL": os.environ.get("QERL_CUDA_PDL"),
        "QERL_DECODE_LAYER": os.environ.get("QERL_DECODE_LAYER"),
        "QERL_DECODE_LAYER_ATTN": os.environ.get("QERL_DECODE_LAYER_ATTN"),
        "QERL_FP4_DEQUANT_M": os.environ.get("QERL_FP4_DEQUANT_M"),
        "QERL_FP4_DEQUANT_T_M": os.environ.get("QERL_FP4_DEQUANT_T_M"),
        "QERL_FP8_ACT": os.environ.get("QERL_FP8_ACT"),
        "QERL_FP8_ACT_MIN_M": os.environ.get("QERL_FP8_ACT_MIN_M"),
        "QERL_FP4_REPACK": os.environ.get("QERL_FP4_REPACK"),
        "QERL_W4A8": os.environ.get("QERL_W4A8"),
        "QERL_W4A8_MIN_M": os.environ.get("QERL_W4A8_MIN_M"),
        "QERL_MOE_ALIGN": os.environ.get("QERL_MOE_ALIGN"),
    }


_current: KernelOptions | None = None


def kernel_options() -> KernelOptions:
    """The current kernel options (read from the environment on first use). Cheap: hot paths may call it."""
    return _current if _current is not None else reload_kernel_options()


def reload_kernel_options() -> KernelOptions:
    """Read the environment again (an application's start-up); replaces any `update` made before."""
    global _current
    _current = KernelOptions.from_env(read_environment())
    return _current


def set_kernel_options(value: KernelOptions) -> None:
    """Make `value` the current options (what `override` restores on leaving its block)."""
    global _current
    _current = value


def update(**fields: Any) -> KernelOptions:
    """Change options for the rest of the process (`dispatch.set_backend` does); returns the new value."""
    set_kernel_options(kernel_options().replace(**fields))
    return kernel_options()


@contextlib.contextmanager
def override(**fields: Any) -> Iterator[KernelOptions]:
    """Other options inside a block; on leaving it the options before it come back, whatever was updated inside."""
    before = kernel_options()
    set_kernel_options(before.replace(**fields))
    try:
        yield kernel_options()
    finally:
        set_kernel_options(before)
