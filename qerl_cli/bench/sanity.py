"""`qerl bench sanity`: steps until training accuracy passes 95% on the model's perfectible problems.

(i) The perfectible subset, chosen before any training: ``candidates`` problems of the run's task
(``--set task=arith|gsm8k|math``; a problem drawn twice counts once) are each sampled ``samples`` times
(default 40) with the builtin engine by every ARM of the grid -- each (weight format, precision) pair a cell
trains in -- with no adapter (a fresh LoRA has B = 0, so this is each arm's initial policy), scored with the
task's reward, and the problems that every arm solves a fraction in [``lo``, ``hi``] (default [0.2, 0.8]) of
the time are kept: the intersection of the arms' bands, so that the set favours no arm. The subset is saved as
``perfectible.json`` (every candidate's pass rate per arm, the rule in words, the source task, the model hash,
the sampling settings) and reused by a later bench with the same settings on the same model.

(ii) Each grid cell trains from the same initial adapter (same seed) on that subset: a ``Trainer`` with
the subset injected as its task (``Trainer.setup(task=...)``), the cell's TrainConfig, and the model in
the cell's ``format`` (the run's own, or a copy quantized from the run's source, bench/runmodels.py).
Per cell: training accuracy per step, the first step whose accuracy exceeds ``threshold`` (or "not
reached" with the final and best plateau: means over the last / best ``window`` steps), whether it
collapsed (a non-finite loss, or the plateau falling by ``collapse_drop`` after its best), wall time.

With ``seeds`` > 1 every cell runs once per seed (``seed_start``, ``seed_start + 1``, ...: the LoRA init,
the prompt order and the rollout sampling change; the subset and the model do not), ``heldout`` > 0 scores
the policy on that many held-out problems (the task's test split), ``heldout_samples`` samples each, before
the first step and after the last (same sampling seed: the gain is paired within the run), and ``cells`` in
the JSON holds per cell the mean and 95% interval over seeds of each per-seed scalar (:func:`seed_scalars`;
statistics in bench/stats.py, the claims compared in bench/evidence.py).

(iii) ``sanity.json``, ``sanity.png`` (accuracy vs step per cell), each written atomically, last.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qerl_cli.bench import harness
from qerl_cli.bench.harness import figure, num, save_figure
from qerl_cli.errors import QerlError
from qerl_cli.manifest import jsonable, read_regular_text
from qerl_cli.precision import dtype_of

SCHEMA = 1
THRESHOLD = 0.95
WINDOW = 3
COLLAPSE_DROP = 0.3
EARLY_STEPS = 3  # "early" entropy/reward: the mean over the first EARLY_STEPS steps
# AQN's first stage has sigma 0 (QeRL's schedule), so AQN's effect is read over the first AQN_WINDOW steps of
# stage 1 onwards ("noisy" entropy/reward), the same steps for cells with AQN off
AQN_WINDOW = 4
HELDOUT_SAMPLES = 32  # samples per held-out problem (T = the training temperature)
HELDOUT_SLOTS = 256  # concurrent sequences of the held-out scoring engine
# per-step series kept for every cell: name in the row -> trainer metric
SERIES = {"accuracy": "accuracy", "reward": "reward/raw_mean", "loss": "loss", "entropy": "entropy",
          "sampling_entropy": "sampling/entropy", "k3": "sampling/k3", "applied_noise_norm": "aqn/applied_noise_norm",
          "mean_length": "completions/mean_length", "replay_disagreement": "router/replay_disagreement"}


def default_config(device: torch.device) -> dict[str, Any]:
    """The bench's TrainConfig defaults (quick_cpu-sized on CPU); --set values go on top."""
    return {
        "task": "arith", "batch_prompts": 8, "num_generations": 8, "max_completion_length": 8, "lr": 2e-4,
        "lora_rank": 16, "precision": "bf16" if device.type == "cuda" else "fp32", "steps": 20,
        "micro_batch_size": 32, "save_steps": 10**9, "log_rollouts": False, "aqn_stages": 4,
    }


def select_perfectible(pass_rates: Sequence[float], lo: float = 0.2, hi: float = 0.8) -> list[int]:
    """Indices of the problems whose pass rate lies in [lo, hi] (both ends included)."""
    if not (0.0 <= lo <= hi <= 1.0):
        raise QerlError(f"the perfectible band needs 0 <= lo <= hi <= 1, got lo={lo}, hi={hi}")
    return [i for i, r in enumerate(pass_rates) if lo <= r <= hi]


def select_for_arms(rates: dict[str, Sequence[float]], lo: float = 0.2, hi: float = 0.8) -> list[int]:
    """Indices of the problems whose pass rate lies in [lo, hi] for every arm (the intersection of the bands)."""
    per_arm = [set(select_perfectible(r, lo, hi)) for r in rates.values()]
    return sorted(set.intersection(*per_arm)) if per_arm else []


