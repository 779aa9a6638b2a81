#!/usr/bin/env bash
# Stash one carried part of the vLLM transfer on the warm GPU machine (issue 15).
#   bash scripts/gpu_vllm_stash.sh DIR [DIR...]     # each DIR holds `part` and `sha256` (of that part)
# Checks each part against its sha256 and moves it to /tmp/vllm_parts/<basename of DIR> (that survives while
# the machine stays warm: 30 s after each call), then prints what /tmp/vllm_parts holds. A part that fails its
# check is not kept, and the script exits 1. scripts/vllm_pack.sh makes the parts; gpu_vllm_run.sh joins them.
set -uo pipefail
mkdir -p /tmp/vllm_parts
rc=0
for d in "$@"; do
  name=$(basename "$d")
  if [ ! -f "$d/part" ] || [ ! -f "$d/sha256" ]; then echo "stash: $d has no part/sha256"; rc=1; continue; fi
  if echo "$(cat "$d/sha256")  $d/part" | sha256sum -c --quiet -; then
    mv -f "$d/part" "/tmp/vllm_parts/$name" && cp "$d/sha256" "/tmp/vllm_parts/$name.sha256"
  else
    echo "stash: $name does not match its sha256 (transfer broken?): not kept"; rc=1
  fi
done
echo "== /tmp/vllm_parts on $(hostname), uptime $(cut -d' ' -f1 /proc/uptime) s"
ls -l /tmp/vllm_parts
exit $rc
