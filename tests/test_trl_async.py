"""The TRL AsyncGRPOTrainer peer of the async split (qerl_cli/bench/trl_async.py): the parts that decide what it
measures, by hand; the layout's own refusal where TRL or vLLM is missing. It runs for real only on the GPU
(bash scripts/gpu.sh vllm trl, then async_scale --layouts ...,trl_async)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from qerl_cli.bench.async_scale import table
from qerl_cli.bench.trl_async import run_trl_async, server_command, settings, step_rows


def test_settings_make_one_optimizer_step_of_the_same_batch() -> None:
    s = settings(num_generations=8, new_tokens=1024, batch_prompts=64, lr=1e-5, max_staleness=1, port=8123, seed=3)
    assert s["per_device_train_batch_size"] * s["gradient_accumulation_steps"] == 64 * 8
    assert s["token_budget"] == 0  # else TRL fills micro-batches by tokens and a step trains fewer samples
    assert s["max_completion_length"] == 1024 and s["max_staleness"] == 1 and s["weight_sync_steps"] == 1
    assert s["vllm_server_base_url"] == "http://127.0.0.1:8123" and s["learning_rate"] == 1e-5


def test_server_serves_lora_at_the_adapter_rank() -> None:
    cmd = server_command(Path("/m"), 8123, lora_rank=32, max_model_len=1280, max_num_seqs=256)
    assert cmd[cmd.index("--max-lora-rank") + 1] == "32" and "--enable-lora" in cmd
    assert cmd[cmd.index("--max-model-len") + 1] == "1280" and cmd[cmd.index("--model") + 1] == "/m"
    assert cmd[cmd.index("--max-loras") + 1] == "3"  # staleness 1: two live versions and the next one loading
    assert server_command(Path("/m"), 1, lora_rank=4, max_model_len=8, max_num_seqs=2)[
        cmd.index("--max-lora-rank") + 1] == "8"  # vLLM's smallest servable rank


def test_step_rows_count_prompt_and_completion_tokens_per_step_second() -> None:
    """512 samples x 256 prompt tokens + 250,000 completion tokens = 381,072 tokens in 30 s = 12,702 tok/s; the
    first logged step has no predecessor (no perf/step_s) and the warm-up's is dropped."""
    logs = [{"loss": 0.1},
            {"perf/step_s": 40.0, "batch/samples_per_step": 512.0, "batch/trained_tokens_per_step": 1.0},
            {"perf/step_s": 30.0, "batch/samples_per_step": 512.0, "batch/trained_tokens_per_step": 250_000.0,
             "perf/weight_sync_s": 0.6, "perf/rollout_wait_s": 2.0}]
    rows = step_rows(logs, prompt_len=256, warmup=2)
    assert len(rows) == 1 and rows[0]["tokens"] == 512 * 256 + 250_000
    assert rows[0]["tokens_per_s"] == pytest.approx(381_072 / 30) and rows[0]["sync_s"] == 0.6
    assert len(step_rows(logs, prompt_len=256, warmup=1)) == 2


@pytest.mark.skipif(importlib.util.find_spec("trl") is not None and importlib.util.find_spec("vllm") is not None,
                    reason="TRL and vLLM are installed: the layout would run")
def test_missing_trl_is_a_row_that_says_so_not_a_crash(tmp_path: Path) -> None:
    a = SimpleNamespace(shape="tiny", seed=0)
    row = run_trl_async(a, tmp_path / "trl_async.json")
    assert row["status"].startswith("TRL did not run:") and "not installed" in row["status"]
    assert f"| trl_async | 2 | 1 | {row['status']} |" in "\n".join(table([row]))


def test_an_unknown_layout_is_one_line_and_exit_2() -> None:
    res = subprocess.run([sys.executable, "-m", "qerl_cli.bench.async_scale", "--layouts", "sync1,trl"],
                         capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir())
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "unknown layout trl" in res.stderr
    assert json.dumps(res.stdout) == '""'


