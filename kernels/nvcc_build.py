"""Building qerl's CUDA C++ libraries (`cuda_fp4`, `decode_layer`) with nvcc on first use, and the gate that says
whether one can run here (`hopper_available`).

A `CudaLibrary` is one `.cu` file compiled into a shared library under the CUDA cache (`kernel_options().cuda_cache`,
`QERL_CUDA_CACHE`), named by the hash of its source, of every local header it includes (`#include "..."`, followed
recursively) and of its flags: editing a shared header rebuilds every library that includes it. The build is atomic
(a temporary file renamed into place), so concurrent builders are safe.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from qerl_kernels._common import device_index
from qerl_kernels.options import kernel_options

log = logging.getLogger("qerl.kernels")

# the device code alone, for ptxas' resource report (registers, spills) without a host compiler
CUBIN_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-cubin")
_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def find_nvcc() -> str | None:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def local_sources(src: Path) -> list[Path]:
    """`src` and the local headers it includes, recursively, each once, in first-include order."""
    seen: list[Path] = []
    todo = [src]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        todo += [path.parent / m.decode() for m in _LOCAL_INCLUDE.findall(path.read_bytes())]
    return seen


@dataclass(frozen=True)
class CudaLibrary:
    """The shared library `<cuda_cache>/<name>-<hash>.so` built from `src` with nvcc `flags`."""

    name: str
    src: Path
    flags: tuple[str, ...]

    def source_hash(self) -> str:
        h = hashlib.sha256()
        for path in local_sources(self.src):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        h.update(" ".join(self.flags).encode())
        return h.hexdigest()[:16]

    def library_path(self) -> Path:
        return kernel_options().cuda_cache / f"{self.name}-{self.source_hash()}.so"

    def compile_command(self, out: Path, *, cubin: bool = False) -> list[str]:
        """nvcc's command line for the library (or, `cubin`, the device code alone with ptxas' resource report)."""
        nvcc = find_nvcc()
        if nvcc is None:
            raise RuntimeError("nvcc not found (set CUDA_HOME)")
        # a variant's cubin is that variant's: its -D knobs go with the cubin flags
        flags = (*CUBIN_FLAGS, *(f for f in self.flags if f.startswith("-D"))) if cubin else self.flags
        return [nvcc, *flags, "-o", str(out), str(self.src)]

    def build(self) -> Path:
        """Compile the library if this source has not been built yet (atomic: concurrent builders are safe)."""
        path = self.library_path()
        if path.exists():
            return path
        tmp = path.with_suffix(f".tmp{os.getpid()}.so")
        cmd = self.compile_command(tmp)
        path.parent.mkdir(parents=True, exist_ok=True)
        log.info("building %s: %s", path.name, " ".join(cmd))
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed ({res.returncode}): {res.stderr[-2000:]}")
        tmp.replace(path)
        return path


def hopper_available(device: torch.device | None, seen: dict[int, bool], failed: list[str], load: Callable[[], object],
                     what: str) -> bool:
    """Hopper (sm_90) and `load` (build, load, check) succeeds here. `seen` (device index -> usable) makes repeated
    calls a lookup; the first failure is kept in `failed`, logged once, and counts as absent for the process."""
    if failed or not torch.cuda.is_available():
        return False
    idx = device_index(device)
    ok = seen.get(idx)
    if ok is None:
        ok = torch.cuda.get_device_capability(idx) == (9, 0)
        if ok:
            try:
                load()
            except Exception as exc:  # no nvcc, or it failed: the caller's other paths stay
                failed.append(repr(exc)[:500])
                log.warning("%s unavailable: %s", what, failed[0])
                ok = False
        seen[idx] = ok
    return ok
