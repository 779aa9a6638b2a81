"""`qerl bench rollout --episodes TURNS`: what multi-turn episodes cost the builtin engine's throughput.

Random weights never write a tool call, so the workload is synthetic: every sequence runs ``turns`` model turns
of ``new_tokens / turns`` tokens each (the turn ends on its token budget, ``EpisodeHooks.turn_tokens``); after
each turn but the last a synthetic tool sleeps ``tool_latency_ms`` in a worker thread and returns
``observation_tokens`` fixed token ids, which are prefilled into the sequence's slot before it decodes on. The
baseline decodes the same number of model tokens per sequence in one turn, with the same engine, prompts and
seed. Reported: model tokens/s of each (end to end, observations not counted as generated), the loss of the
episodes against the baseline, the time the decode loop sat idle waiting for tools and the time spent
prefilling observations (docs/tools.md and docs/benchmarks.md give the loss the engine is held to).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.rollout.episode import StepResult


class SyntheticTool:
    """Episode hooks: turns of a fixed token budget, a tool that sleeps and answers fixed token ids."""

    stop: tuple[str, ...] = ()

    def __init__(self, turns: int, turn_tokens: int, observation_ids: list[int], latency_s: float,
                 workers: int) -> None:
        self.max_turns = turns
        self.turn_tokens = turn_tokens
        self.observation_ids = observation_ids
        self.latency_s = latency_s
        self.workers = workers

    def wants_step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> bool:
        return turn < self.max_turns

    def step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> StepResult:
        time.sleep(self.latency_s)
        return StepResult(observation_ids=list(self.observation_ids), action=f"turn {turn}")


def check_episode_args(turns: int, new_tokens: int, observation_tokens: int, latency_ms: float) -> None:
    if turns < 1:
        raise QerlError(f"--episodes must be >= 1 turn, got {turns}")
    if new_tokens < turns:
        raise QerlError(f"--new-tokens {new_tokens} is fewer than one token per turn for {turns} turns")
    if observation_tokens < 1 or latency_ms < 0:
        raise QerlError(f"--observation-tokens must be >= 1 and --tool-latency-ms >= 0, got {observation_tokens} "
                        f"and {latency_ms}")


def episode_len(prompt_len: int, new_tokens: int, turns: int, observation_tokens: int) -> int:
    """Tokens one episode holds at most: prompt, model turns and the observations between them."""
    return prompt_len + new_tokens + (turns - 1) * observation_tokens


def measure_episodes(model: Any, tokenizer: Any, *, batch: int, prompts: list[list[int]], prompt_len: int,
                     new_tokens: int, turns: int, observation_tokens: int, latency_ms: float, vocab: int,
                     device: torch.device, gpu_memory_utilization: float, seed: int, warmup: bool,
                     precapture: Callable[..., None]) -> dict[str, Any]:
    """One cell: the single-turn baseline, then the episodes, on one engine of ``batch`` slots."""
    from qerl_cli.rollout import BuiltinEngine, SamplingParams

    turn_tokens = new_tokens // turns
    model_tokens = turn_tokens * turns
    max_len = episode_len(prompt_len, model_tokens, turns, observation_tokens)
    engine = BuiltinEngine(model, tokenizer, max_batch_slots=batch, max_model_len=max_len + 1,
                           gpu_memory_utilization=gpu_memory_utilization, dtype=torch.bfloat16)
    obs = [(seed * 7919 + 31 * i) % vocab for i in range(observation_tokens)]
    hooks = SyntheticTool(turns, turn_tokens, obs, latency_ms / 1000.0, workers=max(1, batch))
    single = SamplingParams(n=1, temperature=1.0, max_tokens=model_tokens, stop_token_ids=[], seed=seed)
    multi = SamplingParams(n=1, temperature=1.0, max_tokens=max_len - prompt_len, stop_token_ids=[], seed=seed)
    try:
        if warmup:
            short = SyntheticTool(2, 2, obs[:4], 0.0, workers=1)
            engine.generate(prompts[:batch], SamplingParams(n=1, max_tokens=8, stop_token_ids=[], seed=seed + 1),
                            episodes=short)
            if device.type == "cuda" and engine.use_graphs:
                precapture(engine, batch, shrinking=True, params=single)
        base = _timed(engine, prompts, single, None, device)
        ep = _timed(engine, prompts, multi, hooks, device)
        slots = engine.num_slots
    finally:
        engine.release()
    return _cell(base, ep, batch=batch, turns=turns, turn_tokens=turn_tokens, latency_ms=latency_ms,
                 observation_tokens=observation_tokens, slots=slots)


def _timed(engine: Any, prompts: list[list[int]], params: Any, hooks: Any, device: torch.device) -> Any:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return engine.generate(prompts, params, episodes=hooks)


def _cell(base: Any, ep: Any, *, batch: int, turns: int, turn_tokens: int, latency_ms: float,
          observation_tokens: int, slots: int) -> dict[str, Any]:
    def rates(res: Any) -> dict[str, float]:
        t = res.timings
        decode_tokens = t["tokens"] - len(res.samples)  # each sample's first token comes from a prefill
        return {"e2e_tok_s": t["tokens"] / t["total_s"], "decode_tok_s": decode_tokens / t["decode_s"],
                "total_s": t["total_s"], "tokens": t["tokens"]}

    b, e = rates(base), rates(ep)
    turns_seen = [len(s.observation_spans) + 1 for s in ep.samples]
    return {
        "e2e_tok_s": e["e2e_tok_s"], "decode_tok_s": e["decode_tok_s"], "total_s": e["total_s"],
        "tokens": int(e["tokens"]), "sequences": len(ep.samples), "num_slots": slots,
        "prefill_tok_s": None, "ttft_s": ep.timings.get("ttft"), "decode_steps": ep.stats.get("decode_steps"),
        "decode_ms_per_step": None, "kv_room": None,
        "episodes": {
            "turns": turns, "turn_tokens": turn_tokens, "tool_latency_ms": latency_ms,
            "observation_tokens": observation_tokens, "turns_mean": sum(turns_seen) / max(1, len(turns_seen)),
            "single_turn_e2e_tok_s": b["e2e_tok_s"], "single_turn_decode_tok_s": b["decode_tok_s"],
            "single_turn_total_s": b["total_s"], "episode_e2e_tok_s": e["e2e_tok_s"],
            "loss_pct": 100.0 * (1.0 - e["e2e_tok_s"] / b["e2e_tok_s"]) if b["e2e_tok_s"] else None,
            "tool_wait_s": ep.timings.get("tool_wait_s"), "resume_s": ep.timings.get("resume_s"),
            "resume_batches": ep.stats.get("resume_batches"), "parked_max": ep.stats.get("parked_max"),
            "batch": batch,
        },
    }


def summary_lines(res: dict[str, Any]) -> list[str]:
    """One line per episode cell: both throughputs, the loss and where the time went."""
    lines = []
    for c in res["results"]:
        ep = c.get("episodes")
        if not ep:
            continue
        lines.append(f"episodes {c['format']} batch {c['batch']}: {ep['turns']} turns x {ep['turn_tokens']} tokens, "
                     f"tool {ep['tool_latency_ms']:g} ms, {ep['observation_tokens']} observation tokens: "
                     f"{ep['episode_e2e_tok_s']:,.0f} vs {ep['single_turn_e2e_tok_s']:,.0f} tok/s single-turn "
                     f"(loss {ep['loss_pct']:.1f}%; idle waiting for tools {ep['tool_wait_s']:.2f} s, observations "
                     f"prefilled in {ep['resume_s']:.2f} s)")
    return lines
