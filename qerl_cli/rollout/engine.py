"""``BuiltinEngine``: rollouts with the trainer's own modules (LoRA and quantized layers included).

Usage::

    engine = BuiltinEngine(model, tokenizer, max_batch_slots=64, max_model_len=2048)
    result = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=512, seed=0))
    engine.release()   # give the KV cache back before the training step

``generate`` puts the model in eval mode for the rollout (LoRA dropout off) and restores every module's
training flag afterwards. The KV cache is allocated on first use and kept until ``release()``.

Why CUDA graphs: at small shapes (Qwen2.5-0.5B) a decode step is bound by ~40 small kernels per layer (norm,
RoPE, cache write), not by the GEMMs, so replaying the captured step runs about 3-4x the tokens/s of eager
decoding or transformers ``generate``; fusing those kernels (docs/decode.md) goes further.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.options import RunOptions, options
from qerl_cli.rollout.episode import EpisodeHooks, EpisodeScheduler
from qerl_cli.rollout.kv_cache import (
    CacheShape,
    KVBudget,
    KVCache,
    activation_reserve,
    cache_dtype,
    kv_budget,
    plan_num_slots,
)
from qerl_cli.rollout.model_runner import (
    CudaGraphDecoder,
    ModelRunner,
    graph_fingerprint,
    kv_len_buckets,
)
from qerl_cli.rollout.sampling import SamplingParams, TokenNoise
from qerl_cli.rollout.scheduler import Scheduler, Sequence

# Prompts streaming into a running generate call (an asynchronous rollout rank, train/disagg.py): called between
# decode windows with the samples of the groups that completed since the last call (all n samples of each prompt,
# in order), how many more prompts the free slots could start, and the call's progress (prefill_s, decode_s,
# decode_steps so far); returns new prompts as (token ids, noise key), or raises scheduler.StreamStopped to end the
# call. Episodes keep their call's prompt list.
PromptFeed = Callable[[list["Sample"], int, dict[str, float]], list[tuple[list[int], int]]]

_CACHE_ALIGN = 64  # cache length multiple: keeps SDPA mask/K strides aligned for the fused kernels


@dataclass
class Sample:
    """One generated completion. ``token_ids`` include the stop token when it ended the sample;
    ``logprobs[i]`` is the float32 log-prob of ``token_ids[i]`` under the processed distribution and, with
    ``SamplingParams(entropy=True)``, ``entropies[i]`` that distribution's entropy."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: str  # "stop" | "length"
    text: str | None = None
    entropies: torch.Tensor | None = None  # float32 per token: the sampled distribution's entropy (entropy=True)
    # episodes (rollout/episode.py): [start, end) of each observation in token_ids (log-prob 0.0 there, masked
    # from the loss) and what each step returned; empty for a single-turn completion
    observation_spans: list[tuple[int, int]] = field(default_factory=list)
    steps: list[Any] = field(default_factory=list)
    # a mixture of experts' routing as the engine computed it (routing replay, docs/moe.md): each sparse layer's
    # top-k expert ids for every token the model ran, prompt then completion, [len(prompt) + len(token_ids) - 1,
    # layers, k] (uint8, int16 past 256 experts; the last token was sampled, never run); None when not recorded
    routing: torch.Tensor | None = None
    # --rollout-gpus (train/disagg.py): the adapter version (optimizer steps seen) that sampled its first token and
    # the one of its last (newer when adapters arrived between decode windows while it ran); None otherwise
    policy_version: int | None = None
    policy_version_last: int | None = None

    def model_mask(self) -> torch.Tensor:
        """float32 [len(token_ids)]: 1 on the tokens the model sampled, 0 on observation tokens."""
        mask = torch.ones(len(self.token_ids), dtype=torch.float32)
        for start, end in self.observation_spans:
            mask[start:end] = 0.0
        return mask


@dataclass
class RolloutResult:
    """Samples ordered by (prompt_index, sample_index); ``timings`` in seconds; ``stats`` counters.

    timings: prefill_s, decode_s, total_s, tokens (generated, kept), tokens_per_s (tokens / total_s),
    decode_tokens_per_s, ttft (start of generate -> first tokens on the host); with episodes also tool_wait_s
    (the decode loop idle, every sequence waiting for a step) and resume_s (observations prefilled).
    stats: seed, num_slots, prefill_prompts (prefills run: once per prompt, not per sample),
    prefill_batches, prefill_tokens, prefill_padded_tokens, decode_steps, decode_row_steps, syncs,
    discarded_tokens (computed past a stop before the host saw it); with episodes also steps, resumes,
    resume_batches, observation_tokens, parked_max.
    """

    samples: list[Sample]
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)

    def for_prompt(self, prompt_index: int) -> list[Sample]:
        return [s for s in self.samples if s.prompt_index == prompt_index]


