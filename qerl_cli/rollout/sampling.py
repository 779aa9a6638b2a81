"""Sampling parameters and on-device, batch-invariant sampling.

Log-probabilities
-----------------
Every sampled token comes with its log-probability under the PROCESSED distribution that was actually
sampled (REFERENCE.md section 5): ``logits / temperature`` in float32, then top-k, then top-p filtering
(filtered tokens get -inf), renormalised by ``log_softmax``. The order and the tie rules are those of
transformers' ``TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper`` (top-k keeps every
token whose logit is >= the k-th largest; top-p keeps the smallest top set whose mass reaches top_p).
Greedy decoding (``temperature == 0``) takes the argmax of the raw logits and reports its log-prob
under the same processing with temperature 1, so a greedy rollout still carries a finite, comparable
number.

Determinism (why continuous batching equals one-at-a-time)
----------------------------------------------------------
No stateful generator is used. The noise for sequence ``uid`` at generation step ``step`` and vocabulary
entry ``v`` is a pure function ``hash(seed, uid, step, v)`` (a counter-based RNG built from the
``lowbias32`` integer mixer, evaluated with int64 tensor ops so it runs on any device and inside a
CUDA graph). A token is drawn with the exponential race (equivalent to Gumbel-max):
``argmax_v  logp_v - log(E_v)`` with ``E_v = -log(1 - u_v) ~ Exp(1)``, which picks ``v`` with
probability ``p_v``. Because the noise of a row depends only on its own key and never on its batch
row, slot or neighbours, a sequence samples the same tokens whether it runs alone or among others
(given the same logits). ``uid = (prompt_offset + prompt_index) * n + sample_index`` within one ``generate``
call (``prompt_offset`` 0 unless a caller splits one batch over several calls).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from qerl_cli.errors import QerlError

_M32 = 0xFFFFFFFF
_log = logging.getLogger("qerl.rollout")


@dataclass
class SamplingParams:
    """What to sample and how much. ``top_k <= 0`` and ``top_p == 1`` disable the filters.

    ``stop_token_ids=None`` means "the model's EOS tokens"; pass ``[]`` to ignore EOS. The stop token
    is kept as the last generated token (a policy must learn to emit it). ``stop`` strings end a
    sample at the first token whose decoded completion contains one of them (that token is kept).
    ``seed=None`` draws a fresh seed; the one used is reported in ``RolloutResult.stats["seed"]``.
    ``prompt_offset`` shifts the prompt index in each sequence's noise key (``uid``): a call on prompts
    ``p..q`` of a larger batch with ``prompt_offset=p`` samples what one call on the whole batch would
    (data-parallel rollout splits a batch across ranks this way). ``entropy=True`` also reports, per
    sampled token, the entropy of the processed distribution it was drawn from (``Sample.entropies``):
    the sampling policy's own entropy (under AQN, the noisy policy's), which no recompute with the
    training forward can give.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    prompt_offset: int = 0
    entropy: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise QerlError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise QerlError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise QerlError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.prompt_offset < 0:
            raise QerlError(f"SamplingParams.prompt_offset must be >= 0, got {self.prompt_offset}")
        if self.max_tokens < 1:
            raise QerlError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise QerlError("SamplingParams.stop must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else random.SystemRandom().getrandbits(63)


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs [B, V] (float32) of the processed distribution: temperature, top-k, top-p, renormalise.

    ``temperature == 0`` is treated as 1 (the greedy log-prob convention, see the module docstring).
    """
    x = logits.float()
    if temperature not in (0.0, 1.0):
        x = x / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - top_p)
        remove_sorted[..., -1] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        x = x.masked_fill(remove, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 without overflowing int64: split x into 16-bit halves.
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` (C. Wellons): a 32-bit bijective integer mixer; x holds values in [0, 2^32) as int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int, device: torch.device) -> torch.Tensor:
    """The 32-bit key of a call's seed, as a 0-dim int64 tensor on ``device`` (made once per call:
    building it from a Python int every step would cost a host-to-device copy per step)."""
    s_lo, s_hi = seed & _M32, (seed >> 32) & _M32
    base = mix32(torch.tensor(s_lo ^ 0x243F6A88, dtype=torch.int64))
    return mix32(base ^ s_hi).to(device)


def row_keys(base: torch.Tensor, uids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """32-bit key per row from (seed key, sequence uid, step); uids/steps are int64 [B]."""
    k = mix32(base ^ (uids & _M32))
    return mix32(k ^ (steps & _M32))


class TokenNoise:
    """Counter-based exponential noise E[B, V] ~ Exp(1), a pure function of (seed, uid, step, v).

    ``fused`` (default: on CUDA, unless ``QERL_FAST_DECODE=0``) computes the uniforms with one Triton
    kernel (``qerl_kernels.decode.token_uniform``) instead of ~25 int64 passes over [B, V]; its first
    result is compared bit for bit with the torch arithmetic, and any failure or difference logs one
    warning and keeps the torch path.
    """

    def __init__(self, vocab_size: int, device: torch.device, fused: bool | None = None) -> None:
        v = torch.arange(vocab_size, dtype=torch.int64, device=device)
        # Hash the vocabulary index once; per step only one mixer pass over [B, V] remains.
        self.vocab_hash = mix32(mix32(v ^ 0x9E3779B9))
        if fused is None:
            fused = device.type == "cuda" and os.environ.get("QERL_FAST_DECODE", "1") != "0"
        self._kernel = None
        self._checked = False
        if fused:
            try:
                from qerl_kernels.decode import token_uniform

                self._kernel = token_uniform
            except Exception as exc:  # noqa: BLE001 - any import problem means: torch path
                _log.warning("qerl fused sampling noise unavailable (%s); using the torch path", exc)

    @property
    def fused(self) -> bool:
        return self._kernel is not None

    def uniform(self, keys: torch.Tensor) -> torch.Tensor:
        """The torch arithmetic: u[b, v] in (0, 1) from the row keys [B] (int64 holding 32-bit values)."""
        h = mix32(keys[:, None] ^ self.vocab_hash[None, :])
        # u in (0, 1) at 2^-32 resolution near 0; E = -log(1 - u) keeps full relative precision for the
        # small E that decide rare tokens, and the clamp keeps E finite near u = 1.
        u = (h.to(torch.float32) + 0.5) * (2.0**-32)
        return u.clamp(max=1.0 - 2.0**-24)

    def _fused_uniform(self, keys: torch.Tensor) -> torch.Tensor | None:
        try:
            u = self._kernel(keys, self.vocab_hash)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001
            self._kernel = None
            _log.warning("qerl fused sampling noise disabled, torch path used instead: %s: %s",
                         type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        if not self._checked:
            self._checked = True
            if not torch.equal(u, self.uniform(keys)):
                self._kernel = None
                _log.warning("qerl fused sampling noise disabled: its first result differs from the torch path")
                return None
        return u

    def exponential(self, keys: torch.Tensor) -> torch.Tensor:
        u = self._fused_uniform(keys) if self._kernel is not None else None
        if u is None:
            u = self.uniform(keys)
        return -torch.log1p(-u)


class Sampled(NamedTuple):
    tokens: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor  # float32 [B]
    entropies: torch.Tensor | None  # float32 [B], with SamplingParams.entropy


def processed_entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy [B] of processed log-probs [B, V] (filtered tokens: -inf, contributing 0)."""
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    noise: TokenNoise,
    key: torch.Tensor,
    uids: torch.Tensor,
    steps: torch.Tensor,
) -> Sampled:
    """Sample one token per row on the logits' device: tokens, their log-probs and, with ``params.entropy``,
    the entropy of each row's processed distribution.

    ``key`` is ``seed_key(seed, device)``; ``uids``/``steps`` (int64 [B]) name each row's sequence and
    step, which with the key fully determine the row's noise.
    """
    logp = process_logits(logits, params.temperature, params.top_k, params.top_p)
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        e = noise.exponential(row_keys(key, uids, steps))
        tokens = torch.argmax(logp - torch.log(e), dim=-1)
    entropies = processed_entropy(logp) if params.entropy else None
    return Sampled(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), entropies)


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    noise: TokenNoise,
    key: torch.Tensor,
    uids: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample` without the entropies: (tokens int64 [B], logprobs float32 [B])."""
    out = sample(logits, params, noise, key, uids, steps)
    return out.tokens, out.logprobs
