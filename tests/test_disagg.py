"""Asynchronous RL across GPUs (--rollout-gpus, train/disagg.py): the queue, grouping and staleness rules as units,
the adapter buffer, the refusals; then gloo runs through torchrun on CPU: versions recorded per sample and moving
forward, every received group accounted for, resume on another role split and synchronously, a killed rollout rank
ending the run with one line, and a SIGTERM to a rollout rank alone stopping every rank at a checkpoint."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from qerl_cli.train.adapter_sync import flat_size, pack, unpack_into
from qerl_cli.train.async_queue import (
    GroupItem,
    IdleClock,
    PromptPool,
    QueueFailed,
    SampleQueue,
    is_fresh,
    prompt_target,
)
from tests.test_distributed import ARGS, _env, _free_port, metrics, qerl_here


def group(version: int, idx: int = 0, rewards: tuple[float, ...] = (0.0, 1.0)) -> GroupItem:
    r = torch.tensor(rewards)
    return GroupItem(idx, [object()] * len(rewards), r, r.clone(), version)


# ---- units ---------------------------------------------------------------------------------------------------
def test_staleness_gate() -> None:
    assert is_fresh(3, 3, 0) and not is_fresh(2, 3, 0)
    assert is_fresh(2, 3, 1) and not is_fresh(1, 3, 1)


def test_queue_drops_stale_groups_and_counts_them_k0() -> None:
    q = SampleQueue(max_staleness=0)
    q.put([group(0, 0), group(0, 1), group(1, 2), group(1, 3), group(1, 4)])
    got, dropped = q.take(2, train_version=1)
    # K = 0: the version-0 groups may not be trained at version 1; oldest fresh first
    assert [g.prompt_index for g in got] == [2, 3] and dropped == {"dropped_stale": 2, "dropped_zero_std": 0}
    acc = q.snapshot()
    assert (acc.received, acc.trained, acc.dropped_stale, acc.queued) == (5, 2, 2, 1) and acc.balanced()


def test_queue_k1_keeps_one_version_back_and_closes_with_a_count() -> None:
    q = SampleQueue(max_staleness=1)
    q.put([group(0, 0), group(1, 1), group(2, 2)])
    got, dropped = q.take(2, train_version=2)  # version 0 is two updates old: dropped
    assert [g.version for g in got] == [1, 2] and dropped["dropped_stale"] == 1
    q.put([group(2, 3)])
    acc = q.close()  # the stop: what is still queued is dropped and counted
    assert acc.dropped_at_stop == 1 and acc.queued == 0 and acc.balanced()
    q.put([group(2, 4)])  # a chunk that arrives after the stop: counted too
    acc = q.snapshot()
    assert (acc.received, acc.trained, acc.dropped) == (5, 2, 3) and acc.balanced()


def test_queue_drops_zero_variance_groups_with_dynamic_sampling() -> None:
    q = SampleQueue(max_staleness=1, drop_zero_std=True)
    q.put([group(0, 0, (1.0, 1.0)), group(0, 1, (0.0, 1.0))])
    got, dropped = q.take(1, 0)
    assert got[0].prompt_index == 1 and dropped["dropped_zero_std"] == 1


def test_queue_wait_reports_a_broken_producer_and_refills() -> None:
    q = SampleQueue(max_staleness=1)
    calls = []
    with pytest.raises(QueueFailed, match="rank 7 died"):
        q.take(1, 0, poll_s=0.01, failed=lambda: "rank 7 died" if len(calls) >= 3 else None,
               on_wait=lambda: calls.append(1))
    assert len(calls) == 3  # the trainer refills the prompt pool while it waits


def test_prompt_pool_hands_out_chunks_and_tracks_outstanding() -> None:
    pool = PromptPool(chunk=3)
    stream = iter(range(100))
    assert pool.top_up(8, queued=0, take=lambda n: [next(stream) for _ in range(n)]) == 8
    assert pool.hand_out() == (0, [0, 1, 2]) and pool.hand_out() == (1, [3, 4, 5])
    assert pool.outstanding == 6
    # 2 pending + 6 outstanding + 2 queued groups: at the target, nothing taken
    assert pool.top_up(10, queued=2, take=lambda n: [next(stream) for _ in range(n)]) == 0
    pool.returned(3)
    assert pool.top_up(10, queued=2, take=lambda n: [next(stream) for _ in range(n)]) == 3
    assert pool.hand_out() == (2, [6, 7, 8]) and pool.hand_out() == (3, [9, 10]) and pool.hand_out() == (-1, [])
    # a streaming rank asks for what its free slots can start: at most that, never more than a chunk
    pool.top_up(20, queued=0, take=lambda n: [next(stream) for _ in range(n)])
    assert pool.hand_out(1) == (4, [11]) and pool.hand_out(7) == (5, [12, 13, 14]) and pool.hand_out(0) == (-1, [])


def test_prompts_streamed_into_a_running_call_sample_as_one_call() -> None:
    """The rollout ranks' engine side: a call started on one prompt, fed the others one by one as its slots free
    up (keyed by their place), samples exactly what one call over all of them samples; every group reaches the
    feed complete and in order, the feed is asked only for what the free slots can start, and StreamStopped ends
    the call at once, leaving the engine usable."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qerl_cli.rollout import BuiltinEngine, SamplingParams
    from qerl_cli.rollout.scheduler import StreamStopped

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    engine = BuiltinEngine(LlamaForCausalLM(cfg).eval(), None, max_batch_slots=3, max_model_len=32)
    prompts = [[1, 5, 7], [2, 9], [3, 4, 4, 8], [6], [9, 9, 1]]
    sp = dict(n=2, temperature=1.0, max_tokens=6, stop_token_ids=[3], seed=11)
    whole = engine.generate(prompts, SamplingParams(**sp)).samples
    queue, groups, asks = list(enumerate(prompts))[1:], [], []

    def feed(done: list, want: int, progress: dict[str, float]) -> list[tuple[list[int], int]]:
        groups.append([(s.prompt_index, s.sample_index) for s in done])
        asks.append(want)
        assert set(progress) == {"prefill_s", "decode_s", "decode_steps"}
        out = [(p, key) for key, p in queue[:1]] if want else []  # one prompt per ask: the slow trickle
        del queue[:len(out)]
        return out

    engine.prompt_feed = feed
    rest = engine.generate(prompts[:1], SamplingParams(**sp)).samples
    assert rest == [] and not queue
    fed = [pair for g in groups for pair in g]
    assert fed == [(p, j) for p in range(len(prompts)) for j in range(2)]  # complete groups, in order
    assert all(len(g) % 2 == 0 for g in groups) and max(asks) <= 2  # 3 slots start at most 2 prompts of 2 samples
    by = {(s.prompt_index, s.sample_index): s for s in whole}
    streamed = {}

    def keep(done: list, want: int, progress: dict[str, float]) -> list[tuple[list[int], int]]:
        streamed.update({(s.prompt_index, s.sample_index): s for s in done})
        out = [(p, key) for key, p in queue[:want]]
        del queue[:len(out)]
        return out

    queue = list(enumerate(prompts))[1:]
    engine.prompt_feed = keep
    engine.generate(prompts[:1], SamplingParams(**sp))
    assert sorted(streamed) == sorted(by)
    for k, s in streamed.items():
        assert s.token_ids == by[k].token_ids and s.finish_reason == by[k].finish_reason
        torch.testing.assert_close(s.logprobs, by[k].logprobs, rtol=0, atol=1e-5)

    def stop(done: list, want: int, progress: dict[str, float]) -> list[tuple[list[int], int]]:
        raise StreamStopped("SIGTERM")

    engine.prompt_feed = stop
    with pytest.raises(StreamStopped, match="SIGTERM"):
        engine.generate(prompts, SamplingParams(**sp))
    engine.prompt_feed = None
    assert [s.token_ids for s in engine.generate(prompts, SamplingParams(**sp)).samples] == \
        [s.token_ids for s in whole]


