"""Shared fixtures. Tests run on CPU; the embedded SmolLM2 model is loaded once per session."""

from __future__ import annotations

import os
import shutil
import tempfile

# Triton kernels run under the interpreter on CPU; this must be set before any kernel module imports.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the dequantized embedded model is cached per session (models.py): the first load converts the GGUF file (~40 s),
# every later one in this process and its subprocesses reads the cache (~1 s); set QERL_CACHE_DIR to keep one
_run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # pytest -n N: the workers of one run share one cache
os.environ.setdefault("QERL_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"qerl-test-cache-{_run_id}") if _run_id
                      else tempfile.mkdtemp(prefix="qerl-test-cache-"))

import contextlib  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _options_restored():
    """Each test starts from the options this process read at start-up (qerl_cli/options.py), and whatever a test
    changes (an override, `dispatch.set_backend`, an in-process CLI run's start-up read) ends with it."""
    from qerl_cli.options import options, set_options

    before = options()
    yield
    set_options(before)


@pytest.fixture
def use_options():
    """`use_options(fused_lora=False, ...)`: other run or kernel options for the rest of the test (typed values or
    the variables' strings), as `monkeypatch.setenv` would have changed the environment."""
    from qerl_cli.options import override

    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(override(**fields))


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct in fp32 with its tokenizer (loaded once per session)."""
    import torch

    from qerl_cli.models import load_model

    torch.manual_seed(0)
    return load_model(None, dtype=torch.float32)


class _QuantizedRuns(dict):
    """fmt -> QuantizeResult, quantized from the shared embedded model on first use."""

    def __init__(self, embedded, tmp_path_factory) -> None:
        super().__init__()
        self._embedded = embedded
        self._factory = tmp_path_factory

    def __missing__(self, fmt: str):
        from qerl_cli.quantize import quantize_model

        path = self._factory.mktemp(f"run_{fmt}")
        self[fmt] = quantize_model(path, None, fmt=fmt, loaded=self._embedded)
        return self[fmt]


@pytest.fixture(scope="session")
def quantized_runs(embedded, tmp_path_factory):
    """Run directories per format (`quantized_runs["nvfp4"]`), each quantized once per session."""
    return _QuantizedRuns(embedded, tmp_path_factory)


@pytest.fixture
def run_dir(quantized_runs, tmp_path):
    """A fresh copy of the session's NVFP4 run (model + manifest; no lock, no train/eval/bench outputs), so
    a test may train or bench in it while the shared run stays as other tests expect it."""
    dst = tmp_path / "run"
    shutil.copytree(quantized_runs["nvfp4"].run, dst, ignore=shutil.ignore_patterns(".lock", "train", "eval", "bench"))
    return dst


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a test module (`pytestmark = pytest.mark.usefixtures("one_thread")`): small
    CPU matmuls on the shared 2-core machine run many times faster than on two threads that wait for each other,
    with the same results."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory):
    """A tiny random Llama (2 layers, hidden 64) with the embedded model's tokenizer, saved as a model directory:
    CLI runs on it cost the process start, not the model."""
    from tests.helpers import tiny_llama

    model, tok = tiny_llama()
    src = tmp_path_factory.mktemp("tiny_src")
    model.save_pretrained(str(src))
    tok.save_pretrained(str(src))
    return src


@pytest.fixture
def text_hash_reward(tmp_path) -> str:
    """``--reward`` for the tiny random model, which solves nothing: a fixed function of the completion's text in
    [0, 1), so every group has unequal rewards (a non-zero gradient), the same on every rank and every rerun."""
    path = tmp_path / "text_hash_reward.py"
    path.write_text("import hashlib\n\n\ndef text_hash(prompts, completions, **kw):\n"
                    "    return [int(hashlib.sha256(c.encode()).hexdigest()[:8], 16) / 16**8 for c in completions]\n")
    return f"{path}:text_hash"


@pytest.fixture
def tiny_run(tiny_source, tmp_path):
    """A fresh run quantized (NVFP4) from the tiny model."""
    from qerl_cli.quantize import quantize_model

    run = tmp_path / "tiny_run"
    quantize_model(run, str(tiny_source), fmt="nvfp4")
    return run
