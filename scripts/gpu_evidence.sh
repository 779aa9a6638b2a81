#!/usr/bin/env bash
# The evidence study (issue 18, docs/evidence.md) in one GPU call: the four seed claims on the embedded SmolLM2,
# many seeds at once as parallel processes on one GPU, then `qerl bench evidence` (intervals, tests, verdicts).
# Same machine rules as scripts/gpu_step.sh: no network, no qerl install (path shim under /tmp/qk), wheels from
# $QERL_WHL_DIR (default out/rollout_whl); the GGUF travels in two parts (scripts/gpu_common.sh embedded_gguf).
#
#   QERL_EV_STAGE=stash  the first (smoke) call: stash out/rollout_gguf_a/part_a in /tmp/qk_gguf, install the wheels,
#                        check that qerl imports on CUDA. Carry out/rollout_gguf_a and out/rollout_whl.
#   QERL_EV_STAGE=study  the next call on the same warm machine (carry out/rollout_gguf_b and out/rollout_whl):
#     1. quantize the embedded model to nvfp4 (/tmp/ev_nv) and bf16 (/tmp/ev_bf), in parallel; the bf16 run is
#        also the qerl group's "format=bf16" copy (linked as <out>/models/bf16, same source hash).
#     2. one process per grid cell (14), each running seeds 0, 1, 2, ... of its cell until its time budget:
#          qerl    (nvfp4 run) format=bf16|nvfp4 x aqn=false|true               8 x 8, 8 tokens, $QERL_EV_STEPS steps
#          flashrl (bf16 run)  rollout_quant=none|int8|fp8 x correction=none|token_tis   same sizes
#          fp16    (bf16 run)  algo=grpo|pg_seq_is x precision=bf16|fp16, --no-stop: every completion is
#                              $QERL_EV_LONG tokens, 4 x 8, $QERL_EV_LONG_STEPS steps
#        The first cell of each group builds the group's perfectible subset ($QERL_EV_CANDIDATES mixed-level arith
#        problems x 16 samples, pass rate in [0.2, 0.8]); the group's other cells start once it is on disk and
#        reuse it (copied into their --out). Held-out: 32 test problems x 4 samples after each seed's last step.
#     3. qerl bench evidence over every sanity.json -> $OUT/evidence.{json,md,png}; the per-cell logs go to
#        $OUT/logs.txt. Everything keeps to $QERL_DEADLINE_S (default 480 s).
# CPU proof of the plumbing (tiny sizes): QERL_EV_CPU=1 QERL_EV_STAGE=study OUT=/tmp/ev bash scripts/gpu_evidence.sh
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
mkdir -p /tmp/qk_gguf
STAGE=${QERL_EV_STAGE:-study}
job_start gpu_evidence out/gpu_evidence 480
if [ "${QERL_EV_CPU:-0}" = 1 ]; then  # the checkout's own venv instead of the shim
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  qerl() { (cd /tmp && timeout "$1" "$REPO/.venv/bin/qerl" "${@:2}"); }
else
  qerl_shim
  install_wheels "${QERL_WHL_DIR:-out/rollout_whl}"
fi
export OMP_NUM_THREADS=1

if [ "$STAGE" = stash ]; then
  [ -f out/rollout_gguf_a/part_a ] && cp out/rollout_gguf_a/part_a /tmp/qk_gguf/part_a && echo "GGUF part A stashed"
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null
  python3 -P -c "import torch, triton, transformers, peft, compressed_tensors; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  (cd /tmp && python3 -c "import qerl_cli.bench.evidence, qerl_cli.train.trainer; print('qerl imports')")
  nproc; free -g | head -2
  stamp done
  exit 0
fi

if [ "${QERL_EV_CPU:-0}" = 1 ]; then
  STEPS=${QERL_EV_STEPS:-2}; LSTEPS=${QERL_EV_LONG_STEPS:-2}; LONG=${QERL_EV_LONG:-6}; CAND=${QERL_EV_CANDIDATES:-3}
  SAMPLES=2; SEEDS=2; B="--set batch_prompts=1 --set num_generations=2 --set lora_rank=4"; BL="$B"; HELD=2
  QGRID="format=bf16,nvfp4 --grid aqn=false"; FGRID="rollout_quant=none,int8 --grid correction=none"
  LGRID="precision=bf16,fp16 --grid algo=grpo"; PAR=1; BAND="--lo 0 --hi 1"
else
  embedded_gguf || { stamp "the embedded GGUF is not here: run QERL_EV_STAGE=stash first on the same warm machine"; exit 3; }
  STEPS=${QERL_EV_STEPS:-16}; LSTEPS=${QERL_EV_LONG_STEPS:-24}; LONG=${QERL_EV_LONG:-128}
  CAND=${QERL_EV_CANDIDATES:-96}; SAMPLES=16; SEEDS=${QERL_EV_SEEDS:-8}; HELD=32; PAR=0
  B="--set batch_prompts=8 --set num_generations=8 --set lora_rank=16"
  BL="--set batch_prompts=4 --set num_generations=8 --set lora_rank=16"
  QGRID=""; FGRID=""; LGRID=""; BAND=""
