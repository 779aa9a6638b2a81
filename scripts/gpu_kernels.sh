#!/usr/bin/env bash
# The whole GPU run of qerl's kernels in one call (the GPU machine has no network and no qerl install):
#   1. import qerl through the path shim (scripts/gpu_common.sh qerl_shim: kernels/ as `qerl_kernels`);
#   2. install peer wheels from .whl/ if present (bitsandbytes, gemlite; optional);
#   3. check every kernel path against the torch reference on the GPU;
#   4. (optional) sweep the FP4 tile configurations;
#   5. run `qerl bench kernels` and print the short tables last; JSON and logs go to $OUT.
#   (humming-kernels, vLLM's W4A16 kernels, joins as a peer when its wheel sits in out/humming/;
#    stage "hwarm" JIT-compiles its kernels for the bench shapes in parallel processes first)
#   (qerl's CUDA C++ kernel, kernels/cuda/: stage "cudabuild" compiles it with nvcc and reports registers,
#    "cudacheck" runs only its self-check, "ncucuda" reads its counters against humming's)
#   (issue 25, stage "decode": the CUDA kernel's decode-size plans in one call: build + ptxas registers, the
#    self-check (legacy and stream plans, LoRA epilogue, PDL in graphs), humming compiled for the decode shapes
#    when its wheel is there, the sweep old vs new plans vs humming vs BF16 at M = 1..64 on the 7B and 32B GEMMs,
#    ncu on the rule's plans at M = 8 and 64 (7B gate_up, 32B down); its table is printed last)
# Knobs: QERL_GPU_STAGES (default "info selfcheck bench"; add "sweep", "peers", "hwarm", "cudabuild",
#        "cudacheck", "cudasweep", "ncucuda", "decode"; QERL_CUDA_PTXAS=1 also prints ptxas registers per kernel),
#        QERL_BENCH_SHAPES (default "qwen2.5-7b qwen2.5-32b"), QERL_BENCH_MS (default "1 16 64 128 256 512 2048").
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
STAGES=${QERL_GPU_STAGES:-"info selfcheck bench"}
SHAPES=${QERL_BENCH_SHAPES:-"qwen2.5-7b qwen2.5-32b"}
MS=${QERL_BENCH_MS:-"1 16 64 128 256 512 2048"}
job_start gpu_kernels out/gpu 0 nolog
qerl_shim
install_wheels .whl out/humming  # peers: bitsandbytes, gemlite; humming (its other deps are in the image)
# ncu over the profiler-marked region of a command: run_ncu TIMEOUT OUTFILE [--section X ...] COMMAND...
# (the clocks are left as they are: --clock-control none)
run_ncu() {
  local limit=$1 out=$2; shift 2
  local ncu; ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout "$limit" "$ncu" --clock-control none --profile-from-start off --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats "$@" > "$out" 2>&1
}
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/tmp/humming_cache} QERL_KERNEL_CACHE=${QERL_KERNEL_CACHE:-/tmp/qerl_plans}

if has info; then
  stamp info
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
fi

export QERL_CUDA_CACHE=${QERL_CUDA_CACHE:-/tmp/qerl_cuda}
if has cudabuild; then  # build the CUDA FP4 library (timed) and print ptxas' registers/spills per kernel
  stamp cudabuild
  python3 -c "
import time, logging; logging.basicConfig(level=logging.INFO)
from qerl_kernels import cuda_fp4
t = time.time(); p = cuda_fp4.build(); print('built', p, f'{time.time() - t:.1f}s'); print('available', cuda_fp4.available())
" 2>&1 | tail -n 5
  if [ "${QERL_CUDA_PTXAS:-0}" = 1 ]; then
    nvcc -O3 -std=c++17 -arch=sm_90a -Xptxas -v -c -o /tmp/qk/fp4_gemm.o kernels/cuda/fp4_gemm.cu 2>&1 \
      | grep -E "Compiling entry|registers|spill" | paste - - - | sed -E 's/ptxas info *: //g' | cut -c1-220 \
      > "$OUT/cuda_ptxas.txt"
    sed -E 's/_ZN4qerl//' "$OUT/cuda_ptxas.txt" | cut -c1-200
  fi
fi

if has cudacheck; then
  stamp cudacheck
  timeout "${QERL_CUDACHECK_TIMEOUT:-200}" python3 -c "
