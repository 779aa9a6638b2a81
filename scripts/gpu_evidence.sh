#!/usr/bin/env bash
# The evidence study v2 (issues 18 and 28, docs/evidence.md) in one GPU call of at most 9 minutes: the four seed
# claims on the embedded SmolLM2 (a Q4_1 GGUF: "bf16" below is Q4_1 dequantized, "nvfp4" Q4_1 re-quantized), many
# processes at once on one GPU, then `qerl bench evidence` (paired t intervals, exact sign-flip p, verdicts, the
# seeds that would decide each part). Same machine rules as scripts/gpu_step.sh: no network, no qerl install (path
# shim under /tmp/qk), wheels from $QERL_WHL_DIR (default out/rollout_whl); the GGUF travels in two parts
# (scripts/gpu_common.sh embedded_gguf).
#
#   QERL_EV_STAGE=stash  first call (carry out/rollout_gguf_a and out/rollout_whl): stash GGUF part A in /tmp/qk_gguf,
#                        install the wheels, check that qerl imports on CUDA (~20 s).
#   QERL_EV_STAGE=study  next call on the SAME warm machine (carry out/rollout_gguf_b and out/rollout_whl), ~8 min:
#     1. quantize the embedded model to nvfp4 (/tmp/ev/nv) and bf16 (/tmp/ev/bf) in parallel (~60 s); the bf16 run
#        is also the qerl group's format=bf16 copy (linked as <out>/models/bf16: same source hash).
#     2. processes on the one GPU (20 by default, 16 CPU cores; each single-threaded):
#          qerl    8 processes, seed s = 0..7, each the 4 cells aqn=false,true x format=bf16,nvfp4 (claims 1, 2):
#                  arith levels 1 and 4 (the 125 one-digit sums and products), 8 prompts x 8 samples, 8 tokens,
#                  16 steps, LoRA r16, lr 2e-4, AQN 1e-2 -> 5e-4 over 8 stages; held-out 32 test problems x 32
#                  samples before the first step and after the last
#          flashrl 8 processes, seed s = 0..7, each 5 cells rollout_quant=none,int8,fp8 x correction=none,token_tis
#                  without (none, token_tis) (claim 3): arith level 3 (two-digit sums), same sizes, 16 steps
#          fp16    4 processes, one per cell algo=grpo,pg_seq_is x precision=bf16,fp16, seeds 0..2 each (claim 4):
#                  level 3, --no-stop (every completion 128 tokens), 4 prompts x 8 samples, 12 steps
#        The first process of each group builds the group's training set before any training (perfectible.json:
#        qerl: the problems BOTH models solve in [0.1, 0.9] of 32 samples; flashrl: those the BF16 model solves in
#        [0.05, 0.5] of 32; fp16: those it solves in [0.05, 0.5] in bf16 and in fp16); the group's other processes
#        start once it is on disk and reuse it. Each process stops starting cells when its time budget would not
#        hold the longest cell so far, so everything ends by $QERL_DEADLINE_S (default 480 s) minus the analysis.
#     3. `qerl bench evidence` over every sanity.json, run in /tmp/ev with relative paths (so that the recorded
#        command re-runs after `tar xzf evidence_raw.tgz`), recorded in /tmp/ev/nv's manifest (raw files with
#        sha256, selection rules, analysis version). Back in $OUT (5 files): gpu_evidence.log, evidence.json,
#        evidence.md, evidence.png, evidence_raw.tgz (every process's sanity.json, perfectible.json and log, the
#        quantize logs, the manifest). evidence.md is printed last; its last table holds the verdicts.
# Sizing (measured 2026-11-24, 14 processes on an H200: ~2.4 s a step of 8 x 8 x 8 tokens, ~3.8 with AQN (its
# per-norm device syncs, removed since), ~2.7 with INT8/FP8 rollouts, ~5 s a step of 4 x 8 x 128 tokens):
#   qerl 16 x (2.4 + 2.4 + 2.6 + 2.6) + 8 held-out scorings x 3 + 4 setups x 3 = ~200 s a process,
#   flashrl 5 x 16 x 2.7 + 5 x 3 = ~230 s, fp16 3 x (12 x 5 + 3) = ~190 s; x 20/14 for 20 processes instead of 14:
#   ~280-330 s, in a window of ~350 s (processes start at ~+95 s after the quantization and the training sets,
#   stop by the deadline - 35 s). If it is slower, the last cells of a process are skipped (AQN-on and FP8 cells
#   and the third fp16 seed go first), and the verdict table says how many seeds each part had and needs.
# CPU proof of the whole pipeline (tiny sizes, processes one at a time, ~15 min on 2 cores):
#   QERL_EV_CPU=1 QERL_EV_STAGE=study OUT=/tmp/ev_cpu_out bash scripts/gpu_evidence.sh
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
mkdir -p /tmp/qk_gguf
STAGE=${QERL_EV_STAGE:-study}
CPU=${QERL_EV_CPU:-0}
if [ "$CPU" = 1 ]; then job_start gpu_evidence out/gpu_evidence 5400; else job_start gpu_evidence out/gpu_evidence 480; fi
if [ "$CPU" = 1 ]; then
  qerl_shim "${QERL_EV_QK:-/tmp/qk_evidence_cpu}"
  export OMP_NUM_THREADS=${QERL_EV_THREADS:-1}
