#!/usr/bin/env bash
# Pack vLLM 0.26.0 for the GPU machine (no network there, at most 64 MiB carried per call), on a machine
# with pip access. Issue 15; docs/vllm.md "vLLM 0.26.0 on the GPU machine" explains every choice.
#   bash scripts/vllm_pack.sh WORK_DIR STAGE_PREFIX
#   e.g. bash scripts/vllm_pack.sh /work/vllm_whl /work/main/.gpu_v15   (-> .gpu_v15p0 .gpu_v15p1 ... .gpu_v15w)
# Makes: the vLLM tree as `pip install --no-deps --target` leaves it, minus what a Hopper GPU never loads
# (FlashAttention 2 kernels, the vllm-rs binary, DeepGEMM's C++ headers and its .so for other Pythons),
# tar.xz, split in 50 MiB parts (STAGE_PREFIX p0, p1, ...: `part` + `sha256`), and STAGE_PREFIX w: the
# cp312 wheels of what `import vllm` + `LLM(...)` with LoRA imports and the image lacks (found by importing
# in a bare venv, see the docs), plus `vt.sha256` of the whole tar.xz.
set -euo pipefail
W=$1; S=$2
mkdir -p "$W" && cd "$W"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d . vllm==0.26.0
rm -rf site vt && python3 -m pip install -q --no-deps --no-compile --target site vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
mkdir vt && cp -a site/vllm site/vllm-0.26.0.dist-info vt/
( cd vt/vllm && rm -f vllm_flash_attn/_vllm_fa2_C.abi3.so vllm-rs \
  && find third_party -name include -type d -prune -exec rm -rf {} + \
  && rm -f third_party/deep_gemm/_C.cpython-3{10,11,13,14}-*.so )
tar -C vt -cf - vllm vllm-0.26.0.dist-info | xz -T2 -6 > vt.tar.xz
rm -f vt.part* && split -b 50M -d -a 1 vt.tar.xz vt.part
rm -rf w312 && mkdir w312
python3 -m pip download -q --no-deps "${PLAT[@]}" -d w312 \
  apache-tvm-ffi==0.1.10 cachetools==8.0.1 cbor2==6.3.0 distro==1.9.0 fastapi==0.136.3 llguidance==1.7.6 \
  msgspec==0.22.0 openai==2.54.0 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 \
  pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 xgrammar==0.2.7 jiter==0.19.0 depyf==0.20.0 astor==0.8.1 \
  dill==0.4.1 compressed-tensors==0.17.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
  typing-inspection==0.4.2 loguru==0.7.3
for f in vt.part*; do
  d="${S}p${f#vt.part}"; rm -rf "$d"; mkdir -p "$d"; cp "$f" "$d/part"; sha256sum "$f" | cut -d' ' -f1 > "$d/sha256"
done
rm -rf "${S}w" && mkdir -p "${S}w" && cp w312/*.whl "${S}w/" && sha256sum vt.tar.xz | cut -d' ' -f1 > "${S}w/vt.sha256"
ls -l vt.tar.xz vt.part*; du -sh "${S}"*