import json, sys, torch
from qerl_cli.bench.kernel_selfcheck import check_cuda_kernel
res = check_cuda_kernel()
bad = [r for r in res if not r['ok']]
for r in bad[:30]: print('FAIL', json.dumps(r)[:300])
worst = {}
for r in res:
    if r.get('rel') is not None: worst[r['path']] = max(worst.get(r['path'], 0), r['rel'])
for k, v in sorted(worst.items()): print(f'  {k:64s} worst rel err {v:.2e}')
print(f'cudacheck: {len(res) - len(bad)}/{len(res)} passed')
json.dump(res, open('$OUT/cudacheck.json', 'w'), indent=1)
" 2>&1 | tee "$OUT/cudacheck.log" | tail -n 45
fi

if has selfcheck; then
  stamp selfcheck
  timeout "${QERL_SELFCHECK_TIMEOUT:-300}" python3 -m qerl_cli.bench.kernel_selfcheck "$OUT/selfcheck.json" 2>&1 \
    | tee "$OUT/selfcheck.log" | tail -n 60
fi

if has sweep; then
  stamp sweep
  timeout "${QERL_SWEEP_TIMEOUT:-300}" python3 -m qerl_cli.bench.kernel_tune "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" \
    | grep -v '^sweep ' | tail -n 80
fi

cat > /tmp/qk/run_bench.py <<'EOF'
import os, sys
from pathlib import Path
from rich.console import Console
from qerl_cli.bench.harness import report, show
from qerl_cli.bench.kernels import bench_kernels
shapes = tuple(os.environ.get("QERL_BENCH_SHAPES", "qwen2.5-7b qwen2.5-32b").split())
ms = tuple(int(m) for m in os.environ.get("QERL_BENCH_MS", "1 16 64 128 256 512 2048").split())
kw = eval("dict(" + sys.argv[2] + ")")
log = open(Path(sys.argv[1]).with_suffix(".log"), "w")
res = bench_kernels(shapes, ms, Path(sys.argv[1]), log=lambda s: print(s, file=log, flush=True), **kw)
show(Console(width=250), *report(res))
for e in res["errors"][:20]:
    print("error:", e)
EOF

if has hwarm; then  # compile humming's kernel for every (fmt, shape, M) the bench times, in parallel processes
  stamp hwarm
  cat > /tmp/qk/hwarm.py <<'EOF'
import sys, torch
from qerl_cli.bench.kernels import layer_linears
from qerl_cli.formats import quantize
from qerl_kernels import humming_peer
fmt, model, gemm = sys.argv[1:4]
n, k = next((n, k) for g, n, k in layer_linears(model) if g == gemm)
qw = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), fmt)
lay = humming_peer.build(qw.tensors, fmt, n, k)
for m in sys.argv[4:]:
    humming_peer.warm(lay, torch.randn(int(m), k, device="cuda", dtype=torch.bfloat16))
print("warm", fmt, model, gemm, sys.argv[4:], "ok")
EOF
  jobs=""
  for fmt in ${QERL_HUMMING_FMTS:-nvfp4 mxfp4}; do for model in $SHAPES; do for g in qkv o gate_up down; do
    for m in $MS; do jobs+="$fmt $model $g $m"$'\n'; done
  done; done; done
  printf "%s" "$jobs" | timeout "${QERL_HWARM_TIMEOUT:-150}" xargs -P "${QERL_HWARM_PROCS:-12}" -L 1 \
    python3 /tmp/qk/hwarm.py > "$OUT/hwarm.log" 2>&1
  echo "hwarm: $(grep -c ' ok$' "$OUT/hwarm.log") of $(printf "%s" "$jobs" | wc -l) compiled; errors:"
  grep -iE "error" "$OUT/hwarm.log" | sort | uniq -c | sort -rn | head -5
fi

if has bench; then
  stamp bench
  QERL_BENCH_SHAPES="$SHAPES" QERL_BENCH_MS="$MS" timeout "${QERL_BENCH_TIMEOUT:-420}" \
    python3 /tmp/qk/run_bench.py "$OUT/bench.json" "${QERL_BENCH_KW:-peers=[]}"
fi

if has peers; then
  stamp peers
  QERL_BENCH_SHAPES="${QERL_PEER_SHAPES:-qwen2.5-7b}" QERL_BENCH_MS="$MS" timeout "${QERL_PEERS_TIMEOUT:-200}" \
    python3 /tmp/qk/run_bench.py "$OUT/peers.json" "methods=('bf16',), backward=False, variants=False, \
peers=${QERL_PEER_LIST:-None}"
fi
if has profile; then  # hardware counters of the fused FP4 kernel on one Qwen2.5-7B GEMM (gate_up), M=1
  stamp profile
  cat > /tmp/qk/prof.py <<'EOF'
