#!/usr/bin/env bash
# Issue 23's two GPU failure cells, re-run on an "80 GB card" (an H200 capped at 79.2 GiB, or an H100 as is), in one
# call (<= ~8 minutes): each must now say what failed and why, in the table (the note under it) and in the JSON.
# Same machine rules as scripts/gpu_step.sh: no network, no qerl install (path shim /tmp/qk); wheels the image lacks
# from $QERL_WHL_DIR (default out/rollout_whl): `carry` it.
# Stages (QERL_FAIL_STAGES, in this order; default "info rollout32 step72"):
#   info       GPU, torch, triton versions
#   rollout32  bench rollout --shape qwen2.5-32b --formats bf16 --batches 8 (256 prompt + 256 new tokens), capped:
#              the 61 GiB of BF16 weights leave KV room for fewer than 8 sequences. Was `error: StopIteration` (a bare
#              next() over the graph buckets); now `ok (N of 8 slots fit)` with a note saying what memory left room
#              for how many sequences of how many tokens
#   step72     bench step --shape qwen2.5-72b --formats nvfp4, 1 x 8 x (256 + 1024), default settings, capped: either
#              it fits (the memory plan's work) or the row says `OOM in <phase>` with the plan's estimate for that
#              phase, the capacity and the setting to change (or the plan's own one-line refusal)
# $QERL_FAIL_CAP (79.2) is the cap in GiB; the whole call keeps to $QERL_DEADLINE_S (default 480 s).
# Files under $OUT: r32/rollout.{json,png}, s72/step.{json,png}, gpu_failcells.log. Last: the tables and notes.
# A CPU proof of the script (tiny shapes, no cap):
#   QERL_FAIL_SHAPE32=tiny QERL_FAIL_SHAPE72=tiny QERL_FAIL_NEW=8 QERL_FAIL_NEW72=8 QERL_FAIL_PROMPT_LEN=8 \
#   QERL_FAIL_STAGES="rollout32 step72" OUT=/tmp/gf bash scripts/gpu_failcells.sh
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
STAGES=${QERL_FAIL_STAGES:-"info rollout32 step72"}
job_start gpu_failcells out/gpu_failcells 480
qerl_shim "${QERL_SHIM:-/tmp/qk}"
install_wheels "${QERL_WHL_DIR:-out/rollout_whl}"
CAP=()
if python3 -P -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  CAP=(--memory-cap "${QERL_FAIL_CAP:-79.2}")
fi
PL=${QERL_FAIL_PROMPT_LEN:-256}

if has info; then
  stamp info
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -P -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
fi

if has rollout32; then
  L=$(left); stamp "rollout32 (${L}s left)"
  qerl $(( L / 2 > 60 ? L / 2 : 60 )) bench rollout --shape "${QERL_FAIL_SHAPE32:-qwen2.5-32b}" --formats bf16 \
    --batches 8 --prompt-len "$PL" --new-tokens "${QERL_FAIL_NEW:-256}" "${CAP[@]}" --out "$OUT/r32" 2>&1 | tail -n 25
fi

if has step72; then
  L=$(left); stamp "step72 (${L}s left)"
  qerl $(( L - 15 > 60 ? L - 15 : 60 )) bench step --shape "${QERL_FAIL_SHAPE72:-qwen2.5-72b}" --formats nvfp4 \
    --set batch_prompts=1 --set num_generations=8 --set max_completion_length="${QERL_FAIL_NEW72:-1024}" \
    --prompt-len "$PL" --warmup 0 --measure 1 "${CAP[@]}" --out "$OUT/s72" 2>&1 | tail -n 25
fi

stamp "done; results:"
show_results "$OUT/r32/rollout.json" "$OUT/s72/step.json"
