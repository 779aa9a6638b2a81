"""Bad `qerl train` input in every form it comes in (a YAML file, a flag, `--set`, a task file, a prompt) is one
line and exit 2, never an internal error, a silently accepted value or a stall."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qerl_cli.errors import QerlError
from tests.helpers import deadline, qerl_in_process


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`qerl ARGS` in this process: exit code, stdout, stderr."""
    return qerl_in_process(capsys, *args)


def assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line and "internal error" not in line, line
    for needle in needles:
        assert needle in line, line


def billion_laughs() -> bytes:
    """Twelve levels of ten aliases each inside a valid option: 10**12 strings once expanded."""
    lines = ["steps: 3", "lora_targets:", f"  - &l0 [{', '.join(['lol'] * 10)}]"]
    lines += [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 13)]
    return "\n".join(lines).encode() + b"\n"


YAML_CASES = [
    (b'steps: "ten"\n', ["--steps must be an integer, got 'ten'"]),
    (b'lora_rank: "16"\n', ["--lora-rank must be an integer, got '16' (write it without quotes)"]),
    (b"steps: true\n", ["--steps must be an integer, got True"]),
    (b'aqn: "yes please"\n', ["--aqn must be true or false, got 'yes please'"]),
    (b"top_p: 2\n", ["--top-p must be in (0, 1], got 2.0"]),
    (b"task_level: 3\n", ["--task-level must be text, got 3 (quote it to give text)"]),
    (b"1: 2\n", ["option names are text, got 1 (int)"]),
    (b"steps: 3\nsteps: 4\n", ["'steps' is given twice at line 2"]),
    (b"lora-rank: 4\nlora_rank: 8\n", ["lora_rank is given twice"]),
    (b'task: "caf\xe9"\n', ["is not UTF-8 text (byte offset 10, line 1)"]),
    (b"- steps\n", ["must be a mapping of `option: value` lines, not a list"]),
    (b"[" * 100_000 + b"\n", ["is not a config qerl can read (RecursionError"]),
    (b"seed: !!float abc\n", ["is not a config qerl can read (ValueError"]),
    (b"steps: 3\n# " + b"x" * (1 << 20) + b"\n", [f"is over {1 << 20} bytes"]),
    (billion_laughs(), ["found the alias *l0 (config files may not use aliases", "line 4"]),
]