import torch
from qerl_cli.formats import quantize
from qerl_kernels._common import TileConfig
from qerl_kernels.fp4 import fp4_matmul_v2, kernel_scales, repack_fp4
n, k = 37888, 3584
qw = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), "nvfp4")
t = qw.tensors
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
cfg = TileConfig(16, 128, 128, 4, 4, 1)
args = {tiled: (repack_fp4(t["weight_packed"], tiled=tiled),
                kernel_scales(t["weight_scale"], "nvfp4", torch.bfloat16, 0, tiled=tiled)) for tiled in (False, True)}
for _ in range(2):
    for tiled, (w, s) in args.items():
        fp4_matmul_v2(x, w, s, t["weight_global_scale"], "nvfp4", cfg, tiled=tiled)
torch.cuda.synchronize()
EOF
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout "${QERL_PROFILE_TIMEOUT:-150}" "$NCU" --clock-control none -k regex:_fp4_mm_v2 --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats \
    --section MemoryWorkloadAnalysis python3 /tmp/qk/prof.py > "$OUT/ncu.txt" 2>&1
  grep -E "_fp4_mm|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Stall|Registers Per|Block Limit|L2 Hit|Mem Busy|Max Bandwidth|Warp Cycles Per Issued" "$OUT/ncu.txt" | head -80
fi
if has ncu14; then  # counters of qerl's fused kernel vs humming on the 7B q/k/v GEMM at M=16 and o at M=1
  stamp ncu14
  cat > /tmp/qk/prof14.py <<'EOF'
import torch
from qerl_cli.formats import quantize
from qerl_cli.qlinear import QuantLinear
from qerl_kernels import humming_peer, linear as ql
runs = []
for n, k, m in ((4608, 3584, 16), (3584, 3584, 1)):
    qw = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), "nvfp4")
    mod = QuantLinear.from_quantized(qw)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    lay = humming_peer.build({a: b.clone() for a, b in qw.tensors.items()}, "nvfp4", n, k)
    for _ in range(2):
        ql.fp4_fused(x, mod); humming_peer.forward(lay, x)
    runs.append((x, mod, lay))
torch.cuda.synchronize()
torch.cuda.profiler.start()
for x, mod, lay in runs:
    ql.fp4_fused(x, mod); humming_peer.forward(lay, x)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
EOF
  run_ncu "${QERL_NCU_TIMEOUT:-90}" "$OUT/ncu14.txt" python3 /tmp/qk/prof14.py
  grep -E "^  [A-Za-z_].*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Grid Size|Block Size|Waves Per SM|Warp Cycles Per Issued|Stall" "$OUT/ncu14.txt" | head -60
fi
if has cudasweep; then  # the CUDA kernel's configurations on the 7B GEMMs (the plan's rule comes from this)
  stamp cudasweep
  timeout "${QERL_CUDASWEEP_TIMEOUT:-120}" python3 -c "
import json, torch
from qerl_cli.bench.kernels import layer_linears
from qerl_cli.formats import quantize
from qerl_kernels import cuda_fp4
from qerl_kernels.dispatch import _time_gpu
from qerl_kernels.fp4 import repack_fp4
grid = {1: [(1, 4, 1, False, s) for s in (1, 4)] + [(1, 4, 2, False, s) for s in (1, 2)] + [(1, 1, 8, False, s) for s in (1, 2, 4)],
        16: [(2, 4, 1, True, s) for s in (1, 2)] + [(2, 4, 2, True, 1)] + [(2, 1, 8, True, s) for s in (1, 2)],
        64: [(4, 1, 8, True, 1), (4, 4, 1, True, 1)] + [(8, 4, 1, True, s) for s in (1, 2, 4)]}