def _stale_drops(target: Callable[[int, int, bool], int], steps: int = 6, batch: int = 4, k: int = 1) -> int:
    """Stale groups dropped over ``steps`` updates when the rollout is faster than the update (every handed-out
    prompt comes back at once, under the adapter version published at that moment)."""
    q, pool, stream = SampleQueue(max_staleness=k), PromptPool(chunk=batch), itertools.count()
    version, dropped = 0, 0

    def top(waiting: bool) -> None:
        pool.top_up(target(batch, k, waiting), q.snapshot().queued, lambda n: [next(stream) for _ in range(n)])
        while (got := pool.hand_out()[1]):
            q.put([GroupItem(i, [], torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]), version) for i in got])
            pool.returned(len(got))

    top(False)
    for s in range(steps):
        _, d = q.take(batch, s, poll_s=0.001, on_wait=lambda: top(True))
        dropped += d["dropped_stale"]
        top(False)  # during the update from s
        version = s + 1  # its adapters published
    return dropped


def test_prompt_target_hands_out_only_what_the_staleness_bound_can_train() -> None:
    assert [prompt_target(64, 1, w) for w in (False, True)] == [64, 128]
    assert [prompt_target(64, 0, w) for w in (False, True)] == [0, 64]
    # two batches at K = 1 (the first GPU run's rule), the rollout ahead: the second batch made under version v
    # waits behind the first, then is too old for the update from v + 2; a whole batch every second update (2, 4)
    assert _stale_drops(lambda b, k, w: 2 * b) == 2 * 4
    assert _stale_drops(prompt_target) == 0 and _stale_drops(prompt_target, k=0) == 0


