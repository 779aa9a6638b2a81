"""`qerl eval gsm8k --harness lm-eval`: lm-eval-harness' own gsm8k task, filters and metric on qerl's model.

Nothing is fetched: the model object (quantized base + adapter) and its tokenizer are handed to lm-eval
through `QerlLM`, an `lm_eval.api.model.LM` whose `generate_until` runs qerl's rollout engine, and the
task is a local YAML derived at run time from the installed `lm_eval/tasks/gsm8k/gsm8k.yaml` with only
these changes:
- dataset: `json` with `data_files` = qerl's bundled GSM8K train/test JSONL (same rows as openai/gsm8k);
- few-shot: `sampler: first_n` (the first k train rows, as qerl's prompts; lm-eval's default draws
  k rows at random with a fixed seed) and `num_fewshot` = the requested shots;
- zero-shot: qerl's instruction line goes into `doc_to_text` (not `description`, which lm-eval would
  turn into a system message under a chat template), so both harnesses see the same prompt;
- `generation_kwargs.max_gen_toks` = --max-tokens (and `do_sample`/`temperature` when T > 0).
The `strict-match` and `flexible-extract` filters and the `exact_match` metric with its
`regexes_to_ignore` stay exactly lm-eval's. The YAML text is stored in the eval result.

Known, deliberate differences from qerl's builtin scorers (documented in tasks/answers.py): lm-eval's
strict-match takes the FIRST "#### N" (qerl the last), and its exact_match compares normalised strings
("5.0" != "5"), where qerl compares numbers exactly.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.eval.generation import hf_offline

log = logging.getLogger(__name__)

TASK_NAME = "qerl_gsm8k"
FILTERS = ("strict-match", "flexible-extract")
# The version whose prompt construction the tests check against the builtin harness (prompts are
# built by lm-eval's fewshot_context, which changed within 0.4.x).
MIN_VERSION = (0, 4, 13)


def require_lm_eval() -> str:
    """lm-eval's version, or a one-line QerlError saying how to install it."""
    try:
        version = importlib.metadata.version("lm-eval")
    except importlib.metadata.PackageNotFoundError:
        raise QerlError("--harness lm-eval needs lm-eval-harness: pip install 'qerl[lm-eval]' "
                        "(or use the builtin harness)") from None
    parts = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    if parts < MIN_VERSION:
        raise QerlError(f"--harness lm-eval needs lm-eval >= {'.'.join(map(str, MIN_VERSION))}, found {version}: "
                        "pip install -U lm-eval")
    return version


def _gsm8k_yaml_path() -> Path:
    import lm_eval.tasks

    path = Path(lm_eval.tasks.__file__).resolve().parent / "gsm8k" / "gsm8k.yaml"
    if not path.is_file():
        raise QerlError(f"lm-eval is installed but has no gsm8k task at {path}: reinstall lm-eval")
    return path


def gsm8k_task_config(*, shots: int, max_tokens: int, temperature: float = 0.0,
                      data_dir: Path | None = None) -> dict[str, Any]:
    """lm-eval's gsm8k task config, pointed at qerl's bundled data and qerl's prompt protocol."""
    import yaml

    from qerl_cli.tasks.datasets import DATA_DIR, GSM8K_INSTRUCTION

    cfg = yaml.safe_load(_gsm8k_yaml_path().read_text())
    data_dir = data_dir or DATA_DIR / "gsm8k"
    cfg.pop("tag", None)
    cfg["task"] = TASK_NAME
    cfg["dataset_path"] = "json"
    cfg.pop("dataset_name", None)
    cfg["dataset_kwargs"] = {"data_files": {"train": str(data_dir / "train.jsonl"),
                                            "test": str(data_dir / "test.jsonl")}}
    cfg["num_fewshot"] = shots
    cfg["fewshot_config"] = {"sampler": "first_n"}
    if shots == 0:
        # Escape Jinja delimiters in the instruction (it has none today, but keep it literal regardless).
        instruction = GSM8K_INSTRUCTION.replace("{{", "{{ '{{' }}").replace("{%", "{{ '{%' }}")
        cfg["doc_to_text"] = instruction + "\n\n" + cfg["doc_to_text"]
    gen = dict(cfg.get("generation_kwargs") or {})
    gen["max_gen_toks"] = max_tokens
    if temperature > 0:
        gen["do_sample"] = True
        gen["temperature"] = float(temperature)
    else:
        gen["do_sample"] = False
        gen["temperature"] = 0.0
    cfg["generation_kwargs"] = gen
    names = [f.get("name") for f in cfg.get("filter_list", [])]
    if list(names) != list(FILTERS):
        raise QerlError(f"lm-eval's gsm8k task has filters {names}, expected {list(FILTERS)}: this qerl supports "
                        "lm-eval 0.4.x; pin lm-eval accordingly")
    return cfg


