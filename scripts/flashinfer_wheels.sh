#!/usr/bin/env bash
# Run HERE (the CPU machine with network), once: the FlashInfer wheels the GPU jobs carry, split so that each
# device call stays under its 64 MiB carry limit (the flashinfer wheel alone is 62 MB, the repo ~10 MB):
#   out/fi_whl_a/part_a                      first half of flashinfer_python-0.7.2.post1-py3-none-any.whl
#   out/fi_whl_b/{part_b,name,sha256}        second half, the wheel's file name, its sha256
#   out/fi_whl_b/apache_tvm_ffi-*.whl        the one import-time dependency the GPU image lacks (cp312)
# The image already has nvidia-ml-py, einops, ninja, tabulate, cuda-bindings and nvcc (FlashInfer JIT-builds
# its kernels with them on first use). Call 1 carries out/fi_whl_a with QERL_ROLLOUT_STAGES=fistash (copies
# part A to /tmp/qk_fi, which lives while the machine stays warm); call 2 carries out/fi_whl_b, and
# gpu_common.sh's flashinfer_install joins, checks and installs the wheel into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
FI=${QERL_FI_VERSION:-0.7.2.post1}
TVM=${QERL_TVM_FFI_VERSION:-0.1.15.post2}
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" "flashinfer-python==$FI"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$tmp" "apache-tvm-ffi==$TVM"
whl=$(ls "$tmp"/flashinfer_python-*.whl)
rm -rf out/fi_whl_a out/fi_whl_b && mkdir -p out/fi_whl_a out/fi_whl_b
half=$(( ($(stat -c %s "$whl") + 1) / 2 ))
head -c "$half" "$whl" > out/fi_whl_a/part_a
tail -c +"$(( half + 1 ))" "$whl" > out/fi_whl_b/part_b
basename "$whl" > out/fi_whl_b/name
sha256sum "$whl" | cut -d' ' -f1 > out/fi_whl_b/sha256
cp "$tmp"/apache_tvm_ffi-*.whl out/fi_whl_b/
rm -rf "$tmp"
du -sh out/fi_whl_a out/fi_whl_b
