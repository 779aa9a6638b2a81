#!/usr/bin/env bash
# Pack TRL 1.16.0 (+ Liger-Kernel 0.8.5) and the packages TRL imports that the GPU image may lack, for the GPU
# machine (no network there; at most ~55 MiB carried per call besides the checkout). Issue 26; docs/bench_step.md
# "TRL on the GPU machine" explains the choices. Run where pip works:
#   bash scripts/trl_pack.sh WORK_DIR STAGE_PREFIX        e.g. bash scripts/trl_pack.sh /work/trl_whl /work/main/.gpu_trl
# Makes STAGE_PREFIXp0 (and p1... with QERL_TRL_PACK_ALL=1; each: `part` + `sha256`, <= 40 MiB; stash them with
# scripts/gpu_vllm_stash.sh like vLLM's parts) and STAGE_PREFIXw/trl.sha256 (of the whole tar). The wheels are
# already zip-compressed (xz gains < 1%), so the tar is split as is. Which of them get installed is decided on the
# GPU machine by trying imports (scripts/gpu_trl_install.sh): only the missing or too old ones.
# Versions: the ones that import together with transformers 5.19 / torch 2.13 here (trl's own pins: accelerate
# >= 1.10.1, datasets >= 4.7, pandas >= 2.1.1, psutil >= 5.9.4, pyarrow >= 21); cp312 manylinux wheels.
set -euo pipefail
W=$1; S=$2
mkdir -p "$W" && cd "$W"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64
      --platform manylinux2010_x86_64 --platform any)
rm -rf w && mkdir w
# only what the GPU image lacks (2026-11-26: it has accelerate, pandas, pyarrow, psutil, xxhash, fsspec, dateutil and
# six at versions TRL accepts): 3 MB, one part, instead of ~80 MB in two. QERL_TRL_PACK_ALL=1 packs the whole set.
PKGS=(trl==1.16.0 liger-kernel==0.8.5 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 tzdata==2026.6)
[ "${QERL_TRL_PACK_ALL:-0}" = 1 ] && PKGS+=(accelerate==1.15.0 pyarrow==26.0.1 pandas==3.1.1 psutil==7.2.2 \
  xxhash==4.1.0 fsspec==2026.9.0 python-dateutil==2.9.0.post0 six==1.17.0)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d w "${PKGS[@]}"
tar -C w -cf trl.tar .
rm -f trl.part* && split -b 40M -d -a 1 trl.tar trl.part
for f in trl.part*; do
  d="${S}p${f#trl.part}"; rm -rf "$d"; mkdir -p "$d"; cp "$f" "$d/part"; sha256sum "$f" | cut -d' ' -f1 > "$d/sha256"
done
rm -rf "${S}w" && mkdir -p "${S}w" && sha256sum trl.tar | cut -d' ' -f1 > "${S}w/trl.sha256"
ls -l trl.tar trl.part*; du -sh "${S}"*