else
  qerl_shim
  install_wheels "${QERL_WHL_DIR:-out/rollout_whl}"
  export OMP_NUM_THREADS=1
fi
PY=(python3 -c "from qerl_cli.cli import main; main()")

if [ "$STAGE" = stash ]; then
  [ -f out/rollout_gguf_a/part_a ] && cp out/rollout_gguf_a/part_a /tmp/qk_gguf/part_a && echo "GGUF part A stashed"
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null
  python3 -P -c "import torch, triton, transformers, peft, compressed_tensors; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  (cd /tmp && python3 -c "import qerl_cli.bench.evidence, qerl_cli.train.trainer; print('qerl imports')")
  echo "cores: $(getconf _NPROCESSORS_ONLN)"; free -g | head -2
  stamp done
  exit 0
fi

EV=${QERL_EV_DIR:-/tmp/ev}
if [ "$CPU" = 1 ]; then
  EV=${QERL_EV_DIR:-/tmp/ev_cpu}
  # every group and code path at tiny sizes, fewer cells (on a CPU an NVFP4 forward dequantizes every weight):
  # qerl trains the bf16 cells only (its training set still measures both arms), flashrl bf16 and int8 + TIS
  # rollouts, fp16 GRPO in both precisions, each over 2 seeds, one process at a time
  QN=2; FN=2; LN=2; STEPS=2; LSTEPS=2; TOK=3; LONG=4; SAMPLES=2; HELD="--heldout 2 --heldout-samples 2"
  B="--set batch_prompts=1 --set num_generations=2 --set lora_rank=4"; BL="$B"
  QBAND="--candidates 6 --lo 0 --hi 1 --skip format=nvfp4"
  FBAND="--candidates 4 --lo 0 --hi 1 --skip rollout_quant=fp8 --skip rollout_quant=int8,correction=none"; SERIAL=1
else
  embedded_gguf || { stamp "the embedded GGUF is not here: run QERL_EV_STAGE=stash first on the same warm machine"; exit 3; }
  QN=${QERL_EV_QERL_SEEDS:-8}; FN=${QERL_EV_FLASHRL_SEEDS:-8}; LN=${QERL_EV_FP16_SEEDS:-3}
  STEPS=${QERL_EV_STEPS:-16}; LSTEPS=${QERL_EV_LONG_STEPS:-12}; TOK=8; LONG=128; SAMPLES=32
  HELD="--heldout 32 --heldout-samples 32"
  B="--set batch_prompts=8 --set num_generations=8 --set lora_rank=16"
  BL="--set batch_prompts=4 --set num_generations=8 --set lora_rank=16"
  QBAND="--candidates 125 --lo 0.1 --hi 0.9"; FBAND="--candidates 256 --lo 0.05 --hi 0.5"; SERIAL=0
fi
quantized() { grep -q '"status": "completed"' "$1/manifest.json" 2>/dev/null; }
if [ "${QERL_EV_KEEP_MODELS:-0}" = 1 ] && quantized "$EV/nv" && quantized "$EV/bf"; then
  # a rerun of the CPU proof: keep the two quantized runs, drop everything else
  find "$EV" -mindepth 1 -maxdepth 1 ! -name nv ! -name bf -exec rm -rf {} +
  KEEP=1
else
  rm -rf "$EV"; mkdir -p "$EV"; KEEP=0
