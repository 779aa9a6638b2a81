"""`qerl train` configuration: TRL-style names, YAML presets, flag overrides, validation."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from qerl_cli.arch import DEFAULT_LORA_TARGETS
from qerl_cli.errors import QerlError
from qerl_cli.formats import FORMATS, WeightFormat, get_format, rollout_formats
from qerl_cli.precision import PRECISIONS
from qerl_cli.tools import TOOL_NAMES
from qerl_cli.train.algos import ALGORITHMS, Algorithm, get_algorithm

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

CORRECTIONS = ("none", "token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mis")
SCALE_REWARDS = ("group", "batch", "none")
FINETUNES = ("lora", "full")
# How the trained weights are laid out over the processes (docs/distributed.md): one process ("none"),
# replicated on every torchrun rank with summed gradients ("ddp"), or sharded with FSDP2 ("fsdp2").
# "auto": fsdp2 for --finetune full under torchrun, ddp for LoRA under torchrun, none on one process.
SHARDINGS = ("auto", "none", "ddp", "fsdp2")
# rollout_quant's value for no FlashRL copy (the rollouts run the trained weights); any other is a format name,
# which the config resolves to its format object (TrainConfig.rollout_format), so nothing compares this string
NO_ROLLOUT_QUANT = "none"
ROLLOUT_QUANTS = (NO_ROLLOUT_QUANT, *rollout_formats())
REQUANT_SCALES = ("fixed", "dynamic")
FLASHRL_IS_CAP = 2.0  # FlashRL's token-TIS cap C


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a run. Field names follow TRL's GRPOConfig where one exists. Frozen: the request as the user
    made it; :meth:`resolved` returns a filled-in copy and the memory plan's choices live apart
    (memory_plan.ResolvedSettings)."""

    algo: str = "grpo"
    task: str = "arith"
    reward: str | None = None  # default: the task's reward
    steps: int = 20
    batch_prompts: int = 8
    num_generations: int = 8
    max_completion_length: int = 256
    max_prompt_length: int = 1024
    truncate_prompts: bool = False  # a prompt over max_prompt_length: refused, or cut to its last tokens when set
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float | None = None  # default per precision/paper: 1e-5 (QeRL used 1e-5..3e-5 for NVFP4 LoRA)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora_rank: int = 32
    lora_alpha: float | None = None  # default 2 * rank
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    lora_dropout: float = 0.0
    beta: float = 0.0
    epsilon: float | None = None  # default per algo (grpo 0.2; gspo 3e-4)
    epsilon_high: float | None = None  # default per algo (dapo 0.28; gspo 4e-4)
    scale_rewards: str | None = None  # default per algo: group (dr_grpo: none)
    mask_truncated_completions: bool = False
    overlong_buffer: int | None = None  # DAPO soft overlong punishment buffer (default: max_len / 4 for dapo)
    dynamic_sampling: bool | None = None  # default: on for dapo
    max_refill_rounds: int = 3
    precision: str = "bf16"
    correction: str | None = None  # default: none, or token_tis (C = 2) with --rollout-quant (FlashRL)
    correction_cap: float | None = None
    aqn: bool = False
    aqn_sigma_start: float = 1e-2
    aqn_sigma_end: float = 5e-4
    aqn_stages: int = 10
    rollout_engine: str = "builtin"
    gpu_memory_utilization: float | None = None  # KV-cache share of the GPU; None: what is free (memory plan)
    max_batch_slots: int = 256
    micro_batch_size: int | None = None  # sequences per forward/backward; None: the memory plan picks (<= 8)
    gradient_checkpointing: bool | None = None  # None: the memory plan turns it on only when needed
    gpu_memory_gib: float | None = None  # GPU memory this run may use (e.g. 79.2 on an H200 for an 80 GB card)
    logprob_chunk_tokens: int = 512  # completion tokens per lm_head + log-softmax chunk; 0: all at once
    optimizer_offload: bool | None = None  # AdamW's moments in pinned host memory; None: the memory plan decides
    kernel_weight_copies: bool | None = None  # may FP4 kernels keep a second weight copy (humming)? None: the plan
    logprob_backend: str = "chunked"  # the update's log-probs: qerl's chunked path, or liger (fused linear + CE)
    pack_sequences: bool = True  # training forwards on the micro-batch's real tokens only (varlen attention)
    routing_replay: bool | None = None  # MoE: the training forward routes as the rollout did (None: on, builtin engine)
    recompute_logprobs: bool = False  # pi_old from its own no-grad pass instead of the update forward's log-probs
    async_rollout: bool = False  # the next step's rollouts generated during this step's update (one step stale)
    # asynchronous RL across GPUs (train/disagg.py): this many torchrun ranks only roll out, the others train
    rollout_gpus: int = 0
    max_staleness: int = 1  # --rollout-gpus: a sample of adapter version v is trained at version <= v + K, or dropped
    keep_rollout_cache: bool | None = None  # builtin engine: keep KV cache + CUDA graphs between steps (None: plan)
    async_checkpoint: bool = True  # write checkpoints in a background thread while the next step runs
    save_steps: int = 10
    keep_checkpoints: int = 3
    # after SIGTERM (preemption), how long the step in flight may take to finish and be checkpointed before it is
    # abandoned; set it to the scheduler's grace period minus a checkpoint write (docs/checkpoints.md)
    sigterm_grace_s: float = 10.0
    seed: int = 0
    shots: int | None = None
    chat_template: bool = False
    task_level: str | None = None  # arith difficulty knob
    # multi-turn episodes (docs/tools.md): a built-in tool or a user environment answers the model's turns
    tools: str | None = None  # python | calculator
    env: str | None = None  # module:Class or path/to/file.py:Class
    max_turns: int = 4
    max_episode_tokens: int | None = None  # after the prompt, model + observation tokens (None: max_completion_length)
    tool_timeout_s: float = 10.0  # per Python call: wall clock, and CPU seconds rounded up
    tool_memory_mb: int = 1024  # per Python call: address space
    tool_workers: int = 8  # tool calls / environment steps run at once, beside decoding
    log_rollouts: bool = True
    log_sampling_entropy: bool = False  # sampling/entropy (rollouts then sample in torch, not the fused kernel)
    finetune: str = "lora"  # lora | full (all weights but embeddings/lm_head; see docs/flashrl.md)
    rollout_quant: str = NO_ROLLOUT_QUANT  # FlashRL: rollouts on a quantized copy re-quantized after every update
    requant_scales: str | None = None  # default: fixed for int8 (calibrated once), dynamic otherwise
    # W4A8 rollouts: the rollout's no-grad NVFP4/MXFP4 forwards from QERL_W4A8_MIN_M rows on the FP8 tensor cores
    # (kernel option w4a8, switched on around each rollout only); off by default: its k3 measured 16x W4A16's
    rollout_w4a8: bool = False
    sharding: str = "auto"  # auto | none | ddp | fsdp2 (resolve_sharding; docs/distributed.md)
    fsdp_offload: bool = False  # fsdp2: sharded weights, grads and AdamW state in pinned host memory

    @property
    def algorithm(self) -> Algorithm:
        """The RL algorithm object of ``algo`` (qerl_cli/train/algos/): ask it, never compare the name."""
        return get_algorithm(self.algo)

    @property
    def rollout_format(self) -> WeightFormat | None:
        """The weight format of FlashRL's rollout copy (``rollout_quant``), None without one: ask it, never compare
        the string (the field stays the name: run configs and manifests record it so)."""
        return None if self.rollout_quant == NO_ROLLOUT_QUANT else get_format(self.rollout_quant)

    @property
    def completion_tokens(self) -> int:
        """Tokens a rollout may add after its prompt: an episode's (model and observations), else a completion's."""
        return int(self.max_episode_tokens or self.max_completion_length)

    def resolved(self) -> TrainConfig:
        """A copy with the per-algorithm defaults filled in, so the manifest records what actually ran; ``self`` is
        left as asked (frozen). Each group of defaults reads the ones resolved before it."""
        c = dataclasses.replace(
            self,
            lr=1e-5 if self.lr is None else self.lr,
            lora_alpha=2 * self.lora_rank if self.lora_alpha is None else self.lora_alpha,
            max_episode_tokens=self.max_completion_length if self.max_episode_tokens is None and (
                self.tools or self.env) else self.max_episode_tokens,
            routing_replay=self.rollout_engine == "builtin" if self.routing_replay is None else self.routing_replay)
        c = dataclasses.replace(c, requant_scales=_resolved_requant(c))
        c = dataclasses.replace(c, **_resolved_correction(c))
        return dataclasses.replace(c, **c.algorithm.defaults(c))

    def validate(self) -> None:
        """Every field on its own (check_value), then the rules between fields; a QerlError names the flag."""
        for name in field_types():
            check_value(name, getattr(self, name))
        if self.requant_scales is not None:
            if self.rollout_format is None:
                raise QerlError(f"--requant-scales only applies with --rollout-quant {'|'.join(rollout_formats())}")
            fixed = [n for n in ROLLOUT_QUANTS if n in FORMATS and FORMATS[n].fixed_scales]
            if self.requant_scales == "fixed" and not self.rollout_format.fixed_scales:
                raise QerlError(f"--requant-scales fixed is for --rollout-quant {', '.join(fixed)} only "
                                f"({self.rollout_quant} "
                                "scales are recomputed at every update): use --requant-scales dynamic")
        if self.finetune == "full" and self.beta > 0:
            raise QerlError("--beta > 0 needs a frozen reference model, which --finetune full does not keep: "
                            "use --beta 0 or --finetune lora")
        if self.rollout_format is not None and self.rollout_engine != "builtin":
            raise QerlError("--rollout-quant needs the builtin rollout engine (--rollout-engine builtin)")
        if self.rollout_w4a8:
            self.check_rollout_w4a8()
        if self.routing_replay and self.rollout_engine != "builtin":
            raise QerlError("--routing-replay needs the routing the builtin rollout engine records; vLLM does not "
                            "record it: use --rollout-engine builtin or --no-routing-replay")
        if self.sharding == "fsdp2":
            if self.finetune != "full":
                raise QerlError("--sharding fsdp2 shards full fine-tuning (--finetune full); LoRA adapters are "
                                "small and replicate: use --sharding ddp (the default under torchrun)")
            if self.rollout_format is None:
                raise QerlError("--sharding fsdp2 rolls out from a quantized copy of the sharded weights: add "
                                f"--rollout-quant {'|'.join(rollout_formats())}")
            if self.precision == "fp16":
                raise QerlError("--sharding fsdp2 trains in bf16 or fp32 (fp16 loss scaling is not sharded): use "
                                "--precision bf16")
        if self.fsdp_offload and self.sharding not in ("fsdp2", "auto"):
            raise QerlError("--fsdp-offload offloads FSDP2's sharded state: use it with --sharding fsdp2")
        self.algorithm.validate(self)
        length, length_flag = ((self.max_episode_tokens, "--max-episode-tokens") if self.max_episode_tokens else
                               (self.max_completion_length, "--max-completion-length"))
        if self.overlong_buffer is not None and self.overlong_buffer > length:
            raise QerlError(f"--overlong-buffer ({self.overlong_buffer}) must be <= {length_flag} ({length}): the "
                            "penalty ramps over the last tokens of a completion")
        if self.tools and self.env:
            raise QerlError("--tools and --env both given: an episode has one tool or one environment")
        if self.async_rollout:
            self.check_async_rollout()
        if self.rollout_gpus:
            self.check_rollout_gpus()

    def check_rollout_w4a8(self, weights: str | None = None) -> None:
        """--rollout-w4a8 switches a process-wide kernel option around the builtin engine's rollouts, and the W4A8
        kernel serves NVFP4/MXFP4 weights only: ``weights`` is the run's weight format where it is known (the
        rollout's is --rollout-quant's when that is set)."""
        if self.rollout_engine != "builtin":
            raise QerlError("--rollout-w4a8 runs in the builtin engine's kernels; vLLM runs its own: use "
                            "--rollout-engine builtin or drop --rollout-w4a8")
        if self.async_rollout:
            raise QerlError("--rollout-w4a8 turns W4A8 on for the whole process while a rollout runs, and "
                            "--async-rollout runs the rollout beside the update: drop one of them")
        rollout = weights if self.rollout_format is None else self.rollout_quant
        if rollout is not None and get_format(rollout).kernel != "fp4":  # the W4A8 kernel widens FP4 weights
            fp4 = " or ".join(n for n in FORMATS if get_format(n).kernel == "fp4")
            raise QerlError(f"--rollout-w4a8 needs {fp4} rollout weights (the W4A8 kernel widens FP4 weights to "
                            f"FP8), not {rollout}: quantize the run to {fp4}, or drop --rollout-w4a8")

    def check_rollout_gpus(self) -> None:
        """--rollout-gpus trains on samples of older adapter versions: it needs an importance correction, and the
        builtin engine on LoRA adapters whose factors it can publish to the rollout ranks."""
        if self.correction == "none":
            raise QerlError("--rollout-gpus trains on samples of older adapter versions (up to --max-staleness): "
                            "keep an importance correction (--correction token_tis, the default with it, or a "
                            "sequence-level one)")
        blockers = {"--rollout-engine vllm": self.rollout_engine != "builtin", "--finetune full": self.finetune
                    != "lora", "--rollout-quant": self.rollout_format is not None, "--tools/--env": bool(
                        self.tools or self.env), "--async-rollout": self.async_rollout}
        bad = [k for k, v in blockers.items() if v]
        if bad:
            raise QerlError(f"--rollout-gpus publishes LoRA adapters to builtin-engine rollout ranks; it does not "
                            f"combine with {', '.join(bad)}: drop one of them")

    def check_async_rollout(self) -> None:
        """--async-rollout needs a correction for its stale policy and a rollout that nothing else writes to."""
        if self.correction == "none":
            raise QerlError("--async-rollout samples with the policy one update old: keep an importance correction "
                            "(--correction token_tis, the default with it)")
        blockers = {"--rollout-engine vllm": self.rollout_engine != "builtin", "--finetune full": self.finetune
                    != "lora", "--rollout-quant": self.rollout_format is not None, "--tools/--env": bool(
                        self.tools or self.env), "--lora-dropout > 0": self.lora_dropout > 0}
        bad = [k for k, v in blockers.items() if v]
        if bad:
            raise QerlError(f"--async-rollout runs the builtin engine on LoRA adapters it can snapshot; it does not "
                            f"combine with {', '.join(bad)}: drop one of them")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _resolved_requant(c: TrainConfig) -> str | None:
    """Fixed scales where the rollout format calibrates once, else dynamic (an unknown name: validate() says)."""
    if c.requant_scales is not None:
        return c.requant_scales
    try:
        spec = c.rollout_format
    except QerlError:  # an unknown name: validate() says
        return "dynamic"
    return None if spec is None else "fixed" if spec.fixed_scales else "dynamic"


