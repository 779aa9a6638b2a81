#!/usr/bin/env bash
# Issue 27: Qwen2.5-72B NVFP4 LoRA r32 GRPO, 1 prompt x 8 generations x (256 + 1024) tokens, on ONE 80 GB card with
# default settings (the memory plan picks micro-batch, checkpointing, where AdamW's moments live, the KV share and
# whether kernels may keep a second weight copy), then the same run under a 48 GiB cap, in one call (<= ~9 min).
# On a card larger than 80 GB (an H200) the process is capped at $QERL_72B_CAP (default 79.2 GiB, an H100's
# usable memory) so the run stands for an 80 GB card; QERL_72B_CAP=0 runs uncapped.
# Stages (QERL_72B_STAGES, default "info offload step72 cap48"):
#   info     GPU, driver, torch/triton/transformers/peft versions, whether humming imports
#   offload  HostOffloadAdamW against torch.optim.AdamW on this GPU (the foreach CUDA path): 5 steps over several
#            buckets, parameters and moments compared bit for bit; then one step of each at the 72B LoRA size
#            (0.42 G fp32 parameters), timed
#   step72   qerl bench step --shape qwen2.5-72b --formats nvfp4 --set batch_prompts=1 --set num_generations=8
#            --set max_completion_length=1024 --prompt-len 256 --warmup 1 --measure 1 [--memory-cap CAP]
#            (one warm-up step, so the measured step has no first-use compiles; peaks are the max over both steps)
#   cap48    the same bench with --memory-cap 48, in-process: the cell must fit or be refused by the plan before
#            any weight is built (max_memory_allocated stays ~0 and the cell returns in seconds)
# Last: a table of the 72B step per phase (measured peak, plan estimate, allocated at the phase's end, seconds),
# the plan's choices, and the cap48 outcome. Files under $OUT: s72/step.json, s72/step.png, cap48.json,
# offload.json, gpu_72b.log.
# Needs: the wheels the image lacks in $QERL_WHL_DIR (default out/rollout_whl, as scripts/gpu_step.sh) and .whl/;
# carry those folders. A CPU proof of the script's plumbing (tiny shape, no GPU stages that need CUDA):
#   QERL_72B_SHAPE=tiny QERL_72B_NEW=8 QERL_72B_PROMPT_LEN=8 QERL_72B_STAGES="step72 cap48" OUT=/tmp/g72 \
#   bash scripts/gpu_72b.sh
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
STAGES=${QERL_72B_STAGES:-"info offload step72 cap48"}
job_start gpu_72b out/gpu_72b 540
qerl_shim "${QERL_SHIM:-/tmp/qk}"
install_wheels "${QERL_WHL_DIR:-out/rollout_whl}" .whl
SHAPE=${QERL_72B_SHAPE:-qwen2.5-72b}
NEW=${QERL_72B_NEW:-1024}
PL=${QERL_72B_PROMPT_LEN:-256}
# the cap that makes this card an 80 GB one (none on a card of <= 80 GB, or without CUDA)
CAP=$(python3 -P -c "
import torch
want = float('${QERL_72B_CAP:-79.2}')
ok = torch.cuda.is_available() and want > 0
print(want if ok and torch.cuda.get_device_properties(0).total_memory / 2**30 > want + 0.5 else '')" 2>/dev/null)

if has info; then
  stamp info
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null
  python3 -P -c "import torch, triton, transformers, peft, importlib.util as u; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, \
torch.cuda.is_available() and torch.cuda.get_device_name(), 'humming:', u.find_spec('humming') is not None)"
  echo "cap for an 80 GB card: ${CAP:-none (the card is one)}"
fi

if has offload; then
  stamp "offload ($(left)s left)"
  timeout 120 python3 -P - "$OUT/offload.json" <<'EOF'
import json, sys, time
import torch
from qerl_cli.train.host_offload import HostOffloadAdamW

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
shapes = [(32, 8192), (8192, 32), (32, 29568), (29568, 32), (64, 8192), (1024, 32), (7,), (3000, 17)] * 3
a = [torch.nn.Parameter(torch.randn(*s, device=dev, generator=g)) for s in shapes]
b = [torch.nn.Parameter(p.detach().clone()) for p in a]
kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)
ref, off = torch.optim.AdamW(a, **kw), HostOffloadAdamW(b, bucket_bytes=4 << 20, **kw)
for step in range(5):
    for group in (ref.param_groups, off.param_groups):
        group[0]["lr"] = 1e-3 / (1 + step)
    for p, q in zip(a, b):
        p.grad = torch.randn(p.shape, device=dev, generator=g)
        q.grad = p.grad.clone()
    ref.step()
    off.step()
same = all(torch.equal(p, q) for p, q in zip(a, b)) and all(
    torch.equal(ref.state[p][k].cpu(), off.state[q][k]) for p, q in zip(a, b) for k in ("exp_avg", "exp_avg_sq"))