def test_sdpa_stand_in_keeps_flash_attention_varlen_contract() -> None:
    """Two packed segments (3 queries over 5 keys, 2 over 2), 4 query heads over 2 KV heads: each query row
    attends its own segment's keys up to i + Lk - Lq (FlashAttention's bottom-right causal alignment), computed
    here by an explicit softmax."""
    import torch

    from qerl_cli.bench.trl_runner import varlen_sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 8, generator=g) for n, h in ((5, 4), (7, 2), (7, 2)))
    cu_q, cu_k = torch.tensor([0, 3, 5]), torch.tensor([0, 5, 7])
    out = varlen_sdpa(q, k, v, cu_q, cu_k, 3, 5, softmax_scale=0.5, causal=True)
    want = torch.empty_like(out)
    for (a, b), (c, d) in zip(((0, 3), (3, 5)), ((0, 5), (5, 7)), strict=True):
        for i in range(b - a):
            for h in range(4):
                keys = range(c, c + i + (d - c) - (b - a) + 1)
                w = torch.softmax(torch.stack([0.5 * q[a + i, h] @ k[j, h // 2] for j in keys]), 0)
                want[a + i, h] = sum(wj * v[j, h // 2] for wj, j in zip(w, keys, strict=True))
    assert torch.allclose(out, want, atol=1e-5)
    with pytest.raises(NotImplementedError):
        varlen_sdpa(q, k, v, cu_q, cu_k, 3, 5, window_size=(4, 0))


def _proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_a_server_that_dies_ends_the_wait_at_once_with_its_code(tmp_path: Path) -> None:
    """The GPU run of 2026-11-29: vLLM's server died on a missing package and TRL's runner waited for it until the
    layout's time limit. A server that exits must end the wait within a poll, and its log's error must be the why."""
    from qerl_cli.bench.trl_async import last_error, wait_runner

    runner, server = _proc("import time; time.sleep(60)"), _proc("import sys; sys.exit(3)")
    try:
        code, server_code = wait_runner(runner, server, timeout_s=50.0, poll_s=0.05)
    finally:
        runner.kill()
    assert (code, server_code) == (None, 3) and runner.poll() is not None  # the runner was stopped, not left
    log = tmp_path / "server.log"
    log.write_text("INFO starting\nTraceback (most recent call last):\n  File x\n"
                   "ModuleNotFoundError: No module named 'uvicorn'\n")
    assert last_error(log) == "ModuleNotFoundError: No module named 'uvicorn'"


def test_a_runner_that_ends_first_returns_its_code_and_a_live_server_none() -> None:
    from qerl_cli.bench.trl_async import wait_runner

    runner, server = _proc("import sys; sys.exit(0)"), _proc("import time; time.sleep(60)")
    try:
        assert wait_runner(runner, server, timeout_s=50.0, poll_s=0.05) == (0, None)
        slow = _proc("import time; time.sleep(60)")
        assert wait_runner(slow, server, timeout_s=0.2, poll_s=0.05) == (None, None)  # past the limit
        assert slow.poll() is not None
    finally:
        server.kill()


def test_a_runner_that_wrote_its_result_and_hangs_is_ended_after_the_grace() -> None:
    """The GPU run of 2026-11-30: TRL trained every step and wrote its result, then its exit waited on TRL's
    rollout worker until the bench's limit ended everything. A finished runner gets only the grace to exit."""
    from qerl_cli.bench.trl_async import wait_runner

    runner, server = _proc("import time; time.sleep(60)"), _proc("import time; time.sleep(60)")
    try:
        t = time.monotonic()
        assert wait_runner(runner, server, timeout_s=50.0, poll_s=0.05, finished=lambda: True,
                           grace_s=0.3) == (None, None)
        assert time.monotonic() - t < 5 and runner.poll() is not None
    finally:
        runner.kill()
        server.kill()


# two optimizer steps as TRL 1.16's console printed them on the GPU (2026-11-30), keys cut to those the row reads
TRL_LOG = """  0%|          | 0/3 [00:00<?, ?it/s]
 33%|###       | 1/3 [02:00<04:01, 120.73s/it]   {'loss': '0.03654', 'perf/weight_sync_s': '2.746', \
'batch/trained_tokens_per_step': '2.375e+05', 'batch/samples_per_step': '512', 'perf/rollout_wait_s': '34.75', \
'completions/mean_length': '479.6'}
 67%|######    | 2/3 [03:01<01:25, 85.68s/it]    {'loss': '-0.009019', 'perf/weight_sync_s': '0.4434', \
'batch/trained_tokens_per_step': '2.417e+05', 'batch/samples_per_step': '512', 'perf/step_s': '56.8', \
'perf/rollout_wait_s': '0.5204', 'completions/mean_length': '444.5'}
100%|##########| 3/3 [04:32<00:00, 88.04s/it]    {'loss': '-0.03328', 'perf/weight_sync_s': '0.8173', \
'batch/trained_tokens_per_step': '2.384e+05', 'batch/samples_per_step': '512', 'perf/step_s': '91.22', \
'perf/rollout_wait_s': '30.62', 'completions/mean_length': '459', 'sample/dropped_stale_total': '1224'}
100%|##########| 3/3 [04:33<00:00, 88.04s/it]    {'train_runtime': '273.6', 'epoch': '1'}
"""


def test_the_row_from_trls_console_log_when_no_result_file_was_written(tmp_path: Path) -> None:
    from qerl_cli.bench.trl_async import log_history_from, measured_row

    log = tmp_path / "runner.log"
    log.write_text(TRL_LOG)
    logs = log_history_from(log)
    assert [h["loss"] for h in logs] == [0.03654, -0.009019, -0.03328]  # the summary dict has no loss: left out
    row = measured_row({}, logs, prompt_len=256, warmup=1)
    # by hand: (512 x 256 prompt + trained completion tokens) / TRL's step time, for the two timed steps
    per_s = sorted([(512 * 256 + 241_700) / 56.8, (512 * 256 + 238_400) / 91.22])
    assert row["status"] == "ok" and row["trained_tokens_per_s"] == pytest.approx(sum(per_s) / 2)
    assert row["step_s_median"] == pytest.approx((56.8 + 91.22) / 2)
    assert row["sync_share"] == pytest.approx((0.4434 + 0.8173) / 2 / row["step_s_median"])
    assert row["dropped_stale"] is None and row["dropped_stale_samples"] == 1224  # TRL's unit: samples
    assert "| 1224 samples |" in table([{**row, "layout": "trl_async", "gpus": 2, "rollout_gpus": 1}])[-1]
