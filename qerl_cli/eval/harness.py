"""`qerl eval`: score a run's model (quantized base + LoRA adapter) on GSM8K, MATH-500, arith or a jsonl task.

Protocol, and why:
- The model is the run's quantized checkpoint (`DIR/model`) with the adapter of the chosen training
  checkpoint applied (`latest` by default, `base` for none), so one command pair shows the RL gain.
  QeRL's released eval never applied the LoRA; here the adapter's sha256 is in
  every result, and a base evaluation has none.
- Prompts, shots and stop strings come from `qerl_cli.tasks`, the same module the trainer uses, so a
  model is evaluated on the format it was trained on. Completions are cut at the first stop string
  (as lm-eval does) before scoring: text the model wrote after "Question:" belongs to a new question.
- One generation, several scorers side by side: GSM8K strict (`#### N`), flexible (last number) and
  answer-tag; MATH-500 math-verify with a normalised exact-match fallback, and the exact match alone;
  arith the first number of the first line. Every accuracy carries a 95% interval.
- Greedy pass@1 by default; with samples=K (temperature > 0) pass@1 and pass@K (unbiased estimator)
  and the mean accuracy. With K > 1 the interval is taken over problems (a problem's K samples are not
  independent), with K = 1 it is the Wilson interval.

Outputs: `DIR/eval/<task>-<checkpoint>[-<harness>][-<tool>][-<settings>].json` (scores + full protocol + hashes)
and `...samples.jsonl` (one line per sample), both written atomically, and a manifest stage under the key
`eval/<task>-<checkpoint>...`. `<settings>` names every setting that differs from the default (`-limit2`,
`-n4-t0.7`, ...): a result made another way never replaces the default one, and `qerl report` compares base and
trained only at equal settings. The adapters for lm-eval-harness and lighteval produce the
same files through `qerl_cli.eval.lm_eval_adapter` and `qerl_cli.eval.lighteval_adapter`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.eval.adapters import EXTERNAL_HARNESSES, external_harness
from qerl_cli.eval.generation import generate_texts, truncate_at_stop
from qerl_cli.eval.metrics import breakdown, mean_and_ci95, pass_at_k
from qerl_cli.manifest import RunDir, atomic_write_json, atomic_write_text, now_iso, sha256_file, write_errors

log = logging.getLogger(__name__)

HARNESSES = ("builtin", *EXTERNAL_HARNESSES)
TASK_CHOICES = "gsm8k, math500, arith (or arith:<level>), jsonl:PATH"
# Which task each external harness runs (its own task definition, our bundled data).
HARNESS_TASKS = {name: h.task for name, h in EXTERNAL_HARNESSES.items()}
RESULT_SCHEMA = 1
# Arith problems are generated; the test set must not move with the sampling seed.
DATA_SEED = 0
PROMPT_PLACEHOLDER = "{question}"

SCORER_DOCS = {
    "strict": "GSM8K strict-match: number after the last '#### ' (lm-eval's regex), compared exactly",
    "flexible": "GSM8K flexible-extract: last number in the completion, compared exactly",
    "answer_tag": "declared answer: <answer>..</answer>, 'The answer is ..', or \\boxed{..}; its number",
    "math": "MATH: math-verify (worker processes, wall-clock timeout) else normalised exact match",
    "exact": "MATH: normalised exact match of the last \\boxed{} (or answer tag) only",
    "arith": "first number of the completion's first line equals the answer exactly",
}
PRIMARY = {"gsm8k": "strict", "math": "math", "arith": "arith"}
DEFAULT_MAX_TURNS = 4
# a setting that differs from its default -> its tag in the result's file name (the value follows the tag)
SETTING_TAGS = {"limit": "limit", "samples": "n", "temperature": "t", "max_tokens": "max", "shots": "shots",
                "chat_template": "chat", "seed": "seed", "max_turns": "turns"}


# ------------------------------------------------------------------------------------------- scoring


def score_gsm8k(completions: Sequence[str], golds: Sequence[str]) -> list[dict[str, Any]]:
    """Per completion: {"extracted": {scorer: str|None}, "correct": {scorer: bool}} for strict/flexible/tag."""
    from qerl_cli.tasks.answers import extract_gsm8k, numbers_equal

    out = []
    for c, g in zip(completions, golds, strict=True):
        ext = {mode: extract_gsm8k(c, mode) for mode in ("strict", "flexible", "answer_tag")}
        out.append({"extracted": ext, "correct": {m: numbers_equal(v, g) for m, v in ext.items()}})
    return out


def score_math(completions: Sequence[str], golds: Sequence[str], workers: int = 2) -> list[dict[str, Any]]:
    """math-verify (+ fallback) and the normalised exact match alone, with the deciding method per sample."""
    from qerl_cli.tasks.math_grader import MathGrader, extract_math_answer, fallback_equal

    with MathGrader(workers=workers) as grader:
        grades = grader.grade_many(list(completions), list(golds))
    out = []
    for c, g, grade in zip(completions, golds, grades, strict=True):
        pred = extract_math_answer(c)
        out.append({
            "extracted": {"math": grade.pred, "exact": pred},
            "correct": {"math": bool(grade.correct), "exact": fallback_equal(pred, g)},
            "grader": {"method": grade.method, "note": grade.note},
        })
    return out


def score_arith(completions: Sequence[str], golds: Sequence[str]) -> list[dict[str, Any]]:
    from qerl_cli.tasks.answers import extract_first_number
    from qerl_cli.tasks.arith import STOP
    from qerl_cli.tasks.arith import score_arith as _score

    return [{"extracted": {"arith": extract_first_number(c.split(STOP, 1)[0])}, "correct": {"arith": _score(c, g)}}
            for c, g in zip(completions, golds, strict=True)]


def scorer_versions(kind: str) -> dict[str, str]:
    import qerl_cli
    from qerl_cli.env_info import git_commit

    qerl = f"qerl {qerl_cli.__version__}" + (f" (git {git_commit()})" if git_commit() else "")
    if kind == "math":
        from qerl_cli.tasks.math_grader import scorer_version

        return {"math": scorer_version(), "exact": f"{qerl} tasks.math_grader.fallback_equal"}
    if kind == "gsm8k":
        return {m: f"{qerl} tasks.answers.extract_gsm8k({m!r}) + numbers_equal" for m in
                ("strict", "flexible", "answer_tag")}
    return {"arith": f"{qerl} tasks.arith.score_arith"}


def _problem_scores(per_problem: list[list[bool]], samples: int) -> dict[str, Any]:
    """accuracy (mean over samples), pass@1 and pass@K, each with a 95% interval over problems."""
    fractions = [sum(p) / len(p) for p in per_problem]
    out: dict[str, Any] = {
        "accuracy": mean_and_ci95(fractions).as_dict(),
        "correct": sum(sum(p) for p in per_problem),
        "total": sum(len(p) for p in per_problem),
    }
    for k in sorted({1, samples}):
        values = [pass_at_k(len(p), sum(p), k) for p in per_problem]
        out[f"pass@{k}"] = mean_and_ci95(values).as_dict()
    return out


def aggregate(records: list[dict[str, Any]], scorers: Sequence[str], samples: int,
              group_keys: Sequence[str] = ()) -> dict[str, Any]:
    """Scores per scorer from per-sample records (fields problem, correct{scorer}, meta{group keys})."""
    by_problem: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_problem.setdefault(r["problem"], []).append(r)
    problems = [by_problem[i] for i in sorted(by_problem)]
    scores: dict[str, Any] = {}
    for s in scorers:
        per_problem = [[bool(r["correct"][s]) for r in rs] for rs in problems]
        entry = _problem_scores(per_problem, samples)
        for key in group_keys:
            rows = [{"group": rs[0]["meta"].get(key), "acc": sum(p) / len(p)}
                    for rs, p in zip(problems, per_problem, strict=True)]
            entry[f"by_{key}"] = {str(g): ci.as_dict() for g, ci in breakdown(rows, "group", "acc").items()}
        scores[s] = entry
    return scores


# ------------------------------------------------------------------------------------------- setup


@dataclass
class _Resolved:
    run: RunDir
    task_name: str  # canonical: gsm8k | math500 | arith[:level] | jsonl:PATH
    task_kind: str  # reward kind: gsm8k | math | arith
    slug: str
    model_dir: Path
    model_record: dict[str, Any]
    checkpoint_requested: str
    checkpoint_name: str
    checkpoint_dir: Path | None
    out_dir: Path  # DIR/eval, confined to the run before anything runs
    data_files: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # those that differ from the default (eval_settings)


def _canonical_task(task: str) -> tuple[str, str]:
    """(canonical name, file-name slug) or a QerlError naming the valid tasks."""
    from qerl_cli.tasks.datasets import MATH_ALIASES

    raw = (task or "").strip()
    key, sep, arg = raw.partition(":")
    low = key.lower()
    if low == "gsm8k" and not sep:
        return "gsm8k", "gsm8k"
    if low in MATH_ALIASES and not sep:
        return "math500", "math500"
    if low == "arith":
        if sep and not arg.strip():
            raise QerlError("task 'arith:' needs a level after the colon, e.g. arith:3 or arith:mixed")
        return (f"arith:{arg.strip()}", "arith-" + re.sub(r"[^A-Za-z0-9_.]+", "_", arg.strip())) if sep \
            else ("arith", "arith")
    if low == "jsonl":
        if not arg.strip():
            raise QerlError("task jsonl needs a path: use jsonl:PATH, e.g. jsonl:data/my_task.jsonl")
        path = Path(arg.strip()).expanduser()
        return f"jsonl:{path}", "jsonl-" + re.sub(r"[^A-Za-z0-9_.]+", "_", path.stem)
    raise QerlError(f"unknown task {task!r}: use one of {TASK_CHOICES}")


def _resolve(run_dir: str | Path, task: str, checkpoint: str, harness: str) -> _Resolved:
    from qerl_cli.runlayout import check_adapter_base, eval_dir, quantized_model_dir
    from qerl_cli.train.checkpointing import require_intact, resolve_checkpoint

    if harness not in HARNESSES:
        raise QerlError(f"unknown harness {harness!r}: use one of {', '.join(HARNESSES)}")
    name, slug = _canonical_task(task)
    if harness in HARNESS_TASKS and name != HARNESS_TASKS[harness]:
        raise QerlError(f"--harness {harness} runs {HARNESS_TASKS[harness]} only, not {task!r}: "
                        "use the builtin harness for other tasks")
    run = RunDir(run_dir, create=False)
    out_dir = eval_dir(run)  # results are written there: an eval/ leading out of the run is refused now
    model_dir = quantized_model_dir(run)
    model_record = run.require("quantize")
    ckpt_dir = resolve_checkpoint(run, checkpoint)
    ckpt_name = "base" if ckpt_dir is None else ckpt_dir.name
    if ckpt_dir is not None:
        # before any model is loaded or result written: every file of the checkpoint against the sha256 recorded
        # when it was written; for a full checkpoint too, the base check: its frozen embeddings come from the
        # base, which must be the trained one
        require_intact(run, ckpt_dir, "eval")
        check_adapter_base(run, ckpt_dir)
    slug = f"{slug}-{ckpt_name}" + ("" if harness == "builtin" else f"-{harness}")
    kind = "gsm8k" if name == "gsm8k" else "math" if name == "math500" else "arith" if name.startswith("arith") \
        else "jsonl"
    return _Resolved(run, name, kind, slug, model_dir, model_record, checkpoint, ckpt_name, ckpt_dir, out_dir)


def scoring_notice(task: str, harness: str = "builtin") -> str | None:
    """What the user must know before reading the scores: MATH-500 without math-verify is exact match only."""
    from qerl_cli.tasks.math_grader import math_verify_available

    try:
        name, _ = _canonical_task(task)
    except QerlError:
        return None  # run_eval reports the bad task
    if name == "math500" and harness == "builtin" and not math_verify_available():
        return ("math-verify is not installed: MATH-500 is scored by normalised exact match only, which misses "
                "equivalent answers (2/4 vs 1/2); pip install 'qerl[math]' for the math-verify score")
    return None


def _fallback_notice(records: list[dict[str, Any]]) -> str | None:
    n = sum(1 for r in records if (r.get("grader") or {}).get("method") == "fallback")
    if not n:
        return None
    return (f"{n} of {len(records)} samples were graded by the exact-match fallback instead of math-verify "
            "(see grader.note in the samples file)")


def _data_files(task_name: str, shots: int) -> dict[str, str]:
    """sha256 of the data files a task reads (bundled files by their package-relative path)."""
    from qerl_cli.tasks.datasets import DATA_DIR

    if task_name == "gsm8k":
        files = [DATA_DIR / "gsm8k" / "test.jsonl"] + ([DATA_DIR / "gsm8k" / "train.jsonl"] if shots else [])
    elif task_name == "math500":
        files = [DATA_DIR / "math500" / "test.jsonl"]
    elif task_name.startswith("jsonl:"):
        p = Path(task_name.partition(":")[2])
        return {str(p): sha256_file(p)}
    else:
        return {}
    return {f"qerl_cli/data/{f.parent.name}/{f.name}": sha256_file(f) for f in files}


def _question(task_kind: str, ex: Any) -> str:
    meta = ex.meta
    if "question" in meta:
        return meta["question"]
    if "problem" in meta:
        return meta["problem"]
    if task_kind == "arith" and "a" in meta:
        return f"{meta['a']} {meta['op']} {meta['b']}"
    return ex.prompt


def _group_keys(task_name: str) -> tuple[str, ...]:
    if task_name == "math500":
        return ("subject", "level")
    if task_name.startswith("arith"):
        return ("level", "op")
    return ()


def _pick_device(device: str | None) -> str:
    from qerl_cli.device import pick

    return device if device else pick().type


# ------------------------------------------------------------------------------------------- main


# Upper bounds of eval's numeric options: far above any evaluation protocol (pass@k is reported up to k = 1024,
# reasoning budgets reach ~128k tokens), low enough that a typo (an extra zero, 1e9) is refused at once instead of
# generating for days.
EVAL_LIMITS: dict[str, int | float] = {"samples": 4096, "max_tokens": 1 << 20, "temperature": 100.0, "shots": 64,
                                 "max_turns": 256, "seed": 2**63 - 1, "batch_slots": 1 << 16}


def _check_eval_options(*, limit: int | None, samples: int, temperature: float | None, max_tokens: int | None,
                        batch_slots: int, harness: str, tools: str | None, env: str | None, shots: int | None = None,
                        max_turns: int = 4, seed: int = 0) -> float:
    """Refuse bad options before anything is loaded; return the sampling temperature (greedy unless samples > 1)."""
    if limit is not None and limit < 1:
        raise QerlError(f"--limit must be >= 1, got {limit}")
    lowest = {"samples": 1, "max_tokens": 1, "shots": 0, "max_turns": 1, "seed": 0, "batch_slots": 1}
    given = {"samples": samples, "max_tokens": max_tokens, "shots": shots, "max_turns": max_turns, "seed": seed,
             "batch_slots": batch_slots}
    for name, value in given.items():
        if value is not None and not lowest[name] <= value <= EVAL_LIMITS[name]:
            raise QerlError(f"--{name.replace('_', '-')} must be from {lowest[name]} to {EVAL_LIMITS[name]}, got "
                            f"{value}")
    if temperature is not None and not (math.isfinite(temperature) and 0 <= temperature <= EVAL_LIMITS["temperature"]):
        raise QerlError(f"--temperature must be a number from 0 to {EVAL_LIMITS['temperature']:g} (0: greedy), got "
                        f"{temperature}")
    if temperature is None:
        temperature = 0.0 if samples == 1 else 1.0
    if samples > 1 and temperature == 0:
        raise QerlError(f"--samples {samples} with --temperature 0 gives {samples} identical greedy samples: "
                        "give a temperature > 0 (e.g. --temperature 1.0) or use --samples 1")
    if harness != "builtin" and (tools or env):
        raise QerlError(f"--harness {harness} scores single answers: use the builtin harness with --tools/--env")
    if harness in EXTERNAL_HARNESSES and samples != 1:
        raise QerlError(f"--harness {harness} runs one sample per problem: use --samples 1 (or the builtin harness "
                        "for pass@k)")
    return temperature


@dataclass
class _EvalTask:
    """The task as run_eval runs it: examples, reward kind, token budget and (with a tool) the episodes."""

    task: Any
    kind: str
    max_new: int
    episodes: Any
    default_max_new: int  # the budget without --max-tokens: the file name names max_new only where it differs


def _load_eval_task(res: _Resolved, *, shots: int | None, chat_template: bool | None, limit: int | None,
                    tools: str | None, env: str | None, max_turns: int, max_tokens: int | None) -> _EvalTask:
    """Load the task with the model's tokenizer, before the model: a bad task or data file fails fast."""
    from qerl_cli.models import load_tokenizer, resolve_model
    from qerl_cli.tasks import load_task
    from qerl_cli.tools.episodes import make_episodes

    tokenizer = load_tokenizer(resolve_model(str(res.model_dir)))
    episodes = make_episodes(tools, env, max_turns=max_turns,  # None: single answers
                             chat_tokenizer=tokenizer if chat_template else None)
    task_obj = load_task(res.task_name, split="test", shots=shots, chat_template=bool(chat_template),
                         tokenizer=tokenizer, limit=limit, seed=DATA_SEED, tools=tools)
    if not task_obj.examples:
        raise QerlError(f"task {res.task_name} has no examples to evaluate (limit={limit})")
    kind = task_obj.reward if res.task_kind == "jsonl" else res.task_kind
    if kind not in PRIMARY:
        raise QerlError(f"task {res.task_name} uses reward {kind!r}, which qerl eval cannot score")
    if episodes is not None:
        default = episodes.default_budget(task_obj.max_new_tokens,
                                          lambda t: tokenizer.encode(t, add_special_tokens=False))
    else:
        default = task_obj.max_new_tokens
    res.data_files = _data_files(res.task_name, task_obj.shots)
    return _EvalTask(task_obj, kind, default if max_tokens is None else max_tokens, episodes, default)


