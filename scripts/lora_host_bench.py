"""Host cost of one LoRA linear's training forward + backward on CPU (a tiny layer, so compute is negligible).

Run from the repository root: ``TRITON_INTERPRET=1 python scripts/lora_host_bench.py``. Three cases:
- ``dense``: an ``nn.Linear`` base;
- ``quant-ref``: an NVFP4 ``QuantLinear`` on the torch reference (its dequantized weight cached, as CPU trainers
  set it), the CPU training path;
- ``quant-kern``: the same layer on qerl_kernels, as on a GPU, with every Triton launch counted and skipped
  (`KernelStub`), so what is measured is the Python and dispatch work around the kernels, which a GPU step pays
  per linear on the host (Triton's own launch cost comes on top, the same before and after).
For each: CPU microseconds per forward + backward (best of 5 rounds; the machine may be shared) and the aten ops
(views excluded) and Triton launches one call issues (gradient accumulation into existing .grad included).
CPU-host timings, not GPU kernel times. fp32 by default: 16-bit GEMMs on a CPU are slow enough to hide the host
cost being measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import OpCounter  # noqa: E402


class KernelStub:
    """Triton launches counted and skipped: under the interpreter a kernel runs for milliseconds in numpy, which would
    drown the microseconds measured here, and its output values do not steer the host path."""

    def __init__(self) -> None:
        self.launches = 0
        from triton.runtime.interpreter import InterpretedFunction

        def skipped(fn_self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
            self.launches += 1

        InterpretedFunction.run = skipped


def emulate_gpu_dispatch() -> None:
    """Route QuantLinear through qerl_kernels on CPU, as `x.is_cuda` does on a GPU (a bench-only switch)."""
    import qerl_kernels.linear as kl

    from qerl_cli import kernel_dispatch
    from qerl_cli.qlinear import QuantLinear

    QuantLinear.forward = lambda self, x: kl.quant_linear(x, self)
    if hasattr(kernel_dispatch, "kernels_cover"):
        kernel_dispatch.kernels_cover = kl.covers


def layer(kind: str, n: int, k: int, rank: int, dtype: torch.dtype) -> nn.Module:
    from qerl_cli.lora import attach_lora, make_lora_config
    from qerl_cli.qlinear import QuantLinear

    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False)
    base = lin.to(dtype)
    if kind != "dense":
        base = QuantLinear.from_linear(lin, "nvfp4", dtype=dtype)
        base.cache_dequantized = kind == "quant-ref"
    cfg = make_lora_config(rank, targets=["q_proj"])
    cfg.task_type = None  # a bare module, not a causal LM (the norm gives peft a parameter to place it by)
    model = attach_lora(nn.Sequential(nn.ModuleDict({"q_proj": base, "norm": nn.LayerNorm(k)})), cfg, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model.get_base_model()[0]["q_proj"]


def measure(mod: nn.Module, x: torch.Tensor, dy: torch.Tensor, calls: int, rounds: int = 5) -> float:
    """The best of `rounds` averages over `calls` calls, in CPU time of this process (one thread): on a shared machine
    wall time also counts the waits for a core; the minimum is the least disturbed round."""
    def step() -> None:
        mod(x).backward(dy)

    for _ in range(5):
        step()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(calls):
            step()
        best = min(best, (time.process_time() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--m", type=int, default=4)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    for kind in ("dense", "quant-ref", "quant-kern"):
        stub = None
        if kind == "quant-kern":
            emulate_gpu_dispatch()
            stub = KernelStub()
        mod = layer(kind, args.n, args.k, args.rank, dtype)
        x = torch.randn(2, args.m // 2, args.k, dtype=dtype, requires_grad=True)
        dy = torch.randn(2, args.m // 2, args.n, dtype=dtype)
        us = measure(mod, x, dy, args.calls)
        launches = stub.launches if stub else 0
        with OpCounter() as counter:
            mod(x).backward(dy)
        if stub:
            counter.counts["triton launch"] = stub.launches - launches
        ops = sum(counter.counts.values())
        print(f"{kind:10s} {type(mod).__name__:16s} host {us:8.1f} us per forward+backward, {ops} ops: "
              + ", ".join(f"{name.removeprefix('aten.')} {c}" for name, c in counter.counts.most_common()))


if __name__ == "__main__":
    main()