def _eos_ids(model: nn.Module, tokenizer: object | None) -> list[int]:
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]
    return []


def _rollout_timings(scheduler: Scheduler, samples: list[Sample], total: float) -> dict[str, float]:
    """Seconds and tokens per second of one generate call."""
    # generated tokens: an episode's observations were prefilled, not sampled
    tokens = sum(len(s.token_ids) - sum(e - b for b, e in s.observation_spans) for s in samples)
    timings = {
        "prefill_s": scheduler.prefill_s,
        "decode_s": scheduler.decode_s,
        "total_s": total,
        "tokens": float(tokens),
        "tokens_per_s": tokens / total if total > 0 else 0.0,
        "decode_tokens_per_s": tokens / scheduler.decode_s if scheduler.decode_s > 0 else 0.0,
        "ttft": scheduler.ttft or 0.0,
    }
    if isinstance(scheduler, EpisodeScheduler):
        timings.update(tool_wait_s=scheduler.tool_wait_s, resume_s=scheduler.resume_s)
    return timings


def checked_model_len(max_model_len: int) -> int:
    """An engine's `max_model_len` (prompt + completion tokens per sequence), refused below 2."""
    if max_model_len < 2:
        raise QerlError(f"max_model_len must be >= 2, got {max_model_len}")
    return max_model_len


def encode_prompts(prompts: list[list[int]] | list[str], tokenizer: Callable[[], Any],
                   max_model_len: int) -> list[list[int]]:
    """Token ids per prompt (strings through ``tokenizer()``, asked for only when one is a string); an empty
    prompt, or one that leaves no room to generate within ``max_model_len``, is refused."""
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        ids = list(tokenizer()(p)["input_ids"]) if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise QerlError(f"prompt {i} is empty")
        if len(ids) >= max_model_len:
            raise QerlError(
                f"prompt {i} has {len(ids)} tokens; max_model_len {max_model_len} leaves no room to generate"
            )
        out.append(ids)
    return out