def _resolved_correction(c: TrainConfig) -> dict[str, Any]:
    """The importance correction and its cap: FlashRL corrects its quantized rollouts with token TIS, C = 2, and
    --async-rollout (sampled by the policy one update old) the same, unless told otherwise."""
    correction, cap = c.correction, c.correction_cap
    if correction is None:
        correction = "token_tis" if c.rollout_format is not None or c.async_rollout or c.rollout_gpus else "none"
        if correction == "token_tis" and cap is None:
            cap = FLASHRL_IS_CAP
    if cap is None and correction != "none":
        from qerl_cli.train.corrections import DEFAULT_IS_CAP

        cap = DEFAULT_IS_CAP[correction]
    return {"correction": correction, "correction_cap": cap}


FIELD_NAMES = {f.name for f in dataclasses.fields(TrainConfig)}

# Help for the `qerl train` flag of each TrainConfig field (choices comma-separated, so a narrow terminal wraps
# them instead of cutting them). Every field becomes a flag (`--name-with-dashes`;
# `--name/--no-name` for booleans; comma-separated for lists) through `train_flags()`, so a new field needs
# no CLI code; a field missing here still gets its flag, with its type as the help.
FIELD_HELP: dict[str, str] = {
    "algo": ", ".join(ALGORITHMS),
    "task": "gsm8k, math, arith or jsonl:PATH",
    "reward": "Reward registry name, module:function or file.py:function (default: the task's).",
    "steps": "Optimizer steps; larger than a finished run's with --resume extends it.",
    "batch_prompts": "Prompts per step.",
    "num_generations": "Completions per prompt (the group).",
    "max_completion_length": "Max new tokens per completion.",
    "max_prompt_length": "Prompt tokens at most: a longer prompt is refused (see --truncate-prompts).",
    "truncate_prompts": "Cut a prompt over --max-prompt-length to its last tokens (after its BOS) instead of "
                        "refusing it; one over 16 characters per token is cut to its tail before tokenizing.",
    "temperature": "Rollout sampling temperature.",
    "top_p": "Rollout nucleus sampling.",
    "lr": "Learning rate (1e-5 where the preset sets none; quick_cpu and gpu_arith set 2e-4).",
    "warmup_steps": "Linear warm-up steps.",
    "weight_decay": "AdamW weight decay.",
    "max_grad_norm": "Gradient clipping norm.",
    "lora_rank": "LoRA rank.",
    "lora_alpha": "LoRA alpha (2 x rank where the preset sets none).",
    "lora_targets": "Comma-separated module names.",
    "lora_dropout": "LoRA dropout.",
    "beta": "KL coefficient against the frozen base (0: no reference forward).",
    "epsilon": "Lower clip range (where the preset sets none, per algo: grpo 0.2, gspo 3e-4).",
    "epsilon_high": "Upper clip range (where the preset sets none, per algo: dapo 0.28, gspo 4e-4).",
    "scale_rewards": ", ".join(SCALE_REWARDS) + " (default group; dr_grpo none)",
    "mask_truncated_completions": "Drop truncated completions from the loss.",
    "overlong_buffer": "DAPO soft overlong punishment buffer (where the preset sets none: max length / 4 for dapo).",
    "dynamic_sampling": "Refill zero-variance groups (where the preset sets none: on for dapo).",
    "max_refill_rounds": "Rollout rounds dynamic sampling may add per step.",
    "precision": ", ".join(PRECISIONS),
    "correction": ", ".join(CORRECTIONS) + " (default none; token_tis with --rollout-quant)",
    "correction_cap": "IS-weight cap C of the correction.",
    "aqn": "Adaptive quantization noise on the rollout policy.",
    "aqn_sigma_start": "AQN noise at the first noisy stage.",
    "aqn_sigma_end": "AQN noise at the last stage.",
    "aqn_stages": "AQN schedule stages (stage 0 is noise-free).",
    "rollout_engine": "builtin or vllm",
    "gpu_memory_utilization": "KV-cache (builtin) or vLLM share of GPU memory (default: the memory plan's).",
    "max_batch_slots": "Sequences the builtin engine decodes at once.",
    "micro_batch_size": "Sequences per training forward/backward (default: the memory plan picks).",
    "gradient_checkpointing": "Recompute activations in the backward (where the preset sets none: on only when the "
                              "memory plan needs it).",
    "gpu_memory_gib": "GPU memory the run may use, GiB (e.g. 79.2 to stand for an 80 GB card).",
    "logprob_chunk_tokens": "Completion tokens per lm_head + log-softmax chunk (0: all at once).",
    "optimizer_offload": "Keep AdamW's moments in pinned host memory, streamed to the GPU for each step "
                         "(default: the memory plan's choice; exact either way).",
    "kernel_weight_copies": "Let the FP4 kernel dispatch keep a second, converted weight copy where a peer kernel "
                            "(humming) is faster (default: only when the step fits with it).",
    "logprob_backend": "chunked (qerl's, default) | liger (Liger-Kernel fused linear + cross-entropy; CUDA).",
    "pack_sequences": "Pack each micro-batch's sequences (no compute on padding; varlen attention).",
    "routing_replay": "Mixture of experts: the training forwards take the experts the rollout's router picked for "
                      "each token (the router's gradient still flows); default on with the builtin engine, off "
                      "with vLLM, which cannot record them (docs/moe.md).",
    "async_rollout": "Generate the next step's rollouts on a second CUDA stream while this step trains: the rollout "
                     "policy is one update stale, corrected by --correction (default token_tis, C = 2; builtin "
                     "engine, LoRA, one process).",
    "rollout_gpus": "Asynchronous RL across GPUs: under --gpus N (or torchrun) this many ranks only roll out "
                    "(builtin engine, continuously) and the other N - R train on their samples; the new adapters "
                    "are broadcast to them after every update (docs/distributed.md). Needs --correction (default "
                    "token_tis with it).",
    "max_staleness": "With --rollout-gpus: a sample generated by adapter version v is trained at version <= v + K, "
                     "else dropped and counted (async/dropped_stale); 0: on-policy only.",
    "recompute_logprobs": "Compute pi_old in a no-grad pass of its own before the update. Off by default: with one "
                          "optimizer step per batch pi_old is the update forward's own (detached) log-probs, the "
                          "same numbers without the pass (LoRA dropout > 0 always recomputes).",
    "keep_rollout_cache": "Keep the builtin engine's KV cache and CUDA graphs between steps (default: when the "
                          "memory plan has room).",
    "log_sampling_entropy": "Log sampling/entropy, the entropy of the policy the rollouts sampled from (under AQN "
                            "the noisy one); rollouts then sample in torch instead of the fused CUDA kernel.",
    "async_checkpoint": "Write checkpoints in a background thread while the next step runs.",
    "save_steps": "Checkpoint every N steps.",
    "keep_checkpoints": "Checkpoints kept (older ones are deleted; 0: all).",
    "sigterm_grace_s": "After SIGTERM (SLURM, Kubernetes, spot preemption) the step in flight may finish and be "
                       "checkpointed within this many seconds, else it is abandoned; exit 143 (docs/checkpoints.md).",
    "seed": "Seed of data order, sampling, AQN and LoRA init.",
    "shots": "Few-shot examples in the prompt (default per task).",
    "chat_template": "Wrap prompts in the model's chat template.",
    "task_level": "arith difficulty: 1-7, 'mixed' or 'd=0.5'.",
    "tools": "python | calculator: multi-turn episodes, the model calls the tool mid-answer (docs/tools.md).",
    "env": "module:Class or file.py:Class: multi-turn episodes with your environment (reset(prompt) -> str, "
           "step(action) -> (observation, done, reward)).",
    "max_turns": "Model turns per episode (--tools/--env).",
    "max_episode_tokens": "Tokens after the prompt per episode, model and observations (default: "
                          "--max-completion-length).",
    "tool_timeout_s": "Per Python tool call: wall-clock limit, and the CPU-time limit rounded up.",
    "tool_memory_mb": "Per Python tool call: address-space limit, MB.",
    "tool_workers": "Tool calls or environment steps run at once, beside decoding.",
    "log_rollouts": "Write every step's rollouts to train/rollouts/.",
    "finetune": "lora | full (all weights but embeddings; needs a bf16 run dir).",
    "rollout_quant": "FlashRL rollouts: " + ", ".join(ROLLOUT_QUANTS) + " (on a bf16 run dir).",
    "requant_scales": "fixed (int8 default) | dynamic",
    "rollout_w4a8": "W4A8 rollouts: the rollout's NVFP4/MXFP4 forwards without autograd, from QERL_W4A8_MIN_M (64) "
                    "rows, on the FP8 tensor cores (per-token FP8 activations, weights widened to E4M3; "
                    "kernels/w4a8.py); the update stays W4A16. Off by default: its mismatch k3 measured 16x W4A16's "
                    "(docs/kernels.md). Builtin engine, nvfp4/mxfp4 weights.",
    "sharding": "auto | none | ddp | fsdp2 (auto: fsdp2 for --finetune full under torchrun, ddp for LoRA).",
    "fsdp_offload": "fsdp2: keep sharded weights, grads and AdamW state in pinned host memory (CPU step).",
}


