"""The rollout side of an RL step: AQN's noise draw, the rollout rounds (dynamic sampling refills), their rewards,
and the padded batch the update trains on.

What one rollout is, is an :class:`EpisodeKind` chosen once from the configuration (:func:`episode_kind`): a
single completion per prompt (:class:`SingleTurn`), or a multi-turn episode with a tool or an environment between
the model's turns (:class:`MultiTurn`, tools/episodes.py). The :class:`Rollouter` asks it and never which it is.

Where a step's rollouts come from is decided here too: collected now, collected during the previous update
(``--async-rollout``, train/async_rollout.py), or taken from the rollout ranks (``--rollout-gpus``, a
:class:`RolloutSource` such as train/disagg.py's ``TrainerSource``). The update side (train/updater.py) only sees
the :class:`Rollouts` and the batch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from qerl_cli.errors import QerlError
from qerl_cli.train.async_rollout import BackgroundRollouts
from qerl_cli.train.batch import RolloutBatch, build_batch
from qerl_cli.train.phases import AQN as AQN_PHASE
from qerl_cli.train.phases import ROLLOUT, PhaseClock, timing_key
from qerl_cli.train.prompt_stream import PromptStream

if TYPE_CHECKING:
    from collections.abc import Callable

    from qerl_cli.rollout import Engine, SamplingParams
    from qerl_cli.tools.episodes import Episodes
    from qerl_cli.train.aqn import AQN
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.step_backend import StepBackend

log = logging.getLogger("qerl.train")

# one prompt's group: its index, its samples, their raw and shaped rewards
Group = tuple[int, list[Any], torch.Tensor, torch.Tensor]
NormOverrides = dict[str, torch.Tensor] | None  # AQN's noisy norm weights for the rollout policy (None: none)


@dataclass
class Rollouts:
    """One step's scored rollouts, as groups (prompt index, samples, raw and shaped rewards), and what collecting them
    measured; ``step``: the step they were generated for."""

    step: int
    policy: int  # the updates the adapters that sampled them had seen
    groups: list[Group]
    metrics: dict[str, Any]

    def samples(self) -> list[Any]:
        """Every sample, group by group: the batch's rows in order."""
        return [s for _, ss, _, _ in self.groups for s in ss]


def rollout_seed(seed: int, step: int, round_: int) -> int:
    return (seed * 1_000_003 + step * 7919 + round_ * 104_729) % (2**31 - 1)


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


# ---- what one rollout is ------------------------------------------------------------------------------------
class EpisodeKind(Protocol):
    """One completion per prompt, or a multi-turn episode: how it is generated, rewarded, masked and logged."""

    def generate(self, engine: Engine, prompts: list[list[int]], texts: list[str], sampling: SamplingParams,
                 overrides: NormOverrides, concurrent: bool) -> Any:
        """The engine's result for ``prompts`` (their task texts: ``texts``); ``concurrent``: beside an update."""

    def rewards(self, samples: list[Any], prompts: list[str], answers: list[str]) -> torch.Tensor:
        """One raw reward per sample, in sample order."""

    def model_masks(self, samples: list[Any]) -> list[torch.Tensor] | None:
        """Which completion tokens the model wrote (None: all of them)."""

    def metrics(self, samples: list[Any]) -> dict[str, float]:
        """The step's metrics of this kind of episode."""

    def record(self, sample: Any) -> dict[str, Any]:
        """What a sample's line in the rollouts JSONL adds."""


class SingleTurn:
    """One completion per prompt, graded by the task's reward."""

    def __init__(self, reward_fn: Callable[..., Any]) -> None:
        self.reward_fn = reward_fn

    def generate(self, engine: Engine, prompts: list[list[int]], texts: list[str], sampling: SamplingParams,
                 overrides: NormOverrides, concurrent: bool) -> Any:
        if concurrent:  # only the builtin engine decodes beside an update (--async-rollout checks it)
            return engine.generate(prompts, sampling, norm_overrides=overrides, concurrent=True)  # type: ignore[call-arg]
        return engine.generate(prompts, sampling, norm_overrides=overrides)  # type: ignore[call-arg]

    def rewards(self, samples: list[Any], prompts: list[str], answers: list[str]) -> torch.Tensor:
        from qerl_cli.tasks.rewards import safe_rewards

        return torch.tensor(safe_rewards(self.reward_fn, prompts, [s.text or "" for s in samples], answer=answers),
                            dtype=torch.float32)

    def model_masks(self, samples: list[Any]) -> list[torch.Tensor] | None:
        return None

    def metrics(self, samples: list[Any]) -> dict[str, float]:
        return {}

    def record(self, sample: Any) -> dict[str, Any]:
        return {}