fi
COMMON="--samples $SAMPLES --set lr=2e-4 --set gpu_memory_utilization=0.9"
declare -A ARGS
ARGS[qerl]="--grid aqn=false,true --grid format=bf16,nvfp4 $QBAND $HELD --set task_level=1,4 \
--set max_completion_length=$TOK --set steps=$STEPS --set aqn_stages=8 $B"
ARGS[flashrl]="--grid rollout_quant=none,int8,fp8 --grid correction=none,token_tis \
--skip rollout_quant=none,correction=token_tis $FBAND --set task_level=3 --set max_completion_length=$TOK \
--set steps=$STEPS $B"
ARGS[fp16]="--grid algo=grpo,pg_seq_is --grid precision=bf16,fp16 ${FBAND%% --skip*} --set task_level=3 --no-stop \
--set max_completion_length=$LONG --set steps=$LSTEPS $BL"
declare -A RUN=([qerl]=nv [flashrl]=bf [fp16]=bf)

if [ "$KEEP" = 0 ]; then
  stamp "quantize nvfp4 + bf16 ($(left)s left)"
  # every wait names its pids: a bare `wait` also waits for the `exec > >(tee ...)` process substitution
  # (bash >= 5.1), which ends only with the script: the 2026-11-24 study call hung there for its whole limit
  QT=$(( CPU == 1 ? 1800 : 200 ))
  qerl "$QT" quantize --run "$EV/nv" --format nvfp4 >"$EV/q_nv.log" 2>&1 &
  Q1=$!
  qerl "$QT" quantize --run "$EV/bf" --format bf16 >"$EV/q_bf.log" 2>&1 &
  wait "$Q1" $!
fi
quantized "$EV/nv" && quantized "$EV/bf" || { tail -5 "$EV"/q_*.log; stamp "quantize failed"; exit 4; }
mkdir -p "$EV/models_nv" && ln -sfn "$EV/bf" "$EV/models_nv/bf16"

# processes: group|name|first seed|seeds|--skip items that leave this process its cells
PROCS=()
for ((s = 0; s < QN; s++)); do PROCS+=("qerl|p$s|$s|1|"); done
for ((s = 0; s < FN; s++)); do PROCS+=("flashrl|p$s|$s|1|"); done
if [ "$CPU" = 1 ]; then  # CPU proof: GRPO in bf16 and in fp16, one process each
  PROCS+=("fp16|c0|0|$LN| --skip algo=pg_seq_is --skip precision=fp16"
          "fp16|c1|0|$LN| --skip algo=pg_seq_is --skip precision=bf16")
else  # one process per cell: the other three cells skipped
  LCELLS=("grpo bf16" "grpo fp16" "pg_seq_is bf16" "pg_seq_is fp16")
  for i in "${!LCELLS[@]}"; do
    skips=""
    for j in "${!LCELLS[@]}"; do
      [ "$i" = "$j" ] && continue
      read -r a p <<<"${LCELLS[$j]}"; skips+=" --skip algo=$a,precision=$p"
    done
    PROCS+=("fp16|c$i|0|$LN|$skips")
  done
fi
END=$(( DEADLINE - 35 ))  # the processes' end: the analysis, the archive and the table need the rest

launch() {  # index: start that process in the background (CPU proof: and wait for it)
  local g name s0 n skips d now budget
  IFS='|' read -r g name s0 n skips <<<"${PROCS[$1]}"
  d=$EV/$g/$name; mkdir -p "$d"
  [ "$g" = qerl ] && ln -sfn "$EV/models_nv" "$d/models"
  [ -f "$EV/$g/perfectible.json" ] && cp "$EV/$g/perfectible.json" "$d/"
  now=$(( $(date +%s) - t0 )); budget=$(( END - now - 20 )); (( budget < 30 )) && budget=30
  # shellcheck disable=SC2086
  (cd /tmp && timeout $(( budget + 50 )) "${PY[@]}" bench sanity --run "$EV/${RUN[$g]}" ${ARGS[$g]} $COMMON \
    --seed-start "$s0" --seeds "$n" $skips --time-budget "$budget" --out "$d") >"$d.log" 2>&1 &
  PID_OF[$1]=$!
  if [ "$SERIAL" = 1 ]; then wait $!; else PIDS+=($!); fi
}
PIDS=()
declare -A PID_OF
if [ "$CPU" != 1 ]; then
  # 20 processes share one GPU: sized for the 141 GB H200. On an 80 GB H100 (2026-11-26) most qerl cells ran out
  # of memory; the monitor below records every process's memory so the next sizing is measured, not guessed
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  (( ${GPU_MIB:-0} < 100000 )) && stamp "warning: ${GPU_MIB} MiB of GPU memory: the study is sized for an H200"
  (while sleep 5; do echo "$(( $(date +%s) - t0 )) $(nvidia-smi --query-compute-apps=used_memory \
     --format=csv,noheader,nounits 2>/dev/null | sort -n | tr '\n' ' ')"; done > "$EV/gpu_mem.log" 2>&1) &
  MON=$!