pinned = all(off.state[q]["exp_avg"].is_pinned() for q in b)
# one step at the 72B LoRA size (r32 on all seven projections: 421,068,800 fp32 parameters), each optimizer
n = 421_068_800
times = {}
for name, cls in (("adamw_gpu", torch.optim.AdamW), ("host_offload", HostOffloadAdamW)):
    params = [torch.nn.Parameter(torch.zeros(n // 16, device=dev)) for _ in range(16)]
    opt = cls(params, **kw)
    for p in params:
        p.grad = torch.ones_like(p)
    for i in range(2):  # the first step allocates the moments (pinned host memory for the offloaded one)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times[f"{name}_step{i + 1}_s"] = time.perf_counter() - t0
    times[f"{name}_gpu_moments_gib"] = sum(
        t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step" and t.is_cuda
    ) / 2**30
    del opt, params
    torch.cuda.empty_cache()
res = {"bit_identical": same, "moments_pinned": pinned, **times}
print(json.dumps(res))
json.dump(res, open(sys.argv[1], "w"), indent=1)
EOF
fi

if has step72; then
  L=$(left); stamp "step72 (${L}s left; cap ${CAP:-none})"
  qerl $(( L - 60 > 60 ? L - 60 : 60 )) bench step --shape "$SHAPE" --formats nvfp4 \
    --set batch_prompts=1 --set num_generations=8 --set max_completion_length="$NEW" \
    --prompt-len "$PL" --warmup "${QERL_72B_WARMUP:-1}" --measure 1 ${CAP:+--memory-cap "$CAP"} --out "$OUT/s72"
fi

if has cap48; then
  L=$(left); stamp "cap48 (${L}s left)"
  timeout $(( L - 5 > 30 ? L - 5 : 30 )) python3 -P - "$OUT/cap48.json" "$SHAPE" "$PL" "$NEW" <<'EOF'
import json, sys, time
import torch
from qerl_cli.bench.step import bench_step

out, shape, pl, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
on_cuda = torch.cuda.is_available()
if on_cuda:
    torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
res = bench_step(shape=shape, formats=["nvfp4"], memory_cap_gib=48.0, prompt_len=pl, warmup=0, measure=1,
                 overrides={"batch_prompts": 1, "num_generations": 8, "max_completion_length": new},
                 out_dir=out.rsplit("/", 1)[0] + "/s48", log=print)
row = res["results"][0]
summary = {"status": row["status"], "wall_s": time.perf_counter() - t0,
           "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None,
           "peak_gb": row.get("peak_gb"), "plan": row.get("memory_plan", {}).get("phase_estimates")}
summary["refused_before_build"] = row["status"].startswith("error: memory plan") and (
    not on_cuda or summary["max_memory_allocated_gib"] < 0.1)  # cuBLAS keeps a 32 MiB workspace
print(json.dumps(summary))
json.dump(summary, open(out, "w"), indent=1)
EOF
  rm -rf "$OUT/s48"  # cap48.json has what matters
fi

show_results "$OUT/s72/step.json"
python3 -P - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
f = out / "s72" / "step.json"
if f.is_file():
    res = json.loads(f.read_text())
    for r in res["results"]:
        print(f"== {res['model']} {r['format']} ({r['status']}), cap {res['config']['memory_cap_gib']}, "
              f"GPU {res['env']['device'].get('gpu')}")
        plan = r.get("memory_plan") or {}
        if plan:
            print(f"   plan: mb {plan['micro_batch_size']}, gc {plan['gradient_checkpointing']}, optimizer offload "
                  f"{plan['optimizer_offload']}, kernel copies {plan['extra_weight_copies']}, kv slots "
                  f"{plan['kv_slots']} (kept between steps: {plan.get('resident_cache')}); weights {plan['weights'] / 2**30:.2f} GiB (stored "
                  f"{plan['weight_parts']['stored'] / 2**30:.2f}, kernel layouts "
                  f"{plan['weight_parts']['kernel_derived'] / 2**30:.2f}, measured "
                  f"{(plan['weight_parts']['measured'] or 0) / 2**30:.2f})")
        if r["status"] != "ok":
            continue
        print(f"   build: model {r.get('model_build_s', 0):.1f} s, trainer ready {r['build_s']:.1f} s; step "
              f"{r['step_s']:.1f} s (rollout {r['rollout_s']:.1f}, recompute {r['recompute_s']:.1f}, fwd+bwd "
              f"{r['fwd_bwd_s']:.1f}, optimizer {r['optimizer_s']:.2f}, checkpoint {r['checkpoint_s']:.2f})")
        print(f"   {'phase':<11}{'measured GiB':>14}{'plan GiB':>10}{'end GiB':>9}")
        for p in ("aqn", "rollout", "recompute", "fwd_bwd", "optimizer", "checkpoint"):
            last = r["steps"][-1]
            print(f"   {p:<11}{r.get(f'mem_{p}_gb') or 0:>14.1f}{r.get(f'est_{p}_gb') or 0:>10.1f}"
                  f"{last.get(f'end_{p}_gb') or 0:>9.1f}")
        peak = r.get("peak_gb")
        verdict = "n/a (no CUDA peaks)" if peak is None else ("met" if peak <= 60 else "MISSED")
        print(f"   peak {peak or 0:.1f} GiB (build {r.get('build_peak_gb') or 0:.1f}); target <= 60 GiB: {verdict}")
for name in ("offload.json", "cap48.json"):
    g = out / name
    if g.is_file():
        print(f"== {name}: {g.read_text().strip()}")
EOF
stamp done