class MultiTurn:
    """Episodes with --tools/--env (docs/tools.md): the model's turns with observations between them."""

    def __init__(self, episodes: Episodes, reward_fn: Callable[..., Any], tokenizer: Any, *, graded: bool,
                 phases: PhaseClock) -> None:
        self.episodes, self.reward_fn, self.tokenizer, self.graded = episodes, reward_fn, tokenizer, graded
        what = "tool calls" if episodes.tool is not None else "environment steps"
        episodes.on_step = lambda n: phases.progress(f"{n} {what} done")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, engine: Engine, prompts: list[list[int]], texts: list[str], sampling: SamplingParams,
                 overrides: NormOverrides, concurrent: bool) -> Any:
        return self.episodes.generate(engine, prompts, texts, sampling, self.encode, norm_overrides=overrides)

    def rewards(self, samples: list[Any], prompts: list[str], answers: list[str]) -> torch.Tensor:
        # graded on what the model wrote (its tool calls left out); an environment's own rewards added
        from qerl_cli.tasks.rewards import safe_rewards

        return self.episodes.rewards(samples, prompts, answers, partial(safe_rewards, self.reward_fn), self.decode,
                                     graded=self.graded)

    def model_masks(self, samples: list[Any]) -> list[torch.Tensor] | None:
        return [s.model_mask() for s in samples]

    def metrics(self, samples: list[Any]) -> dict[str, float]:
        return self.episodes.metrics(samples)

    def record(self, sample: Any) -> dict[str, Any]:
        return {"turns": self.episodes.record(sample, self.decode)}


def episode_kind(cfg: TrainConfig, tokenizer: Any, reward_fn: Callable[..., Any], phases: PhaseClock) -> EpisodeKind:
    """The run's kind of rollout, chosen once: multi-turn episodes with --tools/--env, else single completions."""
    from qerl_cli.tools.episodes import episodes_from_config

    episodes = episodes_from_config(cfg, tokenizer)
    if episodes is None:
        return SingleTurn(reward_fn)
    return MultiTurn(episodes, reward_fn, tokenizer, graded=cfg.env is None or cfg.reward is not None, phases=phases)


# ---- where a step's rollouts come from ---------------------------------------------------------------------
class RolloutSource(Protocol):
    """Rollouts generated elsewhere (``--rollout-gpus``: train/disagg.py's ``TrainerSource``)."""

    def take(self, step: int) -> Rollouts:
        """The rollouts step ``step`` trains on."""

    def published(self, step: int) -> dict[str, float]:
        """Hand the adapters of ``step`` updates to the rollout's generators; the sync metrics."""


