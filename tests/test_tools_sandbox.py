"""The Python sandbox (qerl_cli/tools/sandbox.py) holds model-written code to its limits, and the built-in tools turn
what the code did (a crash included) into an observation. Each run is one short-lived process (~0.1 s)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from qerl_cli.tools import Calculator, PythonTool
from qerl_cli.tools.calculator import CalcError, evaluate
from qerl_cli.tools.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_s=1, wall_s=10.0, memory_mb=512, processes=8, output_chars=300)


def live_members(pgid: int) -> list[int]:
    """Processes of a process group that are still running (a killed child may linger as a zombie until reaped)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def test_infinite_loop_is_killed_at_its_cpu_limit() -> None:
    res = run_python("print('started')\nwhile True:\n    pass\n", LIMITS)
    assert res.error == "killed: CPU time limit of 1 s"  # the CPU limit, not the 10 s wall clock, stopped it
    assert res.stdout == "started\n"  # unbuffered: what it printed before the kill is kept


def test_sleep_is_killed_at_the_wall_clock() -> None:
    res = run_python("import time\ntime.sleep(60)\n", SandboxLimits(wall_s=1.0))
    assert res.error == "timed out: wall-clock limit of 1 s" and res.exit_code is None


def test_fork_bomb_is_refused_and_the_group_is_killed() -> None:
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n"
            "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('refused after', n, e.errno)\n")
    res = run_python(code, LIMITS)
    assert res.error is None, res.stderr
    words = res.stdout.split()
    assert words[:2] == ["refused", "after"] and int(words[2]) < LIMITS.processes and words[3] == "11"  # EAGAIN
    deadline = time.monotonic() + 5.0  # SIGKILL went to the whole group; the kernel takes a moment to finish them
    while live_members(res.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_members(res.pid) == []  # the children sleeping 60 s were killed with the group


def test_ten_gigabyte_allocation_is_refused() -> None:
    res = run_python("b = bytearray(10 * 1024 ** 3)\nprint('allocated')\n", LIMITS)
    assert res.error == "exit code 1: MemoryError (memory limit of 512 MB)" and "allocated" not in res.stdout


def test_output_is_truncated_and_files_are_capped() -> None:
    res = run_python("print('x' * 100000)\n", LIMITS)
    assert res.error is None and res.truncated and res.stdout == "x" * LIMITS.output_chars
    big = run_python("open('big', 'wb').write(b'0' * (64 << 20))\n", SandboxLimits(file_mb=1))
    assert big.error == "exit code 1: OSError: [Errno 27] File too large"


def test_environment_is_emptied_and_stdin_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_TEST_SECRET", "s3cret")
    res = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ.get('QERL_TEST_SECRET'))\n", LIMITS)
    names = eval(res.stdout.splitlines()[0])  # noqa: S307 - a list literal the test's own code printed
    assert "QERL_TEST_SECRET" not in names and res.stdout.splitlines()[1] == "None"
    assert set(names) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONIOENCODING", "OMP_NUM_THREADS",
                          "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    assert run_python("input()\n", LIMITS).error == "exit code 1: EOFError: EOF when reading a line"


def test_each_run_gets_a_fresh_directory_removed_afterwards() -> None:
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nopen('note.txt', 'w').write('hi')\n"
    first, second = run_python(code, LIMITS), run_python(code, LIMITS)
    assert second.stdout.splitlines()[1] == "['main.py']"  # the first run's note.txt is not there
    if "private-root" not in first.layers:  # a host directory of its own, removed afterwards
        cwd1, cwd2 = first.stdout.splitlines()[0], second.stdout.splitlines()[0]
        assert cwd1 != cwd2 and not Path(cwd1).exists() and not Path(cwd2).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the drop to another uid happens when qerl runs as root")
def test_as_root_the_code_runs_as_another_uid_and_cannot_write_root_files(tmp_path: Path) -> None:
    target = tmp_path / "owned_by_root.txt"
    target.write_text("keep")
    target.chmod(0o644)
    res = run_python(f"import os\nprint(os.getuid())\nopen({str(target)!r}, 'w').write('gone')\n", LIMITS)
    # not there at all in a private root; there but not writable without one
    assert res.stdout.split()[0] != "0" and ("PermissionError" in res.error or "FileNotFoundError" in res.error)
    assert target.read_text() == "keep"


def test_python_tool_turns_a_crash_into_an_observation() -> None:
    tool = PythonTool(LIMITS)
    turn = "Let me compute.\n```python\nx = 6 * 7\nprint(x)\nprint(1 / 0)\n```\n"
    assert tool.find_call(turn) == "x = 6 * 7\nprint(x)\nprint(1 / 0)"
    out = tool.run(tool.find_call(turn))
    assert out.error == "exit code 1: ZeroDivisionError: division by zero"
    assert out.observation == "```output\n42\nexit code 1: ZeroDivisionError: division by zero\n```\n"
    ok = tool.run("print(sum(range(10)))")
    assert ok.error is None and ok.observation == "```output\n45\n```\n"
    assert tool.run("x = 1").observation == "```output\n(no output; print() what you want to see)\n```\n"
    # a turn that does not end in a call (or an unclosed block) is no call
    assert tool.find_call("The answer is 4.\n#### 4") is None and tool.find_call("```python\nprint(1)") is None
    assert tool.strip_calls(turn + "So #### 42") == "Let me compute.\n\nSo #### 42"


def test_chat_template_tool_calls_and_tool_turns(tiny_source: Path) -> None:
    """With --chat-template a call may be the template's tagged JSON, and the output comes back as its tool turn."""
    from transformers import AutoTokenizer

    from qerl_cli.tools.chat import chat_observation

    tool = PythonTool(LIMITS)
    tagged = 'Compute it.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
    assert tool.find_call(tagged) == "print(6 * 7)" and "</tool_call>" in tool.stop
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert tool.find_call(as_string) == "print(1)"
    assert tool.find_call('<tool_call>{"name": "search", "arguments": {"code": "x"}}</tool_call>') is None
    assert tool.strip_calls(tagged + " So #### 42") == "Compute it.\n So #### 42"
    assert Calculator().find_call('<tool_call>{"name": "calculator", "arguments": {"expression": "5 + 8"}}'
                                  '</tool_call>') == "5 + 8"
    # SmolLM2's template renders any role the same way: the assistant turn closed, a tool turn, the next one opened
    render = chat_observation(AutoTokenizer.from_pretrained(str(tiny_source)))
    want = "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert render(tool.run("print(6 * 7)").text) == want


def test_calculator_evaluates_a_whitelist_only() -> None:
    assert evaluate("12 * (3 + 4)") == 84 and evaluate("7 / 2") == 3.5 and evaluate("2 ** 10 - 1") == 1023
    for bad, why in [("__import__('os')", "only numbers"), ("1 / 0", "division by zero"), ("9 ** 99", "exponent"),
                     ("", "empty"), ("2 +", "not an arithmetic")]:
        with pytest.raises(CalcError, match=why):
            evaluate(bad)
    calc = Calculator()
    assert calc.find_call(" <calc>5 + 8</calc>") == "5 + 8"
    assert calc.find_call(" <calc>5 + 8</calc><") == "5 + 8"  # the rest of the token that completed the closer
    assert calc.find_call(" 13\n") is None
    assert calc.run("5 + 8").observation == " <result>13</result>"
    failed = calc.run("5 / 0")
    assert failed.error == "division by zero" and failed.observation == " <result>error: division by zero</result>"
    assert calc.strip_calls(" <calc>5 + 8</calc> 13\n") == "  13\n"