def resolve_sharding(cfg: TrainConfig, world_size: int) -> str:
    """The sharding engine a run uses on ``world_size`` processes (what the manifest records).

    auto: fsdp2 for full fine-tuning under torchrun, ddp for LoRA under torchrun, none on one process;
    ddp on one process is none (nothing to replicate to). fsdp2 on one process is FSDP at degree 1: the
    fp32 masters are its sharded parameters, computed in bf16 one layer at a time, offloadable to the host."""
    s = cfg.sharding
    if s == "auto":
        s = "none" if world_size <= 1 else ("fsdp2" if cfg.finetune == "full" else "ddp")
    if s == "ddp" and world_size <= 1:
        s = "none"
    if s == "none" and world_size > 1:
        raise QerlError(f"--sharding none runs one process, but torchrun started {world_size}: use --sharding "
                        "ddp (LoRA) or fsdp2 (--finetune full)")
    if s == "ddp" and cfg.finetune == "full":
        raise QerlError("--finetune full on several processes shards its weights: use --sharding fsdp2 (the "
                        "default under torchrun)")
    if cfg.fsdp_offload and s != "fsdp2":
        raise QerlError("--fsdp-offload offloads FSDP2's sharded state: use it with --sharding fsdp2")
    if s == "fsdp2":  # auto may have chosen it: the checks of an explicit fsdp2
        TrainConfig.validate(dataclasses.replace(cfg, sharding="fsdp2"))
    return s