def eval_settings(task_name: str, et: _EvalTask, *, limit: int | None, samples: int, temperature: float, seed: int,
                  max_turns: int) -> dict[str, Any]:
    """The settings of an evaluation that differ from the defaults, in SETTING_TAGS' order (empty: the default
    evaluation). Each is compared with what the default would be for this task, so `--shots 4` on arith (its
    default) is no different setting; the seed only matters where something is sampled."""
    from qerl_cli.tasks.datasets import default_shots

    task = et.task
    differ = {
        "limit": limit,
        "samples": samples if samples != 1 else None,
        "temperature": temperature if temperature != (0.0 if samples == 1 else 1.0) else None,
        "max_tokens": et.max_new if et.max_new != et.default_max_new else None,
        "shots": task.shots if task.shots != default_shots(task_name) else None,
        "chat_template": True if task.chat_template else None,
        "seed": seed if temperature > 0 and seed != 0 else None,
        "max_turns": max_turns if et.episodes is not None and max_turns != DEFAULT_MAX_TURNS else None,
    }
    return {k: v for k, v in differ.items() if v is not None}


def settings_suffix(settings: dict[str, Any]) -> str:
    """``-limit2-n4-t0.7``: the file-name part of eval_settings (empty for the default settings)."""
    def value(v: Any) -> str:
        return "" if v is True else f"{v:g}" if isinstance(v, float) else str(v)

    return "".join(f"-{SETTING_TAGS[k]}{value(v)}" for k, v in settings.items())