fi

declare -A FIRST
for i in "${!PROCS[@]}"; do g=${PROCS[$i]%%|*}; [ -z "${FIRST[$g]:-}" ] && FIRST[$g]=$i; done
stamp "launching the first process of each group: it builds the group's training set ($(left)s left)"
for g in qerl flashrl fp16; do launch "${FIRST[$g]}"; done
PENDING=()
for i in "${!PROCS[@]}"; do [[ " ${FIRST[*]} " == *" $i "* ]] || PENDING+=("$i"); done
while (( ${#PENDING[@]} )) && (( $(left) > 150 )); do  # a group's other processes start once its set exists
  REST=()
  for i in "${PENDING[@]}"; do
    IFS='|' read -r g _ <<<"${PROCS[$i]}"
    IFS='|' read -r _ first _ <<<"${PROCS[${FIRST[$g]}]}"
    f=$EV/$g/$first/perfectible.json
    if [ -f "$f" ]; then cp "$f" "$EV/$g/perfectible.json"; launch "$i"
    elif ! kill -0 "${PID_OF[${FIRST[$g]}]}" 2>/dev/null; then  # it ended without a training set: its log says why
      stamp "group $g: its first process ended without a training set; process ${PROCS[$i]%%|*}/$i not started"
    else REST+=("$i"); fi
  done
  PENDING=("${REST[@]}")
  (( ${#PENDING[@]} )) && sleep 2
done
(( ${#PENDING[@]} )) && stamp "processes never started (no training set in time): ${PENDING[*]}"
stamp "all processes started ($(left)s left)"
for g in qerl flashrl fp16; do
  [ -f "$EV/$g/perfectible.json" ] && (cd /tmp && python3 -c "import json, sys; s = json.load(open(sys.argv[1])); \
print(sys.argv[2] + ':', s.get('rule'))" "$EV/$g/perfectible.json" "$g")
done
(( ${#PIDS[@]} )) && wait "${PIDS[@]}"
stamp "processes done ($(left)s left)"
if [ -n "${MON:-}" ]; then
  kill "$MON" 2>/dev/null
  (cd /tmp && python3 -c "
import sys
peak_sum = peak_one = 0
for line in open(sys.argv[1]):
    mib = [int(x) for x in line.split()[1:] if x.isdigit()]
    peak_sum, peak_one = max(peak_sum, sum(mib)), max(peak_one, max(mib, default=0))
print(f'GPU memory of the study processes: peak sum {peak_sum} MiB, peak of one process {peak_one} MiB')
" "$EV/gpu_mem.log")
fi

INPUTS=()
while IFS= read -r f; do INPUTS+=(--input "${f%%/*}=$f"); done < <(cd "$EV" && ls -1 */*/sanity.json 2>/dev/null)
for f in "$EV"/*/*.log; do echo "=== $f"; grep -v "step [0-9]*: accuracy" "$f" | tail -n 8; done > "$EV/process_tails.txt" 2>&1
if (( ${#INPUTS[@]} )); then
  (cd "$EV" && timeout 120 "${PY[@]}" bench evidence "${INPUTS[@]}" --run "$EV/nv" --out "$EV/evidence") 2>&1 | tail -n 6
  cp "$EV"/evidence/evidence.{json,md,png} "$OUT/" 2>/dev/null
  # at most 8 files come back: every raw file goes into one archive
  (cd "$EV" && tar czf "$OUT/evidence_raw.tgz" */*/sanity.json */perfectible.json */*/perfectible.json ./*/*.log \
    ./*.log nv/manifest.json bf/manifest.json process_tails.txt gpu_mem.log 2>/dev/null)
  ls -l "$OUT"
  [ -f "$OUT/evidence.md" ] && cat "$OUT/evidence.md"
else
  stamp "no process finished"; tail -n 20 "$EV"/*/*.log
fi
stamp done