@dataclass(frozen=True)
class TrainFlag:
    """One `qerl train` option generated from a TrainConfig field."""

    field: str  # TrainConfig field name
    decl: str  # "--lora-rank", or "--aqn/--no-aqn" for booleans
    type: type  # what the command line parses: bool, int, float or str (lists: comma-separated str)
    is_list: bool
    help: str


@functools.cache
def field_types() -> dict[str, Any]:
    """TrainConfig field name -> resolved type annotation, in field order."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def split_optional(tp: Any) -> tuple[Any, bool]:
    """``int | None`` -> (int, True); ``int`` -> (int, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


# ---- one value of one field: its type, finite, in its range, one of its choices ---------------------------------
INT_LIMIT = 2**31  # far above any count, length or step of a real run: a larger number is a typo

# The range of each numeric field: "[lo, hi]" ("(" or ")" for an open end), ">= x" or "> x". An integer field
# without an upper end is capped at INT_LIMIT; a float field must be finite. Fields not listed have no range.
FIELD_RANGES: dict[str, str] = {
    "steps": ">= 1", "batch_prompts": ">= 1", "num_generations": ">= 1", "max_completion_length": ">= 1",
    "max_prompt_length": ">= 1", "temperature": "> 0", "top_p": "(0, 1]", "lr": "> 0", "warmup_steps": ">= 0",
    "weight_decay": ">= 0", "max_grad_norm": "> 0", "lora_rank": ">= 1", "lora_alpha": "> 0",
    "lora_dropout": "[0, 1)", "beta": ">= 0", "epsilon": "[0, 1)", "epsilon_high": ">= 0", "overlong_buffer": ">= 0",
    "max_refill_rounds": ">= 0", "correction_cap": "> 0", "aqn_sigma_start": "> 0", "aqn_sigma_end": "> 0",
    "aqn_stages": ">= 1", "gpu_memory_utilization": "(0, 1]", "max_batch_slots": ">= 1", "micro_batch_size": ">= 1",
    "gpu_memory_gib": "> 0", "logprob_chunk_tokens": ">= 0", "save_steps": ">= 1", "keep_checkpoints": ">= 0",
    "sigterm_grace_s": ">= 0", "seed": "[0, 4294967295]", "shots": ">= 0",
    "max_turns": ">= 1", "max_episode_tokens": ">= 1", "tool_timeout_s": "> 0", "tool_memory_mb": ">= 1",
    "tool_workers": ">= 1", "rollout_gpus": ">= 0", "max_staleness": ">= 0",
}
# logprob_backend's choices live with the torch code that runs them, algo's in the algorithm registry (field_choices)
FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    "correction": CORRECTIONS, "finetune": FINETUNES, "rollout_quant": ROLLOUT_QUANTS,
    "requant_scales": REQUANT_SCALES, "sharding": SHARDINGS, "precision": PRECISIONS,
    "rollout_engine": ("builtin", "vllm"), "scale_rewards": SCALE_REWARDS, "tools": TOOL_NAMES,
}
_INTERVAL = re.compile(r"([\[(])(\S+), (\S+)([\])])")
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def flag_name(name: str) -> str:
    """The `qerl train` flag of a TrainConfig field: lora_rank -> --lora-rank."""
    return "--" + name.replace("_", "-")


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, so a message stays one short line whatever the input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def field_choices(name: str) -> tuple[str, ...] | None:
    if name == "algo":
        return tuple(ALGORITHMS)
    if name == "logprob_backend":
        from qerl_cli.train.logprobs import LOGPROB_BACKENDS

        return LOGPROB_BACKENDS
    return FIELD_CHOICES.get(name)