def curve_summary(acc: Sequence[float], threshold: float = THRESHOLD, window: int = WINDOW,
                  collapse_drop: float = COLLAPSE_DROP) -> dict[str, Any]:
    """Steps to threshold (1-based, None if never), final/best plateau (window means), collapse flag."""
    vals = [float(a) for a in acc]
    reached = next((i + 1 for i, a in enumerate(vals) if a > threshold), None)
    if not vals:
        return {"steps_to_threshold": None, "final": None, "best": None, "collapsed": False}
    w = max(1, min(window, len(vals)))
    means = [sum(vals[i:i + w]) / w for i in range(len(vals) - w + 1)]
    best_i = max(range(len(means)), key=lambda i: means[i])
    collapsed = any(math.isnan(a) for a in vals) or (means[best_i] - means[-1] >= collapse_drop
                                                     and best_i < len(means) - 1)
    return {"steps_to_threshold": reached, "final": means[-1], "best": means[best_i], "collapsed": collapsed}


def late_steps(n: int) -> int:
    """How many final steps "late" accuracy averages: the last quarter of the run, at least WINDOW steps."""
    return max(WINDOW, n // 4)


def seed_scalars(row: dict[str, Any], early: int = EARLY_STEPS) -> dict[str, float | None]:
    """The per-seed numbers the evidence study compares (None when the row lacks their series).

    ``steps_to_threshold`` is censored at steps_run + 1 when never reached (a lower bound, so a cell that never
    gets there counts as slower than one that did on its last step); ``late_accuracy`` is the mean training
    accuracy over the last quarter of the steps (:func:`late_steps`); ``heldout_gain`` is held-out accuracy after
    the last step minus before the first (same problems, same sampling seed); ``initial_*`` are step 1's values
    (the rollouts of the untrained policy: no update has happened yet); ``k3_growth`` is the mean mismatch k3 of
    the last quarter of the steps minus that of the first quarter; ``noisy_*`` are means over the AQN_WINDOW
    steps from ``aqn_first_noisy_step`` (0-based; the first step of AQN stage 1 under the cell's schedule) and
    ``post_noise_reward`` the mean training reward over the steps after that window. ``sampling_entropy`` is
    the entropy of the distribution the rollout engine sampled from (under AQN, the noisy policy's);
    ``entropy`` the clean training policy's. ``mean_reward`` is the mean training reward over every step (the
    reward curve's level), ``replay_disagreement`` the mean of ``router/replay_disagreement`` over the steps (a
    mixture of experts only) and ``mean_k3`` the mean mismatch k3 over the steps (the W4A8 A/B's sign that its
    rollouts ran other numbers).
    """
    def mean(xs: Sequence[float | None]) -> float | None:
        v = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
        return sum(v) / len(v) if v else None

    def first(xs: Sequence[float | None] | None) -> float | None:
        return mean((xs or [])[:1])

    n = row.get("steps_run", len(row.get("accuracy", [])))
    reached = row.get("steps_to_threshold")
    acc = row.get("accuracy") or []
    k3 = row.get("k3") or []
    q = max(1, len(k3) // 4)
    w0 = int(row.get("aqn_first_noisy_step") or 0)
    k3_first, k3_last = mean(k3[:q]), mean(k3[-q:])
    before, after = row.get("heldout_before"), row.get("heldout")
    return {
        "steps_to_threshold": float(reached) if reached else (float(n + 1) if n else None),
        "final": row.get("final"),
        "late_accuracy": mean(acc[-late_steps(len(acc)):]) if acc else None,
        "heldout_before": before,
        "heldout": after,
        "heldout_gain": None if before is None or after is None else after - before,
        "initial_entropy": first(row.get("entropy")),
        "initial_sampling_entropy": first(row.get("sampling_entropy")),
        "early_entropy": mean((row.get("entropy") or [])[:early]),
        "early_reward": mean((row.get("reward") or [])[:early]),
        "noisy_entropy": mean((row.get("entropy") or [])[w0:w0 + AQN_WINDOW]),
        "noisy_sampling_entropy": mean((row.get("sampling_entropy") or [])[w0:w0 + AQN_WINDOW]),
        "noisy_reward": mean((row.get("reward") or [])[w0:w0 + AQN_WINDOW]),
        "post_noise_reward": mean((row.get("reward") or [])[w0 + AQN_WINDOW:]),
        "noisy_applied_noise_norm": mean((row.get("applied_noise_norm") or [])[w0:w0 + AQN_WINDOW]),
        "k3_first": k3_first,
        "k3_last": k3_last,
        "k3_growth": None if k3_first is None or k3_last is None else k3_last - k3_first,
        "collapsed": float(bool(row.get("collapsed"))),
        # the routing-replay A/B (a MoE model): the whole reward curve's level, and how often the update's own
        # routing differed from the rollout's (None for a dense model, which logs no router/*)
        "mean_reward": mean(row.get("reward") or []),
        "replay_disagreement": mean(row.get("replay_disagreement") or []),
        "mean_k3": mean(k3),
    }


def is_outcome(row: dict[str, Any]) -> bool:
    """Whether a cell's row is a training outcome: it ran ("ok"), or its loss went non-finite (a collapse is
    data). A failure of the machine (out of memory, an error, skipped for time) says nothing about the method."""
    status = str(row.get("status", "ok"))
    return status == "ok" or status.startswith("non-finite")


def summarize_cells(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per cell label: the seeds that gave an outcome and, per seed scalar, its mean and 95% interval over them;
    ``failed`` lists the other seeds with their status (an OOM is no seed of evidence)."""
    from qerl_cli.bench.stats import mean_ci

    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["label"], []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for label, rs in by.items():
        ok = [r for r in rs if is_outcome(r)]
        scal = [seed_scalars(r) for r in ok]
        keys = (scal[0] if scal else seed_scalars(rs[0])).keys()  # every cell failed: still name its columns
        out[label] = {"cell": rs[0]["cell"], "seeds": [r.get("seed") for r in ok],
                      "failed": [f"{r.get('seed')}: {r.get('status')}" for r in rs if not is_outcome(r)],
                      "metrics": {k: mean_ci([s[k] for s in scal]) for k in keys}}
    return out


def measure_pass_rates(model: Any, tok: Any, task: Any, *, samples: int, max_tokens: int, temperature: float,
                       seed: int, max_prompt_length: int, chat_template: bool, dtype: torch.dtype,
                       reward: str | None = None, truncate_prompts: bool = False) -> list[float]:
    """Fraction of ``samples`` sampled completions per problem that ``reward`` (default: the task's) scores as
    correct."""
    from qerl_cli.rollout import BuiltinEngine, SamplingParams
    from qerl_cli.tasks import get_reward
    from qerl_cli.tasks.prompt_ids import encode_prompt
    from qerl_cli.tasks.rewards import safe_rewards

    add_bos = not chat_template and bool(getattr(tok, "add_bos_token", False))  # as train/rollouter.py's encode_prompt
    prompt_ids = [encode_prompt(tok, e.prompt, max_tokens=max_prompt_length, add_bos=add_bos,
                                truncate=truncate_prompts, where=f"the prompt of task example {i} (0-based)")
                  for i, e in enumerate(task.examples)]
    engine = BuiltinEngine(model, tok, max_batch_slots=min(256, len(prompt_ids) * samples),
                           max_model_len=max(len(p) for p in prompt_ids) + max_tokens + 1, dtype=dtype)
    try:
        res = engine.generate(prompt_ids, SamplingParams(n=samples, temperature=temperature, max_tokens=max_tokens,
                                                         stop=list(task.stop), seed=seed))
    finally:
        engine.release()
    ex = task.examples
    rewards = safe_rewards(get_reward(reward or task.reward), [ex[s.prompt_index].prompt for s in res.samples],
                           [s.text or "" for s in res.samples], answer=[ex[s.prompt_index].answer for s in res.samples])
    hits = [0] * len(ex)
    for s, r in zip(res.samples, rewards, strict=True):
        hits[s.prompt_index] += r >= 1.0 - 1e-6
    return [h / samples for h in hits]


class ModelCache:
    """The models loaded so far, by (format, dtype): cells copy them instead of reloading (and re-dequantizing
    on CPU); a grid over formats keeps each of its (small) models once."""

    def __init__(self, run: Any, out: Path, device: torch.device, log: Callable[[str], None]) -> None:
        self.run, self.out, self.device, self.log = run, out, device, log
        self.models: dict[tuple[str, torch.dtype], tuple[Any, Any]] = {}

    def get(self, fmt: str, dtype: torch.dtype) -> tuple[Any, Any]:
        from qerl_cli.bench.runmodels import format_model_dir
        from qerl_cli.models import load_model

        if (fmt, dtype) not in self.models:
            self.models[(fmt, dtype)] = load_model(str(format_model_dir(self.run, fmt, self.out, self.log)),
                                                   dtype=dtype, device=self.device)
        return self.models[(fmt, dtype)]


def arm_label(arm: tuple[str, str]) -> str:
    return f"{arm[0]}/{arm[1]}"


def subset_rule(subset: dict[str, Any]) -> str:
    """The selection rule of a perfectible subset, in words (for the result files and the manifest)."""
    k = subset["key"]
    arms = [arm_label(tuple(a)) for a in k.get("arms") or []]
    who = f"every arm ({', '.join(arms)})" if len(arms) > 1 else (f"the arm {arms[0]}" if arms else "the model")
    return (f"the {len(subset['selected'])} of {len(subset['problems'])} distinct {subset['source_task']} training "
            f"problems (level {k.get('task_level')}, candidates drawn with seed {k['seed']}) that {who} solved in "
            f"[{k['lo']:g}, {k['hi']:g}] of {k['samples']} samples at T = {k['temperature']:g}, "
            f"{k['max_tokens']} tokens, measured before any training")


def task_reward(cfg: Any) -> tuple[str, list[str]]:
    """The reward the command scores with (``--set reward=...``, else the task's own) and the task's stop strings.

    Both come from the command line and qerl's task code, never from a saved subset: a run directory is shared and
    downloaded, and a reward named in a file there would be imported (run) by the next bench."""
    from qerl_cli.tasks import load_task

    # no chat template and one problem: the reward and stop strings depend on neither, and no tokenizer is needed
    task = load_task(cfg.task, split="train", shots=cfg.shots, seed=cfg.seed, level=cfg.task_level, limit=1)
    return cfg.reward or task.reward, list(task.stop)


def subset_key(run: Any, cfg: Any, *, candidates: int, samples: int, lo: float, hi: float, temperature: float,
               arms: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Everything that decides a perfectible subset: a saved one is reused only when its key equals this."""
    from qerl_cli.bench.runmodels import model_hash
    from qerl_cli.manifest import sha256_file

    _, _, data = cfg.task.partition(":")
    data_file = Path(data).expanduser() if cfg.task.lower().startswith("jsonl:") else None
    return {"task": cfg.task, "task_level": cfg.task_level, "shots": cfg.shots, "chat_template": cfg.chat_template,
            "task_data_sha256": sha256_file(data_file) if data_file is not None and data_file.is_file() else None,
            "reward": cfg.reward, "model_hash": model_hash(run), "candidates": candidates, "samples": samples,
            "lo": lo, "hi": hi, "temperature": temperature, "max_tokens": cfg.max_completion_length,
            "max_prompt_length": cfg.max_prompt_length, "seed": cfg.seed, "arms": [list(a) for a in arms]}


def saved_subset(path: Path, key: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any] | None:
    """A saved subset whose key equals ``key``, as data only: prompts, answers and pass rates (the selection is
    recomputed from the rates); None (it is rebuilt) when it is absent, malformed or was built for other settings."""
    if not path.is_file():
        return None
    try:
        old = json.loads(read_regular_text(path))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        old = None
    if not isinstance(old, dict) or not isinstance(old.get("key"), dict):
        log(f"{path} is not a perfectible subset: building a new one")
        return None
    if old["key"] != key:
        differ = sorted(k for k in {*key, *old["key"]} if old["key"].get(k) != key.get(k))
        log(f"{path} was built for other settings ({', '.join(differ)}): building a new one")
        return None
    arms = [arm_label(tuple(a)) for a in key["arms"]]
    problems = old.get("problems")

    def rate(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and 0.0 <= v <= 1.0

    if not isinstance(problems, list) or not isinstance(old.get("source_task"), str) or not all(
            isinstance(q, dict) and isinstance(q.get("prompt"), str) and isinstance(q.get("answer"), str)
            and isinstance(q.get("pass_rates"), dict) and all(rate(q["pass_rates"].get(a)) for a in arms)
            for q in problems):
        log(f"{path} is not a complete perfectible subset: building a new one")
        return None
    rates = {a: [q["pass_rates"][a] for q in problems] for a in arms}
    return {**old, "problems": [{"index": i, "prompt": q["prompt"], "answer": q["answer"],
                                 "pass_rate": sum(q["pass_rates"][a] for a in arms) / len(arms),
                                 "pass_rates": {a: q["pass_rates"][a] for a in arms}} for i, q in enumerate(problems)],
            "selected": select_for_arms(rates, key["lo"], key["hi"])}


def build_subset(run: Any, cfg: Any, *, candidates: int, samples: int, lo: float, hi: float, temperature: float,
                 out: Path, models: ModelCache, log: Callable[[str], None],
                 arms: Sequence[tuple[str, str]] | None = None) -> dict[str, Any]:
    """The perfectible subset: the candidates every arm (format, precision) solves in [lo, hi] of its samples
    (reused from ``out/perfectible.json`` when its key matches; the reward and stop strings always come from this
    command). ``arms`` defaults to the run's format in ``cfg.precision``."""
    from qerl_cli.bench.runmodels import run_format
    from qerl_cli.manifest import RunDir, atomic_write_json
    from qerl_cli.tasks import load_task

    arm_list = [tuple(a) for a in (arms or [(run_format(run), cfg.precision)])]
    key = subset_key(run, cfg, candidates=candidates, samples=samples, lo=lo, hi=hi, temperature=temperature,
                     arms=arm_list)
    reward, stop = task_reward(cfg)
    path = RunDir(out).inside("perfectible.json")  # the bench's folder: a link leading out of it is refused
    old = saved_subset(path, key, log)
    if old is not None:
        log(f"reusing the perfectible subset in {path} ({len(old['selected'])} of {candidates} problems)")
        subset = {**old, "reward": reward, "stop": stop}
        return {**subset, "rule": subset_rule(subset)}
    model, tok = models.get(*_arm_model(arm_list[0]))
    task = load_task(cfg.task, split="train", shots=cfg.shots, chat_template=cfg.chat_template, tokenizer=tok,
                     seed=cfg.seed, level=cfg.task_level, limit=candidates)
    seen: set[str] = set()
    examples = []
    for e in task.examples[:candidates]:  # a small pool repeats problems: each is one candidate
        if e.prompt not in seen:
            seen.add(e.prompt)
            examples.append(e)
    task.examples = examples
    if not examples:
        raise QerlError(f"task {cfg.task} has no training problems to build the perfectible subset from")
    t0 = time.perf_counter()
    rates: dict[str, list[float]] = {}
    for arm in arm_list:
        log(f"sampling {samples} completions for each of {len(examples)} {task.name} problems ({arm_label(arm)}) ...")
        fmt, dtype = _arm_model(arm)
        model, tok = models.get(fmt, dtype)
        rates[arm_label(arm)] = measure_pass_rates(
            model, tok, task, samples=samples, max_tokens=cfg.max_completion_length, temperature=temperature,
            seed=cfg.seed, max_prompt_length=cfg.max_prompt_length, chat_template=cfg.chat_template, dtype=dtype,
            reward=reward, truncate_prompts=cfg.truncate_prompts)
    selected = select_for_arms(rates, lo, hi)
    subset = {
        "schema": SCHEMA, "kind": "bench/sanity/perfectible", "key": key, "source_task": task.name,
        "reward": reward, "stop": stop, "wall_s": time.perf_counter() - t0,
        "problems": [{"index": i, "prompt": e.prompt, "answer": e.answer,
                      "pass_rate": sum(r[i] for r in rates.values()) / len(rates),
                      "pass_rates": {a: r[i] for a, r in rates.items()}} for i, e in enumerate(examples)],
        "selected": selected,
        "selected_per_arm": {a: len(select_perfectible(r, lo, hi)) for a, r in rates.items()},
    }
    subset["rule"] = subset_rule(subset)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, jsonable(subset))
    log(f"perfectible subset: {subset['rule']} -> {path}")
    return subset


def _arm_model(arm: Sequence[str]) -> tuple[str, torch.dtype]:
    return arm[0], dtype_of(arm[1])


def _subset_task(subset: dict[str, Any], stop: bool = True) -> Any:
    """The subset as a Task; stop=False drops the stop strings (every completion runs to max length)."""
    from qerl_cli.tasks.datasets import Example, Task

    rows = {p["index"]: p for p in subset["problems"]}
    examples = [Example(rows[i]["prompt"], rows[i]["answer"], {"pass_rate": rows[i]["pass_rate"]})
                for i in subset["selected"]]
    return Task(f"perfectible:{subset['source_task']}", "train", examples, subset["reward"],
                tuple(subset["stop"]) if stop else (), lambda q: q, max_new_tokens=subset["key"]["max_tokens"])


def heldout_accuracy(trainer: Any, task: Any, samples: int = HELDOUT_SAMPLES) -> float:
    """Mean accuracy of the trainer's current policy (its rollout engine without AQN noise, adapters applied) on a
    held-out task, ``samples`` samples per problem at the training temperature, with a seed that no training step
    draws (so a score before the first step and one after the last sample with the same noise keys)."""
    from qerl_cli.rollout import SamplingParams
    from qerl_cli.tasks import get_reward
    from qerl_cli.tasks.rewards import safe_rewards
    from qerl_cli.train.rollouter import encode_prompt

    c = trainer.cfg
    engine = trainer.engine
    ids = [encode_prompt(c, trainer.tokenizer, e.prompt) for e in task.examples]
    # more slots than a training step's for these few hundred short sequences (the cache is sized at the next
    # generate and given back after it); the engine's own modules, so the plan it runs is the trainer's
    slots = getattr(engine, "max_batch_slots", None)  # the builtin engine's; vLLM sizes its own batches
    engine.release()
    if slots is not None:
        engine.max_batch_slots = max(slots, min(HELDOUT_SLOTS, len(ids) * samples))
    try:
        res = engine.generate(ids, SamplingParams(n=samples, temperature=c.temperature,
                                                  max_tokens=c.max_completion_length, stop=list(task.stop),
                                                  seed=c.seed + 10**6))
    finally:
        engine.release()
        if slots is not None:
            engine.max_batch_slots = slots
    ex = task.examples
    rewards = safe_rewards(get_reward(task.reward), [ex[s.prompt_index].prompt for s in res.samples],
                           [s.text or "" for s in res.samples], answer=[ex[s.prompt_index].answer for s in res.samples])
    return sum(r >= 1.0 - 1e-6 for r in rewards) / max(1, len(rewards))


def cell_label(cell: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in cell.items()) or "base"


def cell_matches(cell: dict[str, Any], sel: dict[str, Any]) -> bool:
    """Whether ``cell`` has every key of ``sel`` with that value (compared as lower-case text)."""
    return all(k in cell and str(cell[k]).lower() == str(v).lower() for k, v in sel.items())


def _run_cell(run: Any, cell: dict[str, Any], cfg: Any, subset: dict[str, Any], models: ModelCache,
              device: torch.device, log: Callable[[str], None], *, heldout: Any = None,
              heldout_samples: int = HELDOUT_SAMPLES, stop: bool = True) -> dict[str, Any]:
    from qerl_cli.bench.runmodels import run_format
    from qerl_cli.manifest import RunDir
    from qerl_cli.train.trainer import Trainer
    from qerl_cli.train.updater import NonFiniteLoss

    fmt = cell.get("format", run_format(run))
    label = cell_label(cell)
    from qerl_cli.train.aqn import aqn_stage

    first_noisy = next((i for i in range(cfg.steps) if aqn_stage(i, cfg.steps, cfg.aqn_stages) >= 1), cfg.steps)
    row: dict[str, Any] = {"cell": cell, "label": label, "format": fmt, "seed": cfg.seed, "heldout_before": None,
                           "heldout": None, "aqn_first_noisy_step": first_noisy, **{k: [] for k in SERIES}}
    t0 = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="qerl-sanity-"))
    trainer = model = None
    try:
        base, tok = models.get(fmt, dtype_of(cfg.precision))
        model = copy.deepcopy(base)  # LoRA attaches in place; every cell starts from the same weights
        trainer = Trainer(RunDir(scratch), cfg, device=str(device))
        trainer.setup(model=model, tokenizer=tok, task=_subset_task(subset, stop))
        if heldout is not None:
            row["heldout_before"] = heldout_accuracy(trainer, heldout, heldout_samples)
        status = "ok"
        for _ in range(cfg.steps):
            try:
                m = trainer.train_step()
            except NonFiniteLoss as exc:
                row["accuracy"].append(float("nan"))
                status = f"non-finite: {exc}"
                break
            for k, name in SERIES.items():
                v = m.get(name)
                row[k].append(None if v is None else float(v))
            log(f"[{label} seed {cfg.seed}] step {trainer.step}: accuracy {m['accuracy']:.3f}")
        if heldout is not None and status == "ok":
            row["heldout"] = heldout_accuracy(trainer, heldout, heldout_samples)
        row["status"] = status
    except Exception as exc:  # noqa: BLE001 - recorded per cell (with the steps it ran), the grid goes on
        if isinstance(exc, QerlError) and "run directory" in str(exc):
            raise
        row["status"], row["note"] = harness.failure_status(exc), harness.failure_note(exc)
        log(f"[{label} seed {cfg.seed}] {row['status']}: {row['note']}")
    finally:
        if trainer is not None and getattr(trainer, "engine", None) is not None:
            trainer.engine.release()
        trainer = model = None
        harness.free_memory()
        shutil.rmtree(scratch, ignore_errors=True)
    row["accuracy"] = [float("nan") if a is None else a for a in row["accuracy"]]
    row.update(curve_summary(row["accuracy"]))
    row["steps_run"] = len(row["accuracy"])
    row["wall_s"] = time.perf_counter() - t0
    return row


def bench_sanity(
    *,
    run_dir: Path,
    grid: dict[str, list[Any]] | None = None,
    overrides: dict[str, Any] | None = None,
    candidates: int = 64,
    samples: int = 40,
    lo: float = 0.2,
    hi: float = 0.8,
    sample_temperature: float = 1.0,
    seeds: int = 1,
    seed_start: int | None = None,
    heldout: int = 0,
    heldout_samples: int = HELDOUT_SAMPLES,
    stop: bool = True,
    skip: Sequence[dict[str, Any]] = (),
    time_budget_s: float | None = None,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build (or reuse) the perfectible subset, train every grid cell on it, write JSON + PNG.

    ``grid`` maps ``format`` and TrainConfig fields to the values to cross (bench/overrides.py
    parse_grid); ``overrides`` are TrainConfig fields for every cell (``--set``), over
    :func:`default_config`. Each cell runs ``seeds`` times, with seeds ``seed_start`` (default: the
    config's seed) onwards; ``heldout`` held-out problems are scored, ``heldout_samples`` samples each, before
    the first step and after the last (0: none); stop=False drops the task's stop strings so that every
    completion runs to max_completion_length; cells matching an entry of ``skip`` (:func:`parse_skip`) are
    left out of the grid. With
    ``time_budget_s`` no further (seed, cell) run starts once the elapsed time plus the longest run so far
    would pass it (the JSON says which were skipped). Recorded in the run's manifest under ``bench/sanity``.
    """
    from qerl_cli.bench.overrides import build_bench_config
    from qerl_cli.bench.runmodels import run_format
    from qerl_cli.manifest import RunDir

    _check_args(candidates, samples, seeds, heldout, heldout_samples, lo, hi)
    device = harness.device()
    base = {"log_sampling_entropy": True, **(overrides or {})}  # the AQN claims are about the sampling policy
    all_cells, all_cfgs, cells, cfgs = _grid(grid, base, skip, device)
    run = RunDir(run_dir, create=False)
    run.require("quantize")
    out = harness.out_dir(out_dir, run, "sanity")
    base_cfg = build_bench_config(default_config(device), base)
    first_seed = base_cfg.seed if seed_start is None else int(seed_start)
    seed_list = list(range(first_seed, first_seed + seeds))
    budget = harness.Budget(time_budget_s)
    models = ModelCache(run, out, device, log)
    # the arms the subset must be fair to: every (weight format, precision) a cell of the grid trains in, skipped
    # cells included (processes that split one grid's cells between them then share one subset)
    arms = list(dict.fromkeys((c.get("format", run_format(run)), cfg.precision)
                              for c, cfg in zip(all_cells, all_cfgs, strict=True)))
    for c, cfg in zip(all_cells, all_cfgs, strict=True):  # a cell W4A8 cannot run is refused before any sampling
        if cfg.rollout_w4a8:
            cfg.check_rollout_w4a8(c.get("format", run_format(run)))
    subset = build_subset(run, base_cfg, candidates=candidates, samples=samples, lo=lo, hi=hi,
                          temperature=sample_temperature, out=out, models=models, log=log, arms=arms)
    if not subset["selected"]:
        raise QerlError(f"no problem of {candidates} has a pass rate in [{lo}, {hi}] for every arm "
                        f"({', '.join(map(arm_label, arms))}): widen the band (--lo/--hi), raise --candidates, or "
                        "pick an easier task (--set task_level=1)")
    held_task = _heldout_task(heldout, stop, models, cells[0].get("format", run_format(run)), cfgs[0], base_cfg)
    res = harness.header("bench/sanity", model=str(run.path), config={
        "grid": jsonable(grid or {}), "overrides": jsonable(base), "train": base_cfg.resolved().to_dict(),
        **_rules(), "seeds": seed_list, "heldout": heldout, "heldout_samples": heldout_samples, "stop": stop,
        "skip": jsonable(list(skip)), "subset": {**{k: subset[k] for k in ("key", "selected", "source_task")},
                                                 "rule": subset.get("rule") or subset_rule(subset)}})
    # seed-major: a run cut short still holds every cell for its first seeds
    runs = [harness.Cell({"label": cell_label(cell), "seed": seed},
                         partial(_run_cell, run, cell, dataclasses.replace(cfg0, seed=seed), subset, models, device,
                                 log, heldout=held_task, heldout_samples=heldout_samples, stop=stop))
            for seed in seed_list for cell, cfg0 in zip(cells, cfgs, strict=True)]
    progress = _Progress(log)
    # _run_cell records a failed training as its row; what escapes it (no run directory, a bug) stops the bench
    rows = harness.run_cells(runs, budget=budget, guess=lambda _c: progress.longest, fatal=lambda _exc: True,
                             on_row=progress.done)
    _collect(res, rows, time_budget_s, log)
    res["wall_s"] = budget.elapsed()
    paths = harness.write_results(res, out, "sanity.json", {"plot": ("sanity.png", partial(plot, res))},
                                  extra_files={"subset": out / "perfectible.json"})
    harness.record(run, "sanity", config=res["config"], inputs={"model": run.rel(quantized_dir(run))}, outputs=paths,
                   metrics={f"{r['label']}/steps_to_threshold": r["steps_to_threshold"] for r in res["results"]})
    return res


def _rules() -> dict[str, Any]:
    """The fixed rules a sanity run is read by (recorded in its config)."""
    return {"threshold": THRESHOLD, "window": WINDOW, "collapse_drop": COLLAPSE_DROP, "early_steps": EARLY_STEPS,
            "aqn_window": AQN_WINDOW}


def _collect(res: dict[str, Any], rows: list[dict[str, Any]], time_budget_s: float | None,
             log: Callable[[str], None]) -> None:
    """The runs that ran, those the time budget skipped, and the per-cell summary across seeds."""
    res["results"] = [r for r in rows if r["status"] != harness.SKIPPED_BUDGET]
    res["skipped"] = [{"label": r["label"], "seed": r["seed"]} for r in rows if r["status"] == harness.SKIPPED_BUDGET]
    res["cells"] = summarize_cells(res["results"])
    if res["skipped"]:
        log(f"time budget {time_budget_s:.0f}s: skipped {len(res['skipped'])} (seed, cell) runs")


def _check_args(candidates: int, samples: int, seeds: int, heldout: int, heldout_samples: int, lo: float,
                hi: float) -> None:
    for name, v in (("candidates", candidates), ("samples", samples), ("seeds", seeds),
                    ("heldout-samples", heldout_samples)):
        if not isinstance(v, int) or v < 1:
            raise QerlError(f"--{name} must be a positive integer, got {v!r}")
    if not isinstance(heldout, int) or heldout < 0:
        raise QerlError(f"--heldout must be a non-negative integer, got {heldout!r}")
    select_perfectible([], lo, hi)  # checks the band


def _grid(grid: dict[str, list[Any]] | None, base: dict[str, Any], skip: Sequence[dict[str, Any]],
          device: Any) -> tuple[list[dict[str, Any]], list[Any], list[dict[str, Any]], list[Any]]:
    """Every cell of the grid and its TrainConfig (all validated before anything runs), then those ``skip``
    leaves to run."""
    from qerl_cli.bench.overrides import build_bench_config, grid_cells

    all_cells = grid_cells(dict(grid or {}))
    all_cfgs = [build_bench_config(default_config(device), {**base, **{k: v for k, v in c.items() if k != "format"}})
                for c in all_cells]
    kept = [i for i, c in enumerate(all_cells) if not any(cell_matches(c, sel) for sel in skip)]
    if not kept:
        raise QerlError("--skip leaves no cell of the grid to run: skip fewer cells")
    return all_cells, all_cfgs, [all_cells[i] for i in kept], [all_cfgs[i] for i in kept]


def _heldout_task(heldout: int, stop: bool, models: Any, fmt: str, cfg: Any, base_cfg: Any) -> Any:
    """The first ``heldout`` test problems, tokenized as the first cell's model reads them (None: no held-out)."""
    if not heldout:
        return None
    from qerl_cli.tasks import load_task

    _, tok = models.get(fmt, dtype_of(cfg.precision))
    held_task = load_task(base_cfg.task, split="test", shots=base_cfg.shots, chat_template=base_cfg.chat_template,
                          tokenizer=tok, seed=base_cfg.seed, level=base_cfg.task_level, limit=heldout)
    held_task.examples = held_task.examples[:heldout]
    if not stop:
        held_task.stop = ()
    return held_task


class _Progress:
    """Logs each finished (seed, cell) run and keeps the longest so far: no run starts that would end past the
    budget if it took this long."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log, self.longest = log, 0.0

    def done(self, cell: harness.Cell, row: dict[str, Any]) -> None:
        if row["status"] == harness.SKIPPED_BUDGET:
            return
        self.longest = max(self.longest, row["wall_s"])
        reached = row["steps_to_threshold"]
        self.log(f"[{row['label']} seed {row['seed']}] {row['status']}: " + (
            f"> {THRESHOLD:.0%} at step {reached}" if reached
            else f"not reached in {row['steps_run']} steps (final {num(row['final'])}, best {num(row['best'])})")
            + (" COLLAPSED" if row["collapsed"] else "") + f", {row['wall_s']:.0f}s")


def quantized_dir(run: Any) -> Path:
    from qerl_cli.runlayout import quantized_model_dir

    return quantized_model_dir(run)


# ---- presentation -------------------------------------------------------------------------------
def tables(res: dict[str, Any]) -> list[Any]:
    return [render_table(res)]


def render_table(res: dict[str, Any]) -> Any:
    from rich.table import Table

    c = res["config"]
    sub = c["subset"]
    table = Table(title=f"qerl bench sanity: {res['model']}, {len(sub['selected'])} perfectible {sub['source_task']} "
                        f"problems (pass rate in [{sub['key']['lo']}, {sub['key']['hi']}] over "
                        f"{sub['key']['samples']} samples), threshold {c['threshold']:.0%}")
    for col in ("cell", "seed", "steps to > threshold", "final", "best", "collapsed", "steps", "wall s", "status"):
        table.add_column(col, justify="left" if col in ("cell", "status") else "right")
    for r in res["results"]:
        table.add_row(r["label"], str(r.get("seed", "-")), str(r["steps_to_threshold"] or "not reached"),
                      num(r["final"]), num(r["best"]),
                      "yes" if r["collapsed"] else "no", str(r["steps_run"]), num(r["wall_s"], "{:.0f}"), r["status"])
    return table


def short_summary(res: dict[str, Any]) -> list[str]:
    f = res["files"]
    return [f"JSON: {f['json']}", f"plot: {f['plot']}", f"subset: {f['subset']}"]


def plot(res: dict[str, Any], path: Path) -> None:
    """PNG: training accuracy vs step, one line per cell, the threshold dashed."""
    fig, ax = figure(figsize=(7.5, 4.6))
    for r in res["results"]:
        acc = r["accuracy"]
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", ms=3, label=f"{r['label']} (seed {r.get('seed', 0)})")
    ax.axhline(res["config"]["threshold"], color="k", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("qerl bench sanity: accuracy on the perfectible subset", fontsize=10)
    if res["results"]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, path)


def parse_skip(items: Iterable[str] | None) -> list[dict[str, str]]:
    """``--skip`` items (``KEY=V[,KEY=V...]``: the grid cells that have all of these values) -> selectors."""
    out = []
    for item in items or ():
        sel: dict[str, str] = {}
        for pair in item.split(","):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise QerlError(f"--skip {item!r}: expected KEY=VALUE[,KEY=VALUE...], e.g. "
                                "rollout_quant=none,correction=token_tis")
            sel[key.strip().replace("-", "_")] = value.strip()
        out.append(sel)
    return out


def parse_axes(items: Iterable[str] | None) -> dict[str, list[Any]]:
    """``--grid`` items -> axes (``format`` checked against qerl's formats)."""
    from qerl_cli.bench.overrides import parse_grid
    from qerl_cli.formats import FORMATS

    return parse_grid(items, FORMATS)
