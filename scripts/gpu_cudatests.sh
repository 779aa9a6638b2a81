#!/usr/bin/env bash
# The GPU-only tests (tests/test_rollout_cuda.py and the kernel self-check), each under several switch settings in
# parallel processes on one GPU, so that a failure names the switch that causes it. One call, ~3 minutes.
#   QERL_CT_CONFIGS: ';'-separated env settings, one pytest process each (default below: the defaults, then each
#   issue-25 switch off, then all off); QERL_CT_SELFCHECK=1 also runs the kernel self-check (python -m
#   qerl_cli.bench.kernel_selfcheck, ~5 min); QERL_CT_TESTS: the test files (default tests/test_rollout_cuda.py).
# Files under $OUT: cudatests_<i>.log per config, selfcheck.json/.log; the summary table prints last.
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
job_start gpu_cudatests out/gpu_cudatests 540 nolog
qerl_shim
install_wheels "${QERL_WHL_DIR:-out/rollout_whl}"
export QERL_KERNEL_CACHE=${QERL_KERNEL_CACHE:-/tmp/qerl_plans}
flashinfer_install >/dev/null 2>&1 || true
CONFIGS=${QERL_CT_CONFIGS:-"QERL_DEFAULTS=1;QERL_FUSED_SAMPLING=0;QERL_FUSED_LORA=1;QERL_FUSED_SAMPLING=0 QERL_CUDA_FP4_PLANS=legacy"}
TESTS=${QERL_CT_TESTS:-tests/test_rollout_cuda.py}
IFS=';' read -ra CFG <<< "$CONFIGS"
if [ "${QERL_CT_SELFCHECK:-0}" = 1 ]; then
  (TRITON_INTERPRET=0 timeout 330 python3 -P -m qerl_cli.bench.kernel_selfcheck "$OUT/selfcheck.json" > "$OUT/selfcheck.log" 2>&1) &
fi
i=0
for c in "${CFG[@]}"; do
  # conftest sets TRITON_INTERPRET=1 only when unset: the GPU runs compiled kernels
  (env $c TRITON_INTERPRET=0 timeout 300 python3 -P -m pytest -q -rf --tb=short -p no:cacheprovider $TESTS \
     > "$OUT/cudatests_$i.log" 2>&1) &
  i=$((i + 1))
done
wait
i=0
for c in "${CFG[@]}"; do
  echo "== [$i] $c: $(tail -n 1 "$OUT/cudatests_$i.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/cudatests_$i.log" | head -n 24
  i=$((i + 1))
done
[ -f "$OUT/selfcheck.log" ] && echo "== selfcheck: $(tail -n 1 "$OUT/selfcheck.log")"
true
