"""A training stage from start to end: the run directory's checks, the model's setup, resume, the steps, their
checkpoints and the manifest's record; a stop request (train/stop.py) ends it at a step boundary.

The RL step itself is the Trainer's (train/trainer.py); this module is what `qerl train` runs around it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import Preempted, QerlError
from qerl_cli.manifest import RunDir
from qerl_cli.metricsfile import read_metrics, write_metrics
from qerl_cli.runlayout import base_fingerprint, checkpoints_dir, metrics_path, train_dir
from qerl_cli.train import checkpointing
from qerl_cli.train.bookkeeping import check_resume_settings, read_trainer_state
from qerl_cli.train.checkpointing import NoCheckpointError, resolve_checkpoint
from qerl_cli.train.config import TrainConfig
from qerl_cli.train.stop import GracefulStop
from qerl_cli.train.trainer import Trainer
from qerl_cli.train.updater import NonFiniteLoss


@dataclass
class TrainResult:
    run: Path
    steps_done: int
    metrics: list[dict[str, Any]]
    checkpoint: Path | None
    stopped_early: bool = False


def _checkpoint_outputs(run: RunDir, trainer: Trainer, ckpt: Path) -> dict[str, Any]:
    step = checkpointing.checkpoint_step(ckpt)  # a background write finishes after the trainer moved on
    return {**checkpointing.checkpoint_outputs(run, ckpt), "metrics": run.rel(trainer.book.metrics_path),
            "steps_done": step if step is not None else trainer.step}


def _check_resumable(run: RunDir, trainer: Trainer, model: dict[str, Any], resume_from: str | None = None,
                     *, verify: bool = True) -> tuple[Path, dict[str, Any]] | None:
    """`--resume` / `--resume-from step_N` checks, before the stage starts (a refusal leaves the manifest's train
    record as it was): the metrics file, the checkpoint to continue from, verified file by file (``verify``: rank 0
    only, which stops every rank when it refuses; N ranks hashing a sharded checkpoint N times would gain nothing),
    its trainer state and settings (``cfg`` resolved); None when plain `--resume` finds no checkpoint (the run
    starts over)."""
    read_metrics(metrics_path(run))  # a damaged line is refused here, not after the stage began
    if resume_from is not None:
        ckpt = resolve_checkpoint(run, resume_from, "--resume-from")
        if ckpt is None:
            raise QerlError("--resume-from needs a step_N checkpoint (base is not one): train a new --run instead")
    else:
        try:
            ckpt = resolve_checkpoint(run, "latest")
        except NoCheckpointError:
            return None
        assert ckpt is not None
    if verify:
        checkpointing.require_intact(run, ckpt, "resume")
    state = read_trainer_state(run, ckpt)
    cfg = trainer.cfg
    check_resume_settings(cfg, ckpt, state, trainer.mode)
    done = int(state["step"])
    trained_on = (run.record("train") or {}).get("inputs", {}).get("model")
    if trained_on and trained_on.get("files") and base_fingerprint(trained_on) != base_fingerprint(model):
        raise QerlError(f"the checkpoints in {train_dir(run)} were trained on another base model than {run.path}'s "
                        "current one (re-quantized since): train in a new --run directory")
    if done >= cfg.steps:
        more = "already finished" if done == cfg.steps else f"is at step {done}, past --steps {cfg.steps}"
        raise QerlError(f"the training run in {run.path} {more}: pass --steps N with N > {done} to extend it "
                        "(AQN keeps its schedule; the added steps run at --aqn-sigma-end)")
    return ckpt, state


def set_aside_after(run: RunDir, step: int, metrics_path: Path, rollouts_dir: Path) -> dict[str, Any]:
    """`--resume-from step_N`: move what the run wrote after step N (later checkpoints, their rollouts and
    metrics lines) into ``train/checkpoints.abandoned-<time>/``, never deleting it; what the manifest records."""
    dest = checkpointing.abandoned_dir(run)
    moved = checkpointing.set_aside_checkpoints_after(run, step, dest)
    rows = read_metrics(metrics_path)  # a torn last line (a killed trainer) is dropped: its step was never saved
    later_lines = [r for r in rows if r["step"] > step]
    if later_lines:
        dest.mkdir(parents=True, exist_ok=True)
        write_metrics(dest / metrics_path.name, later_lines)
        write_metrics(metrics_path, [r for r in rows if r["step"] <= step])
    rollouts = []
    for p in sorted(rollouts_dir.glob("step_*.jsonl")) if rollouts_dir.is_dir() else []:
        if p.stem[5:].isdigit() and int(p.stem[5:]) > step:
            (dest / rollouts_dir.name).mkdir(parents=True, exist_ok=True)
            p.rename(dest / rollouts_dir.name / p.name)
            rollouts.append(p.name)
    return {"checkpoint": checkpointing.checkpoint_name(step),
            "set_aside": run.rel(dest) if dest.exists() else None, "checkpoints": moved,
            "metrics_lines": len(later_lines), "rollout_files": len(rollouts)}


def _start(run: RunDir, trainer: Trainer, rec: Any, stop: GracefulStop,
           start_from: tuple[Path, dict[str, Any]] | None, resume: bool, resume_from: str | None) -> int:
    """Load the model, set aside what `--resume-from` abandons and restore the checkpoint; the step training
    continues at. A refusal before anything in the run directory changes (a damaged base, a checkpoint that does
    not fit) leaves the manifest as it was (``rec.refusable``)."""
    ctx = trainer.dist
    with ctx.agree("setup"):  # a failure on any rank stops every rank with one clear line
        try:
            trainer.setup()
        except torch.cuda.OutOfMemoryError as exc:
            raise QerlError("out of GPU memory while loading the model: lower --gpu-memory-utilization") from exc
    if start_from is not None and ctx.is_main:
        ckpt, state = start_from
        if resume_from is not None:  # under the run lock: later checkpoints, rollouts, metrics lines set aside
            rec.refusable = False
            with stop.deferred():  # all of it or (before it starts) none of it
                rec.extra["resume_from"] = set_aside_after(run, int(state["step"]), trainer.book.metrics_path,
                                                           trainer.book.rollouts_dir)
        rec.outputs = _checkpoint_outputs(run, trainer, ckpt)  # what the run stands on until its next save
        run.save(rec)
    with ctx.agree("setup"):
        start = (trainer.resume(*start_from) if start_from is not None else trainer.resume()) if resume else 0
    rec.refusable = False  # from here on the run writes: a failure is recorded as one
    return start


def trainer_device() -> str | None:
    """The device of this rank under torchrun (cuda:LOCAL_RANK / cpu); None (the default) otherwise."""
    from qerl_cli.train.distributed import current

    return current().device


def train(run_dir: str | Path, cfg: TrainConfig, *, resume: bool = False, resume_from: str | None = None,
          device: str | None = None, on_step: Callable[[dict[str, Any]], None] | None = None,
          on_setup: Callable[[Trainer], None] | None = None, preset: str | None = None) -> TrainResult:
    """Run `cfg.steps` RL steps on the run's quantized model; resumable with `resume=True` (from `latest`) or
    ``resume_from="step_N"`` (an earlier checkpoint: what the run wrote after it is set aside, not deleted).
    ``preset``: the preset the configuration started from, recorded in the manifest."""
    from qerl_cli.train import disagg

    run = RunDir(run_dir, create=False)
    roles = disagg.init_roles(cfg.rollout_gpus)  # --rollout-gpus: this rank trains or rolls out (train/disagg.py)
    trainer = Trainer(run, cfg, device=device or trainer_device())
    inputs = _model_inputs(run)
    resume = resume or resume_from is not None
    if not resume and (checkpoints_dir(run).exists() or trainer.book.metrics_path.exists()):
        # refused before the stage starts, so the finished run's manifest record stays as it was
        raise QerlError(f"{train_dir(run)} already holds a training run: pass --resume to continue it, or use "
                        "a new --run directory")
    # an earlier extension stays stated when the extended run is resumed again
    extended = (run.record("train") or {}).get("extra", {}).get("extended") if resume else None
    start_from = _check_resumable(run, trainer, inputs["model"], resume_from, verify=trainer.dist.is_main) \
        if resume else None
    # the memory plan from the model's config: a run that cannot fit is refused here, before the stage starts and
    # before any weight is loaded (setup() plans again with the measured weights)
    trainer.plan_run_memory()
    if roles is not None and roles.role == disagg.ROLLOUT:  # no stage, no writes: it generates until told to stop
        disagg.run_rollout_rank(trainer, roles, start_from, resume)
        return TrainResult(run.path, trainer.step, [], None)
    with _stage(run, trainer, inputs) as rec, \
            GracefulStop(trainer.cfg.sigterm_grace_s, can_abandon=not trainer.dist.enabled) as stop:
        start = _start(run, trainer, rec, stop, start_from, resume, resume_from)
        _record_setup(rec, trainer, preset)
        if on_setup:
            on_setup(trainer)
        with disagg.session(trainer, roles, rec, stop):  # a no-op unless --rollout-gpus
            steps = StageSteps(run, trainer, rec, stop, start)
            steps.loop(on_step)
            result = steps.finish(extended)
    return result


def _model_inputs(run: RunDir) -> dict[str, Any]:
    """The stage's input: the quantized model `qerl quantize` recorded."""
    model = run.require("quantize")["outputs"]["model"]
    return {"model": {"path": model["path"], "files": model.get("files", {}), "format": model.get("format")}}


