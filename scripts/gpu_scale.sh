#!/usr/bin/env bash
# Issue 9: data-parallel scaling of one RL step on the Qwen2.5-7B shape at 1, 2 and 4 GPUs (one call).
# Runs qerl_cli/bench/scale.py (the real Trainer.train_step distributed path on a random 7B-shape NVFP4
# model with LoRA, synthetic token prompts, fixed-length generation, random per-sample rewards) under
# torchrun for each world size that fits the visible GPUs, then prints a scaling table
# (tokens/s per GPU, efficiency = per-GPU tokens/s at N over tokens/s at 1; target >= 90%).
# The machine has no network and no qerl install: qerl is imported through a path shim (/tmp/qk); wheels the
# image lacks come from $QERL_WHL_DIR (default out/rollout_whl; `carry` it).
# Knobs: QERL_SCALE_WORLDS ("1 2 4"), QERL_SCALE_SHAPE (qwen2.5-7b), QERL_SCALE_FORMAT (nvfp4),
# QERL_SCALE_ARGS (default: 8 prompts/GPU x 8 generations, 256+256 tokens, rank 32, 3 steps + 1 warmup;
# the global batch grows with N: weak scaling, as data-parallel RL is run), QERL_DEADLINE_S (570).
# Files under $OUT: scale_w{N}.json per world size, scale.json (the table), gpu_scale.log.
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
job_start gpu_scale out/gpu_scale 570
qerl_shim
install_wheels "${QERL_WHL_DIR:-out/rollout_whl}"
# NVLink multicast off: some shared hosts are harmed by it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
stamp "$NGPU GPUs"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
WORLDS=${QERL_SCALE_WORLDS:-"1 2 4"}
SHAPE=${QERL_SCALE_SHAPE:-qwen2.5-7b}
FMT=${QERL_SCALE_FORMAT:-nvfp4}
ARGS=${QERL_SCALE_ARGS:-"--batch-prompts-per-rank 8 --num-generations 8 --prompt-len 256 --new-tokens 256 --lora-rank 32 --micro-batch-size 8 --steps 3 --warmup 1"}
for N in $WORLDS; do
  if (( N > NGPU )); then stamp "skip $N GPUs: only $NGPU"; continue; fi
  L=$(( $(left) - 10 ))
  if (( L < 60 )); then stamp "skip $N GPUs: ${L}s left"; continue; fi
  stamp "world size $N (limit ${L}s)"
  (cd /tmp && timeout "$L" python3 -m torch.distributed.run --standalone --nproc-per-node "$N" -m qerl_cli.bench.scale \
    --shape "$SHAPE" --format "$FMT" $ARGS --out "$OUT/scale_w$N.json" 2>&1 | grep -v "^W[0-9]" | grep -v "^\s*\(time\|host\|error_file\|traceback\|exitcode\) *:" | tail -30)
done
python3 -P - "$OUT" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "/tmp/qk")
from qerl_cli.bench.scale import scaling_table
out = Path(sys.argv[1])
res = [json.loads(p.read_text()) for p in sorted(out.glob("scale_w*.json"))]
if not res:
    sys.exit("no results")
table = scaling_table(res)
(out / "scale.json").write_text(json.dumps({"results": res, "table": table}, indent=2))
c = res[0]["config"]
print(f"== {res[0]['shape']} {res[0]['format']} on {res[0]['gpu']}: {c['batch_prompts']} prompts/rank x "
      f"{c['num_generations']} gen, {c['prompt_len']}+{c['new_tokens']} tokens, LoRA r{c['lora_rank']}")
print(f"{'GPUs':>4} {'step_s':>8} {'tok/s':>10} {'tok/s/GPU':>10} {'eff':>6} {'idle':>6}")
for r in table:
    eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.1%}"
    print(f"{r['world_size']:>4} {r['step_s']:>8.2f} {r['tokens_per_s']:>10.0f} {r['tokens_per_s_per_gpu']:>10.0f} "
          f"{eff:>6} {r['idle_frac']:>6.1%}")
PY
stamp done
