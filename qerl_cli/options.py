"""The run's settings from the environment, read once at start-up into one typed value (`RunOptions`).

Every behaviour-changing `QERL_*` variable is a field here or in the kernels' own `KernelOptions`
(`qerl_kernels.options`, which cannot import qerl_cli), with its default and a one-line help; docs/options.md
lists both in one table. Nothing else in qerl reads these variables: the CLI reads them at start-up
(`reload_options()`), the rollout engine, runner and sampler take the value (or read `options()` once when they
are built), and every manifest stage records the resolved value (`as_record()`), so a run says which switches it
ran with. A value that cannot work fails at once with a `QerlError` naming the variable and what it may be
(a kernel variable: `KernelSettingError`, the CLI reports both as the user's error).

Code and tests that need other settings use `override(...)` for a block; kernel fields (`fp4_repack=False`,
`linear_backend="cublas"`, ...) may be given there too and go to the kernel layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_kernels import options as kopts
from qerl_kernels.options import KernelOptions, choice, option, parse_bool, parse_fields, parse_float, parse_path

from qerl_cli.errors import QerlError

DECODE_ATTN = ("auto", "split", "sdpa", "flashinfer")
DIST_BACKENDS = ("nccl", "gloo")
KV_CACHES = ("auto", "fp8")
DEFAULT_DIST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RunOptions:
    """The settings of this process (docs/options.md); `kernels` holds the kernel layer's."""

    debug: bool = option(
        "QERL_DEBUG", False, parse_bool,
        "show tracebacks on errors (as --debug)")
    fast_decode: bool = option(
        "QERL_FAST_DECODE", True, parse_bool,
        "the builtin engine's fast decode path: LoRA through in-dtype shadows, fused Triton kernels and "
        "token noise on CUDA; 0 turns all of it off")
    fused_lora: bool = option(
        "QERL_FUSED_LORA", True, parse_bool,
        "decode LoRA as one-launch Triton shrinks and expands in the FP4 GEMM's epilogue; 0: cuBLAS shrinks, "
        "in-place expands")
    fused_sampling: bool = option(
        "QERL_FUSED_SAMPLING", True, parse_bool,
        "sampling as one Triton kernel (log-sum-exp, race, log-prob) captured in the decode graph; 0: torch")
    fused_proj: bool = option(
        "QERL_FUSED_PROJ", True, parse_bool,
        "q/k/v and gate/up as one GEMM each in the decode step; 0: one GEMM per projection")
    decode_attn: str = option(
        "QERL_DECODE_ATTN", "auto", choice(*DECODE_ATTN),
        "decode attention: auto (on CUDA qerl's split-KV kernels, timed against FlashInfer per CUDA graph where it "
        "imports; SDPA elsewhere), split, cuDNN SDPA, or FlashInfer's paged batch decode")
    kv_cache: str = option(
        "QERL_KV_CACHE", "auto", choice(*KV_CACHES),
        "the builtin engine's KV cache: auto (the model's dtype) or fp8 (E4M3, unit scale, saturating: half the "
        "bytes and twice the sequences per GiB; the attention widens it back exactly)")
    dist_backend: str | None = option(
        "QERL_DIST_BACKEND", None, choice(*DIST_BACKENDS),
        "torchrun's process-group backend; default NCCL on CUDA, gloo on CPU")
    dist_timeout_s: float = option(
        "QERL_DIST_TIMEOUT_S", DEFAULT_DIST_TIMEOUT_S, parse_float,
        "seconds a rank waits for a dead peer before the process group fails")
    cache_dir: Path = option(
        "QERL_CACHE_DIR", None, parse_path,
        "where converted GGUF models are cached (default ~/.cache/qerl)",
        factory=lambda: Path.home() / ".cache" / "qerl")
    kernels: KernelOptions = field(default_factory=KernelOptions)

    @classmethod
    def from_env(cls, env: Mapping[str, str | None]) -> RunOptions:
        """The options from a {variable: value} mapping (kernel variables included); missing or empty variables
        keep their defaults."""
        return cls(**parse_fields(cls, env, QerlError), kernels=KernelOptions.from_env(env))

    def replace(self, **fields: Any) -> RunOptions:
        """A copy with `fields` changed (typed values or the variables' strings; kernel fields go to `kernels`)."""
        names = {f.name for f in dataclasses.fields(self)}
        kernel_fields = {k: v for k, v in fields.items() if k not in names}
        run_fields = {k: v for k, v in fields.items() if k in names and k != "kernels"}
        kernels = fields.get("kernels", self.kernels)
        if kernel_fields:
            kernels = kernels.replace(**kernel_fields)
        parsed = parse_fields(type(self), run_fields, QerlError, by="name")
        nones = {k: None for k, v in run_fields.items() if v is None}
        return dataclasses.replace(self, **parsed, **nones, kernels=kernels)

    def as_record(self) -> dict[str, Any]:
        """JSON-ready, as the manifest records it."""
        return kopts.record(self)


def read_environment() -> dict[str, str | None]:
    """This process's value of every run variable and every kernel variable. One literal read per variable, so a
    scan of the code finds each name (tests/test_env_record.py)."""
    return {
        "QERL_DEBUG": os.environ.get("QERL_DEBUG"),
        "QERL_FAST_DECODE": os.environ.get("QERL_FAST_DECODE"),
        "QERL_FUSED_LORA": os.environ.get("QERL_FUSED_LORA"),
        "QERL_FUSED_SAMPLING": os.environ.get("QERL_FUSED_SAMPLING"),
        "QERL_FUSED_PROJ": os.environ.get("QERL_FUSED_PROJ"),
        "QERL_DECODE_ATTN": os.environ.get("QERL_DECODE_ATTN"),
        "QERL_KV_CACHE": os.environ.get("QERL_KV_CACHE"),
        "QERL_DIST_BACKEND": os.environ.get("QERL_DIST_BACKEND"),
        "QERL_DIST_TIMEOUT_S": os.environ.get("QERL_DIST_TIMEOUT_S"),
        "QERL_CACHE_DIR": os.environ.get("QERL_CACHE_DIR"),
        **kopts.read_environment(),
    }


_current: RunOptions | None = None


def options() -> RunOptions:
    """The current options (read from the environment on first use); `.kernels` is the kernel layer's current
    value, so a `dispatch.set_backend` shows here and in the manifest."""
    global _current
    if _current is None:
        return reload_options()
    kernels = kopts.kernel_options()
    if _current.kernels is not kernels:
        _current = dataclasses.replace(_current, kernels=kernels)
    return _current


def reload_options() -> RunOptions:
    """Read the environment (the CLI's start-up): both layers; replaces any override or update made before."""
    global _current
    value = RunOptions.from_env(read_environment())
    kopts.set_kernel_options(value.kernels)
    _current = value
    return value


def set_options(value: RunOptions) -> None:
    """Make `value` current, its kernel options included (what `override` restores on leaving its block)."""
    global _current
    kopts.set_kernel_options(value.kernels)
    _current = value


@contextlib.contextmanager
def override(**fields: Any) -> Iterator[RunOptions]:
    """Other options inside a block (run or kernel fields, typed values or the variables' strings); on leaving it
    the options before it come back, both layers, whatever was changed inside."""
    before = options()
    set_options(before.replace(**fields))
    try:
        yield options()
    finally:
        set_options(before)
