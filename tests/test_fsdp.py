"""FSDP2 full fine-tuning (train/fsdp.py, train/sharded_checkpoint.py) on CPU with gloo.

Units: row-sharded checkpoint files written by 3 "ranks" read back on 2 and whole (and refused when a byte
changed), lockstep micro-batches, the --sharding resolution. End to end on a tiny random fp32 Llama
(--finetune full --rollout-quant int8, AQN on, a reward that varies within each group so every step has a
gradient): 2 gloo processes under torchrun train like 1 process (the same rollouts and rewards at every
step, step 1's loss and gradient norm to fp32 rounding, the final fp32 masters within 1e-4 where one step
moves them by ~lr = 1e-3: AdamW's first steps divide by |g| + 1e-8, so the summation order of near-zero
gradient entries shows at ~1e-5), a 2-rank checkpoint of step 1 resumes on 2 ranks bitwise equal to the
uninterrupted run and on 1 process with exactly the saved state (within the same tolerance after).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.train.sharded_checkpoint import RowShard, ShardReader, chunk_rows, write_index, write_rank

REWARD = '''
def varied(prompts, completions, answer=None, **kw):
    return [float(sum(map(ord, c)) % 7) / 6.0 for c in completions]
'''
DRIVER = '''
import json, shutil, sys
from pathlib import Path
from qerl_cli.train import distributed
from qerl_cli.train.config import build_config
from qerl_cli.train.run import train

sys.path.insert(0, sys.argv[3])
from test_fsdp import cut_back

cfg, jobs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
ctx = distributed.init_from_env()
for job in jobs:  # one launch for several runs: each torchrun start costs seconds of imports per rank
    if job[0] == "train":
        train(job[1], build_config("quick_cpu", {**cfg, "steps": job[2]}), resume=job[3])
    elif ctx.is_main:
        cut_back(Path(job[1]), Path(job[2]), job[3])
    ctx.barrier()
distributed.shutdown()
'''


# ---- units -------------------------------------------------------------------------------------------
def test_row_shards_written_on_three_ranks_read_on_two_and_whole(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(7, 5, generator=g), "b": torch.randn(2, generator=g),  # fewer rows than ranks
            "n": torch.randn(9, generator=g).to(torch.bfloat16)}
    parts = []
    for rank in range(3):
        shards = {}
        for k, t in full.items():
            start, stop = chunk_rows(t.shape[0], rank, 3)
            shards[k] = RowShard(t[start:stop], start, tuple(t.shape))
        parts.append(write_rank(tmp_path, "weights", rank, shards, max_file_bytes=64))  # several files per rank
    write_index(tmp_path, "weights", parts, {"note": "x"})
    assert [chunk_rows(7, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 7)]
    assert [chunk_rows(2, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]
    with ShardReader(tmp_path, "weights") as r:
        assert r.meta == {"note": "x"} and r.world_size == 3 and len(r.files) > 3
        for k, t in full.items():
            assert torch.equal(r.full(k), t) and r.full(k).dtype == t.dtype
            for rank in range(2):  # the rows each of 2 new ranks reads span the 3 old ranks' files
                start, stop = chunk_rows(t.shape[0], rank, 2)
                assert torch.equal(r.rows(k, start, stop), t[start:stop])
    victim = sorted(tmp_path.glob("weights-r00001-*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with ShardReader(tmp_path, "weights") as r, pytest.raises(QerlError, match="sha256"):
        r.verify_all()
    index = json.loads((tmp_path / "weights.index.json").read_text())
    index["files"]["../../etc/passwd"] = "0" * 64
    (tmp_path / "weights.index.json").write_text(json.dumps(index))
    with pytest.raises(QerlError, match="does not write"):
        ShardReader(tmp_path, "weights")


def test_rows_that_do_not_tile_a_tensor_are_refused(tmp_path: Path) -> None:
    t = torch.arange(6.0)
    part = write_rank(tmp_path, "weights", 0, {"t": RowShard(t[:3], 0, (6,))})
    with pytest.raises(QerlError, match="3 of its 6 rows"):
        write_index(tmp_path, "weights", [part])


@pytest.mark.parametrize("n,world,size", [(6, 2, 2), (5, 2, 2), (1, 2, 4), (7, 3, 1), (16, 4, 3)])
def test_sharded_model_ranks_run_the_same_passes(n: int, world: int, size: int) -> None:
    from qerl_cli.train.distributed import DistContext, DistributedBackend

    plans = [DistributedBackend(None, DistContext(rank=r, world_size=world), sharded_model=True)  # type: ignore[arg-type]
             .update_micro_batches(n, size) for r in range(world)]
    assert len({len(p) for p in plans}) == 1  # every rank all-gathers each layer as often as the others
    real = sorted(i for p in plans for mb in p if mb.counts for i in range(mb.rows.start, mb.rows.stop))
    assert real == list(range(n))  # the counted passes cover every row once
    assert all(mb.rows == slice(0, 1) for p in plans for mb in p if not mb.counts)
    assert all(mb.rows.stop - mb.rows.start <= size for p in plans for mb in p)
    replicated = DistributedBackend(None, DistContext(rank=0, world_size=world)).update_micro_batches(n, size)  # type: ignore[arg-type]
    assert all(mb.counts for mb in replicated)


def test_sharding_resolution() -> None:
    from qerl_cli.train.config import TrainConfig, resolve_sharding

    full = TrainConfig(finetune="full", rollout_quant="int8", precision="fp32")
    assert resolve_sharding(full, 1) == "none" and resolve_sharding(full, 2) == "fsdp2"
    assert resolve_sharding(TrainConfig(), 1) == "none" and resolve_sharding(TrainConfig(), 4) == "ddp"
    assert resolve_sharding(TrainConfig(finetune="full", rollout_quant="int8", sharding="fsdp2"), 1) == "fsdp2"
    for cfg, world, msg in [
        (TrainConfig(finetune="full", rollout_quant="int8", sharding="ddp"), 2, "use --sharding fsdp2"),
        (TrainConfig(sharding="none"), 2, "runs one process"),
        (TrainConfig(finetune="full"), 2, "--rollout-quant"),  # auto picks fsdp2, which needs the rollout copy
        (TrainConfig(fsdp_offload=True), 1, "--fsdp-offload"),
    ]:
        with pytest.raises(QerlError, match=msg):
            resolve_sharding(cfg, world)
    for fields, msg in [({"sharding": "fsdp2"}, "--finetune full"),
                        ({"sharding": "fsdp2", "finetune": "full", "rollout_quant": "int8", "precision": "fp16"},
                         "bf16 or fp32"),
                        ({"sharding": "zero3"}, "must be one of")]:
        with pytest.raises(QerlError, match=msg):
            TrainConfig(**fields).validate()


# ---- end to end ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp_run(tmp_path_factory) -> Path:
    from qerl_cli.quantize import quantize_model
    from tests.helpers import tiny_llama  # here: the torchrun script imports this module with only tests/ on its path

    path = tmp_path_factory.mktemp("fsdp") / "base"
    quantize_model(path, None, fmt="bf16", loaded=tiny_llama())
    return path


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> dict:
    reward = tmp_path_factory.mktemp("reward") / "reward.py"
    reward.write_text(REWARD)
    # 5 prompts x 2 samples, micro-batches of 4: on 2 ranks 5 + 5 rows, 2 passes each; rank 1's rows 5-9
    return {"task_level": "1", "batch_prompts": 5, "num_generations": 2, "max_completion_length": 4, "aqn": True,
            "micro_batch_size": 4, "lr": 1e-3, "weight_decay": 0.1, "save_steps": 1, "keep_checkpoints": 10,
            "seed": 5, "finetune": "full", "precision": "fp32", "rollout_quant": "int8", "requant_scales": "fixed",
            "sharding": "fsdp2", "reward": f"{reward}:varied"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_jobs(nproc: int, cfg: dict, jobs: list[tuple], tmp: Path) -> None:
    """Under one torchrun launch: ("train", run, steps, resume) and ("cut", src, dst, step) jobs, in order."""
    driver = tmp / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QERL_DIST_TIMEOUT_S": "300"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                          "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(driver), json.dumps(cfg),
                          json.dumps(jobs), str(Path(__file__).parent)], capture_output=True, text=True, env=env,
                         timeout=600,
                         cwd=tempfile.gettempdir())
    assert res.returncode == 0, res.stderr[-4000:]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines() if line.strip()]


def stable(m: dict) -> dict:
    """A metrics line without its wall-clock timings."""
    return {k: v for k, v in m.items() if not k.startswith(("timing/", "dist/rollout_s", "dist/rollout_idle"))}


def rollouts(run: Path, step: int) -> list[tuple]:
    lines = (run / "train" / "rollouts" / f"step_{step:05d}.jsonl").read_text().splitlines()
    return [(r["prompt_index"], r["completion"], r["reward"]) for r in map(json.loads, lines)]


def ckpt(run: Path, step: int) -> Path:
    return run / "train" / "checkpoints" / f"step_{step}"


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    with ShardReader(ckpt(run, step), "weights") as r:
        return {k: r.full(k) for k in r.keys()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def cut_back(src: Path, dst: Path, step: int) -> None:
    """A copy of a run as if it had been killed right after checkpoint ``step``."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    for p in (dst / "train" / "checkpoints").glob("step_*"):
        if int(p.name.split("_")[1]) > step:
            shutil.rmtree(p)
    (dst / "train" / "checkpoints" / "latest").write_text(f"step_{step}\n")