def _stage(run: RunDir, trainer: Trainer, inputs: dict[str, Any]) -> Any:
    """The manifest's train stage: only rank 0 takes the run lock and writes the manifest; other ranks only read
    the run directory."""
    from qerl_cli.train.distributed import follower_stage

    if not trainer.dist.is_main:
        return follower_stage("train")
    return run.stage("train", config=trainer.cfg.to_dict(), inputs=inputs, seeds={"seed": trainer.cfg.seed})


def _record_setup(rec: Any, trainer: Trainer, preset: str | None) -> None:
    """What setup decided, beside the request: the memory plan and the settings it resolved, the preset."""
    if not trainer.dist.is_main:
        return
    if trainer.memory_plan is not None:
        rec.extra.update(memory_plan=trainer.memory_plan.to_dict(),
                         resolved={**trainer.settings.to_dict(), "sharding": trainer.sharding})
    if preset is not None:
        rec.extra["preset"] = preset


class StageSteps:
    """The stage's steps: train, log and checkpoint until --steps or a stop request; then the stage's record."""

    def __init__(self, run: RunDir, trainer: Trainer, rec: Any, stop: GracefulStop, start: int) -> None:
        self.run, self.trainer, self.rec, self.stop, self.start = run, trainer, rec, stop, start
        self.ctx = trainer.dist
        self.history: list[dict[str, Any]] = []
        self.last_ckpt: Path | None = None
        self.saved_step = start  # the step of the newest checkpoint written (or resumed from)
        self.stopped = self.abandoned = False
        self.logged = trainer.step  # steps whose metrics are in metrics.jsonl

    def record_outputs(self, ckpt: Path, *, save: bool = True) -> None:
        """The manifest's outputs: the checkpoint the run stands on now (rank 0 writes it)."""
        if self.ctx.is_main:
            self.rec.outputs = _checkpoint_outputs(self.run, self.trainer, ckpt)
            if save:
                self.run.save(self.rec)

    def checkpoint(self, *, background: bool | None) -> Path:
        t = self.trainer
        path = t.save(background=background)
        self.saved_step = t.step
        if self.history:
            # in history; the jsonl line is written
            self.history[-1]["timing/checkpoint_s"] = t.checkpoints.last_checkpoint_s
        if self.ctx.enabled:
            self._record_dist()
        if not t.writer.busy:
            self.record_outputs(path)
        return path

    def _record_dist(self) -> None:
        from qerl_cli.train.distributed import replica_digests

        t, ctx = self.trainer, self.ctx
        self.rec.extra["dist"] = {"world_size": ctx.world_size, "backend": ctx.backend, "sharding": t.sharding,
                                  "pids": ctx.gather_objects(os.getpid())}
        if not t.mode.sharded:  # replicas must stay bitwise equal; shards differ
            self.rec.extra["dist"]["adapter_digests"] = replica_digests(t.params, self.ctx, t.step)

    def loop(self, on_step: Callable[[dict[str, Any]], None] | None) -> None:
        t = self.trainer
        self.stop.loop()
        while t.step < t.cfg.steps:
            if self.ctx.any_true(self.stop.requested):  # every rank stops at the same step boundary
                self.stopped = True
                return
            self.logged = t.step
            m = self.step()
            if m is None:
                return
            finished = t.wait_checkpoint()  # the previous step's background write
            if finished is not None:
                self.record_outputs(finished)
            t.book.append_metrics(m)
            self.history.append(m)
            if on_step:
                on_step(m)
            done = t.step >= t.cfg.steps
            if done or t.step % t.cfg.save_steps == 0:
                # the last checkpoint is written before the process moves on
                self.last_ckpt = self.checkpoint(background=None if not done else False)

    def step(self) -> dict[str, Any] | None:
        """One train step, or None when a SIGTERM past the grace period abandoned it: the step is dropped whole
        (nothing of it is logged or saved, its half-updated state is never written); the last checkpoint is what
        --resume continues from."""
        t = self.trainer
        try:
            with self.stop.step():
                return t.train_step()
        except Preempted:
            self.stopped = self.abandoned = True
            return None
        except NonFiniteLoss:  # the record names the checkpoint that stays the newest (the stop waited for it)
            newest = checkpointing.latest_step(self.run)
            if newest is not None:
                self.record_outputs(checkpointing.checkpoint_path(self.run, newest), save=False)
            raise
        except torch.cuda.OutOfMemoryError as exc:
            raise QerlError(
                f"out of GPU memory at step {t.step + 1}: lower --batch-prompts, "
                "--micro-batch-size or --max-completion-length, or use --gradient-checkpointing; the last "
                "checkpoint is intact (--resume)") from exc

    def finish(self, extended: dict[str, Any] | None) -> TrainResult:
        """Settle the checkpoints and record the stage; a stop request ends here as KeyboardInterrupt (Ctrl-C) or
        Preempted (SIGTERM), the stage recorded `interrupted`."""
        t = self.trainer
        if self.stopped and not self.abandoned and self.saved_step < t.step:
            self.last_ckpt = self.checkpoint(background=False)  # Ctrl-C / SIGTERM: the finished step is kept
        preempted = self.ctx.any_true(self.stop.preempted) if self.stopped else False
        finished = t.wait_checkpoint()
        if finished is not None:
            self.record_outputs(finished, save=False)
        if self.last_ckpt is None and t.step > 0 and not self.abandoned:  # resumed a run that had finished
            self.last_ckpt = resolve_checkpoint(self.run, "latest")
            assert self.last_ckpt is not None
            self.record_outputs(self.last_ckpt, save=False)
        self._record_end(extended)
        if self.stopped:
            self._stop(preempted)
        return TrainResult(self.run.path, t.step, self.history, self.last_ckpt, self.stopped)

    def _record_end(self, extended: dict[str, Any] | None) -> None:
        t, rec = self.trainer, self.rec
        if t.extended_from is not None:
            extended = {"from_steps": t.extended_from, "to_steps": t.cfg.steps,
                        "aqn_schedule_steps": t.updater.aqn.total_steps if t.updater.aqn else None}
        if extended:
            rec.extra["extended"] = extended
        self.logged = self.logged if self.abandoned else t.step  # an abandoned step may have counted itself already
        last = self.history[-1] if self.history else {}
        rec.metrics = {"steps_done": self.logged, "resumed_from": self.start,
                       **{k: last[k] for k in ("reward", "accuracy", "completions/mean_length") if k in last}}

    def _stop(self, preempted: bool) -> None:
        """Recorded as interrupted; the newest checkpoint is what --resume continues from."""
        logged, saved = self.logged, self.saved_step
        name = checkpointing.checkpoint_name(saved) if saved else None
        if self.ctx.is_main:
            self.rec.extra["stopped"] = {"signal": "SIGTERM" if preempted else "SIGINT", "at_step": logged,
                                         "abandoned_step": logged + 1 if self.abandoned else None,
                                         "checkpoint": name}
        if not preempted:
            raise KeyboardInterrupt
        where = (f"step {logged + 1} was abandoned past --sigterm-grace-s" if self.abandoned
                 else f"step {logged} finished and was checkpointed")
        again = f"`qerl train --run {self.run.path} --resume`"
        hint = f"{again} continues from {name}" if saved else f"no checkpoint was written yet: {again} starts over"
        raise Preempted(f"preempted (SIGTERM): {where}; {hint}")