def in_range(value: float, spec: str) -> bool:
    """Whether ``value`` lies in a FIELD_RANGES ``spec`` (False for NaN)."""
    m = _INTERVAL.fullmatch(spec)
    if m:
        lo, hi = float(m[2]), float(m[3])
        return (lo < value if m[1] == "(" else lo <= value) and (value < hi if m[4] == ")" else value <= hi)
    op, _, bound = spec.partition(" ")
    return value > float(bound) if op == ">" else value >= float(bound)


def parse_text(base: Any, text: str) -> Any:
    """Command-line text -> a value of ``base`` (bool, int, float, str or a comma-separated list); ValueError."""
    t = text.strip()
    if base is bool:
        if t.lower() in _TRUE + _FALSE:
            return t.lower() in _TRUE
        raise ValueError(t)
    if base in (int, float, str):
        return base(t)
    if typing.get_origin(base) is list:
        return [x.strip() for x in t.split(",") if x.strip()]
    raise ValueError(t)


def _type_problem(base: Any, value: Any) -> str | None:
    """Why ``value`` is not a ``base`` (bool, int, float, str or list[str]; never bool for a number), or None."""
    if typing.get_origin(base) is list:
        ok = isinstance(value, list) and bool(value) and all(isinstance(v, str) and v.strip() for v in value)
        return None if ok else f"must be a non-empty list of names, got {shown(value)}"
    number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = {bool: isinstance(value, bool), int: number and isinstance(value, int), float: number,
          str: isinstance(value, str)}[base]
    if ok:
        return None
    hint = ""
    if isinstance(value, str):
        try:
            parsed = parse_text(base, value)
            # unquoted, YAML reads `nan` and `inf` as text as well: no hint that leads back here
            hint = "" if base is float and not math.isfinite(parsed) else " (write it without quotes)"
        except ValueError:
            pass
    elif base is str and number:
        hint = " (quote it to give text)"
    return f"must be {_KINDS[base]}, got {shown(value)}{hint}"


