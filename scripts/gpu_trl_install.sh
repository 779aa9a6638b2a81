#!/usr/bin/env bash
# Install, on the GPU machine, the TRL wheels that scripts/trl_pack.sh packed, but only those the image lacks.
#   source scripts/gpu_trl_install.sh SHA_FILE PART [PART...]      (sourced: it extends PYTHONPATH)
# PARTs are names in /tmp/vllm_parts (stashed by scripts/gpu_vllm_stash.sh in earlier calls on the same warm
# machine) or carried folders holding `part` + `sha256` (stashed first). Joins them, checks the whole against
# SHA_FILE, unpacks the wheels into /tmp/trlwhl, then for each package TRL needs tries `import` (and its
# minimum version): a package that is missing or too old is installed from its wheel into /tmp/tsite with
# --no-deps; nothing else is touched. /tmp/tsite goes on PYTHONPATH after what is there (vLLM's /tmp/vsite too).
# Prints what it found and what it installed; `trl_ok` says whether `from trl import GRPOTrainer` then works.
trl_install() {
  local sha=$1; shift
  local p files=()
  for p in "$@"; do
    if [ -f "$p/part" ]; then bash "$REPO/scripts/gpu_vllm_stash.sh" "$p" >/dev/null || return 2; p=$(basename "$p"); fi
    [ -f "/tmp/vllm_parts/$p" ] || { echo "trl: part $p is not in /tmp/vllm_parts (not the warm machine?)"; return 2; }
    files+=("/tmp/vllm_parts/$p")
  done
  if [ ! -f /tmp/trlwhl/.done ]; then
    cat "${files[@]}" > /tmp/trl.tar
    echo "$(cat "$sha")  /tmp/trl.tar" | sha256sum -c --quiet - || { echo "trl: the joined parts fail their sha256"; return 2; }
    rm -rf /tmp/trlwhl && mkdir -p /tmp/trlwhl && tar -C /tmp/trlwhl -xf /tmp/trl.tar && rm -f /tmp/trl.tar
    touch /tmp/trlwhl/.done
  fi
  [[ ":$PYTHONPATH:" == *":/tmp/tsite:"* ]] || export PYTHONPATH="$PYTHONPATH:/tmp/tsite"
  # distribution, import name, minimum version (trl 1.16.0's requirements; liger for the log-prob peer)
  local want="trl trl 1.16.0
liger_kernel liger_kernel 0.8.5
accelerate accelerate 1.10.1
datasets datasets 4.7.0
pyarrow pyarrow 21.0.0
pandas pandas 2.1.1
psutil psutil 5.9.4
dill dill 0.3.0
multiprocess multiprocess 0.70.0
xxhash xxhash 0.0.1
fsspec fsspec 2023.1.0
python_dateutil dateutil 2.8.2
tzdata tzdata 2022.7
six six 1.5"
  local missing
  missing=$(cd /tmp && printf '%s\n' "$want" | python3 -P -c '
import importlib, importlib.metadata as md, sys
from packaging.version import Version
for line in sys.stdin:
    dist, mod, low = line.split()
    try:
        importlib.import_module(mod)
        v = md.version(dist.replace("_", "-"))
        ok = Version(v) >= Version(low)
        state = "ok" if ok else "too old (< " + low + ")"
    except Exception as exc:  # noqa: BLE001
        ok, v, state = False, "-", "missing (" + type(exc).__name__ + ")"
    print("  %-16s %-14s %s" % (dist, v, state), file=sys.stderr)
    if not ok:
        print(dist)
')
  local whl=() d
  for d in $missing; do
    f=$(ls /tmp/trlwhl/"${d}"-*.whl 2>/dev/null | head -1)
    [ -n "$f" ] && whl+=("$f") || echo "trl: no wheel carried for $d"
  done
  if [ ${#whl[@]} -gt 0 ]; then
    echo "trl: installing ${#whl[@]} wheel(s) into /tmp/tsite: $(for f in "${whl[@]}"; do basename "$f" | cut -d- -f1-2; done | tr '\n' ' ')"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tsite "${whl[@]}" \
      || { echo "trl: pip install failed"; return 2; }
  fi
  if (cd /tmp && python3 -P -c "from trl import GRPOConfig, GRPOTrainer; import liger_kernel" 2>/tmp/trl_import.err); then
    trl_ok=1; echo "trl: imports"
  else
    trl_ok=0; echo "trl: does not import: $(tail -1 /tmp/trl_import.err)"
  fi
}
trl_install "$@"
