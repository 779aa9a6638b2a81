"""`qerl eval` on CPU: base vs trained from a run directory, files and manifest, pass@k, bad input, adapters.

One int8 run directory (quantized from the session's embedded SmolLM2; int8 keeps QuantLinear layers and
is the cheapest format to run on CPU) with a training checkpoint made here: LoRA attached, its B
factors perturbed so that the adapter changes greedy outputs, saved in the trainer's layout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.eval.harness import (
    aggregate,
    render_eval_table,
    run_eval,
    score_gsm8k,
    truncate_at_stop,
)
from qerl_cli.eval.metrics import pass_at_k
from qerl_cli.manifest import RunDir, sha256_file
from qerl_cli.tasks import load_task
from qerl_cli.tasks.answers import extract_strict, numbers_equal

LIMIT = 8
MAX_TOKENS = 48
STEP = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch intra-op thread


def _save_checkpoint(run: Path, step: int, *, scale: float = 0.02, seed: int = 1) -> Path:
    """A training checkpoint in the trainer's layout: train/checkpoints/step_N/adapter + latest pointer, and
    the manifest's train record naming the base it was made on (as `qerl train` records it)."""
    from qerl_cli.lora import adapter_hash, attach_lora, make_lora_config
    from qerl_cli.models import load_model
    from qerl_cli.runlayout import checkpoints_dir
    from qerl_cli.train.checkpointing import write_latest

    model, _ = load_model(str(run / "model"))
    peft_model = attach_lora(model, make_lora_config(rank=8), seed=0)
    gen = torch.Generator().manual_seed(seed)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # B starts at zero (adapter = identity); perturb it so outputs change
            p.data = torch.randn(p.shape, generator=gen) * scale
    out = checkpoints_dir(RunDir(run)) / f"step_{step}" / "adapter"
    peft_model.save_pretrained(str(out))
    write_latest(RunDir(run), step)
    rd = RunDir(run)
    model = rd.require("quantize")["outputs"]["model"]
    with rd.stage("train", inputs={"model": {k: model[k] for k in ("path", "files", "format")}}) as rec:
        rec.outputs = {"checkpoint": f"train/checkpoints/step_{step}", "adapter_sha256": adapter_hash(out)}
    return out


@pytest.fixture(scope="module")
def eval_run(embedded, tmp_path_factory) -> Path:
    from qerl_cli.quantize import quantize_model

    path = tmp_path_factory.mktemp("eval_run")
    quantize_model(path, None, fmt="int8", loaded=embedded)
    _save_checkpoint(path, STEP)
    return path


