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
