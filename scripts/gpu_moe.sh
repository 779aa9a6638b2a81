#!/usr/bin/env bash
# The GPU runs of the mixture-of-experts support (docs/moe.md) on Qwen3-30B-A3B's shape, one stage list per call.
# Same machine rules as scripts/gpu_step.sh: no network, no qerl install (the /tmp/qk path shim), wheels the image
# lacks from $QERL_WHL_DIR (default out/rollout_whl); `carry` that folder.
# Stages (QERL_MOE_STAGES, run in this order; default "info kcheck rollout"):
#   info     GPU, torch, triton, transformers, peft, compressed-tensors versions
#   kcheck   the grouped expert GEMMs against the per-expert reference at the real expert shape (E 128, H 2048,
#            I 768, top-8), nvfp4/mxfp4/bf16, forward + LoRA + backward, and a CUDA-graph replay
#            (qerl_cli.bench.kernel_selfcheck.check_moe_kernels) -> $OUT/kcheck.json
#   load     scripts/moe_load_check.py on --shape $QERL_MOE_LOAD_SHAPE (tiny-moe): the checkpoint qerl writes, loaded by
#            transformers (and by vLLM when it imports: see docs/vllm.md for carrying it) -> $OUT/load
#   rollout  bench rollout --shape $QERL_MOE_SHAPE (qwen3-30b-a3b) bf16,nvfp4 at batches $QERL_MOE_BATCHES (1,8,64),
#            $QERL_MOE_PROMPT_LEN (256) prompt + $QERL_MOE_NEW (256) new tokens, LoRA r32 on attention and experts
#            -> $OUT/rollout (the 1.5x-over-bf16 target at batch 64 is checked in its targets)
#   step     bench step --shape $QERL_MOE_SHAPE nvfp4: 8 prompts x 8 samples x (256 + $QERL_MOE_NEW_STEP (1024)), LoRA
#            r32 GRPO, default settings (the memory plan chooses), --memory-cap $QERL_MOE_CAP (79.2: an 80 GB card),
#            0 warm-up + 1 measured step -> $OUT/step (the peak <= 40 GiB target is in its targets)
#   stepbf16 the same workload in bf16 (BF16-LoRA; recorded as not fitting when the plan says so) -> $OUT/stepbf16
# Each stage gets what is left of $QERL_DEADLINE_S (default 570 s); run the long ones (rollout, step, stepbf16) one
# per call. A CPU proof of the script:
#   QERL_MOE_SHAPE=tiny-moe QERL_MOE_BATCHES=1,2 QERL_MOE_NEW=4 QERL_MOE_NEW_STEP=4 QERL_MOE_PROMPT_LEN=4 \
#   QERL_MOE_STAGES="rollout step" OUT=/tmp/gm bash scripts/gpu_moe.sh
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
STAGES=${QERL_MOE_STAGES:-"info kcheck rollout"}
SHAPE=${QERL_MOE_SHAPE:-qwen3-30b-a3b}
PL=${QERL_MOE_PROMPT_LEN:-256}
job_start gpu_moe out/gpu_moe 570
qerl_shim "${QERL_SHIM:-/tmp/qk}"
install_wheels "${QERL_WHL_DIR:-out/rollout_whl}"

if has info; then
  stamp info
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  python3 -P -c "import torch, triton, transformers, peft, compressed_tensors as ct; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'compressed-tensors', \
ct.__version__)"
fi
if has kcheck; then
  stamp "kcheck ($(left)s left)"
  (cd /tmp && timeout $(( $(left) - 10 )) python3 -c "
import json
from qerl_cli.bench.kernel_selfcheck import check_moe_kernels
rows = check_moe_kernels()
for r in rows: print(json.dumps(r))
print('moe kernels:', sum(r['ok'] for r in rows), '/', len(rows), 'passed')
open('$OUT/kcheck.json', 'w').write(json.dumps(rows, indent=1))")
fi
if has load; then
  stamp "load ($(left)s left)"
  ENG="hf"; python3 -P -c "import vllm" >/dev/null 2>&1 && ENG="vllm hf"
  (cd /tmp && timeout $(( $(left) - 10 )) python3 "$REPO/scripts/moe_load_check.py" --out "$OUT/load" \
    --shape "${QERL_MOE_LOAD_SHAPE:-tiny-moe}" --engines $ENG 2>&1 | grep -v " INFO \| WARNING " | tail -8)
fi
if has rollout; then
  L=$(left); stamp "rollout (${L}s left)"
  qerl $(( L - 10 > 60 ? L - 10 : 60 )) bench rollout --shape "$SHAPE" --formats bf16,nvfp4 \
    --batches "${QERL_MOE_BATCHES:-1,8,64}" --prompt-len "$PL" --new-tokens "${QERL_MOE_NEW:-256}" \
    --out "$OUT/rollout"
fi
step() {  # step LABEL FORMAT
  local L; L=$(left); stamp "$1 (${L}s left)"
  qerl $(( L - 10 > 60 ? L - 10 : 60 )) bench step --shape "$SHAPE" --formats "$2" \
    --set batch_prompts=8 --set num_generations=8 --set max_completion_length="${QERL_MOE_NEW_STEP:-1024}" \
    --prompt-len "$PL" --warmup 0 --measure 1 --memory-cap "${QERL_MOE_CAP:-79.2}" --out "$OUT/$1"
}
has step && step step nvfp4
has stepbf16 && step stepbf16 bf16
show_results "$OUT"/rollout/rollout.json "$OUT"/step/step.json "$OUT"/stepbf16/step.json