def test_watch_tells_a_dead_rank_from_a_hung_one() -> None:
    """Both counters on a real c10d store: a rank whose heartbeat thread beats but whose rollout never moves (the
    first two-GPU run's deadlock in a CUDA wait) is stalled, not silent; progress clears it; a stopped heartbeat
    is silent."""
    from torch.distributed import HashStore

    from qerl_cli.train.disagg import HEARTBEAT_S, Heartbeat, HeartbeatWatch

    store = HashStore()
    beat = Heartbeat(3, store=store)
    watch = HeartbeatWatch([3], timeout_s=4 * HEARTBEAT_S, stall_s=2 * HEARTBEAT_S, store=store)
    try:
        assert watch.silent(set()) is None and watch.stalled(set()) is None  # first reads
        time.sleep(3 * HEARTBEAT_S)
        assert watch.silent(set()) is None  # beats came
        assert watch.stalled(set()) == 3 and watch.stalled({3}) is None  # no progress; a rank that left is not asked
        beat.progress()
        assert watch.stalled(set()) is None
        beat.progress()  # throttled: within HEARTBEAT_S of the last, no store round trip
        assert int(store.add("qerl/async/progress/3", 0)) == 1
    finally:
        beat.stop()
    watch.silent(set())
    time.sleep(5 * HEARTBEAT_S)
    assert watch.silent(set()) == 3


def test_idle_clock_reads_and_resets() -> None:
    c = IdleClock()
    c.add(3.0, 1.0)
    assert c.read() == 0.25 and c.read() == 0.0


def test_adapter_buffer_round_trip_in_place() -> None:
    params = [torch.randn(4, 3), torch.randn(2, 5, dtype=torch.bfloat16)]
    buf = pack(params, version=7, stop=False, device=torch.device("cpu"))
    assert buf.numel() == flat_size(params) and buf[0].item() == 7 and buf[1].item() == 0
    dst = [torch.zeros(4, 3), torch.zeros(2, 5, dtype=torch.bfloat16)]
    ptrs = [p.data_ptr() for p in dst]
    unpack_into(buf, dst)
    assert all(torch.equal(a, b) for a, b in zip(dst, params, strict=True))
    assert [p.data_ptr() for p in dst] == ptrs  # the engine's views stay valid: no new storage


def test_refusals() -> None:
    from qerl_cli.errors import QerlError
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.disagg import check_split

    with pytest.raises(QerlError, match="leaves no trainer"):
        check_split(2, 2)
    with pytest.raises(QerlError, match="--gpus N"):
        check_split(1, 1)
    with pytest.raises(QerlError, match="importance correction"):
        TrainConfig(rollout_gpus=1, correction="none").resolved().validate()
    with pytest.raises(QerlError, match="--async-rollout"):
        TrainConfig(rollout_gpus=1, async_rollout=True).resolved().validate()
    assert TrainConfig(rollout_gpus=1).resolved().correction == "token_tis"