def check_value(name: str, value: Any) -> Any:
    """``value`` for TrainConfig field ``name``, checked: its type (None only where the field is optional), a finite
    number, in FIELD_RANGES, one of its choices. An int for a float field comes back a float. A QerlError names the
    field as its flag (`--top-p must be in (0, 1], got 2.0`)."""
    base, optional = split_optional(field_types()[name])
    flag = flag_name(name)
    if value is None:
        if optional:
            return None
        raise QerlError(f"{flag} needs a value: only options whose default is automatic take null")
    problem = _type_problem(base, value)
    if problem:
        raise QerlError(f"{flag} {problem}")
    if base is float:
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            value = math.inf
        if not math.isfinite(value):
            raise QerlError(f"{flag} must be a finite number, got {value}")
    spec = FIELD_RANGES.get(name)
    if spec is not None and not in_range(value, spec):
        raise QerlError(f"{flag} must be {'in ' if _INTERVAL.fullmatch(spec) else ''}{spec}, got {shown(value)}")
    if base is int and not (spec and _INTERVAL.fullmatch(spec)) and value > INT_LIMIT:
        raise QerlError(f"{flag} must be <= {INT_LIMIT}, got {shown(value)}")
    choices = field_choices(name)
    if choices is not None and value not in choices:
        raise QerlError(f"{flag} must be one of {', '.join(choices)}, not {shown(value)}")
    return value