@pytest.mark.slow  # ~60 s on a quiet 2-core machine: one torchrun launch of 2 ranks, two 1-process runs
def test_two_gloo_ranks_train_like_one_and_resume_on_one_and_two(fp_run: Path, cfg: dict, tmp_path: Path) -> None:
    import torch.distributed as dist

    from qerl_cli.train import checkpointing
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    one, two, again, solo = (tmp_path / n for n in ("one", "two", "again", "solo"))
    for r in (one, two):
        shutil.copytree(fp_run, r)
    # 2 ranks: 2 steps; then step 1's checkpoint, as if killed there, resumed on 2 ranks
    torchrun_jobs(2, cfg, [("train", str(two), 2, False), ("cut", str(two), str(again), 1),
                           ("train", str(again), 2, True)], tmp_path)
    try:
        train(one, build_config("quick_cpu", {**cfg, "steps": 2}))  # 1 process: FSDP at degree 1
        got, want = metrics(two), metrics(one)
        assert [m["step"] for m in got] == [1, 2] and all(m["dist/world_size"] == 2.0 for m in got)
        for step in (1, 2):  # same completions (per-prompt noise keys) and rewards at every step
            assert rollouts(two, step) == rollouts(one, step), step
            for k in ("reward", "completions/mean_length", "timing/rollout_tokens"):
                assert got[step - 1][k] == want[step - 1][k], (step, k)
        assert want[0]["grad_norm"] > 1e-2
        assert got[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=1e-5)
        assert got[0]["loss"] == pytest.approx(want[0]["loss"], abs=2e-6)
        assert max_diff(weights(two, 1), weights(one, 1)) < 1e-4
        assert max_diff(weights(two, 2), weights(one, 2)) < 1e-4
        assert max_diff(weights(two, 2), weights(two, 1)) > 5e-4  # the tolerance is below one step's update
        # the checkpoint: every rank's rows, indexed, hashed in the manifest; only rank 0 wrote the rest
        c = ckpt(two, 2)
        assert checkpointing.checkpoint_kind(c) == checkpointing.FULL_SHARDED
        assert sorted(p.name for p in c.glob("*-r*.safetensors")) == [
            "optimizer-r00000-000.safetensors", "optimizer-r00001-000.safetensors",
            "weights-r00000-000.safetensors", "weights-r00001-000.safetensors"]
        rec = json.loads((two / "manifest.json").read_text())["stages"]["train"]
        assert rec["outputs"]["weights_sha256"] == checkpointing.weights_record(c)["weights_sha256"]
        assert rec["config"]["sharding"] == "fsdp2" and rec["extra"]["dist"]["sharding"] == "fsdp2"
        assert "adapter_digests" not in rec["extra"]["dist"]
        assert rec["pid"] == rec["extra"]["dist"]["pids"][0] != rec["extra"]["dist"]["pids"][1]  # rank 0 wrote it
        assert not [p for p in two.rglob("*") if ".tmp" in p.name or ".old" in p.name]
        # qerl eval's reader assembles the rows into the whole fp32 masters
        masters = checkpointing.read_full_weights(c, set(weights(two, 2)))
        assert max_diff(masters, weights(two, 2)) == 0.0

        # resumed on 2 ranks from step 1: bitwise the uninterrupted run
        assert [m["step"] for m in metrics(again)] == [1, 2]
        assert stable(metrics(again)[1]) == stable(got[1])
        assert max_diff(weights(again, 2), weights(two, 2)) == 0.0

        # ... and on 1 process: the state it starts from is exactly the saved one
        cut_back(two, solo, 1)
        seen: dict = {}

        def at_setup(t) -> None:  # noqa: ANN001 - the Trainer after resume(), before step 2
            seen["step"] = t.step
            seen["masters"] = {n: p.full_tensor().detach().clone() for n, p in t.full.trained.items()}
            seen["opt"] = {n: t.optimizer.state[p]["exp_avg_sq"].full_tensor().clone()
                           for n, p in t.full.trained.items()}

        train(solo, build_config("quick_cpu", {**cfg, "steps": 2}), resume=True, on_setup=at_setup)
        assert seen["step"] == 1
        assert max_diff(seen["masters"], weights(two, 1)) == 0.0
        with ShardReader(ckpt(two, 1), "optimizer") as r:
            assert max_diff(seen["opt"], {n: r.full(f"{n}/exp_avg_sq") for n in seen["opt"]}) == 0.0
        solo_m = metrics(solo)
        assert [m["step"] for m in solo_m] == [1, 2] and "dist/world_size" not in solo_m[1]
        assert rollouts(solo, 2) == rollouts(two, 2)
        assert max_diff(weights(solo, 2), weights(two, 2)) < 1e-4
    finally:
        if dist.is_initialized():  # the 1-process runs' own 1-rank group
            dist.destroy_process_group()


