"""Tasks: examples, the prompt format, the default reward and stop strings, in one place.

A Task carries everything the trainer and `qerl eval` must agree on, so that a model is trained and
evaluated on the same prompt format and the same answer extraction.

Prompt formats:
- gsm8k, shots=0: an instruction to end with "#### <number>", then "Question: ...\\nAnswer:".
- gsm8k, shots=k: lm-eval-harness' `gsm8k` format -- the first k train rows as
  "Question: q\\nAnswer: <full worked answer ending #### N>\\n\\n", then "Question: q\\nAnswer:".
  With split="train" those k rows are dropped from the examples: a prompt must not contain its answer.
- math (MATH-500), shots=0: an instruction to put the answer in \\boxed{}, then
  "Problem:\\n...\\n\\nSolution:"; shots=1..4: lm-eval's minerva_math exemplars (Lewkowycz et al. 2022).
- arith: a four-example few-shot completion prompt (see tasks/arith.py).
- jsonl:PATH: the file's `prompt` column as is.
With a tool (`tools="python"|"calculator"`, docs/tools.md): gsm8k and math open with a line saying how to call
it; arith's shots show each sum worked with the calculator ("2 + 3 = <calc>2 + 3</calc> <result>5</result> 5").
Answers are scored as without the tool, on what the model wrote outside its calls.
chat_template=True wraps the whole text as one user message with the tokenizer's chat template (as
lm-eval does without --fewshot_as_multiturn).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.tasks import arith as arith_mod
from qerl_cli.tasks.answers import gsm8k_gold, parse_number

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

GSM8K_INSTRUCTION = (
    "Solve the following math problem step by step. "
    'End your answer with a final line of the form "#### <number>", for example "#### 42".'
)
MATH_INSTRUCTION = (
    "Solve the following math problem step by step. Put your final answer within \\boxed{}."
)

# lm-eval's gsm8k stops at the next "Question:"; minerva_math at the next "Problem:".
GSM8K_STOP: tuple[str, ...] = ("Question:",)
MATH_STOP: tuple[str, ...] = ("Problem:",)

# lm-eval minerva_math's four exemplars (its first problem carries a stray "}" there; dropped here).
MATH_SHOTS: tuple[tuple[str, str], ...] = (
    (
        "Find the domain of the expression  $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.",
        "The expressions inside each square root must be non-negative. Therefore, $x-2 \\ge 0$, so "
        "$x\\ge2$, and $5 - x \\ge 0$, so $x \\le 5$. Also, the denominator cannot be equal to zero, so "
        "$5-x>0$, which gives $x<5$. Therefore, the domain of the expression is $\\boxed{[2,5)}$.\n"
        "Final Answer: The final answer is $[2,5)$. I hope it is correct.",
    ),
    (
        "If $\\det \\mathbf{A} = 2$ and $\\det \\mathbf{B} = 12,$ then find "
        "$\\det (\\mathbf{A} \\mathbf{B}).$",
        "We have that $\\det (\\mathbf{A} \\mathbf{B}) = (\\det \\mathbf{A})(\\det \\mathbf{B}) = "
        "(2)(12) = \\boxed{24}.$\nFinal Answer: The final answer is $24$. I hope it is correct.",
    ),
    (
        "Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, "
        "how many times must Terrell lift them in order to lift the same total weight?",
        "If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\\cdot 12\\cdot20=480$ "
        "pounds of weight.  If he lifts two 15-pound weights instead for $n$ times, he will lift a total "
        "of $2\\cdot15\\cdot n=30n$ pounds of weight.  Equating this to 480 pounds, we can solve for $n$:\n"
        "\\begin{align*}\n30n&=480\\\\\n\\Rightarrow\\qquad n&=480/30=\\boxed{16}\n\\end{align*}\n"
        "Final Answer: The final answer is $16$. I hope it is correct.",
    ),
    (
        "If the system of equations\n\n\\begin{align*}\n6x-4y&=a,\\\\\n6y-9x &=b.\n\\end{align*}has a "
        "solution $(x, y)$ where $x$ and $y$ are both nonzero,\nfind $\\frac{a}{b},$ assuming $b$ is "
        "nonzero.",
        "If we multiply the first equation by $-\\frac{3}{2}$, we obtain\n\n$$6y-9x=-\\frac{3}{2}a.$$"
        "Since we also know that $6y-9x=b$, we have\n\n$$-\\frac{3}{2}a=b\\Rightarrow\\frac{a}{b}="
        "\\boxed{-\\frac{2}{3}}.$$\nFinal Answer: The final answer is $-\\frac{2}{3}$. I hope it is correct.",
    ),
)

TASK_NAMES = ("gsm8k", "math500", "arith", "jsonl:PATH")
MATH_ALIASES = ("math", "math500", "math-500", "math_500")

_PLAIN_NUMBER = re.compile(r"\s*[-+\u2212]?\$?(\d[\d,]*(\.\d+)?|\.\d+)(\s*/\s*\d+)?\s*%?\s*")

# Default sizes of generated arith splits (the test size is further capped by distinct problems).
ARITH_TRAIN_SIZE = 2000
ARITH_TEST_SIZE = 200


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    """A loaded task: its examples plus everything needed to generate for them and score them.

    build_prompt turns a raw question into the final prompt text, with the same shots and chat
    wrapping as the examples, so callers can prompt for new questions consistently.
    """

    name: str
    split: str
    examples: list[Example]
    reward: str
    stop: tuple[str, ...]
    build_prompt: Callable[[str], str]
    shots: int = 0
    chat_template: bool = False
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS; () none (fixed lengths)

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def prompts(self) -> list[str]:
        return [e.prompt for e in self.examples]

    @property
    def answers(self) -> list[str]:
        return [e.answer for e in self.examples]

    def to_records(self) -> list[dict[str, Any]]:
        """Rows with `prompt`, `answer` and the meta columns: TRL passes the extra columns to rewards."""
        return [{**e.meta, "prompt": e.prompt, "answer": e.answer} for e in self.examples]


def _read_bundled_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise QerlError(f"bundled data file {path} is missing: reinstall qerl (pip install -e .)")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _wrap(text: str, chat_template: bool, tokenizer: Any, system_prompt: str | None, tool: Any = None) -> str:
    if not chat_template:
        return text
    if tokenizer is None:
        raise QerlError("chat_template=True needs a tokenizer: pass the model's tokenizer or use --no-chat")
    if getattr(tokenizer, "chat_template", None) is None:
        raise QerlError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: "
            "use a plain completion prompt (chat_template=False)"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": text})
    # a template with tool calling shows the model the tool's schema; one without ignores it
    extra = {"tools": [tool.schema()]} if tool is not None else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)


def gsm8k_shots_text(shots: int, train_rows: list[dict[str, Any]] | None = None) -> str:
    """The lm-eval gsm8k few-shot block: the first `shots` train rows, each followed by a blank line."""
    if shots == 0:
        return ""
    rows = train_rows if train_rows is not None else _read_bundled_jsonl(DATA_DIR / "gsm8k" / "train.jsonl")
    if shots > len(rows):
        raise QerlError(f"gsm8k has only {len(rows)} train rows for shots, {shots} requested")
    return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows[:shots])


def gsm8k_prompt_text(question: str, shots_text: str, tool_line: str = "") -> str:
    """Prompt text (before any chat wrapping) for one GSM8K question; ``tool_line`` says how to call a tool."""
    if shots_text:
        return f"{tool_line}\n\n{shots_text}Question: {question}\nAnswer:" if tool_line else \
            f"{shots_text}Question: {question}\nAnswer:"
    head = f"{GSM8K_INSTRUCTION} {tool_line}" if tool_line else GSM8K_INSTRUCTION
    return f"{head}\n\nQuestion: {question}\nAnswer:"


def math_prompt_text(problem: str, shots: int, tool_line: str = "") -> str:
    """Prompt text (before any chat wrapping) for one MATH problem, minerva_math style; ``tool_line`` says how to
    call a tool."""
    if shots == 0:
        head = f"{MATH_INSTRUCTION} {tool_line}" if tool_line else MATH_INSTRUCTION
        return f"{head}\n\nProblem:\n{problem}\n\nSolution:"
    block = "".join(f"Problem:\n{p}\n\nSolution: {s}\n\n" for p, s in MATH_SHOTS[:shots])
    return f"{tool_line}\n\n{block}Problem:\n{problem}\n\nSolution:" if tool_line else \
        f"{block}Problem:\n{problem}\n\nSolution:"


def _finish(
    examples: list[Example], limit: int | None, shuffle: bool, seed: int
) -> list[Example]:
    if shuffle:
        examples = examples[:]
        random.Random(f"qerl-task-shuffle:{seed}").shuffle(examples)
    if limit is not None:
        if limit < 0:
            raise QerlError(f"limit must be >= 0, got {limit}")
        examples = examples[:limit]
    return examples


def _load_gsm8k(split: str, shots: int, wrap: Callable[[str], str],
                tool_line: str = "") -> tuple[list[Example], Callable]:
    if split not in ("train", "test"):
        raise QerlError(f"gsm8k has splits 'train' and 'test', not {split!r}")
    train_rows = _read_bundled_jsonl(DATA_DIR / "gsm8k" / "train.jsonl")
    rows = train_rows if split == "train" else _read_bundled_jsonl(DATA_DIR / "gsm8k" / "test.jsonl")
    shots_text = gsm8k_shots_text(shots, train_rows)

    def build(question: str) -> str:
        return wrap(gsm8k_prompt_text(question, shots_text, tool_line))

    first = shots if split == "train" else 0
    examples = [
        Example(build(r["question"]), gsm8k_gold(r["answer"]), {"index": i, "question": r["question"],
                                                                 "solution": r["answer"]})
        for i, r in enumerate(rows)
        if i >= first
    ]
    return examples, build


def _load_math500(split: str, shots: int, wrap: Callable[[str], str],
                  tool_line: str = "") -> tuple[list[Example], Callable]:
    if split != "test":
        raise QerlError(f"MATH-500 has only a 'test' split, not {split!r}: use --split test")
    if not 0 <= shots <= len(MATH_SHOTS):
        raise QerlError(f"math supports 0 to {len(MATH_SHOTS)} shots (minerva_math exemplars), got {shots}")
    rows = _read_bundled_jsonl(DATA_DIR / "math500" / "test.jsonl")

    def build(problem: str) -> str:
        return wrap(math_prompt_text(problem, shots, tool_line))

    examples = [
        Example(
            build(r["problem"]),
            r["answer"],
            {"index": i, "problem": r["problem"], "solution": r["solution"], "subject": r["subject"],
             "level": r["level"], "unique_id": r["unique_id"]},
        )
        for i, r in enumerate(rows)
    ]
    return examples, build


def _load_arith(
    split: str, shots: int, wrap: Callable[[str], str], level: Any, limit: int | None, seed: int,
    tool: Any = None,
) -> tuple[list[Example], Callable]:
    if split not in ("train", "test"):
        raise QerlError(f"arith has splits 'train' and 'test', not {split!r}")
    if limit is not None:
        n = limit
    elif split == "train":
        n = ARITH_TRAIN_SIZE
    else:
        n = min(ARITH_TEST_SIZE, arith_mod.max_unique(level, "test"))

    def build(problem: str) -> str:
        return wrap(arith_mod.arith_prompt(problem, shots, tool))

    problems = arith_mod.generate_arith(n, level, split, seed)
    examples = [
        Example(build(p.text), str(p.answer), {"a": p.a, "op": p.op, "b": p.b, "level": p.level})
        for p in problems
    ]
    return examples, build


def _jsonl_line(raw: bytes, where: str) -> Any:
    """One line of a task file as JSON: a QerlError naming ``where`` (file:line) if it is not UTF-8 or not JSON."""
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not part of the JSON
    except UnicodeDecodeError as exc:
        raise QerlError(f"{where}: not UTF-8 text (byte offset {exc.start} in the line): save the file as "
                        "UTF-8") from None
    try:
        return json.loads(text.rstrip("\r\n"))  # without its newline, a cut line's error points into the line
    except json.JSONDecodeError as exc:
        raise QerlError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON "
                        'object like {"prompt": "...", "answer": "..."}') from None
    except (ValueError, RecursionError) as exc:  # an integer over Python's digit limit, nesting past the stack
        raise QerlError(f"{where}: not a JSON object qerl can read ({type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0][:80]})") from None


def _check_row(row: Any, where: str) -> dict[str, Any]:
    """A task row with a non-empty string 'prompt' and a string or number 'answer'; else a QerlError at ``where``."""
    if not isinstance(row, dict):
        raise QerlError(f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(row).__name__}")
    for column in ("prompt", "answer"):
        if column not in row or row[column] is None:
            raise QerlError(f"{where}: missing column '{column}'; every line needs 'prompt' and 'answer'")
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        raise QerlError(f"{where}: 'prompt' must be a non-empty string")
    if not isinstance(row["answer"], (str, int, float)) or isinstance(row["answer"], bool):
        raise QerlError(f"{where}: 'answer' must be a string or a number, got {type(row['answer']).__name__}")
    if not str(row["answer"]).strip():
        raise QerlError(f"{where}: 'answer' is empty")
    return row


def load_jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a user task file; every problem raises a one-line QerlError naming file and line."""
    if not path.is_file():
        raise QerlError(f"task file {path} does not exist: give jsonl:PATH to a file with one JSON object "
                        "per line holding 'prompt' and 'answer'")
    rows: list[dict[str, Any]] = []
    try:
        with path.open("rb") as f:  # bytes: a line that is not UTF-8 is named, not a decode error mid-file
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    rows.append(_check_row(_jsonl_line(raw, f"{path}:{lineno}"), f"{path}:{lineno}"))
    except OSError as exc:
        raise QerlError(f"task file {path} cannot be read: {exc.strerror or exc}") from None
    if not rows:
        raise QerlError(f"task file {path} is empty: add one JSON object per line with 'prompt' and 'answer'")
    return rows


