"""Nsight Compute counters of the decode step's kernels, one category at a time.

    ncu --profile-from-start off --csv --page details --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --metrics "$(python3 scripts/ncu_decode_step.py metrics)" python3 scripts/ncu_decode_step.py run labels.json
    python3 scripts/ncu_decode_step.py table ncu.csv labels.json     # the per-kernel table

(``bash scripts/gpu.sh ncu`` runs both on a GPU machine.)

``run`` builds one Qwen2.5-7B decoder layer's pieces at decode sizes (batch 8 and 64, context 384 in a 512
bucket) the way the rollout engine runs them: NVFP4 ``QuantLinear`` GEMMs through qerl's dispatcher (its
measured plan choice), the LoRA shrinks (fused forms and cuBLAS) and the in-place expand, cuDNN SDPA decode
attention, the residual add + RMSNorm kernel, the lm_head GEMM and the one-pass sampler over 152,064 logits.
Each piece is warmed up, then called once inside ``cudaProfilerStart/Stop``, in a fixed order, with a one-element
add between pieces (the table splits ncu's rows at those); the labels go to ``labels.json``. ``table`` joins
the two: per kernel its duration, DRAM throughput (% of peak), compute (SM) throughput, achieved occupancy,
registers, and the two largest warp-stall reasons -- the counters that say whether a kernel is bound by bytes,
by latency (few bytes in flight: low DRAM % with low occupancy or long-scoreboard stalls) or by launches.
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, RANK = 3584, 28, 4, 128, 18944, 152064, 32
STALL = "smsp__average_warps_issue_stalled_"
STALL_REASONS = ("long_scoreboard", "short_scoreboard", "barrier", "membar", "wait", "math_pipe_throttle",
                 "lg_throttle", "mio_throttle", "not_selected", "selected", "no_instruction", "drain", "imc_miss",
                 "dispatch_stall", "branch_resolving", "tex_throttle", "sleeping", "misc")
# the --metrics argument of the ncu command line: warp stalls by reason, per issued instruction
STALL_METRICS = ",".join(f"{STALL}{r}_per_issue_active.ratio" for r in STALL_REASONS)


def run(labels_out: Path) -> None:
    import torch
    from qerl_kernels import decode as kd

    from qerl_cli.formats import quantize
    from qerl_cli.qlinear import QuantLinear
    from qerl_cli.rollout.attention import sdpa_decode

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (s * torch.randn(*shape, device=dev, generator=g)).to(bf)

    linears = {"qkv": (HEADS + 2 * KV_HEADS) * HEAD_DIM, "o": HIDDEN, "gate_up": 2 * INTER, "down": HIDDEN}
    k_of = {"qkv": HIDDEN, "o": HEADS * HEAD_DIM, "gate_up": HIDDEN, "down": INTER}
    mods = {n: QuantLinear.from_quantized(quantize(rnd(out, k_of[n], s=0.02), "nvfp4")) for n, out in linears.items()}
    a_qkv, a_o, a_down = rnd(3 * RANK, HIDDEN, s=0.02), rnd(RANK, HEADS * HEAD_DIM, s=0.02), rnd(RANK, INTER, s=0.02)
    b_qkv = rnd(linears["qkv"], 3 * RANK, s=0.02)
    lm_head = rnd(VOCAB, HIDDEN, s=0.02)
    w_norm = (1 + 0.1 * torch.randn(HIDDEN, device=dev, generator=g)).to(bf)
    vhash = torch.randint(-2**31, 2**31 - 1, (VOCAB,), device=dev, dtype=torch.int32, generator=g)
    calls: list[tuple[str, object]] = []
    for b in (8, 64):
        x = {n: rnd(b, k) for n, k in k_of.items()}
        h, d = rnd(b, HIDDEN, s=2.0), rnd(b, HIDDEN)
        gu = rnd(b, 2 * INTER)
        kv = 512
        cache_k, cache_v = rnd(b, kv, KV_HEADS, HEAD_DIM), rnd(b, kv, KV_HEADS, HEAD_DIM)
        q = rnd(b, HEADS, HEAD_DIM)
        pos = torch.full((b,), 383, device=dev)
        visible = (torch.arange(kv, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
        mask = torch.zeros(visible.shape, dtype=bf, device=dev).masked_fill_(~visible, float("-inf"))
        y_qkv = torch.empty(b, linears["qkv"], device=dev, dtype=bf)
        hl = rnd(b, 3 * RANK)
        logits = rnd(b, VOCAB, s=3.0)
        keys = (torch.tensor(7, device=dev), torch.arange(b, device=dev), torch.full((b,), 5, device=dev))
        for n, mod in mods.items():
            calls.append((f"quantized GEMM {n} b{b}", lambda mod=mod, xx=x[n]: mod(xx)))
        calls += [
            (f"LoRA fused norm+shrink qkv b{b}", lambda h=h, d=d: kd.rmsnorm_shrink(h, d, w_norm, 1e-6, a_qkv)),
            (f"LoRA cuBLAS shrink qkv b{b}", lambda xx=x["qkv"]: torch.mm(xx, a_qkv.t())),
            (f"LoRA plain shrink o b{b}", lambda xx=x["o"]: kd.lora_shrink(xx, a_o)),
            (f"LoRA fused silu+shrink down b{b}",
             lambda gu=gu: kd.silu_mul_shrink(gu[:, :INTER], gu[:, INTER:], a_down)),
            (f"LoRA cuBLAS shrink down b{b}", lambda xx=x["down"]: torch.mm(xx, a_down.t())),
            (f"LoRA addmm_ expand qkv b{b}", lambda y=y_qkv, hl=hl: y.addmm_(hl, b_qkv.t())),
            (f"norm add_rmsnorm b{b}", lambda h=h, d=d: kd.add_rmsnorm(h, d, w_norm, 1e-6)),
            (f"attention SDPA kv{kv} b{b}",
             lambda q=q, ck=cache_k, cv=cache_v, m=mask, n=kv: sdpa_decode(q, ck, cv, n, m, HEAD_DIM ** -0.5)),
            (f"dense lm_head b{b}", lambda xx=x["qkv"]: torch.mm(xx, lm_head.t())),
            (f"sampling one-pass b{b}", lambda lg=logits, k=keys: kd.sample_tokens(lg, vhash, *k, greedy=False,
                                                                                  scale_mode=0)),
        ]
    for _, fn in calls:  # compile, autotune and measure plans outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    marker = torch.zeros(1, device=dev)
    torch.cuda.profiler.start()
    for _, fn in calls:
        marker.add_(1)  # one elementwise kernel between the pieces: the table splits the rows at it
        fn()
    marker.add_(1)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    labels_out.write_text(json.dumps([label for label, _ in calls]))
    print(f"profiled {len(calls)} pieces; labels in {labels_out}")


PICK = {  # (section-free) metric names of ncu's details page -> table column
    "Duration": "us", "DRAM Throughput": "dram_pct", "Compute (SM) Throughput": "sm_pct",
    "Achieved Occupancy": "occ_pct", "Registers Per Thread": "regs", "Grid Size": "grid", "Block Size": "block",
}


def table(csv_path: Path, labels_path: Path) -> list[str]:
    labels = json.loads(labels_path.read_text())
    kernels: dict[str, dict] = {}
    order: list[str] = []
    stalls: dict[str, dict[str, float]] = defaultdict(dict)
    with csv_path.open() as f:
        rows = [r for r in csv.reader(f) if r]
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r and "Metric Name" in r)
    cols = rows[head]
    ix = {c: cols.index(c) for c in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
    ix["ID"] = cols.index("ID") if "ID" in cols else cols.index("Id")
    need = max(ix.values()) + 1  # metric rows stop before the rule columns
    for r in rows[head + 1:]:
        if len(r) < need:
            continue
        kid = r[ix["ID"]]
        if kid not in kernels:
            kernels[kid] = {"name": r[ix["Kernel Name"]]}
            if "Grid Size" in cols:
                kernels[kid]["grid"] = r[cols.index("Grid Size")]
            order.append(kid)
        name, unit, val = r[ix["Metric Name"]], r[ix["Metric Unit"]], r[ix["Metric Value"]].replace(",", "")
        if name in PICK and not (name == "Grid Size" and "grid" in kernels[kid]):
            try:
                v = float(val)
            except ValueError:
                v = val
            if name == "Duration" and isinstance(v, float):
                v = v / 1e3 if unit in ("ns", "nsecond") else v * 1e3 if unit in ("ms", "msecond") else v
            kernels[kid][PICK[name]] = v
        if name.startswith(STALL) and name.endswith("_per_issue_active.ratio"):
            try:
                stalls[kid][name[len(STALL):-len("_per_issue_active.ratio")]] = float(val)
            except ValueError:
                pass
    # split at the marker kernels (the elementwise add between pieces)
    pieces: list[list[str]] = [[]]
    for kid in order:
        if "elementwise" in kernels[kid]["name"] and kernels[kid].get("grid") in ("(1, 1, 1)", "1"):
            pieces.append([])
        else:
            pieces[-1].append(kid)
    pieces = pieces[1:]
    out = ["| piece | kernel | grid | us | DRAM % | SM % | occupancy % | regs | top stalls (cycles/issue) |",
           "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for i, kids in enumerate(pieces):
        label = labels[i] if i < len(labels) else f"piece {i}"
        for kid in kids:
            k = kernels[kid]
            st = sorted(((v, n) for n, v in stalls[kid].items() if n not in ("selected",)), reverse=True)[:2]
            st_txt = ", ".join(f"{n} {v:.1f}" for v, n in st)

            def f(key: str, k: dict = k) -> str:
                v = k.get(key)
                return f"{v:.1f}" if isinstance(v, float) else str(v if v is not None else "-")

            out.append(f"| {label} | {k['name'][:48]} | {k.get('grid', '-')} | {f('us')} | {f('dram_pct')} | "
                       f"{f('sm_pct')} | {f('occ_pct')} | {f('regs')} | {st_txt} |")
    return out


if __name__ == "__main__":
    if sys.argv[1] == "metrics":
        print(STALL_METRICS)
    elif sys.argv[1] == "run":
        run(Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/ncu_labels.json"))
    else:
        print("\n".join(table(Path(sys.argv[2]), Path(sys.argv[3]))))
