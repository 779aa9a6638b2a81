#!/usr/bin/env bash
# Issue 27: FSDP2 full fine-tuning with INT8 rollouts (FlashRL mode) of the Qwen2.5-7B shape, on 1 GPU (sharding
# degree 1) and, when `nvidia-smi -L` lists 2+ GPUs, on 2 GPUs: per-GPU peak memory per phase and scaling efficiency
# (tokens/s per GPU at 2 over tokens/s at 1). One call of at most ~9 minutes.
# Runs qerl_cli/bench/scale.py under torchrun: the real Trainer.train_step on a random bf16 7B-shape model with
# --finetune full --sharding fsdp2 --rollout-quant int8 (fp32 sharded masters, bf16 compute, fused AdamW, the INT8
# rollout copy re-quantized layer by layer from the sharded masters), synthetic prompts, fixed-length generation,
# random rewards, 8 prompts x 8 generations per GPU (weak scaling), gradient checkpointing on.
# Memory: the 7B state is ~16 B per trained parameter (fp32 masters, grads, AdamW moments: 6.5e9 x 16 B = 97 GiB)
# plus the INT8 copy (6 GiB) and bf16 embeddings/lm_head (2 GiB) on every GPU. 1 GPU: fits an H200 (139 GiB) as is;
# on an 80 GB card the 1-GPU run adds --fsdp-offload (state in pinned host memory, ~100 GiB of RAM, CPU AdamW
# step). 2 GPUs: ~57 GiB per GPU without offload (fits 80 GB cards).
# The machine has no network and no qerl install: qerl is imported through a path shim (/tmp/qk); wheels the image
# lacks come from $QERL_WHL_DIR (default out/rollout_whl; `carry` it if the image lacks them; nothing here needs
# more than torch + transformers + triton).
# Knobs: QERL_FSDP_SHAPE (qwen2.5-7b), QERL_FSDP_WORLDS ("1 2"), QERL_FSDP_OFFLOAD1 (auto | 0 | 1: offload on the
# 1-GPU run; auto: when the GPU has < 120 GiB), QERL_FSDP_OFFLOAD_MB (64: the offloaded run's micro-batch),
# QERL_FSDP_ARGS (the bench flags below), QERL_FSDP_RESERVE2_S (230: seconds the 1-GPU run leaves the 2-GPU run),
# QERL_DEADLINE_S (540).
# Files under $OUT: fsdp_w{N}.json per world size, fsdp.json (results + table), gpu_fsdp.log.
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
job_start gpu_fsdp out/gpu_fsdp 540
qerl_shim
install_wheels "${QERL_WHL_DIR:-out/rollout_whl}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
stamp "$NGPU GPUs"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
SHAPE=${QERL_FSDP_SHAPE:-qwen2.5-7b}
WORLDS=${QERL_FSDP_WORLDS:-"1 2"}
ARGS=${QERL_FSDP_ARGS:-"--batch-prompts-per-rank 8 --num-generations 8 --prompt-len 256 --new-tokens 256 --micro-batch-size 16 --steps 2 --warmup 1 --gradient-checkpointing --gpu-memory-utilization 0.95"}
OFFLOAD1=${QERL_FSDP_OFFLOAD1:-auto}
if [ "$OFFLOAD1" = auto ]; then
  if (( ${MEM_MIB:-0} < 120 * 1024 )); then OFFLOAD1=1; else OFFLOAD1=0; fi
fi
for N in $WORLDS; do
  if (( N > NGPU )); then stamp "skip $N GPUs: only $NGPU"; continue; fi
  L=$(( $(left) - 15 ))
  # the 1-GPU run leaves the 2-GPU run its share of the call
  if (( N == 1 && NGPU >= 2 )) && [[ " $WORLDS " == *" 2 "* ]]; then L=$(( L - ${QERL_FSDP_RESERVE2_S:-230} )); fi
  if (( L < 90 )); then stamp "skip $N GPUs: ${L}s left"; continue; fi
  EXTRA=""
  # offloaded: every pass copies the fp32 shards to the GPU, so fewer, larger micro-batches (GPU memory is free)
  if (( N == 1 )) && [ "$OFFLOAD1" = 1 ]; then EXTRA="--fsdp-offload --micro-batch-size ${QERL_FSDP_OFFLOAD_MB:-64}"; fi
  stamp "world size $N $EXTRA (limit ${L}s)"
  (cd /tmp && timeout "$L" python3 -m torch.distributed.run --standalone --nproc-per-node "$N" -m qerl_cli.bench.scale \
    --shape "$SHAPE" --format bf16 --finetune full --sharding fsdp2 --rollout-quant int8 $ARGS $EXTRA \
    --out "$OUT/fsdp_w$N.json" 2>&1 | grep -v "^W[0-9]" | grep -v "^\s*\(time\|host\|error_file\|traceback\|exitcode\) *:" | tail -30)
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
done
python3 -P - "$OUT" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "/tmp/qk")
from qerl_cli.bench.scale import PEAK_PHASES, scaling_table
out = Path(sys.argv[1])
res = [json.loads(p.read_text()) for p in sorted(out.glob("fsdp_w*.json"))]
if not res:
    sys.exit("no results")
table = scaling_table(res)
(out / "fsdp.json").write_text(json.dumps({"results": res, "table": table}, indent=2))
c = res[0]["config"]
print(f"== FSDP2 full FT + INT8 rollouts, {res[0]['shape']} on {res[0]['gpu']}: {c['batch_prompts'] // res[0]['world_size']}"
      f" prompts/GPU x {c['num_generations']} gen, {c['prompt_len']}+{c['new_tokens']} tokens, micro-batch "
      f"{c['micro_batch_size']}, median of {c['steps']} steps")
by_n = {r["world_size"]: r for r in res}
f = lambda v, fmt="{:.1f}": "-" if v is None else fmt.format(v)
print(f"{'GPUs':>4} {'offload':>7} {'step s':>7} {'rollout':>7} {'recomp':>7} {'fwd+bwd':>7} {'optim':>6} {'requant':>7} "
      f"{'tok/s':>7} {'tok/s/GPU':>9} {'eff':>6} " + " ".join(f"{p[:7] + ' GiB':>11}" for p in PEAK_PHASES)
      + f" {'build GiB':>9}")
for t in table:
    r = by_n[t["world_size"]]
    ph, pk = r["phase_s"], r["peak_gb"]
    eff = "-" if t["efficiency"] is None else f"{t['efficiency']:.1%}"
    print(f"{t['world_size']:>4} {('yes' if r['mode']['fsdp_offload'] else 'no'):>7} {t['step_s']:>7.1f} "
          f"{f(ph['rollout']):>7} {f(ph['recompute']):>7} {f(ph['fwd_bwd']):>7} {f(ph['optimizer']):>6} "
          f"{f(ph['requant'], '{:.2f}'):>7} {t['tokens_per_s']:>7.0f} {t['tokens_per_s_per_gpu']:>9.0f} {eff:>6} "
          + " ".join(f"{f(pk[p]):>11}" for p in PEAK_PHASES) + f" {f(r['build_peak_gb']):>9}")
print("peaks: per-GPU max over ranks of max_memory_allocated in each phase; eff: tokens/s per GPU over the 1-GPU "
      "run's tokens/s (weak scaling; the 1-GPU run may be offloaded, see the offload column)")
PY
stamp done