class Rollouter:
    """The rollout side: the task's prompts and rewards, the engine, AQN's noise draw, the rounds each step collects
    (through the step backend, which splits them over the ranks), and the batch they make."""

    def __init__(self, cfg: TrainConfig, phases: PhaseClock, *, task: Any, prompt_ids: list[list[int]],
                 tokenizer: Any, episodes: EpisodeKind, engine: Engine, aqn: AQN | None,
                 keep_rollout_cache: bool) -> None:
        self.cfg, self.phases, self.device = cfg, phases, phases.device
        self.task, self.prompt_ids, self.tokenizer = task, prompt_ids, tokenizer
        self.episodes, self.engine, self.aqn = episodes, engine, aqn
        self.keep_rollout_cache = keep_rollout_cache  # the builtin engine keeps its KV cache between steps
        self.stream = PromptStream(len(task.examples), cfg.seed)
        self.backend: StepBackend  # set once both sides exist (train/distributed.py's make_backend)
        self.rollout_step, self.rollout_concurrent = 0, False  # the step the engine is generating for, and how
        self.noise_metrics: dict[str, Any] = {}  # the AQN draw of the rollouts being collected
        self.pending: BackgroundRollouts[Rollouts] | None = None  # --async-rollout: the next step's, in flight
        self.source: RolloutSource | None = None  # --rollout-gpus: the rollout ranks' (train/disagg.py)

    # ---- one round: what the step backend asks (step_backend.RolloutWorker) --------------------------------
    def generate(self, indices: list[int], round_: int, norm_overrides: NormOverrides,
                 prompt_offset: int = 0) -> Any:
        """Roll out the task examples `indices` with this step and round's seed; the engine's result."""
        from qerl_cli.rollout import SamplingParams

        c = self.cfg
        # prompt_offset: these prompts start at that position of the round (noise keyed by global position)
        stop_ids = getattr(self.task, "stop_token_ids", None)
        sp = SamplingParams(n=c.num_generations, temperature=c.temperature, top_p=c.top_p, top_k=-1,
                            max_tokens=c.completion_tokens, stop=list(self.task.stop),
                            stop_token_ids=None if stop_ids is None else list(stop_ids),
                            seed=rollout_seed(c.seed, self.rollout_step, round_), prompt_offset=prompt_offset,
                            # sampling/entropy: the rollout policy's own (AQN-noised) entropy; the torch sampler
                            # computes it, so it is asked for only when logged (the fused kernel is faster)
                            entropy=c.log_sampling_entropy)
        prompts = [self.prompt_ids[i] for i in indices]
        texts = [self.task.examples[i].prompt for i in indices]
        with rollout_kernels(c):
            return self.episodes.generate(self.engine, prompts, texts, sp, norm_overrides, self.rollout_concurrent)

    def score(self, indices: list[int], samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw and shaped (DAPO overlong penalty) rewards of `samples`, in sample order."""
        c = self.cfg
        prompts = [self.task.examples[indices[s.prompt_index]].prompt for s in samples]
        answers = [self.task.examples[indices[s.prompt_index]].answer for s in samples]
        raw = self.episodes.rewards(samples, prompts, answers)
        assert raw.numel() == len(indices) * c.num_generations
        shaped = raw.clone()
        if c.algorithm.overlong_penalty and c.overlong_buffer:
            from qerl_cli.train.advantages import dapo_overlong_penalty

            lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.float32)
            shaped = shaped + dapo_overlong_penalty(lengths, c.completion_tokens, c.overlong_buffer)
        return raw, shaped

    # ---- one step's rollouts ------------------------------------------------------------------------------
    def take(self, step: int) -> Rollouts:
        """The rollouts step ``step`` (the updates done so far) trains on: those --async-rollout collected during
        the previous update, those the rollout ranks generated, else collected now."""
        if self.pending is not None:
            rollouts, self.pending = self.pending.take(), None
            return rollouts
        if self.source is not None:
            return self.source.take(step)
        return self.collect(step, self.noise(step), policy=step)

    def start_next(self, step: int) -> None:
        """--async-rollout: step ``step + 1``'s rollouts start in a thread, beside step ``step``'s update.

        Everything they read that a checkpoint also writes is settled here, on the main thread: AQN's noise of
        the next step is drawn (its stream advances in step order), the adapters are copied into the engine's
        shadows, and the data position and AQN state step ``step``'s checkpoint must record are kept."""
        nxt = step + 1
        if not self.cfg.async_rollout or nxt >= self.cfg.steps:
            return
        before = self.resume_state()
        overrides = self.noise(nxt)
        self.engine.snapshot_adapters()  # type: ignore[attr-defined]
        self.pending = BackgroundRollouts(
            nxt, before, lambda: self.collect(nxt, overrides, concurrent=True, policy=step), self.device)

    def resume_state(self) -> dict[str, Any]:
        """Where the data and AQN stand for a checkpoint: before the rollouts in flight (--async-rollout) began."""
        if self.pending is not None:
            return self.pending.resume_state
        return {"data": self.stream.state(), "aqn": self.aqn.state_dict() if self.aqn is not None else None}

    def published(self, step: int) -> dict[str, float]:
        """--rollout-gpus: the adapters of ``step`` updates go to the rollout ranks now; nothing otherwise."""
        return {} if self.source is None else self.source.published(step)

    def noise(self, step: int) -> NormOverrides:
        """AQN's noisy norm weights for ``step``'s rollout policy (None without AQN); its metrics kept for the step."""
        self.phases.enter(AQN_PHASE)
        ta = self.phases.clock()
        overrides = None
        self.noise_metrics = {}
        if self.aqn is not None:
            overrides = self.aqn.noisy_norm_weights(step)
            self.noise_metrics = dict(self.aqn.last_metrics)
        self.noise_metrics[timing_key(AQN_PHASE)] = self.phases.clock() - ta
        self.phases.record_peak(self.noise_metrics, AQN_PHASE)
        return overrides

    def collect(self, step: int, overrides: NormOverrides, *, concurrent: bool = False, policy: int) -> Rollouts:
        """``step``'s rollout rounds (dynamic sampling refills), scored: the groups an update trains on.
        ``concurrent``: in --async-rollout's thread, while the model trains (no phase callbacks or peaks);
        ``policy``: the updates the sampling adapters had seen."""
        metrics: dict[str, Any] = dict(self.noise_metrics)
        if not concurrent:
            self.phases.enter(ROLLOUT)
        t0 = time.perf_counter()
        self.rollout_step, self.rollout_concurrent = step, concurrent
        groups, busy, timing = self._rounds(overrides, metrics)
        if self.device.type == "cuda" and not self.keep_rollout_cache:
            self.engine.release()
        t_rollout = (self.phases.clock() if not concurrent else time.perf_counter()) - t0
        if not concurrent:
            self.phases.record_peak(metrics, ROLLOUT)
        metrics.update(self.backend.step_metrics(busy))
        if not groups:
            raise QerlError("dynamic sampling kept no group (every group had equal rewards); raise "
                            "--max-refill-rounds or lower the task difficulty")
        metrics.update(rollout_metrics(t_rollout, timing))
        return Rollouts(step, policy, groups, metrics)

    def _rounds(self, overrides: NormOverrides,
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

    # ---- what the update trains on -------------------------------------------------------------------------
    def batch(self, rollouts: Rollouts, metrics: dict[str, Any]) -> RolloutBatch:
        """The padded training batch of the rollouts' samples, on the device; its lengths and token counts."""
        samples = rollouts.samples()
        # an environment's reset() text makes an episode's prompt its own (tools/episodes.py)
        prompt_ids = [s.prompt_token_ids or self.prompt_ids[idx] for idx, ss, _, _ in rollouts.groups for s in ss]
        truncated = [s.finish_reason == "length" for s in samples]
        pad = getattr(self.tokenizer, "pad_token_id", None)
        pad = 0 if pad is None else pad
        batch = build_batch(prompt_ids, [s.token_ids for s in samples], [s.logprobs for s in samples], truncated,
                            pad, mask_truncated=self.cfg.mask_truncated_completions,
                            model_masks=self.episodes.model_masks(samples),
                            routings=[getattr(s, "routing", None) for s in samples]).to(self.device)
        metrics.update(self.episodes.metrics(samples))
        lengths = batch.lengths.float()
        metrics["completions/mean_length"] = lengths.mean().item()
        metrics["completions/min_length"] = lengths.min().item()
        metrics["completions/max_length"] = lengths.max().item()
        metrics["completions/clipped_ratio"] = batch.truncated.float().mean().item()
        metrics.update(batch_token_metrics(batch))
        return batch


def rollout_kernels(cfg: TrainConfig) -> AbstractContextManager[Any]:
    """The kernel options of a training rollout: with --rollout-w4a8, QERL_W4A8 on for this rollout only (the options
    before it come back on leaving, error or not, so the update's no-grad forwards, a held-out score and the next run
    in the same process keep theirs); without it, the process's options unchanged."""
    if not cfg.rollout_w4a8:
        return contextlib.nullcontext()
    from qerl_cli.options import override

    return override(w4a8=True)


# ---- building it --------------------------------------------------------------------------------------------
def encode_prompt(cfg: TrainConfig, tokenizer: Any, prompt: str, index: int | None = None) -> list[int]:
    """Token ids of a prompt (``index``: its task example, for the message), within --max-prompt-length."""
    from qerl_cli.tasks.prompt_ids import encode_prompt as encode

    add_bos = not cfg.chat_template and bool(getattr(tokenizer, "add_bos_token", False))
    where = f"the prompt of task example {index} (0-based)" if index is not None else "a prompt"
    return encode(tokenizer, prompt, max_tokens=cfg.max_prompt_length, add_bos=add_bos,
                  truncate=cfg.truncate_prompts, where=where)


@dataclass
class TaskInputs:
    """The task a run trains on, its reward, and its prompts as token ids."""

    task: Any
    reward_fn: Callable[..., Any]
    prompt_ids: list[list[int]]


def load_task(cfg: TrainConfig, tokenizer: Any, task: Any = None, reward_fn: Callable[..., Any] | None = None,
              prompt_ids: list[list[int]] | None = None) -> TaskInputs:
    """The task (``task``: an injected one, else ``cfg.task``), its reward and its prompts as token ids."""
    from qerl_cli.tasks import get_reward
    from qerl_cli.tasks import load_task as load

    c = cfg
    task = task if task is not None else load(
        c.task, split="train", shots=c.shots, chat_template=c.chat_template, tokenizer=tokenizer,
        seed=c.seed, level=c.task_level, tools=c.tools)
    if not task.examples:
        raise QerlError(f"task {task.name} has no training examples")
    reward_fn = reward_fn if reward_fn is not None else get_reward(c.reward or task.reward)
    ids = ([list(p) for p in prompt_ids] if prompt_ids is not None
           else [encode_prompt(c, tokenizer, e.prompt, i) for i, e in enumerate(task.examples)])
    if len(ids) != len(task.examples):
        raise QerlError(f"{len(ids)} prompt id lists for {len(task.examples)} task examples")
    return TaskInputs(task, reward_fn, ids)


def make_rollout_engine(cfg: TrainConfig, model: torch.nn.Module, tokenizer: Any, settings: Any, *,
                        device: torch.device, dtype: torch.dtype, distributed: bool, prompt_tokens: int,
                        model_dir: Any, routing_replay_asked: bool | None) -> Engine:
    """The rollout engine on ``model`` (the mode's rollout model), sized by the memory plan's ``settings``."""
    from qerl_cli.rollout import make_engine

    max_len = prompt_tokens + cfg.completion_tokens + 1
    # the builtin engine keeps its KV cache, LoRA shadows and CUDA graphs across steps when the plan says so:
    # re-allocating and re-capturing them every step costs the step's rollout its bench speed
    check_async_rollout(cfg, settings, device, distributed)
    note_routing_replay(cfg, model, routing_replay_asked)
    if cfg.rollout_w4a8:
        cfg.check_rollout_w4a8(rollout_weights(model))
    return make_engine(cfg.rollout_engine, model, tokenizer, max_batch_slots=settings.kv_slots,
                       max_model_len=max_len, gpu_memory_utilization=settings.gpu_memory_utilization,
                       dtype=dtype, model_dir=model_dir)


def rollout_weights(model: torch.nn.Module) -> str:
    """The weight format the rollout model's quantized linears hold (the first one's; "bf16" when none is)."""
    from qerl_cli.qlinear import QuantLinear

    return next((m.fmt for m in model.modules() if isinstance(m, QuantLinear)), "bf16")


def note_routing_replay(cfg: TrainConfig, model: torch.nn.Module, asked: bool | None) -> None:
    """One line where a mixture of experts trains without routing replay because vLLM cannot record routing
    (``asked``: the option as given, None for its default)."""
    from qerl_cli.moe import moe_blocks

    if asked is None and not cfg.routing_replay and moe_blocks(model):
        log.warning("routing replay is off: the vLLM rollout engine does not record the experts it routes to; "
                    "the update routes every token anew (--rollout-engine builtin records them)")


def check_async_rollout(cfg: TrainConfig, settings: Any, device: torch.device, distributed: bool) -> None:
    if not cfg.async_rollout:
        return
    if device.type == "cuda" and not settings.keep_rollout_cache:
        raise QerlError("--async-rollout keeps the rollout's KV cache beside the training step, and the memory "
                        "plan found no room for it: drop --async-rollout or lower --batch-prompts")
    if distributed:
        raise QerlError("--async-rollout runs on one process (its rollout thread would interleave the ranks' "
                        "collectives): drop it or run without torchrun")
