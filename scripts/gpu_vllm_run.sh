#!/usr/bin/env bash
# vLLM side by side with the builtin engine on the GPU machine, in one call (issue 15).
#   bash scripts/gpu_vllm_run.sh WHEEL_DIR PART [PART...] [-- ARGS for scripts/vllm_side_by_side.py]
# PARTs are the names of the parts of the trimmed vLLM tree (scripts/vllm_pack.sh), in join order; a part
# carried in this very call (WHEEL_DIR/../PART/part) is stashed first, the others must already be in
# /tmp/vllm_parts (scripts/gpu_vllm_stash.sh, earlier calls on the same warm machine). Joins them, checks the
# whole against WHEEL_DIR/vt.sha256, unpacks it into /tmp/vsite, installs WHEEL_DIR/*.whl there
# (pip --no-index --no-deps --target), then runs scripts/vllm_side_by_side.py. Files under $OUT, named by
# $QERL_SBS_TAG (default s4_v15): TAG_side_by_side.json, TAG_run.log (all but vLLM's INFO lines), TAG_full.log,
# TAG_vllm_notes.log (kernel / backend / compile / KV-cache size lines). Deadline: $QERL_DEADLINE_S (default 570 s)
# for the whole call. A second run on the same warm machine skips the install and reuses the checkpoint of the
# same shape (/tmp/qerl_sbs_SHAPE) and vLLM's compile cache.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$PWD/out/gpu_vllm_run}
DEADLINE=$(( $(date +%s) + ${QERL_DEADLINE_S:-570} ))
TAG=${QERL_SBS_TAG:-s4_v15}
mkdir -p "$OUT" /tmp/qk
exec > >(tee -a "$OUT/${TAG}_run.log") 2>&1
WHL=$(cd "$1" && pwd); shift
parts=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do parts+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
for p in "${parts[@]}"; do
  [ -f "$WHL/../$p/part" ] && bash "$REPO/scripts/gpu_vllm_stash.sh" "$WHL/../$p" >/dev/null
done
if [ ! -d /tmp/vsite/vllm ]; then
  t0=$(date +%s)
  files=()
  for p in "${parts[@]}"; do
    [ -f "/tmp/vllm_parts/$p" ] || { echo "run: part $p is missing from /tmp/vllm_parts (machine not the warm one?)"; ls -l /tmp/vllm_parts; exit 2; }
    files+=("/tmp/vllm_parts/$p")
  done
  cat "${files[@]}" > /tmp/vt.tar.xz
  echo "$(cat "$WHL/vt.sha256")  /tmp/vt.tar.xz" | sha256sum -c - || exit 2
  mkdir -p /tmp/vsite && tar -C /tmp/vsite -xJf /tmp/vt.tar.xz || exit 2
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite "$WHL"/*.whl || exit 2
  rm -f /tmp/vt.tar.xz
  echo "install: $(( $(date +%s) - t0 )) s, /tmp/vsite $(du -sh /tmp/vsite | cut -f1)"
fi
ln -sfn "$REPO/qerl_cli" /tmp/qk/qerl_cli
ln -sfn "$REPO/kernels" /tmp/qk/qerl_kernels
export PYTHONPATH="/tmp/qk:/tmp/vsite" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# flashinfer is not carried: keep vLLM's sampler from importing it (the sampler skips FlashInfer anyway for
# requests with their own seeds and processed log-probs, which is every VllmEngine request).
export VLLM_USE_FLASHINFER_SAMPLER=0
python3 -P -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" || exit 3
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "disk /tmp: $(df -h /tmp | tail -1 | awk '{print $4}') free; checkpoints: $(ls -d /tmp/qerl_sbs_* 2>/dev/null | tr '\n' ' ')"
left=$(( DEADLINE - $(date +%s) ))
rm -rf /tmp/sbs_out  # an earlier call's results on the same warm machine are not this one's
(cd /tmp && timeout $(( left - 5 )) python3 "$REPO/scripts/vllm_side_by_side.py" --out /tmp/sbs_out \
  --deadline-s $(( left - 25 )) "$@") 2>&1 | tee /tmp/sbs_full.log | grep -v "INFO"
cp /tmp/sbs_out/side_by_side.json "$OUT/${TAG}_side_by_side.json" 2>/dev/null
grep -E "ERROR|Error|Using .* for NVFP4|Marlin|backend|CUDA graph|compil|KV cache|concurrency|Model loading" \
  /tmp/sbs_full.log | head -80 > "$OUT/${TAG}_vllm_notes.log"
cp /tmp/sbs_full.log "$OUT/${TAG}_full.log"
