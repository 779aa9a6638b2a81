"""Failures leave the run directory right, on the tiny random model (the run's state is the point, not the model):

* a non-finite update stops the run before its checkpoint: `latest` stays the previous one, the line names the
  likely cause; a checkpoint is never written from NaN/inf weights, and `qerl eval` / `--resume` / `qerl report`
  refuse one (naming the newest good checkpoint);
* a safetensors file with a corrupt header whose hash was updated to match is one line, not a traceback;
* refusals after `qerl train --resume` starts (a damaged base, settings that do not match) leave the manifest byte
  for byte as it was; a refused `qerl quantize` leaves no empty run directory;
* a torn last line of metrics.jsonl (a kill mid-append) is skipped, a damaged line in the middle refused in one line;
* what a killed writer staged (`.model.tmp-PID/`, `.step_N.tmp-PID/`, atomic-write temp files) is removed by the next
  stage once that process is gone;
* a full disk (or a file-size limit) while writing is one line naming the path, and the previous state stays.
"""

from __future__ import annotations

import errno
import json
import resource
import shutil
import signal
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from tests.helpers import qerl_in_process

ADAPTER = "adapter/adapter_model.safetensors"
TINY = {"steps": 2, "save_steps": 1, "batch_prompts": 2, "num_generations": 4, "max_completion_length": 4,
        "shots": 0, "lora_rank": 4, "micro_batch_size": 8, "seed": 3, "log_rollouts": False}
REWARD = ("import hashlib\n\n\ndef text_hash(prompts, completions, **kw):\n"
          "    return [int(hashlib.sha256(c.encode()).hexdigest()[:8], 16) / 16**8 for c in completions]\n")


@pytest.fixture(scope="module")
def runs(tiny_source, tmp_path_factory) -> dict:
    """The tiny model quantized (``base``) and trained 2 steps with a checkpoint each (``trained``), and the train
    options as a config dict and as flags (a reward that differs per completion, so updates are not zero)."""
    from qerl_cli.quantize import quantize_model
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    root = tmp_path_factory.mktemp("failure_state")
    (root / "reward.py").write_text(REWARD)
    overrides = {**TINY, "reward": f"{root / 'reward.py'}:text_hash"}
    base = root / "base"
    quantize_model(base, str(tiny_source), fmt="nvfp4")
    trained = copy_run(base, root / "trained")
    assert train(trained, build_config("quick_cpu", overrides)).steps_done == 2
    flags = ["--config", "quick_cpu"] + [a for k, v in overrides.items() if k != "log_rollouts"
                                         for a in (f"--{k.replace('_', '-')}", str(v))]
    return {"base": base, "trained": trained, "overrides": overrides, "flags": flags}


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def cli(capsys, *args: str) -> tuple[int, str]:  # noqa: ANN001
    """`qerl ARGS` in this process: exit code and stderr."""
    code, _, err = qerl_in_process(capsys, *args)
    return code, err


def one_line(code: int, err: str) -> str:
    assert code == 2 and "Traceback" not in err and "internal error" not in err, err
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err
    return " ".join(err.split())  # rich wraps long lines: compare the words


def ckpt(run: Path, step: int) -> Path:
    return run / "train" / "checkpoints" / f"step_{step}"


def latest(run: Path) -> str:
    return (run / "train" / "checkpoints" / "latest").read_text().strip()


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def rehash(run: Path, step: int) -> None:
    """Update step_N's record and the manifest's copy to the files as they are now (what someone who controls the
    run directory can do): only what the files hold can then give them away."""
    from qerl_cli.manifest import RunDir, atomic_write_json, sha256_file
    from qerl_cli.train import checkpointing as ck

    path = ckpt(run, step)
    record = json.loads((path / ck.RECORD_FILE).read_text())
    for rel in record["files"]:
        record["files"][rel] = {"sha256": sha256_file(path / rel), "bytes": (path / rel).stat().st_size}
    atomic_write_json(path / ck.RECORD_FILE, record)
    data = manifest(run)
    if data["stages"]["train"]["outputs"].get("checkpoint") == f"train/checkpoints/step_{step}":
        data["stages"]["train"]["outputs"].update(ck.checkpoint_outputs(RunDir(run), path))
        atomic_write_json(run / "manifest.json", data)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ---- a non-finite step ------------------------------------------------------------------------------------------