def check_fields(data: dict[str, Any], where: str | None = None) -> dict[str, Any]:
    """TrainConfig fields from one source, each through check_value; ``where`` (a config file) starts a message."""
    prefix = f"{where}: " if where else ""
    unknown = sorted(set(data) - FIELD_NAMES)
    if unknown:
        raise QerlError(f"{prefix}unknown train option(s) {', '.join(shown(k) for k in unknown)}; see "
                        "`qerl train --help`")
    out: dict[str, Any] = {}
    for name, value in data.items():
        try:
            out[name] = check_value(name, value)
        except QerlError as exc:
            raise QerlError(f"{prefix}{exc}") from None
    return out


def train_flags() -> list[TrainFlag]:
    """The `qerl train` options, one per TrainConfig field, in field order."""
    flags = []
    for name, tp in field_types().items():
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = args[0] if len(args) == 1 else str
        is_list = typing.get_origin(tp) is list
        base = str if is_list or tp not in (bool, int, float, str) else tp
        dash = name.replace("_", "-")
        decl = f"--{dash}/--no-{dash}" if base is bool else f"--{dash}"
        flags.append(TrainFlag(name, decl, base, is_list, FIELD_HELP.get(name, f"TrainConfig.{name} ({tp})")))
    return flags


def flag_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """Parsed flag values (None: not given) -> TrainConfig overrides; list flags are split on commas."""
    out: dict[str, Any] = {}
    for flag in train_flags():
        value = values.get(flag.field)
        if value is None:
            continue
        out[flag.field] = [t.strip() for t in value.split(",") if t.strip()] if flag.is_list else value
    return out


def parse_value(key: str, text: str, flag: str = "--set") -> Any:
    """``text`` parsed to the type of TrainConfig field ``key`` and checked (check_value); ``null`` means None for
    optional fields, and so does ``none`` for optional non-string ones (string fields keep ``"none"``: a real value
    of ``correction`` and ``scale_rewards``). A QerlError names ``flag`` and the pair."""
    types_ = field_types()
    if key not in types_:
        raise QerlError(f"unknown train option {key!r}; valid options: {', '.join(sorted(types_))}")
    base, optional = split_optional(types_[key])
    t = text.strip()
    if optional and (t.lower() == "null" or (t.lower() == "none" and base is not str)):
        return None
    try:
        value = parse_text(base, t)
    except ValueError:
        raise QerlError(f"{flag} {key}={shown(text)}: expected {getattr(base, '__name__', base)}") from None
    try:
        return check_value(key, value)
    except QerlError as exc:
        raise QerlError(f"{flag} {key}={shown(text)}: {exc}") from None