def test_cli_refuses_a_split_without_trainers_with_one_line(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    # refused before --gpus looks for GPUs: the split is wrong whatever the machine
    assert qerl_here("train", "--run", str(run_dir), "--gpus", "2", "--rollout-gpus", "2", "--steps", "1") == 2
    err = capsys.readouterr().err
    assert "leaves no trainer" in err and err.count("error") == 1


# ---- gloo runs through torchrun ----------------------------------------------------------------------------------
def torchrun(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", "-m", "qerl_cli", "--", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout,
                          cwd=tempfile.gettempdir())


def rollout_lines(run: Path, step: int) -> list[dict]:
    return [json.loads(x) for x in (run / f"train/rollouts/step_{step:05d}.jsonl").read_text().splitlines()]


def async_record(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["stages"]["train"]


def balanced(a: dict) -> bool:
    """Every prompt handed out came back as a group or was cut at the stop; every group came to an end."""
    return a["prompts_handed"] == a["received"] + a["prompts_cut_at_stop"] and \
        a["received"] == a["trained"] + a["dropped_stale"] + a["dropped_zero_std"] + a["dropped_at_stop"]


@pytest.mark.slow
def test_async_run_records_versions_and_resumes_on_other_splits(tiny_run: Path, text_hash_reward: str) -> None:
    run = tiny_run
    args = [*ARGS, "--reward", text_hash_reward]
    # 2 trainers (data parallel among themselves) + 1 rollout rank
    res = torchrun(3, "train", "--run", str(run), *args, "--steps", "2", "--rollout-gpus", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    got = metrics(run)
    assert [m["async/adapter_version"] for m in got] == [1.0, 2.0]
    for m in got:
        assert 0.0 <= m["async/staleness_mean"] <= m["async/staleness_max"] <= 1.0  # --max-staleness 1
        assert m["async/sync_s"] > 0 and 0.0 <= m["async/rollout_idle_frac"] <= 1.0 and m["grad_norm"] > 0
    # every sample carries the adapter version that sampled it, within the bound of the step that trained it
    v1 = [r["version"] for r in rollout_lines(run, 1)]
    v2 = [r["version"] for r in rollout_lines(run, 2)]
    assert len(v1) == len(v2) == 2 * 2 and set(v1) == {0} and set(v2) <= {0, 1} and min(v2) >= min(v1)
    rec = async_record(run)
    a = rec["extra"]["async"]
    assert a["trainer_ranks"] == [0, 1] and a["rollout_ranks"] == [2] and a["correction"] == "token_tis"
    assert a["trained"] == 4 and balanced(a) and a["stop"] == "done" and a["all_rollout_ranks_stopped"]
    d = rec["extra"]["dist"]
    assert d["world_size"] == 2 and d["adapter_digests"][0] == d["adapter_digests"][1]
    assert rec["pid"] == d["pids"][0] and rec["status"] == "completed"

    # the same checkpoint on another split (1 trainer + 1 rollout rank), then synchronously on one process
    res = torchrun(2, "train", "--run", str(run), *args, "--steps", "3", "--rollout-gpus", "1", "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    got = metrics(run)
    assert [m["step"] for m in got] == [1, 2, 3] and got[2]["async/adapter_version"] == 3.0
    assert {r["version"] for r in rollout_lines(run, 3)} == {2}  # the rollout rank starts from the checkpoint's
    assert async_record(run)["extra"]["async"]["rollout_ranks"] == [1]
    assert qerl_here("train", "--run", str(run), *args, "--steps", "4", "--resume") == 0
    got = metrics(run)
    assert [m["step"] for m in got] == [1, 2, 3, 4] and "async/adapter_version" not in got[3]
    assert "version" not in rollout_lines(run, 4)[0]


KILLER = """import hashlib, os, signal

calls = [0]


def text_hash(prompts, completions, **kw):
    calls[0] += 1
    if os.environ.get("RANK") == "1" and calls[0] == 3:  # the rollout rank dies hard at its 3rd scoring
        os.kill(os.getpid(), signal.SIGKILL)
    return [int(hashlib.sha256(c.encode()).hexdigest()[:8], 16) / 16**8 for c in completions]
"""


@pytest.mark.slow
def test_a_killed_rollout_rank_ends_the_run_with_one_line(tiny_run: Path, tmp_path: Path) -> None:
    reward = tmp_path / "killer.py"
    reward.write_text(KILLER)
    t = time.monotonic()
    # a long grace period: torchrun SIGTERMs the trainer when the rollout rank dies; the line must not depend on it
    res = torchrun(2, "train", "--run", str(tiny_run), *ARGS, "--reward", f"{reward}:text_hash", "--steps", "20",
                   "--rollout-gpus", "1", "--sigterm-grace-s", "120", timeout=300)
    assert res.returncode != 0
    assert time.monotonic() - t < 150  # not a hang until the process group timeout
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rollout rank 1 stopped responding" in errors[0], res.stderr[-3000:]
    assert async_record(tiny_run)["status"] == "failed"


@pytest.mark.slow
def test_sigterm_to_a_rollout_rank_stops_every_rank_at_a_checkpoint(tiny_run: Path, text_hash_reward: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", "-m", "qerl_cli", "--", "train", "--run", str(tiny_run), *ARGS,
           "--reward", text_hash_reward, "--steps", "200", "--rollout-gpus", "1"]
    # stdout (the console's lines) not piped: nobody reads it while the run goes on, and a full pipe would block it
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(),
                            cwd=tempfile.gettempdir())
    try:
        mfile = tiny_run / "train" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (mfile.exists() and mfile.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
            time.sleep(0.2)
        rollout_pid = rank_pid(proc.pid, "1")
        os.kill(rollout_pid, signal.SIGTERM)  # the rollout rank alone: the trainers must stop too
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    rec = async_record(tiny_run)
    steps = len(metrics(tiny_run))
    assert rec["status"] == "interrupted" and rec["extra"]["stopped"]["signal"] == "SIGTERM", err[-3000:]
    assert rec["extra"]["stopped"]["checkpoint"] == f"step_{steps}" and steps < 200
    a = rec["extra"]["async"]
    assert a["stop"] == "SIGTERM" and a["all_rollout_ranks_stopped"] and balanced(a)
    assert a["trained"] == 2 * steps  # every received group trained or dropped with a count, never lost
    assert "preempted (SIGTERM)" in err


def rank_pid(parent: int, rank: str) -> int:
    """The pid of the torchrun worker with RANK=rank (a child of the elastic agent, itself ``parent``)."""
    for _ in range(50):
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                env = (p / "environ").read_bytes().split(b"\0")
                stat = (p / "stat").read_text().split()
            except OSError:
                continue
            if int(stat[3]) == parent and f"RANK={rank}".encode() in env:
                return int(p.name)
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under {parent}")


@pytest.mark.slow
def test_async_bench_layout_on_two_gloo_ranks(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "qerl_cli.bench.async_scale", "--smoke", "--gpus", "2", "--layouts",
                          "async", "--steps", "2", "--out", str(tmp_path)], capture_output=True, text=True,
                         env=_env(), timeout=600, cwd=tempfile.gettempdir())
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads((tmp_path / "async.json").read_text())
    assert r["layout"] == "async" and r["gpus"] == 2 and r["rollout_gpus"] == 1 and len(r["steps_detail"]) == 2
    assert r["date"][:4].isdigit() and r["env"]["packages"]["torch"]  # when and on what, as every bench records
    assert r["trained_tokens_per_s"] > 0 and 0 < r["sync_share"] < 1 and 0 <= r["rollout_idle_frac"] <= 1
    assert r["async"]["trained"] == (2 + 1) * 4 and balanced(r["async"])  # warm-up + steps, 4 prompts each
    assert "| async | 2 | 1 |" in res.stdout


def test_docs_name_the_async_mode() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    for word in ("--rollout-gpus", "--max-staleness", "async/dropped_stale", "async/sync_s",
                 "qerl_cli/train/disagg.py"):
        assert word in text, word