def test_a_non_finite_update_stops_the_run_before_its_checkpoint(runs: dict, tmp_path: Path, capsys) -> None:
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train
    from qerl_cli.train.trainer import NonFiniteLoss

    run = copy_run(runs["base"], tmp_path / "run")
    trainers = []

    def diverge(m: dict) -> None:  # after step 2, an update that overflows: what an inf learning rate does
        if m["step"] == 2:
            trainers[0].optimizer.param_groups[0]["lr"] = float("inf")

    with pytest.raises(NonFiniteLoss) as err:
        train(run, build_config("quick_cpu", {**runs["overrides"], "steps": 4}), on_setup=trainers.append,
              on_step=diverge)
    assert "the optimizer step made trainable parameters NaN or inf at step 3 (likely cause: --lr 0.0002 is too " \
           "high for this run); nothing of step 3 was saved; step_2 stays the newest checkpoint" in str(err.value)
    assert latest(run) == "step_2" and not ckpt(run, 3).exists()
    assert sorted(p.name for p in (run / "train" / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]
    assert [m["step"] for m in map(json.loads, (run / "train" / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    rec = manifest(run)["stages"]["train"]
    assert rec["status"] == "failed" and rec["outputs"]["checkpoint"] == "train/checkpoints/step_2"

    # from the command line: a finite learning rate whose Adam step overflows float32 is named as the cause
    fresh = copy_run(runs["base"], tmp_path / "fresh")
    err = one_line(*cli(capsys, "train", "--run", str(fresh), *runs["flags"], "--lr", "1e39"))
    assert "the optimizer step overflowed float32 at step 1 (likely cause: --lr 1e+39 is too high for this run); " \
           "nothing of step 1 was saved; no checkpoint was written yet" in err, err
    assert not (fresh / "train" / "checkpoints").exists()


def test_the_likely_cause_of_a_non_finite_step_is_a_non_finite_option_else_the_learning_rate() -> None:
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.trainer import nonfinite_message

    # the command line refuses such options; a config built in code (a notebook, a bench) can still hold one
    cfg = TrainConfig(lr=3e-4, weight_decay=float("inf"), aqn_sigma_end=float("nan")).resolved()
    assert nonfinite_message("the loss became nan", 7, cfg, 6) == (
        "the loss became nan at step 7 (likely cause: --weight-decay is inf); nothing of step 7 was saved; step_6 "
        "stays the newest checkpoint: `--resume` continues from it, `--resume-from step_N` from an earlier one")
    assert "(likely cause: --lr 0.0003 is too high for this run)" in nonfinite_message(
        "x", 1, TrainConfig(lr=3e-4).resolved(), None)


def test_a_checkpoint_is_never_written_from_non_finite_weights(tmp_path: Path) -> None:
    from qerl_cli.manifest import RunDir
    from qerl_cli.train import checkpointing as ck

    run = RunDir(tmp_path / "run")
    ck.save_checkpoint(run, 1, None, {}, {}, 0, full_weights={"w": torch.ones(3)})
    bad = {"w": torch.tensor([1.0, float("nan"), 2.0])}
    with pytest.raises(QerlError, match=r"^step_2 was not written: its weights hold NaN or inf \(w\).*; step_1 stays "
                                        r"the newest checkpoint$"):
        ck.save_checkpoint(run, 2, None, {}, {}, 0, full_weights=bad)
    writer = ck.CheckpointWriter()  # a background write: the same refusal, at the step that waits for it
    writer.submit(lambda: ck.save_checkpoint(run, 3, None, {}, {}, 0, adapter_state={"lora_B": bad["w"] * torch.inf}))
    with pytest.raises(QerlError, match=r"^step_3 was not written: its weights hold NaN or inf \(lora_B\)"):
        writer.wait()
    checkpoints = run.path / "train" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_1"] and latest(run.path) == "step_1"


def test_eval_resume_and_report_refuse_a_non_finite_adapter(runs: dict, tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    run = copy_run(runs["trained"], tmp_path / "run")
    tensors = load_file(str(ckpt(run, 2) / ADAPTER))
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(ckpt(run, 2) / ADAPTER))
    rehash(run, 2)
    before = (run / "manifest.json").read_bytes()
    err = one_line(*cli(capsys, "eval", "arith", "--run", str(run), "--limit", "1"))
    assert f"step_2/{ADAPTER} holds NaN or inf ({name})" in err
    assert "the newest intact checkpoint is step_1; evaluate it with --checkpoint step_1" in err
    err = one_line(*cli(capsys, "train", "--run", str(run), *runs["flags"], "--steps", "3", "--resume"))
    assert f"step_2/{ADAPTER} holds NaN or inf" in err and "--resume-from step_1" in err
    err = one_line(*cli(capsys, "report", "--run", str(run)))
    assert f"step_2/{ADAPTER} holds NaN or inf" in err
    assert (run / "manifest.json").read_bytes() == before and not (run / "eval").exists()


def test_a_corrupt_safetensors_header_with_a_matching_hash_is_one_line(runs: dict, tmp_path: Path, capsys) -> None:
    run = copy_run(runs["trained"], tmp_path / "run")
    data = (ckpt(run, 2) / ADAPTER).read_bytes()
    (ckpt(run, 2) / ADAPTER).write_bytes(struct.pack("<Q", 2**62) + data[8:])  # a header "length" of 2**62 bytes
    rehash(run, 2)
    err = one_line(*cli(capsys, "eval", "arith", "--run", str(run), "--limit", "1"))
    assert f"step_2/{ADAPTER} is unreadable (Error while deserializing header: header too large)" in err, err
    assert "evaluate it with --checkpoint step_1" in err
    err = one_line(*cli(capsys, "train", "--run", str(run), *runs["flags"], "--steps", "3", "--resume"))
    assert f"step_2/{ADAPTER} is unreadable" in err and "--resume-from step_1" in err
    assert f"step_2/{ADAPTER} is unreadable" in one_line(*cli(capsys, "report", "--run", str(run)))

    size = struct.unpack("<Q", data[:8])[0]  # the same length, garbage in place of the JSON header
    (ckpt(run, 2) / ADAPTER).write_bytes(data[:8] + b"{" * size + data[8 + size:])
    rehash(run, 2)
    err = one_line(*cli(capsys, "eval", "arith", "--run", str(run), "--checkpoint", "step_2", "--limit", "1"))
    assert f"step_2/{ADAPTER} is unreadable (Error while deserializing header: invalid JSON in header" in err


# ---- refusals leave the manifest as it was ------------------------------------------------------------------------
def test_refusals_after_train_resume_starts_leave_the_manifest_as_it_was(runs: dict, tmp_path: Path, capsys) -> None:
    run = copy_run(runs["trained"], tmp_path / "run")
    before = (run / "manifest.json").read_bytes()
    resume = ["train", "--run", str(run), *runs["flags"], "--steps", "3"]

    weights = run / "model" / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # damaged base: refused while the model loads
    for how in (["--resume"], ["--resume-from", "step_1"]):
        err = one_line(*cli(capsys, *resume, *how))
        assert "model.safetensors does not match the sha256 the manifest recorded" in err
        assert (run / "manifest.json").read_bytes() == before
        assert latest(run) == "step_2" and ckpt(run, 2).is_dir()  # nothing set aside by the refused --resume-from
    weights.write_bytes(good)

    err = one_line(*cli(capsys, *resume, "--lora-rank", "8", "--resume"))
    assert "--resume with a different lora_rank (8, checkpoint has 4)" in err
    err = one_line(*cli(capsys, "train", "--run", str(run), *runs["flags"], "--resume"))
    assert "already finished" in err

    metrics = run / "train" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + "not json\n" + lines[1])
    err = one_line(*cli(capsys, *resume, "--resume"))
    assert f"{metrics} line 2 is not a metrics record" in err
    assert (run / "manifest.json").read_bytes() == before


def test_a_torn_last_metrics_line_and_a_killed_writers_staging_do_not_stop_a_resume(runs: dict, tmp_path: Path,
                                                                                   capsys) -> None:
    from qerl_cli.metricsfile import read_metrics

    run = copy_run(runs["trained"], tmp_path / "run")
    metrics = run / "train" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "loss": 0.12')  # killed while appending step 3's line
    pid = dead_pid()
    litter = [run / "train" / "checkpoints" / f".step_3.tmp-{pid}", run / "train" / f".metrics.jsonl.tmp-{pid}"]
    litter[0].mkdir()
    (litter[0] / "trainer_state.safetensors").write_bytes(b"\0" * 1000)
    litter[1].write_text("{")
    code, err = cli(capsys, "train", "--run", str(run), *runs["flags"], "--steps", "3", "--resume")
    assert code == 0, err[-3000:]
    assert [m["step"] for m in read_metrics(metrics)] == [1, 2, 3] and metrics.read_text().endswith("}\n")
    assert latest(run) == "step_3" and not any(p.exists() for p in litter)


def test_read_metrics_skips_a_torn_last_line_and_refuses_other_damage(tmp_path: Path) -> None:
    from qerl_cli.metricsfile import read_metrics

    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == []
    path.write_text('{"step": 1, "loss": 0.5}\n\n{"step": 2, "loss": 0.25}\n{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    for text, line in (('{"step": 1}\n{"step": 2, "lo\n', 2),  # ends with a newline: a whole line, not torn
                       ('{"step": 1}\n[1, 2]\n{"step": 3}\n', 2), ('{"loss": 1}\n', 1), ("\x00\x01\n", 1)):
        path.write_text(text)
        with pytest.raises(QerlError, match=rf"^{path} line {line} is not a metrics record"):
            read_metrics(path)


# ---- quantize: refusals, staging, a full disk ---------------------------------------------------------------------
def test_a_refused_quantize_leaves_no_run_directory_and_an_existing_run_as_it_was(runs: dict, tiny_source: Path,
                                                                                tmp_path: Path, capsys) -> None:
    one_line(*cli(capsys, "quantize", str(tmp_path / "nope"), "--run", str(tmp_path / "r1")))
    assert not (tmp_path / "r1").exists()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_source / "config.json", no_weights)
    err = one_line(*cli(capsys, "quantize", str(no_weights), "--run", str(tmp_path / "r2")))
    assert "could not load model" in err and not (tmp_path / "r2").exists()  # refused inside the stage

    run = copy_run(runs["base"], tmp_path / "run")
    before = (run / "manifest.json").read_bytes()
    one_line(*cli(capsys, "quantize", str(no_weights), "--run", str(run)))
    assert (run / "manifest.json").read_bytes() == before


def test_a_killed_quantize_leaves_no_staging_after_the_next_one(runs: dict, tiny_source: Path, tmp_path: Path) -> None:
    from qerl_cli.quantize import quantize_model

    run = copy_run(runs["base"], tmp_path / "run")
    pid, live = dead_pid(), subprocess.Popen(["sleep", "60"])
    try:
        stale = [run / f".model.tmp-{pid}", run / f".model.old-{pid}", run / f".manifest.json.tmp-{pid}"]
        for d in stale[:2]:
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"\0" * 100_000)
        stale[2].write_text("{")
        running = run / f".model.tmp-{live.pid}"  # a live process may still be writing it
        running.mkdir()
        quantize_model(run, str(tiny_source), fmt="nvfp4")
        assert not any(p.exists() for p in stale) and running.is_dir()
        assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [".lock", running.name]
    finally:
        live.kill()
        live.wait()


def test_a_full_disk_during_quantize_is_one_line_and_keeps_the_previous_model(runs: dict, tiny_source: Path,
                                                                             tmp_path: Path, capsys,
                                                                             monkeypatch) -> None:
    import qerl_cli.checkpoint

    run = copy_run(runs["base"], tmp_path / "run")
    before = {p.name: p.read_bytes() for p in (run / "model").iterdir()}
    manifest_before = (run / "manifest.json").read_bytes()

    def disk_full(*args, **kwargs) -> None:  # noqa: ANN002, ANN003 - what the OS answers when the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(qerl_cli.checkpoint, "save_file", disk_full)
    err = one_line(*cli(capsys, "quantize", str(tiny_source), "--run", str(run)))
    assert f"out of disk space while writing {run / 'model'}: free space on {run} and run the command again" in err
    monkeypatch.undo()
    # the real library's error for a real failed write: safetensors' SafetensorError (here EFBIG from a file-size
    # limit below the 6 MB weights file)
    with file_size_limit(1_000_000):
        err = one_line(*cli(capsys, "quantize", str(tiny_source), "--run", str(run)))
    assert f"{run / 'model'} grew past the largest file this process may write" in err
    assert {p.name: p.read_bytes() for p in (run / "model").iterdir()} == before
    assert (run / "manifest.json").read_bytes() == manifest_before
    assert sorted(p.name for p in run.iterdir()) == [".lock", "manifest.json", "model"]


class file_size_limit:  # noqa: N801 - used like a function
    """RLIMIT_FSIZE for this process: a write past ``limit`` bytes fails with EFBIG, as a full disk fails a write."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __enter__(self) -> None:
        self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
        self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal that kills
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.old[1]))

    def __exit__(self, *exc: object) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, self.old)
        signal.signal(signal.SIGXFSZ, self.handler)


def test_a_failed_background_checkpoint_write_is_one_line_and_latest_stays(runs: dict, tmp_path: Path) -> None:
    from qerl_cli.train.config import build_config
    from qerl_cli.train.run import train

    run = copy_run(runs["base"], tmp_path / "run")
    limit = file_size_limit(30_000)  # the manifest (~13 kB) still fits, step_2's adapter (~36 kB) does not

    def fill_disk(m: dict) -> None:
        if m["step"] == 2:
            limit.__enter__()

    try:
        with pytest.raises(QerlError) as err:
            train(run, build_config("quick_cpu", {**runs["overrides"], "steps": 3}), on_step=fill_disk)
    finally:
        limit.__exit__()
    assert str(err.value).startswith(f"{ckpt(run, 2)} grew past the largest file this process may write")
    assert latest(run) == "step_1" and not ckpt(run, 2).exists()
    assert sorted(p.name for p in (run / "train" / "checkpoints").iterdir()) == ["latest", "step_1"]
    rec = manifest(run)["stages"]["train"]
    assert rec["status"] == "failed" and rec["outputs"]["checkpoint"] == "train/checkpoints/step_1"