def _load_jsonl(path_text: str, wrap: Callable[[str], str]) -> tuple[list[Example], Callable, str]:
    if not path_text:
        raise QerlError("jsonl task needs a path: use jsonl:PATH, e.g. jsonl:data/my_task.jsonl")
    rows = load_jsonl_rows(Path(path_text).expanduser())
    examples = [
        Example(wrap(r["prompt"]), str(r["answer"]),
                {k: v for k, v in r.items() if k not in ("prompt", "answer")} | {"index": i})
        for i, r in enumerate(rows)
    ]
    # Numeric answers get the GSM8K-style number reward; anything else needs the MATH grader.
    numeric = all(_PLAIN_NUMBER.fullmatch(e.answer) and parse_number(e.answer) is not None for e in examples)
    return examples, wrap, ("gsm8k" if numeric else "math")


def _prompt_tool(key: str, tools: str | None) -> Any:
    """The tool whose calls the prompts show (None without one); arith's shots exist for the calculator only."""
    if not tools:
        return None
    from qerl_cli.tools import make_tool

    if key == "arith" and tools != "calculator":
        raise QerlError(f"arith prompts show the calculator, not {tools!r}: use --tools calculator")
    return make_tool(tools)


def default_shots(name: str) -> int:
    """The few-shot examples a task's prompts carry unless ``shots`` says otherwise: arith's worked sums, none
    elsewhere."""
    return len(arith_mod.SHOTS) if name.partition(":")[0].strip().lower() == "arith" else 0