grid[256] = grid[64]
rows = []
for g, n, k in layer_linears('qwen2.5-7b'):
    qw = quantize((torch.randn(n, k, device='cuda') * 0.02).to(torch.bfloat16), 'nvfp4')
    t = qw.tensors
    rep = repack_fp4(t['weight_packed'], tiled=True)
    for m, cfgs in grid.items():
        x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
        plan = cuda_fp4.legacy_plan(m, n, k, 132)
        line = []
        for mt, wn, wk, perm, s in cfgs:
            f = lambda: cuda_fp4.fp4_gemm(x, rep, t['weight_scale'], t['weight_global_scale'], 'nvfp4', tiled=True, mt=mt, wn=wn, wk=wk, perm=perm, splits=s)
            us = _time_gpu(f, 10) * 1e3
            rows.append(dict(gemm=g, N=n, K=k, M=m, mt=mt, wn=wn, wk=wk, perm=perm, splits=s, us=us, plan=plan.key()))
            line.append(f'{mt}/{wn}x{wk}/s{s} {us:.1f}')
        print(g, 'M=%d' % m, 'plan', plan.key(), '|', ', '.join(line), flush=True)
json.dump(rows, open('$OUT/cudasweep.json', 'w'), indent=1)
" 2>&1 | tail -n 20
fi

if has ncucuda; then  # counters: qerl's CUDA kernel vs humming, 7B o_proj and gate/up, M = 1, 16, 64, 256
  stamp ncucuda
  cat > /tmp/qk/profcuda.py <<'EOF'
import torch
from qerl_cli.formats import quantize
from qerl_cli.qlinear import QuantLinear
import os
from qerl_kernels import humming_peer, linear as ql
peer = os.environ.get("QERL_NCU_HUMMING", "1") == "1" and humming_peer.available()
runs = []
for n, k in ((3584, 3584), (37888, 3584)):
    qw = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), "nvfp4")
    mod = QuantLinear.from_quantized(qw)
    lay = humming_peer.build({a: b.clone() for a, b in qw.tensors.items()}, "nvfp4", n, k) if peer else None
    for m in (1, 16, 64, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            ql.cuda_fused(x, mod)
            if peer: humming_peer.forward(lay, x)
        runs.append((x, mod, lay))
torch.cuda.synchronize()
torch.cuda.profiler.start()
for x, mod, lay in runs:
    ql.cuda_fused(x, mod)
    if peer: humming_peer.forward(lay, x)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
EOF
  run_ncu "${QERL_NCU_TIMEOUT:-120}" "$OUT/ncucuda.txt" --section MemoryWorkloadAnalysis python3 /tmp/qk/profcuda.py
  grep -E "^  [A-Za-z_].*\(|Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Grid Size|Block Size|Warp Cycles Per Issued|Stall" "$OUT/ncucuda.txt" | cut -c1-150 | head -120
fi
if has decode; then  # issue 25: build, self-check, sweep, ncu of the decode plans; the table last
  stamp "decode: build"
  python3 -c "
import time, logging; logging.basicConfig(level=logging.INFO)
from qerl_kernels import cuda_fp4
t = time.time(); p = cuda_fp4.build(); print('built', p, f'{time.time() - t:.1f}s'); print('available', cuda_fp4.available())
" 2>&1 | tail -n 3
  # registers / spills / shared memory per kernel, in the background while the self-check runs
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --split-compile=0 -Xptxas -v -c -o /tmp/qk/fp4_gemm.o kernels/cuda/fp4_gemm.cu \
    2>&1 | grep -E "Compiling entry|registers|spill" | paste - - - | sed -E 's/ptxas info *: //g' | cut -c1-240 \
    > "$OUT/decode_ptxas.txt" &
  PTXAS_PID=$!
  stamp "decode: self-check"
  timeout "${QERL_DECODECHECK_TIMEOUT:-170}" python3 -c "
import json
from qerl_cli.bench.kernel_selfcheck import check_cuda_kernel
res = check_cuda_kernel()
bad = [r for r in res if not r['ok']]
for r in bad[:25]: print('FAIL', json.dumps(r)[:300])
new = [r for r in res if r['path'].startswith('stream') or 'lora' in r['path']]
worst = {}
for r in new:
    key = r['path'].split('-fwd-')[0].split('-exact-')[0]
    if r.get('rel') is not None: worst[key] = max(worst.get(key, 0), r['rel'])
for k, v in sorted(worst.items()): print(f'  {k:48s} worst rel err {v:.2e}')
print(f'decode cudacheck: {len(res) - len(bad)}/{len(res)} passed ({len(new)} of them stream/LoRA)')
json.dump(res, open('$OUT/decode_check.json', 'w'), indent=1)
" 2>&1 | tee "$OUT/decode_check.log" | tail -n 30
  if python3 -c "from qerl_kernels import humming_peer; raise SystemExit(0 if humming_peer.available() else 1)"; then
    stamp "decode: humming compile"
    cat > /tmp/qk/hwarm_dec.py <<'EOF'
import sys, torch
from qerl_cli.bench.kernels import layer_linears
from qerl_cli.formats import quantize
from qerl_kernels import humming_peer
model, gemm = sys.argv[1:3]
n, k = next((n, k) for g, n, k in layer_linears(model) if g == gemm)
qw = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), "nvfp4")
lay = humming_peer.build(qw.tensors, "nvfp4", n, k)
for m in sys.argv[3:]:
    humming_peer.warm(lay, torch.randn(int(m), k, device="cuda", dtype=torch.bfloat16))
