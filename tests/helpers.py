"""Plain helpers shared by several test files (fixtures live in conftest.py)."""

from __future__ import annotations

import ast
import contextlib
import signal
import sys
from collections import Counter
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the body runs longer than ``seconds``."""
    def expire(*_: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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


def tiny_llama() -> tuple[torch.nn.Module, object]:
    """(model, tokenizer): a tiny random Llama (2 layers, hidden 64, seeded) with the embedded model's tokenizer, so
    CLI runs on it cost the process start, not the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qerl_cli.models import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(cfg).eval(), tok


def random_decoder(config_cls: type, model_cls: type, *, noisy_bias: bool = False, **config: object) -> torch.nn.Module:
    """A seeded random `model_cls(config_cls(**config))` with no special tokens (generation runs to its length) and
    norm weights 1 + 0.3 N(0, 1) (with `noisy_bias`, biases 0.3 N(0, 1)), so layers differ and ties are rare."""
    torch.manual_seed(0)
    model = model_cls(config_cls(eos_token_id=None, bos_token_id=None, pad_token_id=None, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif noisy_bias and name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    return model.eval()


def environ_uses(path: Path, *, writes: bool = False, skip: tuple[str, ...] = ()) -> list[tuple[int, str | None]]:
    """(line, variable) of every use of the process environment in a file, outside the functions named in
    ``skip``: ``os.environ.get(X)``, ``os.getenv(X)``, ``os.environ[X]``, ``X in os.environ``; with ``writes``
    also every other ``os.environ`` method, ``os.putenv`` and assignments. X is a literal or a module-level string
    constant; the variable is None where it is neither."""
    tree = ast.parse(path.read_text())
    skipped = {line for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in skip
               for line in range(f.lineno, (f.end_lineno or f.lineno) + 1)}
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
              and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                and node.value.id == "os")

    def name(arg: ast.AST) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        return consts.get(arg.id) if isinstance(arg, ast.Name) else None

    os_funcs = ("getenv", "putenv") if writes else ("getenv",)
    out: list[tuple[int, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and is_environ(f.value) and (writes or f.attr == "get"):
                out.append((node.lineno, name(node.args[0])))
            elif isinstance(f, ast.Attribute) and f.attr in os_funcs and isinstance(f.value, ast.Name) \
                    and f.value.id == "os":
                out.append((node.lineno, name(node.args[0])))
        elif isinstance(node, ast.Subscript) and is_environ(node.value) \
                and (writes or isinstance(node.ctx, ast.Load)):
            out.append((node.lineno, name(node.slice)))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(is_environ(c) for c in node.comparators):
            out.append((node.lineno, name(node.left)))
    return [(line, var) for line, var in out if line not in skipped]


def name_decisions(source: str, names: Collection[str], kind: str, *, least: int = 1) -> list[tuple[int, str]]:
    """(line, what) for every decision on one of ``names`` as a literal in ``source``: a comparison or membership
    test with one (inline, or a module constant holding at least ``least`` of them), a `case` on one, a dict keyed
    by at least ``least`` of them. Plain data (defaults, labels, a bench's grid, a conditional value) is not a
    decision. ``kind`` names the names in the messages (e.g. "format", "algorithm")."""

    def names_in(node: ast.AST | None) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value] if node.value in names else []
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return [n for e in node.elts for n in names_in(e)]
        return []

    tree = ast.parse(source)
    constants = {t.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
                 and len(names_in(node.value)) >= least
                 for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                out += [(node.lineno, f"compares {n!r}") for n in names_in(operand)]
                if isinstance(operand, ast.Name) and operand.id in constants:
                    out.append((node.lineno, f"compares with {operand.id}, a list of {kind} names"))
        elif isinstance(node, ast.MatchValue | ast.MatchSingleton):
            out += [(node.lineno, f"matches {n!r}") for n in names_in(getattr(node, "value", None))]
        elif isinstance(node, ast.Dict):
            keys = [n for k in node.keys if k is not None for n in names_in(k)]
            if keys and len(keys) >= least:
                out.append((node.lineno, f"dict keyed by {keys}"))
    return sorted(set(out))