def load_task(
    name: str,
    split: str = "train",
    shots: int | None = None,
    chat_template: bool = False,
    tokenizer: Any = None,
    limit: int | None = None,
    seed: int = 0,
    *,
    shuffle: bool = False,
    level: int | str | list[int] | None = None,
    system_prompt: str | None = None,
    tools: str | None = None,
) -> Task:
    """Load a task by name: "gsm8k", "math"/"math500", "arith" (or "arith:<level>"), "jsonl:PATH".

    shots=None takes the task's default (gsm8k 0, math 0, arith 4, jsonl 0). limit keeps the first
    `limit` examples (after a seeded shuffle if shuffle=True); for arith it is the number generated.
    level is arith's difficulty knob (see tasks/arith.py); "arith:3" sets it from the name. ``tools``
    ("python", "calculator") writes the prompts for episodes with that tool (docs/tools.md).
    """
    key, _, arg = name.partition(":")
    key = key.strip().lower()

    tool = _prompt_tool(key, tools)

    def wrap(text: str) -> str:
        return _wrap(text, chat_template, tokenizer, system_prompt, tool)

    if chat_template:
        wrap("")  # fail before loading anything if the tokenizer cannot do it
    if shots is not None and shots < 0:
        raise QerlError(f"shots must be >= 0, got {shots}")

    tool_line = tool.describe() if tool is not None else ""
    if key == "gsm8k" and not arg:
        k = default_shots(key) if shots is None else shots
        examples, build = _load_gsm8k(split, k, wrap, tool_line)
        task = Task("gsm8k", split, examples, "gsm8k", GSM8K_STOP, build, k, chat_template, 256)
    elif key in MATH_ALIASES and not arg:
        k = default_shots(key) if shots is None else shots
        examples, build = _load_math500(split, k, wrap, tool_line)
        task = Task("math500", split, examples, "math", MATH_STOP, build, k, chat_template, 1024)
    elif key == "arith":
        k = default_shots(key) if shots is None else shots
        if arg and level is not None:
            raise QerlError(f"arith level given twice ({name!r} and level={level!r}): use one")
        lv = arg or level or "mixed"
        examples, build = _load_arith(split, k, wrap, lv, limit, seed, tool)
        task = Task("arith", split, examples, "arith", arith_mod.STOP_STRINGS, build, k, chat_template, 8)
        task.examples = _finish(task.examples, None, shuffle, seed)
        return task
    elif key == "jsonl":
        if shots:
            raise QerlError("jsonl tasks use their 'prompt' column as is: put any shots in the prompts")
        examples, build, reward = _load_jsonl(arg.strip(), wrap)
        task = Task(f"jsonl:{arg.strip()}", split, examples, reward, (), build, 0, chat_template, 512)
    else:
        raise QerlError(f"unknown task {name!r}: use one of {', '.join(TASK_NAMES)}")
    task.examples = _finish(task.examples, limit, shuffle, seed)
    return task