print("warm", model, gemm, "ok")
EOF
    jobs=""
    for model in qwen2.5-7b qwen2.5-32b; do for g in qkv o gate_up down; do
      jobs+="$model $g ${QERL_DECODE_MS:-1 8 16 32 64}"$'\n'
    done; done
    printf "%s" "$jobs" | timeout "${QERL_HWARM_TIMEOUT:-120}" xargs -P 8 -L 1 python3 /tmp/qk/hwarm_dec.py \
      > "$OUT/decode_hwarm.log" 2>&1
    echo "humming: $(grep -c ' ok$' "$OUT/decode_hwarm.log") of 8 shapes compiled"
  fi
  stamp "decode: sweep"
  cat > /tmp/qk/decode_sweep.py <<'EOF'
import os, sys
from pathlib import Path
from qerl_cli.bench.kernels import decode_table, sweep_decode
ms = tuple(int(m) for m in os.environ.get("QERL_DECODE_MS", "1 8 16 32 64").split())
log = open(Path(sys.argv[1]).with_suffix(".log"), "w")
res = sweep_decode(ms=ms, out_json=Path(sys.argv[1]), log=lambda s: print(s, file=log, flush=True),
                   rep_ms=int(os.environ.get("QERL_DECODE_REP_MS", "12")))
Path(sys.argv[1]).with_suffix(".txt").write_text("\n".join(decode_table(res)) + "\n")
for e in res["errors"][:10]:
    print("error:", e)
EOF
  timeout "${QERL_DECODESWEEP_TIMEOUT:-170}" python3 /tmp/qk/decode_sweep.py "$OUT/decode_sweep.json" 2>&1 | tail -n 12
  stamp "decode: ncu"
  cat > /tmp/qk/prof_decode.py <<'EOF'
import torch
from qerl_cli.formats import quantize
from qerl_cli.qlinear import QuantLinear
from qerl_kernels import cuda_fp4, linear as ql
sms = torch.cuda.get_device_properties(0).multi_processor_count
runs = []
for n, k in ((37888, 3584), (5120, 27648)):  # 7B gate_up, 32B down
    mod = QuantLinear.from_quantized(quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), "nvfp4"))
    st = ql.kernel_state(mod)
    for m in (8, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        f = lambda x=x, mod=mod, st=st: cuda_fp4.fp4_gemm(x, st.repacked, mod.weight_scale, mod.weight_global_scale,
                                                            "nvfp4", tiled=st.tiled)
        f(); f()
        print("ncu plan", n, k, m, cuda_fp4.launch_plan(m, n, k, sms).key(), flush=True)
        runs.append(f)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for f in runs:
    f()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
EOF
  run_ncu "${QERL_NCU_TIMEOUT:-100}" "$OUT/decode_ncu.txt" --section MemoryWorkloadAnalysis \
    --metrics dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
    python3 /tmp/qk/prof_decode.py
  wait $PTXAS_PID 2>/dev/null
  echo "--- ptxas (stream kernels): registers / spills"
  grep -E "decode_kernel|wide_kernel|fixup" "$OUT/decode_ptxas.txt" \
    | sed -E "s/Compiling entry function '_ZN4qerl//; s/EEvNS_6ParamsE' for 'sm_90a'//" | cut -c1-150 | head -45
  echo "--- ncu (the rule's plans at M = 8 and 64: 7B gate_up, 32B down)"
  grep -E "^ncu plan|^  [A-Za-z_].*\(|Duration|DRAM Throughput|dram__throughput|sm__warps_active|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|inst_executed|Stall" \
    "$OUT/decode_ncu.txt" | cut -c1-140 | tee "$OUT/decode_ncu_summary.txt" | head -70
  echo "--- decode plans (table)"
  cat "$OUT/decode_sweep.txt" 2>/dev/null || echo "no sweep table (see $OUT/decode_sweep.log)"
fi
stamp done
