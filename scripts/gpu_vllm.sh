#!/usr/bin/env bash
# The GPU check of the vllm rollout engine (issue 5), in one call: NVFP4 (and bf16 for comparison) served by
# vLLM with the LoRA pushed as tensors, log-probs against qerl's training forward, sleep/wake, 2 train steps.
# Needs vLLM importable on the GPU machine (it has no network: the image must have it, or a wheel dir in
# $QERL_VLLM_WHL_DIR, installed with --no-index). The image has no vLLM and one call cannot carry it: the
# carried, trimmed vLLM 0.26 and the side-by-side run are scripts/vllm_pack.sh, gpu_vllm_stash.sh and
# gpu_vllm_run.sh (docs/vllm.md); put /tmp/vsite on PYTHONPATH after those to use this script. Quantized runs come from $QERL_VLLM_MODEL (a local HF dir or
# .gguf; default: the embedded SmolLM2 when importable). Stages ($QERL_VLLM_STAGES, default "info nvfp4 bf16 train").
# Files under $OUT: vllm_<fmt>/vllm_check.json, gpu_vllm.log.  Deadline: $QERL_DEADLINE_S (default 570 s).
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
STAGES=${QERL_VLLM_STAGES:-"info nvfp4 bf16 train"}
MODEL=${QERL_VLLM_MODEL:-}
job_start gpu_vllm out/gpu_vllm 570
qerl_shim
if [ -n "${QERL_VLLM_WHL_DIR:-}" ] && compgen -G "$QERL_VLLM_WHL_DIR/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --find-links "$QERL_VLLM_WHL_DIR" vllm || echo "vllm wheels did not install"
fi
if ! python3 -P -c "import vllm" 2>/dev/null; then echo "vLLM is not importable here: nothing to check"; exit 3; fi
has info && python3 -P -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
for fmt in nvfp4 bf16; do
  has "$fmt" || continue
  [ "$(left)" -gt 90 ] || { echo "skip $fmt: $(left) s left"; continue; }
  rm -rf "/tmp/vr_$fmt"
  qerl 0 quantize $MODEL --run "/tmp/vr_$fmt" --format "$fmt" 2>&1 | tail -2
  (cd /tmp && timeout $(( $(left) - 30 )) python3 "$REPO/scripts/vllm_check.py" --run "/tmp/vr_$fmt" --dtype bf16 \
    --prompts 16 --n 8 --new 128 --out "$OUT/vllm_$fmt") 2>&1 | grep -v " INFO \| WARNING " | tail -5
done
if has train && [ -d /tmp/vr_nvfp4 ] && [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 10 )) bash -c "cd /tmp && python3 -c 'from qerl_cli.cli import main; main()' train \
--run /tmp/vr_nvfp4 --rollout-engine vllm --config gpu_arith --steps 2 --save-steps 2 2>&1 | grep -v ' INFO \| WARNING ' | tail -12"
fi
echo "== summary"; cat "$OUT"/vllm_*/vllm_check.json 2>/dev/null | grep -E '"(dtype|k1|max_abs_dlogp|wake_s|sleep_s|tokens_per_s)"'