@pytest.mark.parametrize(("text", "needles"), YAML_CASES, ids=[str(i) for i in range(len(YAML_CASES))])
def test_bad_yaml_config_is_one_line_naming_the_file(text: bytes, needles: list[str], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(text)
    with deadline(30):  # the alias file made `--dry-run` copy 10**12 strings until killed
        code, _, err = cli(capsys, "train", "--run", str(tmp_path / "r"), "--config", str(path), "--dry-run")
    assert_one_line(code, err, f"config {path}", *needles)


def test_yaml_reads_exponent_floats_and_dashed_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`lr: 1e-5` is the number every user means (YAML 1.1 reads it as text); ints widen for float options."""
    import yaml

    path = tmp_path / "ok.yaml"
    path.write_text("lr: 1e-5\nlora-rank: 4\nmax_grad_norm: 2\n")
    code, out, err = cli(capsys, "train", "--run", str(tmp_path / "r"), "--config", str(path), "--dry-run")
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["lr"] == 1e-5 and cfg["lora_rank"] == 4 and cfg["max_grad_norm"] == 2.0
    assert isinstance(cfg["max_grad_norm"], float) and cfg["truncate_prompts"] is False


FLAG_CASES = [
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number, got inf"),
    (["--beta", "nan"], "--beta must be a finite number, got nan"),
    (["--beta", "-1"], "--beta must be >= 0, got -1.0"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "nan"], "--top-p must be a finite number, got nan"),
    (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["--lora-alpha", "nan"], "--lora-alpha must be a finite number, got nan"),
    (["--max-grad-norm", "nan"], "--max-grad-norm must be a finite number, got nan"),
    (["--max-prompt-length", "0"], "--max-prompt-length must be >= 1, got 0"),
    (["--aqn-sigma-end", "-1"], "--aqn-sigma-end must be > 0, got -1.0"),
    (["--correction-cap", "nan"], "--correction-cap must be a finite number, got nan"),
    (["--steps", "99999999999999999999"], "--steps must be <= 2147483648, got 99999999999999999999"),
    (["--lora-targets", ","], "--lora-targets must be a non-empty list of names, got []"),
    (["--overlong-buffer", "300", "--max-completion-length", "256"], "--overlong-buffer (300) must be <="),
    (["--set", "top_p=2"], "--set top_p='2': --top-p must be in (0, 1], got 2.0"),
    (["--set", "lr=nan"], "--set lr='nan': --lr must be a finite number, got nan"),
    (["--set", "steps=ten"], "--set steps='ten': expected int"),
    (["--set", "steps=99999999999999999999"], "--steps must be <= 2147483648"),
    (["--set", "aqn=yes please"], "--set aqn='yes please': expected bool"),
    (["--set", "seed=-1"], "--seed must be in [0, 4294967295], got -1"),
]


@pytest.mark.parametrize(("args", "needle"), FLAG_CASES, ids=[" ".join(a) for a, _ in FLAG_CASES])
def test_bad_numbers_on_the_command_line_are_refused(args: list[str], needle: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "train", "--run", str(tmp_path / "r"), "--config", "quick_cpu", *args, "--dry-run")
    assert_one_line(code, err, needle)


def test_one_parser_for_train_set_and_bench_grids() -> None:
    """`qerl bench step|sanity --set/--grid` parse and check a value as `qerl train --set` does."""
    from qerl_cli.bench.overrides import parse_grid
    from qerl_cli.train.config import build_config, parse_sets

    with pytest.raises(QerlError, match=r"^--grid top_p='2': --top-p must be in \(0, 1\], got 2.0$"):
        parse_grid(["top_p=0.5,2"], ("bf16",))
    with pytest.raises(QerlError, match=r"^--grid temperature='inf': --temperature must be a finite number"):
        parse_grid(["temperature=1,inf"], ("bf16",))
    assert parse_grid(["top_p=0.5,1"], ("bf16",)) == {"top_p": [0.5, 1.0]}
    assert parse_sets(["lr=1e-4", "lora_alpha=16", "correction_cap=none"]) == {
        "lr": 1e-4, "lora_alpha": 16.0, "correction_cap": None}
    with pytest.raises(QerlError, match=r"^--lr must be a number, got '1e-4' \(write it without quotes\)$"):
        build_config(None, {"lr": "1e-4"})  # the library path checks as strictly as the command line


# ---- task files --------------------------------------------------------------------------------------------------
def test_jsonl_task_file_errors_name_file_and_line(tmp_path: Path) -> None:
    from qerl_cli.tasks import load_task

    good = b'{"prompt": "1 + 1 =", "answer": "2"}\n'
    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "answer": "3"}\n')
    with pytest.raises(QerlError, match=rf"^{bad_utf8}:3: not UTF-8 text \(byte offset 15 in the line\)"):
        load_task(f"jsonl:{bad_utf8}")
    bad_json = tmp_path / "cut.jsonl"
    bad_json.write_bytes(good + good + b'{"prompt": "2 + 2 =", "answer": \n')
    with pytest.raises(QerlError, match=rf"^{bad_json}:3: not valid JSON \(Expecting value at column 33\)"):
        load_task(f"jsonl:{bad_json}")
    deep = tmp_path / "deep.jsonl"
    deep.write_bytes(good + b"[" * 100_000 + b"\n")
    with pytest.raises(QerlError, match=rf"^{deep}:2: not a JSON object qerl can read \(RecursionError"):
        load_task(f"jsonl:{deep}")
    bom = tmp_path / "bom.jsonl"  # a byte-order mark as some editors write it is not an error
    bom.write_bytes(b"\xef\xbb\xbf" + good)
    assert [(e.prompt, e.answer) for e in load_task(f"jsonl:{bom}").examples] == [("1 + 1 =", "2")]


def test_reward_file_that_does_not_compile_is_named_with_its_line(tmp_path: Path) -> None:
    from qerl_cli.tasks import get_reward

    path = tmp_path / "my_reward.py"
    path.write_text("def score(prompts, completions, **kw):\n    return [1.0 for c in completions\n")
    with pytest.raises(QerlError, match=rf"^reward file {path}:2: '\[' was never closed; fix the file"):
        get_reward(f"{path}:score")


# ---- prompts longer than --max-prompt-length ----------------------------------------------------------------------
def test_long_prompts_refused_or_cut_to_their_end(tiny_source: Path) -> None:
    from transformers import AutoTokenizer

    from qerl_cli.tasks.prompt_ids import encode_prompt

    tok = AutoTokenizer.from_pretrained(str(tiny_source))
    text = " ".join(f"w{i}" for i in range(200))
    full = tok(text, add_special_tokens=False).input_ids
    assert 64 < len(full) <= 16 * 64  # over the token limit, under the character guard: the tokens decide
    assert encode_prompt(tok, text, max_tokens=len(full), add_bos=False, truncate=False) == full
    with pytest.raises(QerlError, match=rf"^example 7 has {len(full)} tokens, over --max-prompt-length 64: .*"
                                        "--truncate-prompts to keep its last 64 tokens$"):
        encode_prompt(tok, text, max_tokens=64, add_bos=False, truncate=False, where="example 7")
    assert encode_prompt(tok, text, max_tokens=64, add_bos=False, truncate=True) == full[-64:]
    bos = tok.bos_token_id
    assert encode_prompt(tok, text, max_tokens=64, add_bos=True, truncate=True) == [bos] + full[-63:]

    huge = "x" * 1_000_000 + text  # cut to its last 16 x 64 characters before the tokenizer sees it
    with pytest.raises(QerlError, match=rf"^example 2 has {len(huge)} characters, over the 1024 that "
                                        r"--max-prompt-length 64 allows \(16 per token\)"):
        encode_prompt(tok, huge, max_tokens=64, add_bos=False, truncate=False, where="example 2")
    assert encode_prompt(tok, huge, max_tokens=64, add_bos=False, truncate=True) == full[-64:]


def test_train_refuses_an_over_long_task_prompt(tiny_run: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before a token of it is computed, naming the example, its length and the option; with the option the
    run trains on the prompt's end."""
    task = tmp_path / "long.jsonl"
    rows = [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "x" * 5_000_000, "answer": "3"}]
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["train", "--run", str(tiny_run), "--config", "quick_cpu", "--task", f"jsonl:{task}", "--steps", "1",
            "--batch-prompts", "2", "--num-generations", "2", "--max-completion-length", "2", "--lora-rank", "4",
            "--max-prompt-length", "64", "--no-log-rollouts"]
    code, _, err = cli(capsys, *args)
    assert_one_line(code, err, "the prompt of task example 1 (0-based) has 5000000 characters, over the 1024",
                    "--truncate-prompts")
    code, _, err = cli(capsys, *args, "--truncate-prompts")
    assert code == 0, err[-2000:]


def test_eval_refuses_a_prompt_its_context_cannot_hold(tiny_source: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_cli.eval.generation import generate_texts
    from qerl_cli.rollout import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(str(tiny_source))
    tok = AutoTokenizer.from_pretrained(str(tiny_source))
    context = model.config.max_position_embeddings  # 512: 503 tokens left after 8 new ones
    assert context == 512
    with pytest.raises(QerlError, match=r"^prompt 1 \(0-based\) has 1000000 characters, over the 8048 that the "
                                        r"model's context of 512 tokens leaves after --max-tokens 8"):
        generate_texts(model, tok, ["1 + 1 =", "x" * 1_000_000], SamplingParams(max_tokens=8), 4)


def test_every_numeric_option_has_a_range() -> None:
    """A new count or rate gets a decided range, not none by omission."""
    from qerl_cli.train.config import FIELD_RANGES, field_types, split_optional

    numeric = {name for name, tp in field_types().items() if split_optional(tp)[0] in (int, float)}
    assert numeric == set(FIELD_RANGES)
