"""Plain helpers shared by several test files (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n inside, restored after. Decode-sized matmuls (a few rows) gain nothing
    from a second thread, and when the 2 CI cores are shared an OpenMP barrier waiting on a descheduled thread
    costs ~8 ms per op (measured: 50x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def qerl_exit_code(*args: str) -> int:
    """`qerl ARGS` in this process (a `qerl` subprocess pays ~12 s of imports before it reads its options): its
    exit code; what it prints goes to the test's captured output."""
    from qerl_cli import cli as qerl_cli

    argv, sys.argv = sys.argv, ["qerl", *args]
    try:
        qerl_cli.main()
        return 0
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = argv


def qerl_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`qerl ARGS` in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    code = qerl_exit_code(*args)
    out, err = capsys.readouterr()
    return code, out, err


class OpCounter(TorchDispatchMode):
    """aten ops a call issues, by name (`with OpCounter() as c: ...; c.counts`), views excluded: they launch
    nothing on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not func.is_view and func is not torch.ops.aten._unsafe_view.default:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))