fi
EV=/tmp/ev; rm -rf $EV; mkdir -p $EV
COMMON="$BAND --candidates $CAND --samples $SAMPLES --seeds $SEEDS --heldout $HELD --set task_level=mixed --set lr=2e-4 \
--set gpu_memory_utilization=0.9 --set aqn_stages=8"

stamp "quantize nvfp4 + bf16 ($(left)s left)"
# every wait names its pids: a bare `wait` also waits for the `exec > >(tee ...)` process substitution
# (bash >= 5.1), which ends only with the script: the 2026-11-24 study call hung here for its whole limit
qerl 200 quantize --run $EV/nv --format nvfp4 >$EV/q_nv.log 2>&1 &
Q1=$!
qerl 200 quantize --run $EV/bf --format bf16 >$EV/q_bf.log 2>&1 &
wait $Q1 $!
[ -f $EV/nv/manifest.json ] && [ -f $EV/bf/manifest.json ] || { tail -5 $EV/q_*.log; stamp "quantize failed"; exit 4; }
mkdir -p $EV/models_nv && ln -sfn $EV/bf $EV/models_nv/bf16

# cells: group|run|subset-settings|--grid items of this cell|extra options
CELLS=()
for f in bf16 nvfp4; do for a in false true; do
  CELLS+=("qerl|nv|--set max_completion_length=8 --set steps=$STEPS $B|--grid format=$f --grid aqn=$a|"); done; done
for q in none int8 fp8; do for c in none token_tis; do
  CELLS+=("flashrl|bf|--set max_completion_length=8 --set steps=$STEPS $B|--grid rollout_quant=$q --grid correction=$c|"); done; done
for a in grpo pg_seq_is; do for p in bf16 fp16; do
  CELLS+=("fp16|bf|--set max_completion_length=$LONG --set steps=$LSTEPS $BL|--grid algo=$a --grid precision=$p|--no-stop"); done; done
if [ "$PAR" = 1 ]; then  # CPU proof: 2 cells per group, one after the other
  CELLS=("qerl|nv|--set max_completion_length=4 --set steps=$STEPS $B|--grid $QGRID|"
         "flashrl|bf|--set max_completion_length=4 --set steps=$STEPS $B|--grid $FGRID|"
         "fp16|bf|--set max_completion_length=$LONG --set steps=$LSTEPS $BL|--grid $LGRID|--no-stop")
fi

launch() {  # index: start that cell's process in the background
  local i=$1 g r sub grid extra d budget
  IFS='|' read -r g r sub grid extra <<<"${CELLS[$i]}"
  d=$EV/$g/c$i; mkdir -p "$d"
  [ "$g" = qerl ] && ln -sfn $EV/models_nv "$d/models"
  [ -f "$EV/$g/perfectible.json" ] && cp "$EV/$g/perfectible.json" "$d/"
  budget=$(( $(left) - 75 )); (( budget < 30 )) && budget=30
  # shellcheck disable=SC2086
  qerl $(( budget + 60 )) bench sanity --run $EV/$r $grid $COMMON $sub $extra --time-budget $budget --out "$d" \
    >"$d.log" 2>&1 &
  PIDS+=($!)
  [ "$PAR" = 1 ] && wait $!
}
PIDS=()

declare -A FIRST
for i in "${!CELLS[@]}"; do g=${CELLS[$i]%%|*}; [ -z "${FIRST[$g]:-}" ] && FIRST[$g]=$i; done
stamp "launching the first cell of each group ($(left)s left)"
for g in "${!FIRST[@]}"; do launch "${FIRST[$g]}"; done
PENDING=()
for i in "${!CELLS[@]}"; do [[ " ${FIRST[*]} " == *" $i "* ]] || PENDING+=("$i"); done
while (( ${#PENDING[@]} )) && (( $(left) > 120 )); do  # a group's other cells start once its subset exists
  REST=()
  for i in "${PENDING[@]}"; do
    g=${CELLS[$i]%%|*}; f=$EV/$g/c${FIRST[$g]}/perfectible.json
    if [ -f "$f" ]; then cp "$f" "$EV/$g/perfectible.json"; launch "$i"
    else REST+=("$i"); fi
  done
  PENDING=("${REST[@]}")
  (( ${#PENDING[@]} )) && sleep 2
done
(( ${#PENDING[@]} )) && stamp "cells never started (no subset in time): ${PENDING[*]}"
stamp "all cells started ($(left)s left)"
wait "${PIDS[@]}"
stamp "cells done ($(left)s left)"

INPUTS=()
for f in $EV/*/c*/sanity.json; do g=$(basename "$(dirname "$(dirname "$f")")"); INPUTS+=(--input "$g=$f"); done
for f in $EV/*/c*.log; do echo "=== $f"; grep -v "step [0-9]*: accuracy" "$f" | tail -n 12; done > "$OUT/logs.txt" 2>&1
if (( ${#INPUTS[@]} )); then
  qerl 120 bench evidence "${INPUTS[@]}" --out "$OUT" 2>&1 | tail -n 6
  # at most 8 files come back: the per-cell sanity.json files go into one archive
  (cd $EV && tar czf "$OUT/sanity_cells.tgz" */c*/sanity.json */perfectible.json 2>/dev/null)
  [ -f "$OUT/evidence.md" ] && cat "$OUT/evidence.md"
else
  stamp "no cell finished"; tail -n 20 $EV/*/c*.log
fi
stamp done
