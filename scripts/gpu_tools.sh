#!/usr/bin/env bash
# The two GPU targets of multi-turn episodes (docs/tools.md). Same machine rules as scripts/gpu_evidence.sh: no
# network, no qerl install (path shim under /tmp/qk), wheels from $QERL_WHL_DIR (default out/rollout_whl), the
# embedded GGUF in two parts (scripts/gpu_common.sh embedded_gguf). Stages (QERL_TOOLS_STAGES, in this order):
#
#   stash   (a short first call, carrying out/rollout_gguf_a and out/rollout_whl) GGUF part A into /tmp/qk_gguf
#   bench   the throughput target: Qwen2.5-7B shape, nvfp4 and bf16 at batch 64, 256 prompt + 1024 model tokens,
#           4 turns of 256 tokens with a 50 ms tool and 32-token observations between them, against single-turn
#           decoding of the same 1024 tokens (qerl bench rollout --episodes 4): the loss must be <= 15%
#           (out: ep7b/rollout.json; its targets list says met or missed)
#   arith   the learning target (carry out/rollout_gguf_b too, same warm machine as stash): the embedded SmolLM2
#           quantized to NVFP4 once, then per seed s in 0..$QERL_TOOLS_SEEDS-1 two runs side by side on the GPU,
#           the gpu_arith preset ($QERL_TOOLS_STEPS steps) with and without the calculator:
#             tool_s<s>:  --tools calculator --max-turns 2 --max-episode-tokens 32
#             plain_s<s>: the preset as is (8 tokens)
#           each scored on $QERL_TOOLS_HELDOUT held-out arith problems (test split) x 8 samples at T = 1, before
#           (--checkpoint base) and after training, the tool arm with the tool on; then scripts/tools_target.py:
#           mean and 95% interval over seeds per arm, and the Welch interval of (tool - plain)
#           (out: tools_target.json, tools_runs.tgz with every metrics file, eval result and log)
# CPU dry run of the arith plumbing (numbers meaningless, ~10 min on 2 cores):
#   QERL_TOOLS_CPU=1 QERL_TOOLS_STAGES=arith OUT=/tmp/tools_cpu bash scripts/gpu_tools.sh
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
mkdir -p /tmp/qk_gguf
STAGES=${QERL_TOOLS_STAGES:-bench arith}
CPU=${QERL_TOOLS_CPU:-0}
if [ "$CPU" = 1 ]; then job_start gpu_tools out/gpu_tools 3600; else job_start gpu_tools out/gpu_tools 570; fi
qerl_shim
[ "$CPU" = 1 ] || install_wheels "${QERL_WHL_DIR:-out/rollout_whl}"

if has stash; then
  [ -f out/rollout_gguf_a/part_a ] && cp out/rollout_gguf_a/part_a /tmp/qk_gguf/part_a && echo "GGUF part A stashed"
  (cd /tmp && python3 -c "import qerl_cli.tools.episodes, qerl_cli.train.trainer; print('qerl imports')")
fi

if has bench; then
  stamp "bench: 7B shape, 4-turn episodes vs single-turn ($(left)s left)"
  qerl $(( $(left) > 300 ? 280 : $(left) - 20 )) bench rollout --shape qwen2.5-7b --formats nvfp4,bf16 --batches 64 \
    --prompt-len 256 --new-tokens 1024 --episodes 4 --tool-latency-ms 50 --observation-tokens 32 --out "$OUT/ep7b" \
    2>&1 | tail -n 30
  rm -f "$OUT/ep7b/rollout.png"
fi

if has arith; then
  if [ "$CPU" = 1 ]; then
    SEEDS=${QERL_TOOLS_SEEDS:-1}; STEPS=${QERL_TOOLS_STEPS:-1}; HELDOUT=${QERL_TOOLS_HELDOUT:-4}
    SIZE="--batch-prompts 2 --num-generations 2 --micro-batch-size 8 --precision fp32 --no-aqn"; SAMPLES=2
  else
    embedded_gguf || { stamp "the embedded GGUF is not here: run QERL_TOOLS_STAGES=stash first"; exit 3; }
    SEEDS=${QERL_TOOLS_SEEDS:-4}; STEPS=${QERL_TOOLS_STEPS:-30}; HELDOUT=${QERL_TOOLS_HELDOUT:-100}
    SIZE="--gpu-memory-utilization 0.08"; SAMPLES=8
  fi
  T=${QERL_TOOLS_DIR:-/tmp/tools}
  rm -rf "$T"; mkdir -p "$T"
  stamp "arith: quantize the embedded model ($(left)s left)"
  qerl 600 quantize --run "$T/q" --format nvfp4 >"$T/quantize.log" 2>&1 || { tail -5 "$T/quantize.log"; exit 4; }
  EVAL="--limit $HELDOUT --samples $SAMPLES --temperature 1.0 --json"
  arm() {  # arm seed: train, then score base and trained on the held-out problems
    local name=$1_s$2 extra="" ev=""
    [ "$1" = tool ] && extra="--tools calculator --max-turns 2 --max-episode-tokens 32" \
      && ev="--tools calculator --max-turns 2 --max-tokens 32"
    cp -r "$T/q" "$T/$name"
    # shellcheck disable=SC2086
    {
      qerl 0 eval arith --run "$T/$name" --checkpoint base $EVAL $ev >/dev/null
      qerl 0 train --run "$T/$name" --config gpu_arith --steps "$STEPS" --seed "$2" --save-steps "$STEPS" \
        --no-log-rollouts $SIZE $extra
      qerl 0 eval arith --run "$T/$name" $EVAL $ev >/dev/null
    } >"$T/$name.log" 2>&1
  }
  PIDS=()
  for ((s = 0; s < SEEDS; s++)); do
    for a in tool plain; do
      if [ "$CPU" = 1 ]; then arm "$a" "$s"; else arm "$a" "$s" & PIDS+=($!); fi
    done
  done
  (( ${#PIDS[@]} )) && wait "${PIDS[@]}"
  stamp "arith: runs done ($(left)s left)"
  for f in "$T"/*_s*.log; do echo "=== $f"; grep -v "^step" "$f" | tail -n 4; done
  (cd /tmp && python3 "$REPO/scripts/tools_target.py" "$T" --out "$OUT/tools_target.json")
  (cd "$T" && tar czf "$OUT/tools_runs.tgz" ./*.log ./*_s*/train/metrics.jsonl ./*_s*/eval/*.json 2>/dev/null)
fi
stamp done