def split_pair(item: str, flag: str) -> tuple[str, str]:
    """``"lora-rank=8"`` -> ``("lora_rank", "8")``; a QerlError naming ``flag`` when there is no KEY=."""
    key, sep, value = item.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise QerlError(f"{flag} {shown(item)}: expected KEY=VALUE")
    return key, value


def parse_sets(items: Iterable[str] | None) -> dict[str, Any]:
    """``--set`` items: ``["lr=1e-4", "aqn=true"]`` -> ``{"lr": 1e-4, "aqn": True}`` (types from TrainConfig)."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, value = split_pair(item, "--set")
        out[key] = parse_value(key, value)
    return out


def _presets_dir() -> Traversable:
    """The presets ship inside the package (`qerl_cli/templates/*.yaml`), so a wheel install has them."""
    return resources.files("qerl_cli") / "templates"


# ---- YAML config files: read safely, every value checked -------------------------------------------------------
CONFIG_MAX_BYTES = 1 << 20  # a config is a few hundred bytes; a file this large is not one


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader for config files, with three differences. Aliases (``*name``) are refused: an alias
    re-uses a node, and nested ones expand exponentially in whatever copies the value. A key given twice is
    refused (YAML keeps the last one silently). ``1e-5`` is a float, as in YAML 1.2 and to every user (YAML 1.1
    reads it as a string unless written ``1.0e-5``)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"found the alias *{event.anchor} (config files may not "
                                              "use aliases: write the value out)", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[str] = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"{key.value!r} is given twice",
                                                            key.start_mark)
                seen.add(key.value)
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                   re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                   list("-+0123456789"))


def _config_bytes(path: str | Path) -> tuple[bytes, str]:
    """The bytes of a config file or preset (at most CONFIG_MAX_BYTES) and how a message names it."""
    p = Path(path)
    if p.is_file():
        try:
            with p.open("rb") as f:
                raw = f.read(CONFIG_MAX_BYTES + 1)
        except OSError as exc:
            raise QerlError(f"config {p} cannot be read: {exc.strerror or exc}") from None
        if len(raw) > CONFIG_MAX_BYTES:
            raise QerlError(f"config {p} is over {CONFIG_MAX_BYTES} bytes, too large for a config file: "
                            "give the YAML file of `option: value` lines")
        return raw, f"config {p}"
    preset = _presets_dir() / (p.name if p.suffix else f"{p.name}.yaml")
    if not preset.is_file():
        raise QerlError(f"config {path} does not exist (presets: {', '.join(list_presets())})")
    return preset.read_bytes(), f"preset {p.stem}"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error as one line: the problem and where it is."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    text = f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if problem and mark else str(exc)
    return " ".join(text.split())


def parse_yaml(raw: bytes, where: str) -> dict[Any, Any]:
    """The mapping a config file holds (empty for an empty file); one-line QerlErrors naming ``where``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise QerlError(f"{where} is not UTF-8 text (byte offset {exc.start}, line {line}): save it as UTF-8") from None
    try:
        data = yaml.load(text, Loader=ConfigLoader)  # a SafeLoader: plain data only
    except yaml.YAMLError as exc:
        raise QerlError(f"{where} is not valid YAML: {_yaml_problem(exc)}") from None
    except Exception as exc:  # PyYAML's constructors fail in their own ways on hostile input: nesting deeper
        # than Python's stack, `!!float abc`, an integer over Python's digit limit
        first = (str(exc).splitlines() or [""])[0][:120]
        raise QerlError(f"{where} is not a config qerl can read ({type(exc).__name__}: {first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise QerlError(f"{where} must be a mapping of `option: value` lines, not a {type(data).__name__}")
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A preset name (`quick_cpu`, `quick_cpu.yaml`) or a YAML file path -> TrainConfig fields, each one checked
    (check_fields); every problem is one line naming the file."""
    raw, where = _config_bytes(path)
    out: dict[str, Any] = {}
    for key, value in parse_yaml(raw, where).items():
        if not isinstance(key, str):
            raise QerlError(f"{where}: option names are text, got {shown(key)} ({type(key).__name__}); "
                            "see `qerl train --help`")
        name = key.replace("-", "_")
        if name in out:
            raise QerlError(f"{where}: {name} is given twice (as {key!r} and with the other spelling)")
        out[name] = value
    return check_fields(out, where)


def list_presets() -> list[str]:
    return sorted(p.name[:-5] for p in _presets_dir().iterdir() if p.name.endswith(".yaml"))


def build_config(yaml_path: str | Path | None, overrides: dict[str, Any]) -> TrainConfig:
    """YAML preset first, then explicit flags (only those the user gave) on top. Each value is checked against its
    field where it came from (a file's problems name the file), then the whole config (validate)."""
    data: dict[str, Any] = load_yaml(yaml_path) if yaml_path else {}
    data.update(check_fields({k: v for k, v in overrides.items() if v is not None}))
    cfg = TrainConfig(**data)
    cfg.validate()
    return cfg
