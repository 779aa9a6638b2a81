"""The RL step: rollout (builtin engine on the live adapters, AQN-noised norms) -> rewards -> advantages
-> log-prob recompute and mismatch metrics -> clipped policy loss -> optimizer step -> log, checkpoint, each a
named phase (train/phases.py). The run around the steps (setup, resume, stop, the manifest) is train/run.py.

Everything a run needs comes from the run directory that `qerl quantize` wrote. Resume is exact: the
rollout seed of step N is a function of (seed, N), the data order of (seed, epoch), and the AQN noise
stream, optimizer, scheduler, scaler and RNG states are restored from the checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qerl_cli.device import pick as pick_device
from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir
from qerl_cli.metricsfile import append_metrics, read_metrics, write_metrics
from qerl_cli.moe import router_metrics
from qerl_cli.precision import dtype_of, uses_loss_scaling
from qerl_cli.runlayout import (
    metrics_path,
    model_files,
    quantized_model_dir,
    rollouts_dir,
)
from qerl_cli.train import checkpointing
from qerl_cli.train.batch import RolloutBatch, build_batch
from qerl_cli.train.checkpointing import CheckpointWriter, NoCheckpointError, resolve_checkpoint
from qerl_cli.train.config import TrainConfig
from qerl_cli.train.corrections import is_weights
from qerl_cli.train.logprobs import sampled_logprobs
from qerl_cli.train.losses import policy_loss
from qerl_cli.train.modes import TrainingMode
from qerl_cli.train.phases import (
    AQN,
    CHECKPOINT,
    FWD_BWD,
    OPTIMIZER,
    RECOMPUTE,
    ROLLOUT,
    SETUP,
    TRAIN_PHASES,
    StepRecord,
    end_key,
    peak_key,
    timing_key,
)
from qerl_cli.train.prompt_stream import PromptStream
from qerl_cli.train.step_backend import LogProbs, StepBackend

log = logging.getLogger("qerl.train")


def nonfinite_cause(cfg: TrainConfig) -> str:
    """The likely cause of a non-finite step: an option set to a non-finite number, else the learning rate."""
    import dataclasses
    import math

    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, list) else [value])):
            return f"--{f.name.replace('_', '-')} is {value}"
    return f"--lr {cfg.lr:g} is too high for this run"


def nonfinite_message(what: str, step: int, cfg: TrainConfig, newest: int | None) -> str:
    """One line for a step stopped by a NaN/inf: what, the likely cause, and the checkpoint that stays the newest."""
    if newest is None:
        after = "no checkpoint was written yet: fix the cause and train again (`--resume` starts the run over)"
    else:
        after = (f"step_{newest} stays the newest checkpoint: `--resume` continues from it, `--resume-from step_N` "
                 "from an earlier one")
    return f"{what} at step {step} (likely cause: {nonfinite_cause(cfg)}); nothing of step {step} was saved; {after}"


def params_finite(params: list[torch.Tensor], dist: Any = None) -> bool:
    """Whether every trainable value is finite: one fused max-abs per tensor, one device sync. ``dist``: the
    context whose ranks hold different shards (they must agree, or one rank would stop alone)."""
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in params]
    local = [t for t in local if t.numel()]
    bad = bool(local) and not bool(torch.isfinite(torch.stack(
        [n.float() for n in torch._foreach_norm(local, float("inf"))])).all())
    return not (dist.any_true(bad) if dist is not None else bad)


def sampling_entropy(samples: list[Any], mask: torch.Tensor) -> float | None:
    """Mean entropy of the distributions the rollout engine sampled from (under AQN the noisy policy's), over the
    completion tokens of ``mask`` [B, T], as ``entropy`` averages the training policy's; None when the engine
    reports no entropies (vLLM)."""
    if not samples or any(getattr(s, "entropies", None) is None for s in samples):
        return None
    m = mask.detach().float().cpu()
    total = 0.0
    for i, s in enumerate(samples):
        n = min(len(s.entropies), m.shape[1])
        total += float((s.entropies[:n].float() * m[i, :n]).sum())
    return total / max(float(m.sum()), 1.0)


def rollout_seed(seed: int, step: int, round_: int) -> int:
    return (seed * 1_000_003 + step * 7919 + round_ * 104_729) % (2**31 - 1)


class Trainer:
    def __init__(self, run: RunDir, cfg: TrainConfig, *, device: str | None = None) -> None:
        self.run = run
        self.cfg = cfg.resolved()
        self.routing_replay_asked = cfg.routing_replay  # None: the default (off with vLLM says so for a MoE)
        self.device = pick_device(device)
        self.dtype = dtype_of(self.cfg.precision)
        # resolved in setup() unless a model is injected (benches build theirs in memory)
        self.model_dir: Path | None = None
        self.last_checkpoint_s = 0.0
        self.pending: Any = None  # --async-rollout: the next step's rollouts in flight (train/async_rollout.py)
        # --rollout-gpus: the rollout ranks' groups and the adapter publishing (train/disagg.py's TrainerSource)
        self.rollout_source: Any = None
        self.rollout_step, self.rollout_concurrent = 0, False  # the step the engine is generating for, and how
        self.noise_metrics: dict[str, Any] = {}  # the AQN draw of the rollouts being collected
        self.last_checkpoint_parts: dict[str, float] = {}  # its seconds by part (background writes)
        self.writer = CheckpointWriter()  # background checkpoint writes (train/checkpointing.py)
        self.snapshot = checkpointing.HostSnapshot()  # their pinned host copies, reused from one write to the next
        self.memory_plan: Any = None  # set by setup() (train/memory_plan.py)
        # what the run takes where the TrainConfig left it to the plan (memory_plan.ResolvedSettings); the
        # TrainConfig itself stays the request
        self.settings: Any = None
        self.rates: Any = None  # the device's rates for the plan's cost model (a bench passes measured ones)
        # the phase running now (`qerl bench step` names it when a step runs out of memory) and a callback as each
        # phase starts (the console's progress lines)
        self.phase = SETUP
        self.on_phase: Callable[[str], None] | None = None
        # and what a long phase has done so far (micro-batches, tool calls): a CPU update runs for minutes
        self.on_progress: Callable[[str], None] | None = None
        self.last_step: StepRecord | None = None  # the last step's phases, typed (train/phases.py)
        self.keep_rollout_cache = False  # set by setup(): the builtin engine keeps its KV cache between steps
        self.backend: StepBackend  # set by setup()
        self.metrics_path = metrics_path(run)
        self.rollouts_dir = rollouts_dir(run)
        from qerl_cli.train.config import resolve_sharding
        from qerl_cli.train.distributed import DistributedAbort, current

        self.dist = current()  # world_size 1 unless launched by torchrun (train/distributed.py)
        try:  # the engine that runs; recorded beside the request (the manifest's extra.resolved)
            self.sharding = resolve_sharding(self.cfg, self.dist.world_size)
        except QerlError as exc:
            if not self.dist.is_main:  # every rank refuses the same way; rank 0 says why
                raise DistributedAbort(str(exc)) from exc
            raise
        from qerl_cli.train.modes import make_mode

        self.mode = make_mode(self, self.sharding)  # LoRA, full or sharded full (train/modes.py)

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
        torch.manual_seed(self.cfg.seed)
        self._cap_gpu_memory()
        base = self._load_base(model, tokenizer, model_dir, prompt_ids)
        weights = self._resident_weights(base)
        self.mode.check_base(base)
        self.model, self.params = self.mode.build(base)
        self._load_task(task, reward_fn, prompt_ids)
        self._apply_memory_plan(base, weights, max(len(p) for p in self.prompt_ids))
        self._build_engine()
        self._build_optimizer()
        self.step = 0
        # local or data-parallel: chosen once here, so train_step has no branch on it (train/step_backend.py)
        from qerl_cli.train.distributed import make_backend

        self.backend = make_backend(self, self.dist, sharded_model=self.mode.sharded)
        self.extended_from: int | None = None  # a finished run's steps, when --resume --steps extends it

    def _cap_gpu_memory(self) -> None:
        """--gpu-memory-gib: the cap the memory plan fits into, enforced."""
        from qerl_cli.train.memory_plan import device_capacity

        if self.device.type != "cuda" or self.cfg.gpu_memory_gib is None:
            return
        cap, total = device_capacity(self.device, self.cfg.gpu_memory_gib)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)

    def _load_base(self, model: torch.nn.Module | None, tokenizer: Any, model_dir: Path | None,
                   prompt_ids: list[list[int]] | None) -> torch.nn.Module:
        """The run's quantized model (planned before a weight is loaded: a run that cannot fit is refused first), or
        the injected one (planned from its config when its format and prompts are known)."""
        from qerl_cli.models import load_model

        if model is None:
            self.model_dir = quantized_model_dir(self.run)
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

    def _load_task(self, task: Any, reward_fn: Callable[..., Any] | None, prompt_ids: list[list[int]] | None) -> None:
        """The task, its reward, the prompts as token ids, their stream and (--tools/--env) the episodes."""
        from qerl_cli.tasks import get_reward, load_task
        from qerl_cli.tools.episodes import episodes_from_config

        c = self.cfg
        self.task = task if task is not None else load_task(
            c.task, split="train", shots=c.shots, chat_template=c.chat_template, tokenizer=self.tokenizer,
            seed=c.seed, level=c.task_level, tools=c.tools)
        if not self.task.examples:
            raise QerlError(f"task {self.task.name} has no training examples")
        self.reward_name = c.reward or self.task.reward
        self.reward_fn = reward_fn if reward_fn is not None else get_reward(self.reward_name)
        self.prompt_ids = ([list(p) for p in prompt_ids] if prompt_ids is not None
                           else [self.encode_prompt(e.prompt, i) for i, e in enumerate(self.task.examples)])
        if len(self.prompt_ids) != len(self.task.examples):
            raise QerlError(f"{len(self.prompt_ids)} prompt id lists for {len(self.task.examples)} task examples")
        self.stream = PromptStream(len(self.task.examples), c.seed)
        # multi-turn episodes with --tools/--env (docs/tools.md), or None
        self.episodes = episodes_from_config(c, self.tokenizer)
        if self.episodes is not None:
            self.episodes.on_step = lambda n: self.progress(f"{n} tool calls done" if self.episodes.tool is not None
                                                            else f"{n} environment steps done")

    def _build_engine(self) -> None:
        """The rollout engine on the mode's rollout model, sized by the memory plan's settings."""
        from qerl_cli.rollout import make_engine

        max_len = max(len(p) for p in self.prompt_ids) + self.completion_tokens + 1
        rollout_model = self.mode.rollout_model()
        # the builtin engine keeps its KV cache, LoRA shadows and CUDA graphs across steps when the plan says so:
        # re-allocating and re-capturing them every step costs the step's rollout its bench speed
        run = self.settings
        self.keep_rollout_cache = run.keep_rollout_cache
        self._check_async_rollout()
        self._note_routing_replay(rollout_model)
        self.engine = make_engine(self.cfg.rollout_engine, rollout_model, self.tokenizer, max_batch_slots=run.kv_slots,
                                  max_model_len=max_len, gpu_memory_utilization=run.gpu_memory_utilization,
                                  dtype=self.dtype, model_dir=self.model_dir)

    def _note_routing_replay(self, model: torch.nn.Module) -> None:
        """One line where a mixture of experts trains without routing replay because vLLM cannot record routing."""
        from qerl_cli.moe import moe_blocks

        if self.routing_replay_asked is None and not self.cfg.routing_replay and moe_blocks(model):
            log.warning("routing replay is off: the vLLM rollout engine does not record the experts it routes to; "
                        "the update routes every token anew (--rollout-engine builtin records them)")

    def _check_async_rollout(self) -> None:
        if not self.cfg.async_rollout:
            return
        if self.device.type == "cuda" and not self.settings.keep_rollout_cache:
            raise QerlError("--async-rollout keeps the rollout's KV cache beside the training step, and the memory "
                            "plan found no room for it: drop --async-rollout or lower --batch-prompts")
        if self.dist.enabled:
            raise QerlError("--async-rollout runs on one process (its rollout thread would interleave the ranks' "
                            "collectives): drop it or run without torchrun")

    def _build_optimizer(self) -> None:
        """AQN's noise schedule, the optimizer, its LR schedule (linear warm-up) and the fp16 loss scaler."""
        from qerl_cli.train.aqn import AQN

        c = self.cfg
        self.aqn = (AQN(self.mode.aqn_model(), c.steps, sigma_start=c.aqn_sigma_start, sigma_end=c.aqn_sigma_end,
                        stages=c.aqn_stages, seed=c.seed) if c.aqn else None)
        self.optimizer = self._make_optimizer(**self.mode.optimizer_options())
        self.mode.prepare_snapshot()  # the checkpoint's pinned host buffers, allocated while the first step runs
        warm = max(0, c.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=uses_loss_scaling(c.precision))

    # ---- the memory plan (train/memory_plan.py) and what it decides ----------------------------------------
    def plan_memory(self, model_config: Any, fmt: str, *, prompt_tokens: int, stored: int | None = None,
                    rates: Any = None) -> Any:
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
                                 stored=stored, rates=self.rates)
        self.memory_plan = plan
        if self.device.type == "cuda" and plan.capacity is not None:
            kernel_dispatch.allow_extra_copies(plan.extra_weight_copies)
        return plan

    def plan_run_memory(self) -> Any:
        """:meth:`plan_memory` for the run directory's model, from its config.json (nothing is loaded); prompts
        count at --max-prompt-length, their bound."""
        from qerl_cli.model_config import read_model_config
        from qerl_cli.train.memory_plan import model_dir_format

        self.model_dir = quantized_model_dir(self.run)
        return self.plan_memory(read_model_config(self.model_dir), model_dir_format(self.model_dir),
                                prompt_tokens=self.cfg.max_prompt_length)

    def _make_optimizer(self, **options: Any) -> torch.optim.Optimizer:
        """AdamW, with its moments in pinned host memory when the plan (or --optimizer-offload) says so: the
        same numbers either way (train/host_offload.py). ``options``: AdamW options a sharding engine asks for."""
        kw = dict(lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, betas=(0.9, 0.99), **options)
        if self.cfg.optimizer_offload and options:
            raise QerlError("--optimizer-offload moves replicated AdamW state to the host; FSDP2's sharded state "
                            "goes there with --fsdp-offload")
        if self.settings.optimizer_offload:
            from qerl_cli.train.host_offload import HostOffloadAdamW

            return HostOffloadAdamW(self.params, **kw)
        return torch.optim.AdamW(self.params, **kw)

    def _resident_weights(self, base: torch.nn.Module) -> int:
        """What the base holds on the device before adapters (the plan's "weights"). On CUDA one 1-token
        forward first: kernels build load-time weight layouts at their first call (the decode GEMM's repacked
        FP4 copy), and the plan must see them, not find them at the first rollout."""
        from qerl_cli.train.memory_plan import module_bytes

        if self.device.type != "cuda":
            return module_bytes(base)
        with torch.no_grad():
            base(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), use_cache=False)
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def _apply_memory_plan(self, base: torch.nn.Module, weights: int, prompt_tokens: int) -> None:
        """Plan the step's memory again with the measured weights and the real prompts (train/memory_plan.py) and
        resolve the settings the run takes (``self.settings``); the TrainConfig is left as asked."""
        import dataclasses

        from qerl_cli.train.memory_plan import plan_for_config, resolve_settings

        elem = torch.empty((), dtype=self.dtype).element_size()
        before = self.memory_plan  # made from the config before the weights existed, if it was
        measured: Any = weights
        if before is not None:  # the larger of estimate and measurement counts; the copies decision stands
            measured = dataclasses.replace(before.weight_parts, measured=weights)
        self.memory_plan = plan_for_config(
            self.cfg, base.config, weights=measured, device=self.device, prompt_tokens=prompt_tokens, elem=elem,
            extra_weight_copies=None if before is None else before.extra_weight_copies, rates=self.rates)
        self.settings = resolve_settings(self.cfg, self.memory_plan)
        if self.settings.gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()

    @property
    def full(self) -> Any:
        """The full-weight trainer of --finetune full (None with LoRA)."""
        return self.mode.full

    @property
    def rollout_quant(self) -> Any:
        """FlashRL's quantized rollout copy (None without --rollout-quant)."""
        return self.mode.rollout_quant

    @property
    def plan_metrics(self) -> dict[str, float]:
        """The plan's estimate of a step (seconds), logged beside the measured phases; empty without one (CPU)."""
        est = None if self.memory_plan is None else self.memory_plan.est_step_s
        return {} if est is None else {"plan/est_step_s": est}

    @property
    def micro_batch_size(self) -> int:
        return self.settings.micro_batch_size

    @property
    def completion_tokens(self) -> int:
        """Tokens a rollout may add after its prompt: an episode's (model and observations), else a completion's."""
        return int(self.cfg.max_episode_tokens or self.cfg.max_completion_length)

    def encode_prompt(self, prompt: str, index: int | None = None) -> list[int]:
        """Token ids of a prompt (``index``: its task example, for the message), within --max-prompt-length."""
        from qerl_cli.tasks.prompt_ids import encode_prompt

        add_bos = not self.cfg.chat_template and bool(getattr(self.tokenizer, "add_bos_token", False))
        where = f"the prompt of task example {index} (0-based)" if index is not None else "a prompt"
        return encode_prompt(self.tokenizer, prompt, max_tokens=self.cfg.max_prompt_length, add_bos=add_bos,
                             truncate=self.cfg.truncate_prompts, where=where)

    # ---- resume ----------------------------------------------------------------------------------
    def resume(self, ckpt: Path | None = None, state: dict[str, Any] | None = None) -> int:
        """Restore everything from a checkpoint (default: `latest`, verified here); the step it continues at.

        ``ckpt`` and ``state``: a checkpoint the caller has verified and its loaded trainer state (`train`
        does both before the stage starts, so a damaged checkpoint leaves the manifest as it was)."""
        if ckpt is None:
            try:
                ckpt = resolve_checkpoint(self.run, "latest")
            except NoCheckpointError:
                self._truncate_metrics(0)  # killed before the first checkpoint: start over cleanly
                return 0
            assert ckpt is not None
            checkpointing.require_intact(self.run, ckpt, "resume")
        if state is None:
            state = read_trainer_state(self.run, ckpt)
        saved = state.get("config", {})
        check_resume_settings(self.cfg, ckpt, state, self.mode)
        self.mode.load(ckpt, state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.stream.load(state["data"])
        if saved.get("steps") is not None and self.cfg.steps > saved["steps"]:
            self.extended_from = int(saved["steps"])
        if self.aqn is not None and state.get("aqn"):
            aqn_state = state["aqn"]
            if self.cfg.steps > aqn_state.get("total_steps", self.cfg.steps):
                # an extended run keeps the schedule it was started with: the added steps run at sigma_end
                self.aqn.total_steps = int(aqn_state["total_steps"])
            self.aqn.load_state_dict(aqn_state)
        checkpointing.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self._truncate_metrics(self.step)
        return self.step

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric lines of steps after the checkpoint (they will be recomputed identically)."""
        if not self.dist.is_main or not self.metrics_path.is_file():
            return
        rows = read_metrics(self.metrics_path, covered=step)
        write_metrics(self.metrics_path, [r for r in rows if r["step"] <= step])

    # ---- one step --------------------------------------------------------------------------------
    def clock(self) -> float:
        """perf_counter after the device's queued work: CUDA phases would otherwise bleed into the next."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def enter_phase(self, phase: str) -> None:
        self.phase = phase
        if self.on_phase is not None:
            self.on_phase(phase)

    def progress(self, text: str) -> None:
        if self.on_progress is not None:
            self.on_progress(text)

    def record_phase_peak(self, metrics: dict[str, Any], phase: str) -> None:
        """Record this phase's CUDA peak (and what stays allocated after it) and restart the count for the next."""
        if self.device.type == "cuda":
            metrics[peak_key(phase)] = torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics[end_key(phase)] = torch.cuda.memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)

    def generate(self, indices: list[int], round_: int, norm_overrides: dict[str, torch.Tensor] | None,
                 prompt_offset: int = 0) -> Any:
        """Roll out the task examples `indices` with this step and round's seed; the engine's result."""
        from qerl_cli.rollout import SamplingParams

        c = self.cfg
        # prompt_offset: these prompts start at that position of the round (noise keyed by global position)
        stop_ids = getattr(self.task, "stop_token_ids", None)
        sp = SamplingParams(n=c.num_generations, temperature=c.temperature, top_p=c.top_p, top_k=-1,
                            max_tokens=self.completion_tokens, stop=list(self.task.stop),
                            stop_token_ids=None if stop_ids is None else list(stop_ids),
                            seed=rollout_seed(c.seed, self.rollout_step, round_), prompt_offset=prompt_offset,
                            # sampling/entropy: the rollout policy's own (AQN-noised) entropy; the torch sampler
                            # computes it, so it is asked for only when logged (the fused kernel is faster)
                            entropy=c.log_sampling_entropy)
        prompts = [self.prompt_ids[i] for i in indices]
        if self.episodes is not None:
            return self.episodes.generate(self.engine, prompts, [self.task.examples[i].prompt for i in indices], sp,
                                          self.encode_text, norm_overrides=norm_overrides)
        if self.rollout_concurrent:
            return self.engine.generate(prompts, sp, norm_overrides=norm_overrides, concurrent=True)
        return self.engine.generate(prompts, sp, norm_overrides=norm_overrides)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def score(self, indices: list[int], samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw and shaped (DAPO overlong penalty) rewards of `samples`, in sample order."""
        from qerl_cli.tasks.rewards import safe_rewards

        g = self.cfg.num_generations
        prompts = [self.task.examples[indices[s.prompt_index]].prompt for s in samples]
        answers = [self.task.examples[indices[s.prompt_index]].answer for s in samples]
        if self.episodes is None:
            raw = torch.tensor(safe_rewards(self.reward_fn, prompts, [s.text or "" for s in samples], answer=answers),
                               dtype=torch.float32)
        else:  # graded on what the model wrote (its tool calls left out); an environment's own rewards added
            raw = self.episodes.rewards(samples, prompts, answers, partial(safe_rewards, self.reward_fn), self.decode,
                                        graded=self.cfg.env is None or self.cfg.reward is not None)
        assert raw.numel() == len(indices) * g
        shaped = raw.clone()
        if self.cfg.algorithm.overlong_penalty and self.cfg.overlong_buffer:
            from qerl_cli.train.advantages import dapo_overlong_penalty

            lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.float32)
            shaped = shaped + dapo_overlong_penalty(lengths, self.completion_tokens, self.cfg.overlong_buffer)
        return raw, shaped

    def train_step(self) -> dict[str, Any]:
        """One RL step, phase by phase: this step's rollouts (AQN's noise draw and the rollout, now, or with
        --async-rollout during the previous update), then the update on them (recompute, fwd_bwd, optimizer,
        requant). The step's metrics; :attr:`last_step` holds the same measurements typed."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rollouts = self.take_rollouts()
        self.start_next_rollouts()
        metrics = self.update_on(rollouts)
        if self.rollout_source is not None:  # --rollout-gpus: the new adapters go to the rollout ranks now
            metrics.update(self.rollout_source.published(self))
        return metrics

    def take_rollouts(self) -> Rollouts:
        """This step's rollouts: those --async-rollout collected during the previous update, else collected now."""
        if self.pending is not None:
            rollouts, self.pending = self.pending.take(), None
            return rollouts
        if self.rollout_source is not None:  # --rollout-gpus: what the rollout ranks generated (train/disagg.py)
            return self.rollout_source.take(self)
        return self.collect_rollouts(self.step, self.rollout_noise(self.step))

    def start_next_rollouts(self) -> None:
        """--async-rollout: the next step's rollouts start in a thread, beside this step's update."""
        if self.cfg.async_rollout and self.step + 1 < self.cfg.steps:
            from qerl_cli.train.async_rollout import BackgroundRollouts

            self.pending = BackgroundRollouts(self, self.step + 1)

    def rollout_noise(self, step: int) -> dict[str, torch.Tensor] | None:
        """AQN's noisy norm weights for ``step``'s rollout policy (None without AQN); its metrics kept for the step."""
        self.enter_phase(AQN)
        ta = self.clock()
        overrides = None
        self.noise_metrics = {}
        if self.aqn is not None:
            overrides = self.aqn.noisy_norm_weights(step)
            self.noise_metrics = dict(self.aqn.last_metrics)
        self.noise_metrics[timing_key(AQN)] = self.clock() - ta
        self.record_phase_peak(self.noise_metrics, AQN)
        return overrides

    def collect_rollouts(self, step: int, overrides: dict[str, torch.Tensor] | None, *,
                         concurrent: bool = False, policy: int | None = None) -> Rollouts:
        """``step``'s rollout rounds (dynamic sampling refills), scored: the groups an update trains on.
        ``concurrent``: in --async-rollout's thread, while the model trains (no phase callbacks or peaks);
        ``policy``: the updates the sampling adapters had seen (default: this trainer's step)."""
        policy = self.step if policy is None else policy
        metrics: dict[str, Any] = dict(self.noise_metrics)
        if not concurrent:
            self.enter_phase(ROLLOUT)
        t0 = time.perf_counter()
        self.rollout_step, self.rollout_concurrent = step, concurrent
        groups, busy, timing = self._rollout_rounds(overrides, metrics)
        if self.device.type == "cuda" and not self.keep_rollout_cache:
            self.engine.release()
        t_rollout = (self.clock() if not concurrent else time.perf_counter()) - t0
        if not concurrent:
            self.record_phase_peak(metrics, ROLLOUT)
        metrics.update(self.backend.step_metrics(busy))
        if not groups:
            raise QerlError("dynamic sampling kept no group (every group had equal rewards); raise "
                            "--max-refill-rounds or lower the task difficulty")
        metrics.update(rollout_metrics(t_rollout, timing))
        return Rollouts(step, policy, groups, metrics)

    def _rollout_rounds(self, overrides: dict[str, torch.Tensor] | None,
                        metrics: dict[str, Any]) -> tuple[list[Group], list[float], dict[str, float]]:
        """One round of rollouts, or with dynamic sampling as many as refill the batch (its statistics go into
        ``metrics``): the groups, each process's busy seconds, and the engine's timings summed over the rounds."""
        from qerl_cli.train.advantages import DynamicSampler

        c = self.cfg
        g = c.num_generations
        sampler = DynamicSampler(c.batch_prompts, g, max_refill_rounds=c.max_refill_rounds) if c.dynamic_sampling \
            else None
        timing = {"tokens": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0.0}
        busy = [0.0] * self.backend.world_size
        round_ = 0
        while True:
            indices = self.stream.take(c.batch_prompts if sampler is None else sampler.needed)
            # every process gets the whole round in prompt order (however the backend split the work)
            res = self.backend.rollout_round(indices, round_, overrides)
            busy = [a + b for a, b in zip(busy, res.busy_s, strict=True)]
            for k in timing:
                timing[k] += float(res.timings.get(k, 0.0))
            new_groups = [(indices[p], res.samples[p * g:(p + 1) * g], res.raw[p * g:(p + 1) * g],
                           res.shaped[p * g:(p + 1) * g]) for p in range(len(indices))]
            if sampler is None:
                return new_groups, busy, timing
            sampler.add(res.shaped, new_groups)
            round_ += 1
            if sampler.done:
                groups, ds_stats = sampler.result()
                metrics.update(ds_stats)
                return groups, busy, timing

    def update_on(self, rollouts: Rollouts) -> dict[str, Any]:
        """The update on one step's rollouts, phase by phase: advantages and the batch, pi_old (recompute), the
        policy update (fwd_bwd, optimizer, requant); the step's metrics."""
        metrics: dict[str, Any] = {"step": self.step + 1, **self.plan_metrics, **rollouts.metrics}
        metrics["rollout/policy_lag"] = float(self.step - rollouts.policy)  # 1 with --async-rollout (after step 1)
        samples = [s for _, ss, _, _ in rollouts.groups for s in ss]
        adv = self.advantages(rollouts.groups, metrics)
        batch = self.make_batch(rollouts.groups, samples, metrics)
        old, t_recompute = self.recompute(batch, metrics)
        t_train = self.policy_update(batch, old, adv, samples, metrics)
        self.end_step(metrics, t_recompute, t_train)
        self._log_rollouts(rollouts.groups, adv, metrics["step"])
        self.last_step = StepRecord.from_metrics(metrics)
        return metrics

    def advantages(self, groups: list[Group], metrics: dict[str, Any]) -> torch.Tensor:
        """Group-relative advantages of the shaped rewards; accuracy and mean of the raw ones."""
        from qerl_cli.train.advantages import group_advantages

        raw = torch.cat([r for _, _, r, _ in groups])
        shaped = torch.cat([s for _, _, _, s in groups])
        adv, adv_stats = group_advantages(shaped, self.cfg.num_generations, self.cfg.scale_rewards)
        metrics.update(adv_stats)
        metrics["accuracy"] = (raw >= 1.0 - 1e-6).float().mean().item()
        metrics["reward/raw_mean"] = raw.mean().item()
        return adv

    def make_batch(self, groups: list[Group], samples: list[Any], metrics: dict[str, Any]) -> RolloutBatch:
        """The padded training batch of the samples, on the device; its lengths and token counts."""
        # an environment's reset() text makes an episode's prompt its own (tools/episodes.py)
        prompt_ids = [s.prompt_token_ids or self.prompt_ids[idx] for idx, ss, _, _ in groups for s in ss]
        truncated = [s.finish_reason == "length" for s in samples]
        pad = getattr(self.tokenizer, "pad_token_id", None)
        pad = 0 if pad is None else pad
        batch = build_batch(prompt_ids, [s.token_ids for s in samples], [s.logprobs for s in samples], truncated,
                            pad, mask_truncated=self.cfg.mask_truncated_completions,
                            model_masks=None if self.episodes is None else [s.model_mask() for s in samples],
                            routings=[getattr(s, "routing", None) for s in samples]).to(self.device)
        if self.episodes is not None:
            metrics.update(self.episodes.metrics(samples))
        lengths = batch.lengths.float()
        metrics["completions/mean_length"] = lengths.mean().item()
        metrics["completions/min_length"] = lengths.min().item()
        metrics["completions/max_length"] = lengths.max().item()
        metrics["completions/clipped_ratio"] = batch.truncated.float().mean().item()
        metrics.update(batch_token_metrics(batch))
        return batch

    def recompute(self, batch: RolloutBatch, metrics: dict[str, Any]) -> tuple[OldPolicy, float]:
        """pi_old: the update forward's own log-probs (one optimizer step per batch, so pi_old is the policy the
        update starts from); a separate no-grad pass only where it is needed (reference model, LoRA dropout,
        asked). What it computed and its seconds."""
        self.enter_phase(RECOMPUTE)
        t1 = self.clock()
        old = self.old_pass(batch)
        seconds = self.clock() - t1
        metrics["timing/pi_old_pass"] = float(old.old is not None or old.ref is not None)
        self.record_phase_peak(metrics, RECOMPUTE)
        return old, seconds

    def policy_update(self, batch: RolloutBatch, old: OldPolicy, adv: torch.Tensor, samples: list[Any],
                      metrics: dict[str, Any]) -> float:
        """Forward+backward, then the optimizer (timed apart inside :meth:`_update`), then what the rollout reads
        brought up to the new weights (the mode's requant); the seconds of all of it."""
        self.enter_phase(FWD_BWD)
        t2 = self.clock()
        valid = batch.sampled  # the model's tokens: an episode's observations are no policy's samples
        loss_metrics, own = self._update(batch, old, adv.to(self.device), valid)
        metrics.update(loss_metrics)
        old_logp, entropies = (old.old, old.entropies) if old.old is not None else own
        metrics.update(self.sampling_metrics(batch, samples, old_logp, entropies, valid))
        metrics.update(router_metrics(self.model))  # a mixture of experts' routing in this update (router/*)
        metrics.update(self.mode.after_update())
        return self.clock() - t2

    def end_step(self, metrics: dict[str, Any], t_recompute: float, t_train: float) -> None:
        """Count the step; its learning rate, the update's times and the step's memory peaks."""
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            metrics["memory/train_peak_gb"] = max(metrics.get(peak_key(p), 0.0) for p in TRAIN_PHASES)
        self.step += 1
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        metrics[timing_key(RECOMPUTE)] = t_recompute
        metrics["timing/train_s"] = t_train
        if on_cuda:
            metrics["memory/peak_gb"] = max(v for k, v in metrics.items()
                                            if k.startswith("memory/") and k.endswith("_peak_gb"))

    def forward_no_grad(self, batch: RolloutBatch, with_ref: bool, with_old: bool = True) -> LogProbs:
        """pi_old (and reference, adapters off) log-probs and entropies of `batch`, without gradients; without
        ``with_old`` only the reference (pi_old and entropies come back empty, [B, 0])."""
        mb = self.micro_batch_size
        old, ref, ent = [], [], []
        rows = batch.input_ids.shape[0]
        with torch.no_grad():
            for i in range(0, rows, mb):
                if i:
                    self.progress(f"no-grad pass, micro-batch {i // mb}/{-(-rows // mb)} done")
                part = batch.rows(slice(i, i + mb))
                if with_old:
                    with self.replaying(part):
                        lp, e = sampled_logprobs(self.model, part, self.cfg.temperature, with_entropy=True,
                                                 chunk_tokens=self.cfg.logprob_chunk_tokens,
                                                 packed=self.cfg.pack_sequences)
                    old.append(lp)
                    ent.append(e)
                if with_ref:
                    with self.model.disable_adapter(), self.replaying(part):
                        ref.append(sampled_logprobs(self.model, part, self.cfg.temperature,
                                                    chunk_tokens=self.cfg.logprob_chunk_tokens,
                                                    packed=self.cfg.pack_sequences)[0])
        empty = batch.mask.new_zeros(batch.mask.shape[0], 0)
        return (torch.cat(old) if with_old else empty, (torch.cat(ref) if with_ref else None),
                torch.cat(ent) if with_old else empty)

    def needs_old_pass(self) -> bool:
        """Whether pi_old needs a no-grad pass of its own: asked for (--recompute-logprobs), or the update's forward
        is not the policy pi_old stands for (LoRA dropout samples a different network in train mode)."""
        return self.cfg.recompute_logprobs or self.cfg.lora_dropout > 0

    def old_pass(self, batch: RolloutBatch) -> OldPolicy:
        """The no-grad passes before the update: pi_old where :meth:`needs_old_pass`, the reference for beta > 0,
        and the IS weights from that pi_old; nothing at all otherwise (the update supplies pi_old itself)."""
        with_old, with_ref = self.needs_old_pass(), self.cfg.beta > 0
        if not (with_old or with_ref):
            return OldPolicy()
        old, ref, ent = self.backend.old_logprobs(batch, with_ref, with_old)
        if not with_old:
            return OldPolicy(ref=ref)
        return OldPolicy(old=old, ref=ref, entropies=ent)

    def sampling_metrics(self, batch: RolloutBatch, samples: list[Any], old_logp: torch.Tensor,
                         entropies: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
        """Mismatch between the rollout's mu and pi_old, the IS-weight statistics, and the entropies."""
        from qerl_cli.train.corrections import mismatch_metrics

        c = self.cfg
        metrics = mismatch_metrics(old_logp, batch.rollout_logp, valid)
        if c.correction != "none":
            metrics.update(is_weights(c.correction, old_logp, batch.rollout_logp, valid, cap=c.correction_cap)[1])
        metrics["entropy"] = ((entropies * batch.mask).sum() / batch.mask.sum().clamp(min=1)).item()
        s_ent = sampling_entropy(samples, batch.mask)
        if s_ent is not None:
            metrics["sampling/entropy"] = s_ent
        return metrics

    def _update(self, batch: RolloutBatch, old: OldPolicy, adv: torch.Tensor,
                valid: torch.Tensor) -> tuple[dict[str, float], tuple[torch.Tensor, torch.Tensor] | None]:
        """One optimizer step over this process's micro-batches (the backend's; normalisers stay the whole
        batch's, so the ranks' summed gradients are the 1-process gradient). Without a pi_old pass (``old.old``
        None) each micro-batch's own detached log-probs are pi_old and give its IS weights; they come back with
        the entropies, gathered over the whole batch, for the step's metrics."""
        bsz = batch.input_ids.shape[0]
        own = old.old is None
        isw = None if own or self.cfg.correction == "none" else self._is_weights(old.old, batch.rollout_logp, valid)
        normalizer = self.cfg.algorithm.normalizer(batch.mask, self.completion_tokens)
        self.model.train()
        t_fb = self.clock()
        self.optimizer.zero_grad(set_to_none=True)
        agg: dict[str, float] = {}
        total_loss = 0.0
        own_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        micros = self.backend.update_micro_batches(bsz, self.micro_batch_size)
        for k, micro in enumerate(micros):
            loss, m, own_part = self._micro_batch(batch, micro, old, isw, adv, valid, normalizer)
            self.progress(f"forward+backward, micro-batch {k + 1}/{len(micros)} done")
            if not micro.counts:
                continue
            if own_part is not None:
                own_parts.append(own_part)
            total_loss += loss
            w = micro.rows.stop - micro.rows.start
            for k, v in m.items():
                agg[k] = agg.get(k, 0.0) + v * w / bsz
        self.backend.reduce_gradients(self.params)  # nothing to do on one process
        total_loss, agg = self.backend.reduce_loss_metrics(total_loss, agg)
        t_opt = self.clock()
        agg[timing_key(FWD_BWD)] = t_opt - t_fb
        self.record_phase_peak(agg, FWD_BWD)
        agg.update(self._optimizer_step())
        agg[timing_key(OPTIMIZER)] = self.clock() - t_opt
        self.record_phase_peak(agg, OPTIMIZER)
        self.model.eval()
        agg["loss"] = total_loss
        return agg, (self.backend.gather_rows(own_parts, batch) if own else None)

    def _micro_batch(self, batch: RolloutBatch, micro: Any, old: OldPolicy, isw: torch.Tensor | None,
                     adv: torch.Tensor, valid: torch.Tensor, normalizer: float,
                     ) -> tuple[float, dict[str, float], tuple[torch.Tensor, torch.Tensor] | None]:
        """Forward and backward of one micro-batch: its loss (0 for a stand-in pass), its loss metrics, and without
        a pi_old pass its own detached log-probs (its pi_old) and entropies."""
        part = batch.rows(micro.rows)
        with self.replaying(part):  # the backward too: a checkpointed layer recomputes its forward there
            return self._forward_backward(part, micro, old, isw, adv, valid, normalizer)

    def replaying(self, part: RolloutBatch) -> AbstractContextManager[None]:
        """Routing replay (--routing-replay) around the forwards of ``part``; with it off only the disagreement
        metric is measured (nothing at all without a recorded routing: dense models, vLLM)."""
        from qerl_cli.train.replay import replaying

        return replaying(self.model, part, chunk_tokens=self.cfg.logprob_chunk_tokens,
                         packed=self.cfg.pack_sequences, replay=bool(self.cfg.routing_replay))

    def _forward_backward(self, part: RolloutBatch, micro: Any, old: OldPolicy, isw: torch.Tensor | None,
                          adv: torch.Tensor, valid: torch.Tensor, normalizer: float,
                          ) -> tuple[float, dict[str, float], tuple[torch.Tensor, torch.Tensor] | None]:
        c = self.cfg
        sl = micro.rows
        own = old.old is None
        logp, ent = sampled_logprobs(self.model, part, c.temperature, chunk_tokens=c.logprob_chunk_tokens,
                                     packed=c.pack_sequences, backend=c.logprob_backend, with_entropy=own)
        if own:
            old_part = logp.detach()
            isw_part = None if c.correction == "none" else self._is_weights(old_part, part.rollout_logp, valid[sl])
        else:
            old_part, isw_part = old.old[sl], None if isw is None else isw[sl]
        loss, m = policy_loss(
            c.algorithm, logp, old_part, adv[sl], part.mask, epsilon=c.epsilon, epsilon_high=c.epsilon_high,
            max_completion_length=self.completion_tokens, is_weights=isw_part,
            ref_logp=None if old.ref is None else old.ref[sl], beta=c.beta, rollout_logp=part.rollout_logp,
            loss_normalizer=normalizer)
        if not torch.isfinite(loss):
            raise self.nonfinite(f"the loss became {loss.item()}")
        if not micro.counts:  # a stand-in pass: it runs only so that the ranks' collectives match
            loss = loss * 0.0
        self.scaler.scale(loss).backward()
        if not micro.counts:
            return 0.0, m, None
        return loss.item(), m, (old_part, ent) if own else None

    def _is_weights(self, old_logp: torch.Tensor, rollout_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The importance weights of --correction (pi_old over the rollout's mu), capped."""
        return is_weights(self.cfg.correction, old_logp, rollout_logp, valid, cap=self.cfg.correction_cap)[0]

    def nonfinite(self, what: str) -> NonFiniteLoss:
        """The error that stops a step with a NaN/inf, after the previous step's checkpoint write (if one is in
        flight) has finished, so that the checkpoint it names is complete."""
        self.writer.wait()
        return NonFiniteLoss(nonfinite_message(what, self.step + 1, self.cfg, checkpointing.latest_step(self.run)))

    def _optimizer_step(self) -> dict[str, float]:
        """Clip, step (skipped by the fp16 scaler when its gradients overflowed), schedule. A non-finite gradient
        or update stops the run here, before anything of this step is logged or checkpointed."""
        c = self.cfg
        self.enter_phase(OPTIMIZER)
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, c.max_grad_norm)
        finite = bool(torch.isfinite(grad_norm))
        if not finite and not uses_loss_scaling(c.precision):
            raise self.nonfinite(f"the gradient norm became {grad_norm.item()}")
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        try:
            self.scaler.step(self.optimizer)
        except RuntimeError as exc:  # torch refuses a step size past float32's range ("... without overflow")
            if "overflow" not in str(exc):
                raise
            raise self.nonfinite("the optimizer step overflowed float32") from exc
        if not params_finite(self.params, self.mode.finite_ctx()):
            raise self.nonfinite("the optimizer step made trainable parameters NaN or inf")
        self.scaler.update()
        self.scheduler.step()
        # nothing reads the gradients after the step: freed now, they stay out of the next rollout's memory
        self.optimizer.zero_grad(set_to_none=True)
        out = {"grad_norm": grad_norm.item() if finite else float("nan")}
        if self.scaler.is_enabled():
            out["fp16/loss_scale"] = scale_before
            out["fp16/step_skipped"] = float(not finite)
        return out

    def _log_rollouts(self, groups: list[Any], adv: torch.Tensor, step: int) -> None:
        if not self.cfg.log_rollouts or not self.dist.is_main:
            return
        self.rollouts_dir.mkdir(parents=True, exist_ok=True)
        lines = []
        k = 0
        for idx, samples, raw, shaped in groups:
            ex = self.task.examples[idx]
            for j, s in enumerate(samples):
                lp = s.logprobs
                lines.append(json.dumps({
                    "prompt_index": idx, "sample": j, "prompt": ex.prompt[-500:], "answer": ex.answer,
                    "completion": s.text, "reward": raw[j].item(), "shaped_reward": shaped[j].item(),
                    "advantage": adv[k].item(), "length": len(s.token_ids), "finish_reason": s.finish_reason,
                    "logprob_sum": float(lp.sum()) if lp.numel() else 0.0,
                    "logprob_min": float(lp.min()) if lp.numel() else 0.0,
                    **({} if getattr(s, "policy_version", None) is None else {"version": s.policy_version}),
                    **({} if self.episodes is None else {"turns": self.episodes.record(s, self.decode)}),
                }))
                k += 1
        from qerl_cli.manifest import atomic_write_text

        atomic_write_text(self.rollouts_dir / f"step_{step:05d}.jsonl", "\n".join(lines) + "\n")

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        if self.dist.is_main:
            append_metrics(self.metrics_path, metrics)

    def wait_checkpoint(self) -> Path | None:
        """Wait for the background checkpoint write in flight; its path (None if none was in flight)."""
        return self.writer.wait()

    def save(self, *, background: bool | None = None) -> Path:
        """Checkpoint this step (the mode writes it); ``background`` (default: ``cfg.async_checkpoint``, where the
        mode allows it) copies the state to host memory now and writes it in a thread while the caller goes on."""
        self.enter_phase(CHECKPOINT)
        return self.mode.save(self.cfg.async_checkpoint if background is None else background)

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the weights (and, without sharding, the optimizer)."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            # --async-rollout: where the data and AQN stood before the next step's rollouts began
            "data": self.pending.resume_state["data"] if self.pending is not None else self.stream.state(),
            "aqn": self.pending.resume_state["aqn"] if self.pending is not None else
            (self.aqn.state_dict() if self.aqn is not None else None),
            "config": self.cfg.to_dict(),
            checkpointing.ROLLOUT_QUANT_KEY: self.rollout_quant.state_dict() if self.rollout_quant is not None
            else None,
        }



def rollout_metrics(seconds: float, timing: dict[str, float]) -> dict[str, float]:
    """The rollout phase's seconds and throughput, and the engine's own split: prefill (with the first token) and
    decode; decode steps = token steps of the batch."""
    return {timing_key(ROLLOUT): seconds, "timing/rollout_tokens_per_s": timing["tokens"] / max(seconds, 1e-9),
            "timing/rollout_tokens": timing["tokens"], "timing/rollout_prefill_s": timing["prefill_s"],
            "timing/rollout_decode_s": timing["decode_s"], "rollout/decode_steps": timing["decode_steps"]}


def batch_token_metrics(batch: RolloutBatch) -> dict[str, float]:
    """What the training forwards compute on: real tokens, padded positions, causal attention pairs (for FLOPs)."""
    n = batch.attention_mask.sum(dim=1).double()
    return {"batch/tokens": float(n.sum()), "batch/padded_tokens": float(batch.attention_mask.numel()),
            "batch/attention_pairs": float((n * (n + 1) / 2).sum()),
            "batch/loss_tokens": float((batch.mask > 0).sum())}


# one prompt's group: its index, its samples, their raw and shaped rewards
Group = tuple[int, list[Any], torch.Tensor, torch.Tensor]


@dataclass
class Rollouts:
    """One step's scored rollouts, as groups (prompt index, samples, raw and shaped rewards), and what collecting them
    measured; ``step``: the step they were generated for."""

    step: int
    policy: int  # the updates the adapters that sampled them had seen
    groups: list[Group]
    metrics: dict[str, Any]


@dataclass
class OldPolicy:
    """What the no-grad passes before the update computed: pi_old and its entropies (None: the update's own forward
    supplies them) and the reference log-probs (beta > 0)."""

    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    entropies: torch.Tensor | None = None


class NonFiniteLoss(QerlError):
    """NaN/inf in the loss, the gradients or the updated parameters; the last good checkpoint stays the newest."""


# what a resumed run must share with its checkpoint (other options may change between the two)
RESUME_KEYS = ("algo", "lora_rank", "lora_targets", "precision", "seed", "task", "aqn", "finetune", "rollout_quant",
               "requant_scales")


def check_resume_settings(cfg: TrainConfig, ckpt: Path, state: dict[str, Any], mode: TrainingMode) -> None:
    """Refuse to continue a checkpoint with settings it was not trained with (``cfg`` resolved), or one another
    training mode wrote."""
    saved = state.get("config", {})
    for key in RESUME_KEYS:
        if key in saved and saved[key] != getattr(cfg, key):
            raise QerlError(f"--resume with a different {key} ({getattr(cfg, key)!r}, checkpoint has "
                            f"{saved[key]!r}): use the original settings or a new --run directory")
    mode.check_checkpoint(ckpt)


def read_trainer_state(run: RunDir, ckpt: Path) -> dict[str, Any]:
    """A verified checkpoint's trainer state; an unreadable one is the same one line as a damaged file."""
    try:
        return checkpointing.load_checkpoint(ckpt)
    except checkpointing.CheckpointDamaged as err:
        raise QerlError(checkpointing.damaged_message(run, err, "resume")) from err
