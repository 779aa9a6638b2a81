"""Loading tasks: bundled counts, prompt formats, chat wrapping, and jsonl error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from qerl_cli.errors import QerlError
from qerl_cli.tasks import load_task
from qerl_cli.tasks.datasets import GSM8K_INSTRUCTION, MATH_INSTRUCTION

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A real (tiny, in-memory) fast tokenizer: the chat wrapping runs transformers' own Jinja path."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok)
    t.chat_template = chat_template
    return t


def test_bundled_counts_and_defaults() -> None:
    train = load_task("gsm8k", split="train")
    test = load_task("gsm8k", split="test")
    math = load_task("math500", split="test")
    assert (len(train), len(test), len(math)) == (7473, 1319, 500)
    assert (train.reward, train.stop) == ("gsm8k", ("Question:",))
    assert (math.reward, math.stop) == ("math", ("Problem:",))
    assert load_task("math", split="test").name == "math500"
    assert test.examples[0].answer == "18"
    assert test.examples[0].meta["index"] == 0
    assert "#### 18" in test.examples[0].meta["solution"]


def test_gsm8k_zero_shot_prompt() -> None:
    ex = load_task("gsm8k", split="test", limit=1).examples[0]
    assert ex.prompt == (
        f"{GSM8K_INSTRUCTION}\n\nQuestion: Janet\u2019s ducks lay 16 eggs per day. She eats three for "
        "breakfast every morning and bakes muffins for her friends every day with four. She sells the "
        "remainder at the farmers' market daily for $2 per fresh duck egg. How much in dollars does she "
        "make every day at the farmers' market?\nAnswer:"
    )


def test_gsm8k_five_shot_prompt_is_lm_eval_format() -> None:
    task = load_task("gsm8k", split="test", shots=5, limit=2)
    prompt = task.examples[0].prompt
    # Five exemplars from the start of the train split, each a full worked answer, blank line apart.
    assert prompt.startswith(
        "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May?\nAnswer: Natalia sold 48/2 = "
        "<<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and "
        "May.\n#### 72\n\nQuestion: Weng earns $12 an hour"
    )
    assert prompt.count("Question: ") == 6 and prompt.count("\n\n") == 5
    assert prompt.endswith("make every day at the farmers' market?\nAnswer:")
    assert GSM8K_INSTRUCTION not in prompt
    assert task.shots == 5
    # The exemplar block is shared: only the last question differs between examples.
    p0, p1 = task.prompts
    assert p0.rsplit("Question: ", 1)[0] == p1.rsplit("Question: ", 1)[0]


def test_gsm8k_train_with_shots_drops_the_exemplar_rows() -> None:
    task = load_task("gsm8k", split="train", shots=5)
    assert len(task) == 7473 - 5
    assert task.examples[0].meta["index"] == 5
    assert task.examples[0].meta["question"] not in task.examples[0].prompt.rsplit("Question: ", 1)[0]


def test_math_prompts_and_meta() -> None:
    ex = load_task("math500", split="test", limit=1).examples[0]
    assert ex.prompt.startswith(MATH_INSTRUCTION + "\n\nProblem:\nConvert the point $(0,3)$")
    assert ex.prompt.endswith("\n\nSolution:")
    assert ex.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert (ex.meta["subject"], ex.meta["level"], ex.meta["unique_id"]) == (
        "Precalculus", 2, "test/precalculus/807.json")
    four = load_task("math500", split="test", shots=4, limit=1).examples[0].prompt
    assert four.startswith("Problem:\nFind the domain of the expression")
    assert four.count("Problem:\n") == 5 and four.count("I hope it is correct.") == 4
    with pytest.raises(QerlError, match="only a 'test' split"):
        load_task("math500", split="train")
    with pytest.raises(QerlError, match="0 to 4 shots"):
        load_task("math500", split="test", shots=5)


def test_arith_task() -> None:
    task = load_task("arith", split="test", seed=0)
    assert (task.reward, task.stop, task.shots, task.max_new_tokens) == ("arith", ("\n",), 4, 8)
    assert 0 < len(task) <= 200
    ex = task.examples[0]
    assert ex.prompt.startswith("2 + 3 = 5\n14 + 5 = 19\n7 * 6 = 42\n31 + 22 = 53\n")
    assert ex.prompt == task.build_prompt(f"{ex.meta['a']} {ex.meta['op']} {ex.meta['b']}")
    a, op, b = ex.meta["a"], ex.meta["op"], ex.meta["b"]
    assert int(ex.answer) == (a + b if op == "+" else a * b)
    lvl3 = load_task("arith:3", split="train", limit=30, seed=1)
    assert len(lvl3) == 30 and {e.meta["level"] for e in lvl3.examples} == {3}
    assert load_task("arith", split="train", level=3, limit=30, seed=1).prompts == lvl3.prompts
    with pytest.raises(QerlError, match="given twice"):
        load_task("arith:3", level=2)


def test_limit_and_shuffle() -> None:
    first = load_task("gsm8k", split="test", limit=3)
    assert [e.meta["index"] for e in first.examples] == [0, 1, 2]
    shuffled = load_task("gsm8k", split="test", limit=3, shuffle=True, seed=7)
    assert shuffled.prompts == load_task("gsm8k", split="test", limit=3, shuffle=True, seed=7).prompts
    assert [e.meta["index"] for e in shuffled.examples] != [0, 1, 2]
    assert len(load_task("gsm8k", split="test", limit=0)) == 0


def test_chat_template_wraps_the_prompt() -> None:
    tok = make_tokenizer()
    ex = load_task("gsm8k", split="test", chat_template=True, tokenizer=tok, limit=1).examples[0]
    assert ex.prompt.startswith(f"<|user|>{GSM8K_INSTRUCTION}\n\nQuestion: Janet")
    assert ex.prompt.endswith("\nAnswer:\n<|assistant|>")
    sys_ex = load_task("arith:1", split="test", chat_template=True, tokenizer=tok, limit=1,
                       system_prompt="Be brief.").examples[0]
    assert sys_ex.prompt.startswith("<|system|>Be brief.\n<|user|>2 + 3 = 5\n")
    with pytest.raises(QerlError, match="needs a tokenizer"):
        load_task("gsm8k", split="test", chat_template=True)
    with pytest.raises(QerlError, match="has no chat template"):
        load_task("gsm8k", split="test", chat_template=True, tokenizer=make_tokenizer(None))


def test_to_records_carries_answer_and_meta_for_trl() -> None:
    rec = load_task("math500", split="test", limit=1).to_records()[0]
    assert rec["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert rec["prompt"].endswith("Solution:") and rec["subject"] == "Precalculus"


def test_unknown_task_and_bad_args() -> None:
    with pytest.raises(QerlError, match="unknown task 'gsm9k'"):
        load_task("gsm9k")
    with pytest.raises(QerlError, match="splits 'train' and 'test'"):
        load_task("gsm8k", split="validation")
    with pytest.raises(QerlError, match="shots must be >= 0"):
        load_task("gsm8k", shots=-1)


# ---------------------------------------------------------------- jsonl:PATH


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_jsonl_task(tmp_path: Path) -> None:
    f = write(tmp_path / "t.jsonl", [
        json.dumps({"prompt": "1 + 1 =", "answer": 2, "source": "me"}),
        "",
        json.dumps({"prompt": "2 + 2 =", "answer": "4"}),
    ])
    task = load_task(f"jsonl:{f}")
    assert task.prompts == ["1 + 1 =", "2 + 2 ="]
    assert task.answers == ["2", "4"]
    assert task.examples[0].meta == {"source": "me", "index": 0}
    assert (task.reward, task.stop) == ("gsm8k", ())  # numeric answers get the number reward
    g = write(tmp_path / "g.jsonl", [json.dumps({"prompt": "Simplify", "answer": "\\frac{1}{2}"})])
    assert load_task(f"jsonl:{g}").reward == "math"


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "is empty"),
        (["", "  "], "is empty"),
        (['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": 2'], r"t.jsonl:2: not valid JSON"),
        (['{"prompt": "a"}'], r"t.jsonl:1: missing column 'answer'"),
        (['{"answer": "1"}'], r"t.jsonl:1: missing column 'prompt'"),
        (['["a", 1]'], r"t.jsonl:1: expected a JSON object"),
        (['{"prompt": "", "answer": 1}'], r"t.jsonl:1: 'prompt' must be a non-empty string"),
        (['{"prompt": "a", "answer": ""}'], r"t.jsonl:1: 'answer' is empty"),
        (['{"prompt": "a", "answer": [1]}'], r"t.jsonl:1: 'answer' must be a string or a number"),
    ],
)
def test_jsonl_errors(tmp_path: Path, lines: list[str], message: str) -> None:
    f = write(tmp_path / "t.jsonl", lines)
    with pytest.raises(QerlError, match=message) as info:
        load_task(f"jsonl:{f}")
    assert "\n" not in str(info.value)


def test_jsonl_missing_file(tmp_path: Path) -> None:
    with pytest.raises(QerlError, match="does not exist"):
        load_task(f"jsonl:{tmp_path / 'nope.jsonl'}")
    with pytest.raises(QerlError, match="needs a path"):
        load_task("jsonl:")