class BuiltinEngine:
    """Continuous-batching rollout engine over a Llama/Qwen2/Qwen3 model's own modules.

    Args:
        model: ``*ForCausalLM`` (or a peft model around one); its Linear layers may be any callable
            module. Never copied: weights, LoRA factors and norm weights are read live.
        tokenizer: needed for string prompts, stop strings and ``Sample.text``.
        max_batch_slots: upper bound on concurrently decoded sequences (KV-cache slots).
        max_model_len: prompt + completion tokens per sequence.
        gpu_memory_utilization: on CUDA, fraction of the whole GPU the process may use once the cache
            is allocated (vLLM's meaning); the cache gets what is left after current use and an
            activation reserve, capped at ``max_batch_slots``. Ignored on CPU.
        dtype: activation and KV-cache dtype; defaults to the embedding weight's dtype.
        max_prefill_tokens: padded tokens per prefill batch (at least one prompt is always taken).
        sync_every: decode steps between host syncs (default 8 on CUDA, 1 on CPU).
        cuda_graphs: capture the decode step as CUDA graphs (CUDA only).
        fast_lora: run LoRA layers through in-dtype shadows of A and B*scaling, refreshed in place at
            every ``generate`` (``fast_layers.py``); False calls the peft modules.
        fused_kernels: fused Triton kernels for norm/RoPE/KV-write/SiLU (default: on CUDA only).
            The ``fast_decode`` option off (``QERL_FAST_DECODE=0``) turns both off. With them, LoRA shrinks
            are one-launch Triton kernels and the expands ride in the FP4 GEMM's epilogue where it has one
            (``fused_lora`` off: cuBLAS shrinks and in-place expands, docs/decode.md), and sampling is
            one kernel captured in the decode graph (``fused_sampling`` off: torch); ``decode_attn``
            (sdpa|flashinfer|auto) picks the decode attention (docs/decode.md).
        opts: the run's options (docs/options.md); default ``qerl_cli.options.options()``, read once here.
        record_routing: for a mixture of experts, keep each sparse layer's top-k experts of every token in
            ``Sample.routing`` (routing replay, docs/moe.md); nothing for a dense model.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: object | None = None,
        *,
        max_batch_slots: int = 64,
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.5,
        dtype: torch.dtype | None = None,
        max_prefill_tokens: int = 8192,
        sync_every: int | None = None,
        cuda_graphs: bool = True,
        fast_lora: bool = True,
        fused_kernels: bool | None = None,
        opts: RunOptions | None = None,
        record_routing: bool = True,
    ) -> None:
        if max_batch_slots < 1:
            raise QerlError(f"max_batch_slots must be >= 1, got {max_batch_slots}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = checked_model_len(max_model_len)
        self.max_batch_slots = max_batch_slots
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_prefill_tokens = max_prefill_tokens
        cache_len = -(-max_model_len // _CACHE_ALIGN) * _CACHE_ALIGN
        self.opts = opts or options()
        self.runner = ModelRunner(
            model,
            max_len=max_model_len,
            dtype=dtype,
            cache_len=cache_len,
            fast_lora=fast_lora,
            fused_kernels=fused_kernels,
            opts=self.opts,
        )
        self.device = self.runner.device
        on_cuda = self.device.type == "cuda"
        self.sync_every = sync_every if sync_every is not None else (8 if on_cuda else 1)
        self.use_graphs = cuda_graphs and on_cuda
        self.shape = CacheShape(
            num_layers=self.runner.num_layers,
            num_kv_heads=self.runner.num_kv_heads,
            head_dim=self.runner.head_dim,
            max_len=cache_len,
            dtype=cache_dtype(self.runner.dtype, self.opts.kv_cache),
            routing=self.runner.routing_shape if record_routing else None,
        )
        self.runner.record_routing = record_routing and self.runner.routing_shape is not None
        self.kv_buckets = kv_len_buckets(cache_len)
        # the CUDA memory the cache was sized from (None on CPU): says why fewer slots than asked fit
        self.kv_room: KVBudget | None = None
        self.noise = TokenNoise(self.runner.vocab_size, self.device, opts=self.opts)
        self._graphs: CudaGraphDecoder | None = None
        # set by an asynchronous rollout rank (train/disagg.py): polled between decode windows, it installs newer
        # adapters into the LoRA factors the engine reads and returns (their version, that version's norm
        # overrides), or None; the engine then refreshes its shadows in place (no recompile, no graph recapture)
        self.adapter_updates: Callable[[], tuple[int, dict[str, torch.Tensor] | None] | None] | None = None
        self.adapter_version = 0  # the version of the adapters the engine's shadows hold (with adapter_updates)
        # set by an asynchronous rollout rank too: a generate call without episodes then runs while it streams
        # prompts in, and returns only what it did not hand to the feed
        self.prompt_feed: PromptFeed | None = None

    # ----- memory -------------------------------------------------------------------------------------

    def _activation_reserve(self) -> int:
        r = self.runner
        return activation_reserve(
            hidden=int(r.config.hidden_size), intermediate=int(r.config.intermediate_size), heads=r.num_heads,
            kv_heads=r.num_kv_heads, head_dim=r.head_dim, layers=r.num_layers, vocab=r.vocab_size,
            elem=torch.empty((), dtype=r.dtype).element_size(), prefill_tokens=self.max_prefill_tokens,
            slots=self.max_batch_slots)

    def _ensure_cache(self) -> KVCache:
        cache = self.runner.cache
        if cache is None or not cache.allocated:
            if self.device.type == "cuda":
                self.kv_room = kv_budget(self.shape, self.device, self.gpu_memory_utilization,
                                         self._activation_reserve())
            slots = plan_num_slots(self.shape, self.max_batch_slots, self.kv_room)
            cache = KVCache(self.shape, slots, self.device)
            self.runner.cache = cache
        return cache

    @property
    def num_slots(self) -> int:
        return self._ensure_cache().num_slots

    @property
    def kv_cache_bytes(self) -> int:
        """What the KV cache (and its recorded routing) holds now: 0 until the first ``generate`` and after
        ``release()`` (a trainer rank under --rollout-gpus never allocates one: train/disagg.py records this)."""
        cache = self.runner.cache
        if cache is None or not cache.allocated:
            return 0
        tensors = [cache.k, cache.v, cache.routing.buf if cache.routing is not None else None]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def release(self) -> None:
        """Free the KV cache, LoRA shadows and CUDA graphs (the next ``generate`` reallocates and recaptures)."""
        if self.runner.cache is not None:
            self.runner.cache.release()
        self.runner.cache = None
        self.runner.plan = None  # the LoRA shadows too (rebuilt by the next generate)
        self._graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ----- generation ---------------------------------------------------------------------------------

    def _tokenize(self, prompts: list[list[int]] | list[str]) -> list[list[int]]:
        def tokenizer() -> Any:
            if self.tokenizer is None:
                raise QerlError("string prompts need a tokenizer; pass one to BuiltinEngine")
            return self.tokenizer

        return encode_prompts(prompts, tokenizer, self.max_model_len)

    def _stop_checker(self, stops: list[str]):  # noqa: ANN202 - returns a scheduler.StopCheck
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise QerlError("stop strings need a tokenizer; pass one to BuiltinEngine")
        overlap = max(len(s) for s in stops) + 8

        def check(seq: Sequence, checked: int) -> int | None:
            # Only tokens added since the last check can complete a stop string; decode a tail that
            # reaches `overlap` tokens back (a token carries at least one character) to find out cheaply.
            # Only the current model turn counts: an episode's earlier observations may hold a stop string.
            base = seq.turn_start
            tail = tokenizer.decode(seq.tokens[max(base, checked - overlap) :])
            if not any(s in tail for s in stops):
                return None
            for cut in range(max(base + 1, checked), len(seq.tokens) + 1):
                text = tokenizer.decode(seq.tokens[base:cut])
                if any(s in text for s in stops):
                    return cut
            return None

        return check

    def _decode_fn(self):  # noqa: ANN202
        if not self.use_graphs:
            return self.runner.step_fn
        fingerprint = graph_fingerprint(self.runner)
        if self._graphs is None or self._graphs.fingerprint != fingerprint:
            self._graphs = CudaGraphDecoder(self.runner, self._ensure_cache().num_slots)
            self._graphs.fingerprint = fingerprint
        return self._graphs

    def snapshot_adapters(self) -> None:
        """Copy the trainer's LoRA factors into the engine's shadows now, for a ``concurrent`` generate that starts
        while the factors are being updated."""
        with torch.no_grad():
            self.runner.prepare()

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        sampling: SamplingParams,
        *,
        norm_overrides: dict[str, torch.Tensor] | None = None,
        episodes: EpisodeHooks | None = None,
        concurrent: bool = False,
    ) -> RolloutResult:
        """Generate ``sampling.n`` completions per prompt.

        ``norm_overrides`` maps norm module names (``model.layers.3.input_layernorm``, optional
        ``.weight`` suffix or peft ``base_model.model.`` prefix) to replacement weights for this call
        only (AQN without touching the model). ``episodes``: multi-turn episodes whose turns end in tool
        calls or environment steps (rollout/episode.py); ``sampling.max_tokens`` then bounds the whole
        episode (model and observation tokens). ``concurrent``: the model trains in another thread meanwhile (the
        trainer's --async-rollout): the LoRA shadows keep what :meth:`snapshot_adapters` copied and no module's
        training flag is touched.
        """
        if self.runner.embed_tokens.weight.device != self.device:
            raise QerlError("the model moved to another device after the engine was built; build a new one")
        ids = self._tokenize(prompts)
        stop_ids, stops = self._stops(sampling, episodes)
        seed = sampling.resolved_seed()
        max_new = [self._max_new(sampling, p) for p in ids]
        flags = [] if concurrent else [(m, m.training) for m in self.model.modules()]
        if not concurrent:
            self.model.eval()
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                scheduler = self._prepared_scheduler(sampling, seed, stop_ids, stops, episodes, norm_overrides,
                                                     concurrent)
                seqs = scheduler.run(ids, max_new)
        finally:
            for module, was_training in flags:
                module.training = was_training
        total = time.perf_counter() - t0
        samples = [self._sample(s, sampling) for s in seqs]
        stats = dict(scheduler.stats, seed=seed, num_slots=scheduler.cache.num_slots)
        return RolloutResult(samples=samples, timings=_rollout_timings(scheduler, samples, total), stats=stats)

    def _stops(self, sampling: SamplingParams, episodes: EpisodeHooks | None) -> tuple[set[int], list[str]]:
        """(stop token ids, stop strings) of one generate call: the model's EOS unless the sampling names its own,
        and an episode's tool-call ends after the sampling's strings."""
        stop_ids = set(
            sampling.stop_token_ids if sampling.stop_token_ids is not None else _eos_ids(self.model, self.tokenizer)
        )
        return stop_ids, list(dict.fromkeys([*sampling.stop, *(episodes.stop if episodes is not None else ())]))

    def _prepared_scheduler(self, sampling: SamplingParams, seed: int, stop_ids: set[int], stops: list[str],
                            episodes: EpisodeHooks | None, norm_overrides: dict[str, torch.Tensor] | None,
                            concurrent: bool) -> Scheduler:
        """The scheduler of one generate call, the LoRA shadows, KV cache and norm overrides ready for it."""
        # LoRA shadows <- the trainer's current factors (in place); before the cache is sized, so
        # the budget sees them
        if not concurrent:
            self.runner.prepare()
        cache = self._ensure_cache()
        self.runner.bind_norms(norm_overrides, static=self.use_graphs)
        return self._scheduler(episodes, sampling)(
            runner=self.runner,
            cache=cache,
            decode_fn=self._decode_fn(),
            params=sampling,
            seed=seed,
            noise=self.noise,
            stop_token_ids=stop_ids,
            stop_check=self._stop_checker(stops) if stops else None,
            sync_every=self.sync_every,
            max_prefill_tokens=self.max_prefill_tokens,
            kv_buckets=self.kv_buckets,
            on_window=self._new_adapters if self.adapter_updates is not None else None,
            version=self.adapter_version,
            **({"feed": functools.partial(self._feed, sampling)}
               if self.prompt_feed is not None and episodes is None else {}),
        )

    def _feed(self, sampling: SamplingParams, complete: list[Sequence], want: int,
              progress: dict[str, float]) -> list[tuple[list[int], int, int]]:
        """The scheduler's feed over :attr:`prompt_feed`: finished sequences as samples out, and each new prompt's
        token budget as the call's own prompts get it."""
        assert self.prompt_feed is not None
        new = self.prompt_feed([self._sample(s, sampling) for s in complete], want, progress)
        ids = self._tokenize([p for p, _ in new])  # refused as the call's own prompts are
        return [(p, self._max_new(sampling, p), key) for p, (_, key) in zip(ids, new, strict=True)]

    def _max_new(self, sampling: SamplingParams, ids: list[int]) -> int:
        return min(sampling.max_tokens, self.max_model_len - len(ids))

    def _new_adapters(self) -> int | None:
        """Between decode windows: install the newest published adapters (``adapter_updates``) where the decode
        step reads them, in place; their version, or None when there are none."""
        assert self.adapter_updates is not None
        update = self.adapter_updates()
        if update is None:
            return None
        self.adapter_version, overrides = update
        with torch.no_grad():
            self.runner.refresh_adapters()
            self.runner.bind_norms(overrides, static=self.use_graphs)
        return self.adapter_version

    def _sample(self, s: Sequence, sampling: SamplingParams) -> Sample:
        """One finished sequence of the scheduler as the `Sample` a caller gets."""
        return Sample(
            prompt_index=s.prompt_index,
            sample_index=s.sample_index,
            prompt_token_ids=s.prompt,
            token_ids=s.tokens,
            logprobs=torch.tensor(s.logprobs, dtype=torch.float32),
            finish_reason=s.finish_reason or "length",
            text=self.tokenizer.decode(s.tokens, skip_special_tokens=True) if self.tokenizer else None,
            entropies=torch.tensor(s.entropies, dtype=torch.float32) if sampling.entropy else None,
            observation_spans=s.observation_spans,
            steps=s.steps,
            routing=s.routing.cpu() if s.routing is not None else None,
            **({"policy_version": s.version_first, "policy_version_last": s.version_last}
               if self.adapter_updates is not None else {}),
        )

    def _scheduler(self, episodes: EpisodeHooks | None, sampling: SamplingParams) -> Callable[..., Scheduler]:
        """The scheduler class for this call (bound to the episode hooks when there are any)."""
        if episodes is None:
            return Scheduler
        tokenizer = self.tokenizer

        def encode(text: str) -> list[int]:
            if tokenizer is None:
                raise QerlError("an observation given as text needs a tokenizer; pass one to BuiltinEngine")
            return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

        def decode(ids: list[int]) -> str:
            # without a tokenizer (synthetic benches) turns are told apart by their token budget, not their text
            return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""

        return functools.partial(EpisodeScheduler, hooks=episodes, encode=encode, decode=decode)
