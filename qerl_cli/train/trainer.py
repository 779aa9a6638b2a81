"""The RL step: the rollout side (train/rollouter.py: AQN's noise draw, the rollout, rewards, the batch) joined to
the update side (train/updater.py: advantages, pi_old, the algorithm's loss over micro-batches, the optimizer) by
one short loop, :meth:`Trainer.train_step`; what the run keeps besides weights (metrics, rollout logs, where a
resume starts) is train/bookkeeping.py's. Each part of a step is a named phase (train/phases.py). The run around
the steps (setup, resume, stop, the manifest) is train/run.py.

Everything a run needs comes from the run directory that `qerl quantize` wrote. Resume is exact: the
rollout seed of step N is a function of (seed, N), the data order of (seed, epoch), and the AQN noise
stream, optimizer, scheduler, scaler and RNG states are restored from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qerl_cli.device import pick as pick_device
from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir
from qerl_cli.precision import dtype_of
from qerl_cli.runlayout import model_files, quantized_model_dir
from qerl_cli.train import checkpointing
from qerl_cli.train.async_rollout import BackgroundRollouts
from qerl_cli.train.bookkeeping import Bookkeeper, check_resume_settings
from qerl_cli.train.checkpointing import CheckpointSink
from qerl_cli.train.config import TrainConfig
from qerl_cli.train.memory_plan import MemoryPlan, ResolvedSettings
from qerl_cli.train.modes import make_mode
from qerl_cli.train.phases import CHECKPOINT, ROLE_BOTH, ROLE_ROLLOUT, PhaseClock, StepRecord
from qerl_cli.train.rollouter import (
    NormOverrides,
    Rollouter,
    Rollouts,
    episode_kind,
    load_task,
    make_rollout_engine,
)
from qerl_cli.train.step_backend import StepSides
from qerl_cli.train.updater import NonFiniteLoss, PolicyUpdater, nonfinite_message, sampling_entropy

log = logging.getLogger("qerl.train")

# the update side's names callers have imported from here since before the sides were split
__all__ = ["NonFiniteLoss", "Trainer", "nonfinite_message", "sampling_entropy"]


class Trainer:
    """One run's rollout and update sides, built by :meth:`setup` and joined by :meth:`train_step`; checkpoints
    (:meth:`save`, :meth:`resume`) hold both. After setup the sides are :attr:`rollouter` and :attr:`updater`;
    ``model``, ``params``, ``optimizer``, ``stream``, ``engine``, ``full`` and ``rollout_quant`` name their parts."""

    def __init__(self, run: RunDir, cfg: TrainConfig, *, device: str | None = None) -> None:
        from qerl_cli.train.config import resolve_sharding
        from qerl_cli.train.distributed import DistributedAbort, current

        self.run = run
        self.cfg = cfg.resolved()
        self.routing_replay_asked = cfg.routing_replay  # None: the default (off with vLLM says so for a MoE)
        self.device = pick_device(device)
        self.dtype = dtype_of(self.cfg.precision)
        # resolved in setup() unless a model is injected (benches build theirs in memory)
        self.model_dir: Path | None = None
        self.tokenizer: Any = None
        self.memory_plan: MemoryPlan | None = None  # set by plan_memory() or setup() (train/memory_plan.py)
        # what the run takes where the TrainConfig left it to the plan; the TrainConfig itself stays the request
        self.settings: ResolvedSettings | None = None
        self.rates: Any = None  # the device's rates for the plan's cost model (a bench passes measured ones)
        self.phases = PhaseClock(self.device)  # the phase running now, its callbacks, the step's clock
        self.checkpoints = CheckpointSink(run)  # background writes and what the last one cost
        self.writer = self.checkpoints.writer
        self.last_step: StepRecord | None = None  # the last step's phases, typed (train/phases.py)
        self.extended_from: int | None = None  # a finished run's steps, when --resume --steps extends it
        self.dist = current()  # world_size 1 unless launched by torchrun (train/distributed.py)
        try:  # the engine that runs; recorded beside the request (the manifest's extra.resolved)
            self.sharding = resolve_sharding(self.cfg, self.dist.world_size)
        except QerlError as exc:
            if not self.dist.is_main:  # every rank refuses the same way; rank 0 says why
                raise DistributedAbort(str(exc)) from exc
            raise
        # LoRA, full or sharded full (train/modes.py)
        self.mode = make_mode(self.cfg, self.sharding, self.device, self.dtype, self.dist, self.phases)
        self.book = Bookkeeper(run, self.cfg, self.dist)
        self.rollouter: Rollouter  # set by setup()
        self.updater: PolicyUpdater  # set by setup()

    # ---- setup -----------------------------------------------------------------------------------
    def setup(self, *, model: torch.nn.Module | None = None, tokenizer: Any = None, task: Any = None,
              prompt_ids: list[list[int]] | None = None, reward_fn: Callable[..., Any] | None = None,
              model_dir: Path | None = None) -> None:
        """Load the run's model, task and reward, or take them in memory (benchmarks: `qerl bench step|sanity`).

        ``model`` (a base model on this trainer's device, in its dtype) replaces the run's checkpoint;
        ``tokenizer`` may then be None when ``prompt_ids`` gives the prompts as token ids; ``task``
        replaces ``cfg.task`` and ``reward_fn`` the task's reward. ``model_dir``: the checkpoint of an
        injected model, for a rollout engine that serves its own copy (``--rollout-engine vllm``).
        """
        c = self.cfg
        torch.manual_seed(c.seed)
        cap_gpu_memory(self.device, c.gpu_memory_gib)
        base = self._load_base(model, tokenizer, model_dir, prompt_ids)
        weights = resident_weights(base, self.device)
        self.mode.check_base(base)
        self.model, self.params = self.mode.build(base)
        inputs = load_task(c, self.tokenizer, task, reward_fn, prompt_ids)
        episodes = episode_kind(c, self.tokenizer, inputs.reward_fn, self.phases)  # one completion, or turns
        prompt_tokens = max(len(p) for p in inputs.prompt_ids)
        self.memory_plan, settings = plan_with_weights(c, base, weights, self.memory_plan, device=self.device,
                                                       dtype=self.dtype, prompt_tokens=prompt_tokens, rates=self.rates,
                                                       role=self.dist.role)
        self.settings = settings
        self.engine = make_rollout_engine(c, self.mode.rollout_model(), self.tokenizer, settings, device=self.device,
                                          dtype=self.dtype, distributed=self.dist.enabled, prompt_tokens=prompt_tokens,
                                          model_dir=self.model_dir, routing_replay_asked=self.routing_replay_asked)
        self.updater = PolicyUpdater(c, self.mode, self.params, settings, self.phases, self.checkpoints)
        self.rollouter = Rollouter(c, self.phases, task=inputs.task, prompt_ids=inputs.prompt_ids,
                                   tokenizer=self.tokenizer, episodes=episodes, engine=self.engine,
                                   aqn=self.updater.aqn, keep_rollout_cache=settings.keep_rollout_cache)
        # local or data-parallel: chosen once here, so the step has no branch on it (train/step_backend.py)
        from qerl_cli.train.distributed import make_backend

        backend = make_backend(StepSides(self.rollouter, self.updater), self.dist, sharded_model=self.mode.sharded)
        self.rollouter.backend = self.updater.backend = backend
        self.optimizer, self.stream = self.updater.optimizer, self.rollouter.stream
        # the checkpoint's pinned host buffers, allocated while the first step runs; a rollout rank never saves
        if self.dist.role != ROLE_ROLLOUT:
            self.mode.prepare_snapshot(self.checkpoints, self.optimizer)
        self.full, self.rollout_quant = self.mode.full, self.mode.rollout_quant  # None without them

    def _load_base(self, model: torch.nn.Module | None, tokenizer: Any, model_dir: Path | None,
                   prompt_ids: list[list[int]] | None) -> torch.nn.Module:
        """The run's quantized model (planned before a weight is loaded: a run that cannot fit is refused first), or
        the injected one (planned from its config when its format and prompts are known)."""
        from qerl_cli.models import load_model

        if model is None:
            self.model_dir = quantized_model_dir(self.run)
            if self.cfg.rollout_w4a8:  # refused before the weights load (make_rollout_engine checks the model too)
                from qerl_cli.train.memory_plan import model_dir_format

                self.cfg.check_rollout_w4a8(model_dir_format(self.model_dir))
            if self.memory_plan is None:
                self.plan_run_memory()
            base, self.tokenizer = load_model(str(self.model_dir), dtype=self.dtype, device=self.device,
                                              expected_sha256=model_files(self.run) or None)
            return base
        self.tokenizer, self.model_dir = tokenizer, model_dir
        fmt = getattr(model, "qerl_format", None)
        if self.memory_plan is None and fmt is not None and prompt_ids is not None:
            self.plan_memory(model.config, fmt, prompt_tokens=max(len(p) for p in prompt_ids))
        return model

    # ---- the memory plan (train/memory_plan.py) and what it decides ----------------------------------------
    def plan_memory(self, model_config: Any, fmt: str, *, prompt_tokens: int, stored: int | None = None,
                    rates: Any = None) -> MemoryPlan:
        """The plan from the model's config and format, before any weight is built: raises MemoryPlanError (one
        line naming the setting to change) when the run cannot fit. Sets whether FP4 kernels may keep a second
        weight copy before the first forward could make one; ``setup()`` plans again with what it measures.
        ``rates``: the device's measured rates for the cost model (step_cost.DeviceRates; default: its name's)."""
        from qerl_cli import kernel_dispatch
        from qerl_cli.train.memory_plan import plan_before_build, stored_bytes

        if stored is None and self.model_dir is not None:
            stored = stored_bytes(self.model_dir)
        self.rates = rates if rates is not None else self.rates
        plan = plan_before_build(self.cfg, model_config, fmt, device=self.device, prompt_tokens=prompt_tokens,
                                 stored=stored, rates=self.rates, role=self.dist.role)
        self.memory_plan = plan
        if self.device.type == "cuda" and plan.capacity is not None:
            kernel_dispatch.allow_extra_copies(plan.extra_weight_copies)
        return plan

    def plan_run_memory(self) -> MemoryPlan:
        """:meth:`plan_memory` for the run directory's model, from its config.json (nothing is loaded); prompts
        count at --max-prompt-length, their bound."""
        from qerl_cli.model_config import read_model_config
        from qerl_cli.train.memory_plan import model_dir_format

        self.model_dir = quantized_model_dir(self.run)
        return self.plan_memory(read_model_config(self.model_dir), model_dir_format(self.model_dir),
                                prompt_tokens=self.cfg.max_prompt_length)

    # ---- one step --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One RL step: this step's rollouts (AQN's noise draw and the rollout, now, or with --async-rollout during
        the previous update, or from the rollout ranks), then the update on them (advantages, recompute, fwd_bwd,
        optimizer, requant). The step's metrics; :attr:`last_step` holds the same measurements typed."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rollouter, updater = self.rollouter, self.updater
        step = updater.step
        rollouts = rollouter.take(step)
        rollouter.start_next(step)  # --async-rollout: the next step's rollouts, beside this update
        metrics: dict[str, Any] = {"step": step + 1, **plan_estimate(self.memory_plan), **rollouts.metrics}
        metrics["rollout/policy_lag"] = float(step - rollouts.policy)  # 1 with --async-rollout (after step 1)
        adv = updater.advantages(rollouts.groups, metrics)
        updater.update(rollouter.batch(rollouts, metrics), adv, rollouts.samples(), metrics)
        self.book.log_rollouts(rollouts.groups, adv, metrics["step"], rollouter.task.examples, rollouter.episodes)
        self.last_step = StepRecord.from_metrics(metrics)
        metrics.update(rollouter.published(updater.step))  # --rollout-gpus: the new adapters go out now
        return metrics

    def rollout_noise(self, step: int) -> NormOverrides:
        """AQN's noisy norm weights for ``step``'s rollout policy (the rollout side draws them)."""
        return self.rollouter.noise(step)

    def collect_rollouts(self, step: int, overrides: NormOverrides, *, concurrent: bool = False,
                         policy: int | None = None) -> Rollouts:
        """``step``'s rollouts collected now by the rollout side, outside any step (``policy``: the updates the
        sampling adapters had seen, default this trainer's step)."""
        return self.rollouter.collect(step, overrides, concurrent=concurrent,
                                      policy=self.step if policy is None else policy)

    @property
    def step(self) -> int:
        """The updates made (the step the run is at); the update side counts them."""
        return self.updater.step

    @property
    def pending(self) -> BackgroundRollouts[Rollouts] | None:
        """--async-rollout: the next step's rollouts in flight (train/async_rollout.py)."""
        return self.rollouter.pending

    # ---- checkpoints -----------------------------------------------------------------------------
    def resume(self, ckpt: Path | None = None, state: dict[str, Any] | None = None) -> int:
        """Restore everything from a checkpoint (default: `latest`, verified here); the step it continues at.

        ``ckpt`` and ``state``: a checkpoint the caller has verified and its loaded trainer state (`train`
        does both before the stage starts, so a damaged checkpoint leaves the manifest as it was)."""
        found = self.book.resume_point(ckpt, state)
        if found is None:  # killed before the first checkpoint: start over cleanly
            return 0
        ckpt, state = found
        saved = state.get("config", {})
        check_resume_settings(self.cfg, ckpt, state, self.mode)
        self.updater.load(ckpt, state)
        self.rollouter.stream.load(state["data"])
        if saved.get("steps") is not None and self.cfg.steps > saved["steps"]:
            self.extended_from = int(saved["steps"])
        checkpointing.set_rng_state(state["rng"])
        self.updater.step = int(state["step"])
        self.book.truncate_metrics(self.step)
        return self.step

    def save(self, *, background: bool | None = None) -> Path:
        """Checkpoint this step (the mode writes it); ``background`` (default: ``cfg.async_checkpoint``, where the
        mode allows it) copies the state to host memory now and writes it in a thread while the caller goes on."""
        self.phases.enter(CHECKPOINT)
        return self.mode.save(self.checkpoints, self.step, self.optimizer, self.trainer_state,
                              self.cfg.async_checkpoint if background is None else background)

    def wait_checkpoint(self) -> Path | None:
        """Wait for the background checkpoint write in flight; its path (None if none was in flight)."""
        return self.checkpoints.wait()

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the weights (and, without sharding, the optimizer)."""
        return {
            **self.updater.state(),  # scheduler, scaler
            # --async-rollout: where the data and AQN stood before the next step's rollouts began
            **self.rollouter.resume_state(),
            "config": self.cfg.to_dict(),
            checkpointing.ROLLOUT_QUANT_KEY: self.rollout_quant.state_dict() if self.rollout_quant is not None
            else None,
        }


# ---- what setup measures and plans --------------------------------------------------------------------------
def cap_gpu_memory(device: torch.device, gib: float | None) -> None:
    """--gpu-memory-gib: the cap the memory plan fits into, enforced."""
    from qerl_cli.train.memory_plan import device_capacity

    if device.type != "cuda" or gib is None:
        return
    cap, total = device_capacity(device, gib)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)


def resident_weights(base: torch.nn.Module, device: torch.device) -> int:
    """What the base holds on the device before adapters (the plan's "weights"). On CUDA one 1-token
    forward first: kernels build load-time weight layouts at their first call (the decode GEMM's repacked
    FP4 copy), and the plan must see them, not find them at the first rollout."""
    from qerl_cli.train.memory_plan import module_bytes

    if device.type != "cuda":
        return module_bytes(base)
    with torch.no_grad():
        base(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def plan_with_weights(cfg: TrainConfig, base: torch.nn.Module, weights: int, before: MemoryPlan | None, *,
                      device: torch.device, dtype: torch.dtype, prompt_tokens: int, rates: Any,
                      role: str = ROLE_BOTH) -> tuple[MemoryPlan, ResolvedSettings]:
    """Plan the step's memory again with the measured weights and the real prompts (train/memory_plan.py) and
    resolve the settings the run takes; the TrainConfig is left as asked. ``before``: the plan made from the
    config before the weights existed, if it was (the larger of estimate and measurement counts; its copies
    decision stands); ``role``: this process's under --rollout-gpus (train/phases.py)."""
    from qerl_cli.train.memory_plan import plan_for_config, resolve_settings

    elem = torch.empty((), dtype=dtype).element_size()
    measured: Any = weights
    if before is not None:
        measured = dataclasses.replace(before.weight_parts, measured=weights)
    plan = plan_for_config(cfg, base.config, weights=measured, device=device, prompt_tokens=prompt_tokens, elem=elem,
                           extra_weight_copies=None if before is None else before.extra_weight_copies, rates=rates,
                           role=role)
    settings = resolve_settings(cfg, plan)
    if settings.gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    return plan, settings


def plan_estimate(plan: MemoryPlan | None) -> dict[str, float]:
    """The plan's estimate of a step (seconds), logged beside the measured phases; empty without one (CPU)."""
    est = None if plan is None else plan.est_step_s
    return {} if est is None else {"plan/est_step_s": est}