def test_scale_bench_runs_fsdp2_full_finetuning_with_int8_rollouts(tmp_path: Path) -> None:
    """The runner `scripts/gpu.sh fsdp` drives, on 1 CPU process (sharding degree 1) and the tiny shape, and the
    table it prints from the result files."""
    import torch.distributed as dist

    from qerl_cli.bench.scale import run, write_table

    out = tmp_path / "fsdp_w1.json"
    try:
        res = run("tiny", "bf16", steps=1, warmup=0, batch_prompts=2, num_generations=2, prompt_len=8, new_tokens=4,
                  micro_batch_size=4, out=out, train={"finetune": "full", "rollout_quant": "int8", "sharding": "fsdp2",
                                                      "gradient_checkpointing": True})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    saved = json.loads(out.read_text())
    assert saved["mode"]["sharding"] == "fsdp2" and saved["mode"]["finetune"] == "full"
    assert saved["mode"]["gradient_checkpointing"] is True
    step = saved["steps_detail"][0]
    assert step["grad_norm"] > 0 and step["timing/requant_s"] > 0
    assert res["phase_s"]["fwd_bwd"] > 0 and set(res["peak_gb"]) >= {"rollout", "fwd_bwd", "requant"}
    lines = write_table(tmp_path)
    assert "offload" in lines[1] and "fwd_bwd s" in lines[1]
    row = lines[2].split()
    assert row[:2] == ["1", f"{res['step_s_median']:.2f}"] and row[4:7] == ["100.0%", "0.0%", "no"]
    assert f"{res['phase_s']['fwd_bwd']:.2f}" in row and row[-1] == "-"  # no CUDA peaks on a CPU
    assert json.loads((tmp_path / "fsdp.json").read_text())["table"][0]["efficiency"] == 1.0