def _lm_class() -> type:
    """QerlLM, built lazily so that importing this module does not import lm_eval."""
    from lm_eval.api.model import LM

    from qerl_cli.eval.generation import generate_texts, truncate_at_stop
    from qerl_cli.rollout import SamplingParams

    class QerlLM(LM):
        """lm-eval LM over qerl's loaded model: generate_until through qerl's rollout engine."""

        def __init__(self, model: Any, tokenizer: Any, *, batch_slots: int = 64, seed: int = 0) -> None:
            super().__init__()
            self.model = model
            self.tokenizer = tokenizer
            self.batch_slots = batch_slots
            self.seed = seed
            self.generations: dict[int, dict[str, Any]] = {}  # doc_id -> context, text, finish_reason, tokens

        @property
        def tokenizer_name(self) -> str:
            return str(getattr(self.tokenizer, "name_or_path", "qerl")).replace("/", "__")

        def chat_template(self, chat_template: bool | str = False) -> str | None:
            return getattr(self.tokenizer, "chat_template", None)

        def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
            return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)

        def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
            raise NotImplementedError("qerl's lm-eval adapter runs generate_until tasks only")

        def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
            raise NotImplementedError("qerl's lm-eval adapter runs generate_until tasks only")

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            # As lm-eval's HFLM: stop at any `until` string or the EOS text, and cut the text at the first.
            eos_id = self.tokenizer.eos_token_id
            eos = self.tokenizer.decode([eos_id], skip_special_tokens=False) if eos_id is not None else None
            groups: dict[str, list[int]] = {}
            for i, req in enumerate(requests):
                groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
            out: list[str] = [""] * len(requests)
            for idx in groups.values():
                # Doc order, whatever order lm-eval hands them in: sampling noise is keyed on the prompt's
                # position, so this keeps sampled runs identical to the builtin harness' for one seed.
                idx = sorted(idx, key=lambda i: (requests[i].doc_id, i))
                kwargs = dict(requests[idx[0]].args[1])
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                if eos and eos not in until:
                    until.append(eos)
                max_gen = next((kwargs[k] for k in ("max_gen_toks", "max_new_tokens", "max_tokens") if k in kwargs),
                               256)
                temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
                sampling = SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=-1,
                                          max_tokens=int(max_gen), stop=[s for s in until if s], seed=self.seed)
                contexts = [requests[i].args[0] for i in idx]
                gens = generate_texts(self.model, self.tokenizer, contexts, sampling, self.batch_slots)
                for g in gens:
                    i = idx[g["prompt_index"]]
                    text = truncate_at_stop(g["text"], until)
                    out[i] = text
                    self.generations[requests[i].doc_id] = {"context": contexts[g["prompt_index"]], "text": text,
                                                            "finish_reason": g["finish_reason"],
                                                            "tokens": g["tokens"], "until": until}
            return out

    return QerlLM


def make_lm(model: Any, tokenizer: Any, *, batch_slots: int = 64, seed: int = 0) -> Any:
    """An lm-eval LM object over qerl's model (pass it to lm_eval.simple_evaluate(model=...))."""
    require_lm_eval()
    return _lm_class()(model, tokenizer, batch_slots=batch_slots, seed=seed)