@pytest.fixture(scope="module")
def base_gsm8k(eval_run: Path) -> dict:
    return run_eval(eval_run, "gsm8k", checkpoint="base", limit=LIMIT, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def trained_gsm8k(eval_run: Path) -> dict:
    return run_eval(eval_run, "gsm8k", limit=LIMIT, max_tokens=MAX_TOKENS)  # checkpoint="latest"


def _samples(run: Path, result: dict) -> list[dict]:
    lines = (run / result["files"]["samples"]).read_text().splitlines()
    return [json.loads(line) for line in lines]


# ------------------------------------------------------------------------------ pure scoring helpers

# (completion, gold, strict, flexible, answer_tag) correctness, side by side.
GSM8K_SIDE_BY_SIDE = [
    ("48 + 24 = 72 clips.\n#### 72", "72", True, True, False),
    ("Total 1,234 apples.\n#### 1,234", "1234", True, True, False),
    ("#### 1,000.", "1000", True, True, False),  # trailing "." and thousands comma normalised
    ("He pays $18.\n#### $18", "18", False, True, False),  # lm-eval's strict regex has no "$"
    ("The answer is 42.", "42", False, True, True),
    ("#### 72.0", "72", True, True, False),
    ("The temperature drops to -3 degrees.\n#### -3", "-3", True, True, False),
    ("#### 3 was wrong.\n#### 5", "5", True, True, False),  # qerl's strict takes the last "####"
    ("The answer is 5. Then 6 more", "5", False, False, True),
    ("<answer>3/4</answer>", "0.75", False, True, True),
    ("I do not know.", "7", False, False, False),
]


@pytest.mark.parametrize(("completion", "gold", "strict", "flexible", "tag"), GSM8K_SIDE_BY_SIDE)
def test_gsm8k_scorers_side_by_side(completion: str, gold: str, strict: bool, flexible: bool, tag: bool) -> None:
    (scored,) = score_gsm8k([completion], [gold])
    assert scored["correct"] == {"strict": strict, "flexible": flexible, "answer_tag": tag}
    assert set(scored["extracted"]) == {"strict", "flexible", "answer_tag"}


def test_truncate_at_stop_is_lm_evals_until() -> None:
    assert truncate_at_stop(" 3 + 4 = 7\n#### 7\n\nQuestion: next", ("Question:",)) == " 3 + 4 = 7\n#### 7\n\n"
    assert truncate_at_stop(" 5\n12 + 3 = 15", ("\n",)) == " 5"
    assert truncate_at_stop("no stop here", ("Question:",)) == "no stop here"
    assert truncate_at_stop("a</s>b Question: c", ("Question:", "</s>")) == "a"


def test_aggregate_pass_at_k_by_hand() -> None:
    # problem 0: 2 of 4 correct, problem 1: 0 of 4, problem 2: 4 of 4.
    pattern = {0: [1, 0, 1, 0], 1: [0, 0, 0, 0], 2: [1, 1, 1, 1]}
    records = [{"problem": p, "correct": {"s": bool(c)}, "meta": {"level": p % 2}}
               for p, cs in pattern.items() for c in cs]
    scores = aggregate(records, ["s"], samples=4, group_keys=["level"])["s"]
    assert scores["accuracy"]["mean"] == pytest.approx(6 / 12)
    assert scores["pass@1"]["mean"] == pytest.approx((0.5 + 0 + 1) / 3)
    # pass@4 with n=4: a problem passes iff it has any correct sample.
    assert scores["pass@4"]["mean"] == pytest.approx(2 / 3)
    assert scores["pass@4"]["method"] == "wilson" and scores["accuracy"]["method"] == "normal"
    assert (scores["correct"], scores["total"]) == (6, 12)
    assert scores["by_level"]["0"]["mean"] == pytest.approx(0.75) and scores["by_level"]["1"]["mean"] == 0.0


# ------------------------------------------------------------------------------ builtin harness


def test_base_vs_trained_from_run_dir(eval_run: Path, base_gsm8k: dict, trained_gsm8k: dict) -> None:
    adapter = eval_run / "train" / "checkpoints" / f"step_{STEP}" / "adapter"
    assert base_gsm8k["checkpoint"]["name"] == "base"
    assert base_gsm8k["checkpoint"]["adapter_sha256"] is None and base_gsm8k["checkpoint"]["adapter"] is None
    assert trained_gsm8k["checkpoint"]["requested"] == "latest"
    assert trained_gsm8k["checkpoint"]["name"] == f"step_{STEP}"
    assert trained_gsm8k["checkpoint"]["adapter_sha256"] == sha256_file(adapter / "adapter_model.safetensors")
    assert trained_gsm8k["checkpoint"]["adapter"]["r"] == 8

    base, trained = _samples(eval_run, base_gsm8k), _samples(eval_run, trained_gsm8k)
    assert len(base) == len(trained) == LIMIT
    # Same questions, different model: the perturbed adapter must change what the model writes.
    assert [r["question"] for r in base] == [r["question"] for r in trained]
    assert sum(a["completion"] != b["completion"] for a, b in zip(base, trained, strict=True)) >= 2

    # The model's file hashes come from the quantize stage of the manifest.
    quant = RunDir(eval_run).record("quantize")
    assert base_gsm8k["model"]["files"] == quant["outputs"]["model"]["files"]
    assert base_gsm8k["model"]["format"] == "int8"


def test_result_files_manifest_and_protocol(eval_run: Path, base_gsm8k: dict, trained_gsm8k: dict) -> None:
    # --limit and --max-tokens differ from the defaults: named in the file, so the full result keeps its own
    settings = f"-limit{LIMIT}-max{MAX_TOKENS}"
    for result, key in ((base_gsm8k, f"eval/gsm8k-base{settings}"),
                        (trained_gsm8k, f"eval/gsm8k-step_{STEP}{settings}")):
        assert result["files"] == {"result": f"{key}.json", "samples": f"{key}.samples.jsonl"}
        on_disk = json.loads((eval_run / result["files"]["result"]).read_text())
        assert on_disk == json.loads(json.dumps(result))
        rec = RunDir(eval_run).record(key)
        assert rec["status"] == "completed" and rec["stage"] == "eval"
        assert rec["outputs"] == result["files"]
        assert rec["metrics"]["strict"] == result["scores"]["strict"]["accuracy"]["mean"]
    assert RunDir(eval_run).record(f"eval/gsm8k-base{settings}")["inputs"]["adapter"] is None
    assert base_gsm8k["settings"] == {"limit": LIMIT, "max_tokens": MAX_TOKENS}

    p = base_gsm8k["protocol"]
    assert p["prompt_template"].endswith("Question: {question}\nAnswer:") and "####" in p["prompt_template"]
    assert p["shots"] == 0 and p["chat_template"] is False and p["num_problems"] == LIMIT
    assert p["max_tokens"] == MAX_TOKENS and p["stop"] == ["Question:"] and p["truncate_at_stop"] is True
    assert p["sampling"] == {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 0}
    assert set(p["scorer_versions"]) == {"strict", "flexible", "answer_tag"}
    assert p["data_files"] == {"qerl_cli/data/gsm8k/test.jsonl":
                               sha256_file(Path(__file__).parents[1] / "qerl_cli/data/gsm8k/test.jsonl")}


def test_per_sample_columns_rescore(eval_run: Path, base_gsm8k: dict) -> None:
    task = load_task("gsm8k", split="test", limit=LIMIT)
    records = _samples(eval_run, base_gsm8k)
    for r, ex in zip(records, task.examples, strict=True):
        assert r["question"] == ex.meta["question"] and r["gold"] == ex.answer
        assert set(r["extracted"]) == set(r["correct"]) == {"strict", "flexible", "answer_tag"}
        assert "Question:" not in r["completion"]  # cut at the stop string
        assert r["extracted"]["strict"] == extract_strict(r["completion"])
        assert r["correct"]["strict"] == numbers_equal(r["extracted"]["strict"], r["gold"])
    for scorer, sc in base_gsm8k["scores"].items():
        correct = sum(r["correct"][scorer] for r in records)
        assert sc["correct"] == correct and sc["total"] == LIMIT
        assert sc["accuracy"]["mean"] == pytest.approx(correct / LIMIT) == sc["pass@1"]["mean"]
        assert sc["accuracy"]["low"] <= sc["accuracy"]["mean"] <= sc["accuracy"]["high"]
        assert sc["accuracy"]["method"] == "wilson"  # greedy: one binary value per problem
    assert base_gsm8k["primary"] == "strict"


def test_samples_give_pass_at_k_and_breakdowns(eval_run: Path) -> None:
    result = run_eval(eval_run, "arith", checkpoint="base", limit=6, samples=4, temperature=1.0)
    assert result["protocol"]["sampling"]["n"] == 4 and result["protocol"]["max_tokens"] == 8
    records = _samples(eval_run, result)
    assert len(records) == 24
    sc = result["scores"]["arith"]
    per_problem: dict[int, list[bool]] = {}
    for r in records:
        per_problem.setdefault(r["problem"], []).append(r["correct"]["arith"])
    assert sorted(len(v) for v in per_problem.values()) == [4] * 6
    expected4 = sum(pass_at_k(4, sum(v), 4) for v in per_problem.values()) / 6
    assert sc["pass@4"]["mean"] == pytest.approx(expected4)
    assert sc["pass@1"]["mean"] == pytest.approx(sc["accuracy"]["mean"])
    assert sc["pass@1"]["mean"] <= sc["pass@4"]["mean"]
    assert sc["correct"] == sum(sum(v) for v in per_problem.values())
    assert set(sc) >= {"accuracy", "pass@1", "pass@4", "by_level", "by_op"}
    assert sum(ci["n"] for ci in sc["by_level"].values()) == 6


def test_math500_scorers_and_breakdowns(eval_run: Path) -> None:
    result = run_eval(eval_run, "math500", checkpoint="base", limit=3, max_tokens=32)
    assert set(result["scores"]) == {"math", "exact"} and result["primary"] == "math"
    assert set(result["scores"]["math"]) >= {"by_subject", "by_level"}
    assert "math" in result["protocol"]["scorer_versions"]
    records = _samples(eval_run, result)
    task = load_task("math500", split="test", limit=3)
    for r, ex in zip(records, task.examples, strict=True):
        assert r["gold"] == ex.answer and r["meta"]["subject"] == ex.meta["subject"]
        assert r["grader"]["method"] in ("math_verify", "fallback")
    assert result["files"]["result"] == "eval/math500-base-limit3-max32.json"


def test_math500_without_math_verify_says_so(eval_run: Path, monkeypatch) -> None:
    """Without math-verify the MATH-500 score is exact match only: said in the result JSON and the table (the CLI
    prints it first). qerl's availability probe is switched off; the grader then really runs without it."""
    from rich.console import Console

    from qerl_cli.eval.harness import scoring_notice
    from qerl_cli.tasks import math_grader

    assert scoring_notice("math500") is None or not math_grader.math_verify_available()
    monkeypatch.setattr(math_grader, "math_verify_available", lambda: False)
    notice = scoring_notice("math500")
    assert notice is not None and "exact match only" in notice and "pip install 'qerl[math]'" in notice
    assert scoring_notice("gsm8k") is None and scoring_notice("math500", "lighteval") is None
    result = run_eval(eval_run, "math500", checkpoint="base", limit=2, max_tokens=8)
    assert result["notices"] == [notice]
    assert {r["grader"]["method"] for r in _samples(eval_run, result)} == {"fallback"}
    on_disk = json.loads((eval_run / result["files"]["result"]).read_text())
    assert on_disk["notices"] == [notice]
    console = Console(width=300, record=True)
    console.print(render_eval_table(result))
    text = " ".join(console.export_text().split())
    assert "exact match only" in text and "pip install 'qerl[math]'" in text


def test_jsonl_task(eval_run: Path, tmp_path: Path) -> None:
    data = tmp_path / "sums.jsonl"
    rows = [{"prompt": "2 + 3 = 5\n4 + 4 =", "answer": 8}, {"prompt": "1 + 2 = 3\n5 + 1 =", "answer": "6"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_eval(eval_run, f"jsonl:{data}", checkpoint="base", max_tokens=4)
    assert result["files"]["result"] == "eval/jsonl-sums-base-max4.json"
    assert set(result["scores"]) == {"strict", "flexible", "answer_tag"}  # numeric answers: GSM8K scorers
    assert result["protocol"]["data_files"] == {str(data): sha256_file(data)}
    assert [r["gold"] for r in _samples(eval_run, result)] == ["8", "6"]


def test_render_eval_table(base_gsm8k: dict) -> None:
    from rich.console import Console

    console = Console(record=True, width=140)
    console.print(render_eval_table(base_gsm8k))
    text = console.export_text()
    for needle in ("gsm8k", "base", "strict *", "flexible", "answer_tag", "pass@1", f"/{LIMIT}"):
        assert needle in text


# ------------------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def bare_run(eval_run: Path, tmp_path_factory) -> Path:
    """A copy of the run without any training checkpoint."""
    path = tmp_path_factory.mktemp("bare") / "run"
    shutil.copytree(eval_run, path, ignore=shutil.ignore_patterns("train", "eval", ".lock"))
    return path


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(QerlError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_bad_input_one_line_errors(eval_run: Path, bare_run: Path, tmp_path: Path) -> None:
    before = json.loads((eval_run / "manifest.json").read_text())["stages"].keys()
    assert "unknown task" in _error(run_eval, eval_run, "gsm9k")
    assert "does not exist" in _error(run_eval, eval_run, "gsm8k", checkpoint="step_99")
    assert "latest, base or step_N" in _error(run_eval, eval_run, "gsm8k", checkpoint="final")
    assert "unknown harness" in _error(run_eval, eval_run, "gsm8k", harness="helm")
    assert "gsm8k only" in _error(run_eval, eval_run, "math500", harness="lm-eval")
    assert "temperature" in _error(run_eval, eval_run, "gsm8k", samples=4, temperature=0.0)
    assert "--limit" in _error(run_eval, eval_run, "gsm8k", limit=0)
    assert "does not exist" in _error(run_eval, tmp_path / "nope", "gsm8k")
    msg = _error(run_eval, bare_run, "gsm8k")
    assert "qerl train" in msg and "--checkpoint base" in msg

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "empty" in _error(run_eval, eval_run, f"jsonl:{empty}", checkpoint="base")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": "2 + 2 =", "answer": \n')
    assert re.search(r"broken\.jsonl:2: not valid JSON", _error(run_eval, eval_run, f"jsonl:{broken}",
                                                                 checkpoint="base"))
    missing = tmp_path / "missing.jsonl"
    assert "does not exist" in _error(run_eval, eval_run, f"jsonl:{missing}", checkpoint="base")
    # Nothing above reached the eval stage: no failed records clutter the manifest.
    assert json.loads((eval_run / "manifest.json").read_text())["stages"].keys() == before


def test_adapter_for_another_base_is_refused(bare_run: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from qerl_cli.runlayout import checkpoints_dir
    from qerl_cli.train.checkpointing import write_latest

    run = tmp_path / "run"
    shutil.copytree(bare_run, run)
    tiny = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    peft_model = get_peft_model(tiny, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(str(checkpoints_dir(RunDir(run)) / "step_7" / "adapter"))
    write_latest(RunDir(run), 7)
    assert "another base model" in _error(run_eval, run, "gsm8k", limit=1, max_tokens=4)
    # without a train record nothing says which base the adapter was made on: refused before any loading
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"].pop("train", None)
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "does not record which base" in _error(run_eval, run, "gsm8k", limit=1, max_tokens=4)


def test_requantized_run_refuses_the_old_adapter(eval_run: Path, embedded, tmp_path: Path) -> None:
    """Re-quantizing a trained run gives a new base; the adapter trained on the old one must not meet it."""
    from qerl_cli.quantize import quantize_model

    run = tmp_path / "run"
    shutil.copytree(eval_run, run, ignore=shutil.ignore_patterns("eval", ".lock"))
    before = json.loads((run / "manifest.json").read_text())["stages"].keys()
    # re-quantizing moves train/ aside (--force); a user who moves it back has an adapter beside a new base
    moved = quantize_model(run, None, fmt="nvfp4", loaded=embedded, force=True).replaced_train
    (run / moved["moved_to"]).rename(run / "train")
    after = json.loads((run / "manifest.json").read_text())["stages"].keys()
    assert "another base model" in _error(run_eval, run, "gsm8k", limit=1, max_tokens=4)
    assert json.loads((run / "manifest.json").read_text())["stages"].keys() == after == before  # no eval record
    assert not (run / "eval").exists()
    run_eval(run, "arith", checkpoint="base", limit=1, max_tokens=2)  # the new base itself evaluates


def test_weights_corrupted_at_the_same_size_are_refused(eval_run: Path, tmp_path: Path) -> None:
    """safetensors loads a file whose bytes changed in place; the manifest's sha256 catches it, in eval always."""
    run = tmp_path / "run"
    shutil.copytree(eval_run, run, ignore=shutil.ignore_patterns("eval", ".lock"))
    weights = run / "model" / "model.safetensors"
    original = weights.read_bytes()
    data = bytearray(original)
    data[-1000] ^= 0x01  # one bit of one weight byte: same size, still a valid file
    weights.write_bytes(bytes(data))
    msg = _error(run_eval, run, "arith", checkpoint="base", limit=1, max_tokens=2)
    assert "model.safetensors does not match the sha256" in msg and "qerl quantize" in msg
    assert not (run / "eval").exists()

    adapter = run / "train" / "checkpoints" / f"step_{STEP}" / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(original)
    blob = bytearray(adapter.read_bytes())
    blob[-10] ^= 0x01
    adapter.write_bytes(bytes(blob))
    assert "adapter_model.safetensors does not match the sha256" in _error(run_eval, run, "arith", limit=1,
                                                                          max_tokens=2)


# ------------------------------------------------------------------------------ lm-eval adapter

_LM_EVAL_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def _lm_eval_strict(completion: str) -> str:
    m = _LM_EVAL_STRICT.findall(completion)
    return m[0] if m else "[invalid]"


def _compare_lm_eval(run: Path, builtin: dict, lm: dict, shots: int, limit: int, chat: bool = False) -> None:
    tokenizer = None
    if chat:
        from qerl_cli.models import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(str(run / "model")))
    task = load_task("gsm8k", split="test", shots=shots, limit=limit, chat_template=chat, tokenizer=tokenizer)
    ours, theirs = _samples(run, builtin), _samples(run, lm)
    assert len(ours) == len(theirs) == limit
    assert lm["protocol"]["prompt_template"] == builtin["protocol"]["prompt_template"]
    n_agree = 0
    for a, b, ex in zip(ours, theirs, task.examples, strict=True):
        assert b["prompt"] == ex.prompt  # lm-eval built exactly qerl's prompt from its own YAML
        assert b["completion"] == a["completion"]  # same greedy completion, cut at the same stop
        assert b["extracted"]["strict-match"] == _lm_eval_strict(a["completion"])
        first, last = _LM_EVAL_STRICT.findall(a["completion"])[:1], _LM_EVAL_STRICT.findall(a["completion"])[-1:]
        if first == last:  # one "####" answer (or none): both harnesses read the same number
            assert (a["extracted"]["strict"] or "[invalid]") == b["extracted"]["strict-match"]
            assert a["correct"]["strict"] == b["correct"]["strict-match"]
            n_agree += 1
    # qerl takes the last "####", lm-eval the first; the score agrees wherever they coincide.
    assert n_agree >= limit // 2
    if n_agree == limit:
        assert lm["scores"]["strict-match"]["accuracy"]["mean"] == builtin["scores"]["strict"]["accuracy"]["mean"]
    # Our aggregate of lm-eval's per-sample exact_match is lm-eval's own number.
    assert lm["harness_results"]["exact_match,strict-match"] == pytest.approx(
        lm["scores"]["strict-match"]["accuracy"]["mean"])


def test_lm_eval_agrees_with_builtin_zero_shot(eval_run: Path, base_gsm8k: dict) -> None:
    pytest.importorskip("lm_eval", reason="lm-eval not installed (pip install 'qerl[lm-eval]')")
    lm = run_eval(eval_run, "gsm8k", checkpoint="base", limit=LIMIT, max_tokens=MAX_TOKENS, harness="lm-eval")
    assert lm["files"]["result"] == f"eval/gsm8k-base-lm-eval-limit{LIMIT}-max{MAX_TOKENS}.json"
    assert lm["primary"] == "strict-match" and set(lm["scores"]) == {"strict-match", "flexible-extract"}
    assert "sampler: first_n" in lm["protocol"]["harness_task"]["yaml"]
    _compare_lm_eval(eval_run, base_gsm8k, lm, shots=0, limit=LIMIT)


def test_lm_eval_agrees_with_builtin_few_shot_chat(eval_run: Path) -> None:
    """One shot (lm-eval's first_n sampler = qerl's first train row) inside the chat template, with the
    trained adapter."""
    pytest.importorskip("lm_eval", reason="lm-eval not installed (pip install 'qerl[lm-eval]')")
    kw = {"checkpoint": f"step_{STEP}", "limit": 3, "max_tokens": 32, "shots": 1, "chat_template": True}
    builtin = run_eval(eval_run, "gsm8k", **kw)
    lm = run_eval(eval_run, "gsm8k", harness="lm-eval", **kw)
    assert lm["checkpoint"]["adapter_sha256"] == builtin["checkpoint"]["adapter_sha256"] is not None
    assert lm["protocol"]["chat_template"] is True and "<|im_start|>user" in lm["protocol"]["prompt_template"]
    _compare_lm_eval(eval_run, builtin, lm, shots=1, limit=3, chat=True)


# ------------------------------------------------------------------------------ lighteval adapter


def _skip_or_fail(reason: str) -> None:
    """CI runs this test in lighteval's own venv with QERL_REQUIRE_LIGHTEVAL=1 (.ci/run): there it must run."""
    if os.environ.get("QERL_REQUIRE_LIGHTEVAL") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def test_lighteval_agrees_with_builtin(eval_run: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("lighteval") is None:
        _skip_or_fail("lighteval not installed (pip install 'qerl[lighteval]' in its own environment)")
    from qerl_cli.eval.lighteval_adapter import require_lighteval

    try:
        require_lighteval()
    except QerlError as exc:  # e.g. its latex2sympy2_extended pin conflicts with math-verify's
        _skip_or_fail(f"lighteval cannot run in this environment: {exc}")
    kw = {"checkpoint": "base", "limit": 3, "max_tokens": 32}
    builtin = run_eval(eval_run, "math500", **kw)
    light = run_eval(eval_run, "math500", harness="lighteval", **kw)
    assert light["files"]["result"] == "eval/math500-base-lighteval-limit3-max32.json"
    ours, theirs = _samples(eval_run, builtin), _samples(eval_run, light)
    task = load_task("math500", split="test", limit=3)
    for a, b, ex in zip(ours, theirs, task.examples, strict=True):
        assert b["prompt"] == ex.prompt and b["completion"] == a["completion"]
        assert b["correct"]["pass@k"] == a["correct"]["math"]
    assert set(light["scores"]["pass@k"]) >= {"by_subject", "by_level"}