def test_bf16_compute_on_fp32_shards_and_the_rollout_copy_follows_them() -> None:
    """--precision bf16 at sharding degree 1: the sharded masters are fp32, each layer is gathered in bf16 for the
    step, and after the update every INT8 code of the rollout copy is the quantized bf16 master (fixed scales)
    and its norms are the bf16 masters: re-quantization read the updated shards, layer by layer."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from qerl_cli.bench.scale import build_trainer

    try:
        t = build_trainer("tiny", "bf16", batch_prompts=2, num_generations=2, prompt_len=8, new_tokens=4, lora_rank=8,
                          micro_batch_size=4, seed=0, num_prompts=8, device="cpu",
                          train={"finetune": "full", "rollout_quant": "int8", "sharding": "fsdp2",
                                 "precision": "bf16", "aqn": True, "lr": 1e-2})
        before = {n: p.full_tensor().clone() for n, p in t.full.trained.items()}
        m = t.train_step()
        assert m["grad_norm"] > 0 and m["rollout_quant/rel_err"] > 0
        masters = {n: p.full_tensor() for n, p in t.full.trained.items()}
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in t.full.trained.values())
        assert max((masters[n] - before[n]).abs().max().item() for n in masters) > 1e-3  # the step moved them
        lm = t.rollout_quant.model
        for name, ql in t.rollout_quant.layers.items():
            w = masters[f"{name}.weight"].to(torch.bfloat16).float()
            want = torch.round((w / ql.weight_scale.float()).clamp(-128, 127)).to(torch.int8)
            assert torch.equal(ql.weight, want), name
        for name in t.rollout_quant.private:
            copy = lm.get_parameter(name)
            assert copy.dtype == torch.bfloat16 and torch.equal(copy, masters[name].to(torch.bfloat16)), name
        emb = t.model.model.embed_tokens.weight  # frozen: not sharded, shared with the rollout copy
        assert not isinstance(emb, DTensor) and emb.dtype == torch.bfloat16 and lm.model.embed_tokens.weight is emb
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