@dataclass
class _EvalModel:
    """The run's quantized model with the checkpoint applied, and what it was loaded as."""

    model: Any
    tokenizer: Any
    device: str
    dtype: Any  # torch.dtype
    adapter_info: dict[str, Any] | None
    weights_info: dict[str, Any] | None  # --finetune full: the checkpoint's weights replace the base's
    load_s: float


def _load_eval_model(res: _Resolved, device: str | None) -> _EvalModel:
    import torch

    from qerl_cli.models import load_model

    device = _pick_device(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    t_load = time.perf_counter()
    # always verified: an eval result must name exactly the weights it scored
    model, tokenizer = load_model(str(res.model_dir), dtype=dtype, device=device,
                                  expected_sha256=res.model_record["outputs"]["model"].get("files", {}))
    adapter_info: dict[str, Any] | None = None
    weights_info: dict[str, Any] | None = None
    if res.checkpoint_dir is not None:
        from qerl_cli.train.checkpointing import apply_to_model

        model, adapter_info, weights_info = apply_to_model(res.run, model, res.checkpoint_dir)
    model.eval()
    return _EvalModel(model, tokenizer, device, dtype, adapter_info, weights_info, time.perf_counter() - t_load)


def _eval_protocol(res: _Resolved, et: _EvalTask, em: _EvalModel, *, limit: int | None, samples: int,
                   temperature: float, seed: int, max_turns: int) -> dict[str, Any]:
    """How the scores were made, written into the result (the harness adds its scorers after generating)."""
    task_obj, episodes = et.task, et.episodes
    return {
        "split": "test",
        "limit": limit,
        "num_problems": len(task_obj.examples),
        "shots": task_obj.shots,
        "chat_template": task_obj.chat_template,
        "prompt_template": task_obj.build_prompt(PROMPT_PLACEHOLDER),
        "prompt_placeholder": PROMPT_PLACEHOLDER,
        "stop": list(task_obj.stop),
        "stop_token_ids": "model eos",
        "truncate_at_stop": True,
        "sampling": {"n": samples, "temperature": temperature, "top_p": 1.0, "top_k": -1, "seed": seed},
        "max_tokens": et.max_new,
        "data_files": res.data_files,
        "data_seed": DATA_SEED if et.kind == "arith" else None,
        "dtype": str(em.dtype).removeprefix("torch."),
        "device": em.device,
        "engine": "qerl builtin rollout engine",
        "episodes": None if episodes is None else {"kind": episodes.kind, "max_turns": max_turns,
                                                   "stop": list(episodes.stop), "scored": "model text outside calls"},
    }


def _generate(harness: str, et: _EvalTask, em: _EvalModel, protocol: dict[str, Any], *, samples: int,
              temperature: float, seed: int,
              batch_slots: int) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """Generate and score with the chosen harness (an external one names its engine in `protocol`).
    Returns (per-sample records, the harness' extra results, scorer names)."""
    if harness == "builtin":
        return _run_builtin(em.model, em.tokenizer, et.task, et.kind, samples, temperature, et.max_new, seed,
                            batch_slots, et.episodes)
    external = external_harness(harness)
    records, extra = external.run(em.model, em.tokenizer, et.task, max_tokens=et.max_new, temperature=temperature,
                                  seed=seed, batch_slots=batch_slots)
    protocol["engine"] = external.engine
    return records, extra, list(extra["scorers"])


def _record_scorers(protocol: dict[str, Any], harness: str, kind: str, extra: dict[str, Any],
                    scorers: list[str]) -> str:
    """Name the scorers (and their versions) in `protocol`; return the primary scorer."""
    if harness == "builtin":
        protocol["scorers"] = {s: SCORER_DOCS[s] for s in scorers}
        protocol["scorer_versions"] = scorer_versions(kind)
        return PRIMARY[kind]
    protocol["scorers"] = extra["scorer_docs"]
    protocol["scorer_versions"] = extra["scorer_versions"]
    protocol["harness_task"] = extra["harness_task"]
    return extra["primary"]


def _eval_notices(res: _Resolved, harness: str, et: _EvalTask, records: list[dict[str, Any]]) -> list[str]:
    notices = [n for n in (scoring_notice(res.task_name, harness),) if n]
    if et.kind == "math" and harness == "builtin" and not notices:
        notices += [n for n in (_fallback_notice(records),) if n]
    if et.episodes is not None:
        notices += [n for n in (_budget_notice(records, et.max_new),) if n]
    return notices


def _budget_notice(records: list[dict[str, Any]], max_new: int) -> str | None:
    """Episodes the token budget stopped: their scores say little about the model (a tool's answer cut before the
    model could copy it scores 0), so the result says how many."""
    cut = [r for r in records if r.get("finish_reason") == "length"]
    if not cut:
        return None
    answers = sum(any(t.get("truncated") for t in r.get("turns") or ()) for r in cut)
    notice = (f"{len(cut)} of {len(records)} episodes ran out of the {max_new}-token budget (model and observation "
              f"tokens together)")
    notice += f", {answers} with the tool's answer cut" if answers else ""
    log.warning("%s; raise --max-tokens", notice)
    return notice + "; raise --max-tokens"


def _eval_result(res: _Resolved, et: _EvalTask, em: _EvalModel, *, harness: str, protocol: dict[str, Any],
                 records: list[dict[str, Any]], extra: dict[str, Any], primary: str, scores: dict[str, Any],
                 gen_s: float, t_start: float) -> dict[str, Any]:
    """The result file's content (`files` names the result and samples files it is written to)."""
    rel_dir = res.run.rel(res.out_dir)
    files = {"result": f"{rel_dir}/{res.slug}.json", "samples": f"{rel_dir}/{res.slug}.samples.jsonl"}
    finish = Counter(r.get("finish_reason", "unknown") for r in records)
    tokens = sum(int(r.get("tokens", 0)) for r in records)
    adapter_info = em.adapter_info
    result = {
        "schema": RESULT_SCHEMA,
        "task": res.task_name,
        "harness": harness,
        "settings": res.settings,
        "created": now_iso(),
        "run": str(res.run.path),
        "checkpoint": {"requested": res.checkpoint_requested, "name": res.checkpoint_name,
                       "path": res.run.rel(res.checkpoint_dir) if res.checkpoint_dir else None,
                       "adapter_sha256": adapter_info["sha256"] if adapter_info else None,
                       "adapter": adapter_info, "weights": em.weights_info},
        "model": {"path": res.run.rel(res.model_dir), **_model_hashes(res.model_record)},
        "protocol": protocol,
        "notices": _eval_notices(res, harness, et, records),
        "primary": primary,
        "scores": scores,
        "harness_results": extra.get("harness_results"),
        "counts": {"problems": len(et.task.examples), "samples": len(records), "finish_reason": dict(finish),
                   "completion_tokens": tokens},
        "timings": {"load_s": round(em.load_s, 3), "generate_s": round(gen_s, 3),
                    "total_s": round(time.perf_counter() - t_start, 3),
                    "tokens_per_s": round(tokens / gen_s, 2) if gen_s > 0 else None},
        "files": files,
    }
    if et.episodes is not None:
        result["episodes"] = _episode_counts(records)
    return result


def _write_eval_files(res: _Resolved, result: dict[str, Any], records: list[dict[str, Any]]) -> None:
    out_dir = res.run.inside(res.out_dir)  # checked again: it may have changed since
    with write_errors(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    files = result["files"]
    atomic_write_text(res.run.inside(files["samples"]),
                      "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records))
    atomic_write_json(res.run.inside(files["result"]), result)


def run_eval(
    run_dir: str | Path,
    task: str,
    *,
    checkpoint: str = "latest",
    limit: int | None = None,
    samples: int = 1,
    temperature: float | None = None,
    max_tokens: int | None = None,
    shots: int | None = None,
    chat_template: bool | None = None,
    harness: str = "builtin",
    seed: int = 0,
    device: str | None = None,
    batch_slots: int = 64,
    tools: str | None = None,
    env: str | None = None,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> dict[str, Any]:
    """Evaluate the run's quantized model with a checkpoint's adapter; write results; return the result dict.

    checkpoint: "latest" (default; an error pointing to `qerl train` or `--checkpoint base` when the run
    has none), "step_N", or "base" (no adapter). samples=1 is greedy pass@1 unless a temperature is
    given; samples=K>1 samples at `temperature` (default 1.0) and reports pass@1, pass@K and the mean
    accuracy. max_tokens/shots default to the task's (gsm8k 256/0, math500 1024/0, arith 8/4);
    chat_template=None means a plain completion prompt (the task default).
    harness: "builtin" (qerl's rollout engine and scorers), "lm-eval" (lm-eval-harness' gsm8k task and
    filters on this model, offline) or "lighteval" (lighteval's math_500 metric on this model, offline).
    tools ("python", "calculator") or env ("module:Class", "file.py:Class"): score multi-turn episodes with up to
    ``max_turns`` model turns, the tool on (docs/tools.md); max_tokens then bounds a whole episode, observations
    included (default: the task's per-answer default per turn plus the tool's observation allowance per call,
    ``Episodes.default_budget``), and what the model wrote outside its calls is scored.
    """
    t_start = time.perf_counter()
    temperature = _check_eval_options(limit=limit, samples=samples, temperature=temperature, max_tokens=max_tokens,
                                      batch_slots=batch_slots, harness=harness, tools=tools, env=env, shots=shots,
                                      max_turns=max_turns, seed=seed)
    res = _resolve(run_dir, task, checkpoint, harness)
    if tools or env:  # its own result file: scores with a tool are not the model's single answers
        res.slug += f"-{tools or 'env'}"
    if harness != "builtin":
        external_harness(harness).require()
    et = _load_eval_task(res, shots=shots, chat_template=chat_template, limit=limit, tools=tools, env=env,
                         max_turns=max_turns, max_tokens=max_tokens)
    res.settings = eval_settings(res.task_name, et, limit=limit, samples=samples, temperature=temperature, seed=seed,
                                 max_turns=max_turns)
    res.slug += settings_suffix(res.settings)
    em = _load_eval_model(res, device)
    protocol = _eval_protocol(res, et, em, limit=limit, samples=samples, temperature=temperature, seed=seed,
                              max_turns=max_turns)
    config = {"task": res.task_name, "harness": harness, "checkpoint": checkpoint, "limit": limit, "samples": samples,
              "temperature": temperature, "max_tokens": et.max_new, "shots": et.task.shots,
              "chat_template": et.task.chat_template, "batch_slots": batch_slots, "device": em.device,
              "tools": tools, "env": env, "max_turns": max_turns if et.episodes else None}
    inputs = {"model": {"path": res.run.rel(res.model_dir), **_model_hashes(res.model_record)},
              "adapter": em.adapter_info, "weights": em.weights_info, "data": res.data_files}

    with res.run.stage("eval", config=config, inputs=inputs, seeds={"sampling": seed},
                       key=f"eval/{res.slug}") as rec:
        t_gen = time.perf_counter()
        records, extra, scorers = _generate(harness, et, em, protocol, samples=samples, temperature=temperature,
                                            seed=seed, batch_slots=batch_slots)
        gen_s = time.perf_counter() - t_gen
        primary = _record_scorers(protocol, harness, et.kind, extra, scorers)
        scores = aggregate(records, scorers, samples, _group_keys(res.task_name))
        result = _eval_result(res, et, em, harness=harness, protocol=protocol, records=records, extra=extra,
                              primary=primary, scores=scores, gen_s=gen_s, t_start=t_start)
        rec.refusable = False  # the result files change from here: a failure is recorded as one
        _write_eval_files(res, result, records)
        rec.outputs = result["files"]
        rec.metrics = {"primary": primary, **{s: scores[s]["accuracy"]["mean"] for s in scorers},
                       **{f"{primary}/pass@{samples}": scores[primary][f"pass@{samples}"]["mean"]}}
    return result


def _model_hashes(rec: dict[str, Any]) -> dict[str, Any]:
    out = rec.get("outputs", {}).get("model", {})
    from qerl_cli.runlayout import base_fingerprint

    return {"format": out.get("format"), "files": out.get("files", {}), "fingerprint": base_fingerprint(out),
            "source": rec.get("config", {}).get("model")}


def _episode_counts(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Turns per episode, tool calls and tool errors of an evaluation with a tool or an environment."""
    n = max(1, len(records))
    return {"turns_mean": sum(len(r["turns"]) for r in records) / n,
            "steps": sum(r["steps"] for r in records), "tool_errors": sum(r["tool_errors"] for r in records),
            "env_reward_mean": sum(r["env_reward"] for r in records) / n}


def _run_builtin(model: Any, tokenizer: Any, task: Any, kind: str, samples: int, temperature: float,
                 max_new: int, seed: int, batch_slots: int,
                 episodes: Any = None) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    from qerl_cli.rollout import SamplingParams

    prompts = task.prompts
    sampling = SamplingParams(n=samples, temperature=temperature, top_p=1.0, top_k=-1, max_tokens=max_new,
                              stop=list(task.stop), seed=seed)
    outputs = generate_texts(model, tokenizer, prompts, sampling, batch_slots, episodes)
    golds = [task.examples[s["prompt_index"]].answer for s in outputs]
    # an episode is scored on what the model wrote outside its tool calls, cut at the task's stop as a single answer
    completions = [truncate_at_stop(s.get("answer", s["text"]), task.stop) for s in outputs]
    scorer: Callable[[Sequence[str], Sequence[str]], list[dict[str, Any]]] = {
        "gsm8k": score_gsm8k, "math": score_math, "arith": score_arith}[kind]
    scored = scorer(completions, golds)
    records = []
    for s, comp, sc in zip(outputs, completions, scored, strict=True):
        ex = task.examples[s["prompt_index"]]
        records.append({
            "problem": s["prompt_index"],
            "sample": s["sample_index"],
            "id": ex.meta.get("unique_id", ex.meta.get("index", s["prompt_index"])),
            "question": _question(kind, ex),
            "gold": ex.answer,
            "completion": comp,
            "finish_reason": s["finish_reason"],
            "tokens": s["tokens"],
            **sc,
            "meta": {k: v for k, v in ex.meta.items() if k in ("subject", "level", "op")},
            **({k: s[k] for k in ("text", "turns", "steps", "tool_errors", "env_reward")} if episodes else {}),
        })
    scorers = list(scored[0]["correct"]) if scored else []
    return records, {}, scorers


def _fmt_ci(ci: dict[str, Any]) -> str:
    return f"{100 * ci['mean']:.1f} [{100 * ci['low']:.1f}, {100 * ci['high']:.1f}]"


def render_eval_table(result: dict[str, Any]):  # noqa: ANN201 - rich.table.Table
    """A rich table of a run_eval result: one row per scorer, then the primary scorer's breakdowns."""
    from rich.markup import escape
    from rich.table import Table

    samples = result["protocol"]["sampling"]["n"]
    ckpt = result["checkpoint"]
    title = (f"{result['task']} · {ckpt['name']} · {result['harness']} · "
             f"{result['counts']['problems']} problems x {samples}")
    table = Table(title=title, show_lines=False)
    table.add_column("scorer")
    table.add_column("accuracy % [95% CI]", justify="right")
    ks = sorted({1, samples})
    for k in ks:
        table.add_column(f"pass@{k} %", justify="right")
    table.add_column("correct/total", justify="right")
    primary = result["primary"]
    for name, sc in result["scores"].items():
        label = f"{name} *" if name == primary else name
        table.add_row(label, _fmt_ci(sc["accuracy"]), *[f"{100 * sc[f'pass@{k}']['mean']:.1f}" for k in ks],
                      f"{sc['correct']}/{sc['total']}")
    for key, groups in result["scores"].get(primary, {}).items():
        if not key.startswith("by_"):
            continue
        table.add_section()
        for g, ci in groups.items():
            table.add_row(f"  {key[3:]} {g}", _fmt_ci(ci), *["" for _ in ks], f"n={ci['n']}")
    adapter, weights = ckpt["adapter_sha256"], (ckpt.get("weights") or {}).get("sha256")
    scored = f"full weights {weights[:12]}" if weights else f"adapter {adapter[:12] if adapter else 'none (base)'}"
    table.caption = (f"* primary · {scored} · "
                     f"T={result['protocol']['sampling']['temperature']} · max_tokens "
                     f"{result['protocol']['max_tokens']} · shots {result['protocol']['shots']} · "
                     f"{result['files']['result']}")
    ep = result.get("episodes")
    if ep:
        table.caption += (f"\nepisodes: {result['protocol']['episodes']['kind']}, {ep['turns_mean']:.2f} turns per "
                          f"episode, {ep['steps']} tool calls, {ep['tool_errors']} tool errors")
    for notice in result.get("notices") or ():
        table.caption += f"\nnote: {escape(notice)}"  # escaped: rich would drop the [math] of qerl[math]
    return table