def run_lm_eval_gsm8k(model: Any, tokenizer: Any, task: Any, *, max_tokens: int, temperature: float = 0.0,
                      seed: int = 0, batch_slots: int = 64) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run lm-eval's gsm8k on `model` for the problems of qerl's `task` (a loaded gsm8k test Task).

    Returns per-sample records in qerl's samples.jsonl schema (scorers named after lm-eval's filters,
    extracted = the filtered response, correct = exact_match) and the extra protocol fields: the YAML,
    lm-eval's own aggregate results, scorer docs and versions.
    """
    import yaml

    version = require_lm_eval()
    if task.name != "gsm8k":
        raise QerlError(f"--harness lm-eval runs gsm8k only, not {task.name}")
    cfg = gsm8k_task_config(shots=task.shots, max_tokens=max_tokens, temperature=temperature)
    yaml_text = yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True)

    import lm_eval
    from lm_eval.tasks import TaskManager

    # lm-eval logs every request at INFO/WARNING level; keep the CLI output to qerl's table.
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    lm = make_lm(model, tokenizer, batch_slots=batch_slots, seed=seed)
    with tempfile.TemporaryDirectory(prefix="qerl-lm-eval-") as tmp, hf_offline():
        (Path(tmp) / f"{TASK_NAME}.yaml").write_text(yaml_text)
        manager = TaskManager(include_path=tmp, include_defaults=False)
        try:
            out = lm_eval.simple_evaluate(
                model=lm, tasks=[TASK_NAME], task_manager=manager, limit=len(task.examples), log_samples=True,
                apply_chat_template=bool(task.chat_template), fewshot_as_multiturn=False, bootstrap_iters=0,
                random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            )
        except QerlError:
            raise
        except Exception as exc:
            raise QerlError(f"lm-eval failed on gsm8k: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}") \
                from exc
    if out is None or TASK_NAME not in out.get("samples", {}):
        raise QerlError("lm-eval returned no samples for gsm8k")

    by_doc: dict[int, dict[str, Any]] = {}
    for s in out["samples"][TASK_NAME]:
        entry = by_doc.setdefault(int(s["doc_id"]), {"doc": s["doc"], "extracted": {}, "correct": {}})
        entry["extracted"][s["filter"]] = s["filtered_resps"][0]
        entry["correct"][s["filter"]] = bool(s["exact_match"])
        entry["resp"] = s["resps"][0][0]
        entry["prompt"] = s["arguments"][0][0]
    records = []
    for doc_id in sorted(by_doc):
        e = by_doc[doc_id]
        gen = lm.generations.get(doc_id, {})
        ex = task.examples[doc_id]
        if e["doc"]["question"] != ex.meta["question"]:
            raise QerlError(f"lm-eval doc {doc_id} is not qerl's problem {doc_id}: the data files differ")
        records.append({
            "problem": doc_id, "sample": 0, "id": ex.meta.get("index", doc_id),
            "question": e["doc"]["question"], "gold": ex.answer, "completion": e["resp"],
            "finish_reason": gen.get("finish_reason"), "tokens": gen.get("tokens", 0),
            "extracted": {f: e["extracted"].get(f) for f in FILTERS},
            "correct": {f: e["correct"].get(f, False) for f in FILTERS},
            "prompt": e["prompt"], "meta": {},
        })
    res = out["results"][TASK_NAME]
    harness_results = {k: v for k, v in res.items() if k.startswith(("exact_match", "alias"))}
    extra = {
        "scorers": list(FILTERS),
        "primary": "strict-match",
        "scorer_docs": {
            "strict-match": "lm-eval gsm8k filter: regex '#### (\\-?[0-9\\.\\,]+)', first match; exact_match "
                            "after removing ',', '$', everything up to '#### ', a trailing '.'",
            "flexible-extract": "lm-eval gsm8k filter: regex '(-?[$0-9.,]{2,})|(-?[0-9]+)', last match; same "
                                "exact_match",
        },
        "scorer_versions": {f: f"lm-eval {version} gsm8k v{cfg.get('metadata', {}).get('version')}"
                            for f in FILTERS},
        "harness_task": {"name": TASK_NAME, "lm_eval_version": version, "yaml": yaml_text,
                         "derived_from": "lm_eval/tasks/gsm8k/gsm8k.yaml"},
        "harness_results": harness_results,
    }
    return records, extra
