"""Sampling parameters and on-device, batch-invariant sampling.

Log-probabilities
-----------------
Every sampled token comes with its log-probability under the PROCESSED distribution that was actually
sampled (what importance weights need): ``logits / temperature`` in float32, then top-k, then top-p filtering
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
import random
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from qerl_cli.errors import QerlError
from qerl_cli.options import RunOptions, options

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
    return torch.log_softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)


def has_filters(top_k: int, top_p: float) -> bool:
    return top_k > 0 or top_p < 1.0


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``logits / temperature`` in float32 with the top-k and top-p filters applied (filtered tokens -inf):
    ``process_logits`` before its renormalisation."""
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
    return x


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

    ``fused`` (default: on CUDA, unless the ``fast_decode`` option is off) computes the uniforms with one Triton
    kernel (``qerl_kernels.decode.token_uniform``) instead of ~25 int64 passes over [B, V]; its first
    result is compared bit for bit with the torch arithmetic, and any failure or difference logs one
    warning and keeps the torch path.

    ``fused_sampling`` (default: with ``fused``, unless the ``fused_sampling`` option is off): ``sample_tokens`` runs
    ONE kernel (``qerl_kernels.decode.sample_tokens``) that reads each row's logits once: log-sum-exp of
    ``x / T`` online, the same exponential race on the same noise (row keys hashed in the kernel) and the
    winner's log-prob. What changes in rounding against the torch path: the race compares ``x/T - log E``
    where torch compares ``(x/T - lse) - log E`` (lse is one constant per row, so the winner is the same
    unless two tokens' keys lie within an ulp of each other), and lse is summed in another order (log-probs
    differ by ~1e-7 relative). Top-k/top-p keep torch's filtering (sort) and then run the same one pass;
    greedy with those filters keeps the torch path. The first call is checked against the torch path (same
    tokens up to such near-ties, log-probs within 1e-4); a failure logs one warning and keeps torch.
    """

    def __init__(self, vocab_size: int, device: torch.device, fused: bool | None = None,
                 fused_sampling: bool | None = None, opts: RunOptions | None = None) -> None:
        """``opts``: the run's options for the defaults (default: ``qerl_cli.options.options()``)."""
        v = torch.arange(vocab_size, dtype=torch.int64, device=device)
        # Hash the vocabulary index once; per step only one mixer pass over [B, V] remains.
        self.vocab_hash = mix32(mix32(v ^ 0x9E3779B9))
        if fused is None or fused_sampling is None:
            opts = opts or options()
            if fused is None:
                fused = device.type == "cuda" and opts.fast_decode
            if fused_sampling is None:
                fused_sampling = fused and opts.fused_sampling
        self.device = device
        self._kernel = None
        self._checked = False
        self._sampler = None
        self._sampler_checked = False
        self._inv_t: dict[float, float] = {}
        self.vocab_hash32: torch.Tensor | None = None
        if fused or fused_sampling:
            try:
                from qerl_kernels import decode as kernels
            except Exception as exc:  # noqa: BLE001 - any import problem means: torch path
                _log.warning("qerl fused sampling kernels unavailable (%s); using the torch path", exc)
            else:
                self._kernel = kernels.token_uniform if fused else None
                if fused_sampling:
                    self._sampler = kernels
                    self.vocab_hash32 = self.vocab_hash.to(torch.int32)  # the same 32 bits (wraps above 2^31)

    @property
    def fused(self) -> bool:
        return self._kernel is not None

    @property
    def fused_sampling(self) -> bool:
        return self._sampler is not None

    def capturable(self, params: SamplingParams) -> bool:
        """Whether ``sample_tokens`` is one checked kernel for these parameters (no host sync, no filters), so
        a CUDA graph may capture it after the decode step."""
        return self._sampler is not None and self._sampler_checked and not has_filters(params.top_k, params.top_p)

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

    # ----- the one-pass sampler ------------------------------------------------------------------------------
    def _scale(self, temperature: float) -> tuple[int, float]:
        """How the kernel divides by T as torch does on this device: not at all for T in (0, 1); on CUDA
        torch multiplies by its own float32 reciprocal of a Python-float divisor (read back once per T),
        on the CPU it divides."""
        from qerl_kernels.decode import SAMPLE_SCALE_DIV, SAMPLE_SCALE_MUL, SAMPLE_SCALE_NONE

        if temperature in (0.0, 1.0):
            return SAMPLE_SCALE_NONE, 1.0
        if self.device.type != "cuda":
            return SAMPLE_SCALE_DIV, temperature
        inv = self._inv_t.get(temperature)
        if inv is None:
            inv = self._inv_t[temperature] = float(torch.ones((), device=self.device) / temperature)
        return SAMPLE_SCALE_MUL, inv

    def fused_sample(self, logits: torch.Tensor, params: SamplingParams, key: torch.Tensor, uids: torch.Tensor,
                     steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``sample_tokens`` through the one-pass kernel, or None where it does not apply (then torch runs)."""
        if self._sampler is None or logits.dim() != 2:
            return None
        filtered = has_filters(params.top_k, params.top_p)
        if filtered and params.greedy:
            return None
        x, (mode, scale) = logits, self._scale(params.temperature)
        if filtered:  # torch's exact filters (sort), then the same single pass over the filtered x / T
            x, mode, scale = filter_logits(logits, params.temperature, params.top_k, params.top_p), 0, 1.0
        try:
            out = self._sampler.sample_tokens(x, self.vocab_hash32, key, uids, steps, greedy=params.greedy,
                                              scale_mode=mode, scale=scale)
        except Exception as exc:  # noqa: BLE001 - a kernel that fails to build costs no run
            self._sampler = None
            _log.warning("qerl fused sampler disabled, torch path used instead: %s: %s", type(exc).__name__,
                         str(exc).splitlines()[0] if str(exc) else "")
            return None
        if not self._sampler_checked and not _capturing():
            self._sampler_checked = True
            why = _sampler_mismatch(out, torch_sample(logits, params, self, key, uids, steps), logits, params,
                                    self, key, uids, steps)
            if why:
                self._sampler = None
                _log.warning("qerl fused sampler disabled, torch path used instead: first-use check: %s", why)
                return None
        return out


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _sampler_mismatch(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                      logits: torch.Tensor, params: SamplingParams, noise: TokenNoise, key: torch.Tensor,
                      uids: torch.Tensor, steps: torch.Tensor) -> str:
    """'' when the fused result is the torch path's up to rounding: each row's token equal, or both tokens'
    race keys within 1e-5 of each other (a near-tie the two roundings may resolve differently); log-probs of
    equal tokens within 1e-4 + 1e-5 |lp|."""
    tok, lp = got
    ref_tok, ref_lp = want
    same = tok == ref_tok
    if not bool(same.all()):
        logp = process_logits(logits, params.temperature, params.top_k, params.top_p)
        keys = logp if params.greedy else logp - torch.log(noise.exponential(row_keys(key, uids, steps)))
        a = keys.gather(-1, tok[:, None].clamp(0, keys.shape[-1] - 1))[:, 0]
        b = keys.gather(-1, ref_tok[:, None])[:, 0]
        near = (a - b).abs() <= 1e-5 * b.abs().clamp_min(1.0)
        if not bool((same | near).all()):
            return f"{int((~(same | near)).sum())} of {tok.numel()} rows sampled another token"
    err = (lp - ref_lp).abs()[same]
    if err.numel() and not bool((err <= 1e-4 + 1e-5 * ref_lp[same].abs()).all()):
        return f"log-prob differs by {float(err.max()):.3g}"
    return ""


def torch_sample(logits: torch.Tensor, params: SamplingParams, noise: TokenNoise, key: torch.Tensor,
                 uids: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of ``sample_tokens`` (the reference the fused sampler is checked against)."""
    out = sample(logits, params, noise, key, uids, steps)
    return out.tokens, out.logprobs


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
    """The torch sampler: tokens, their log-probs and, with ``params.entropy``, the entropy of each row's
    processed distribution (the fused kernel reports no entropies, so a call that wants them runs here)."""
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
    """Sample one token per row on the logits' device. Returns (tokens int64 [B], logprobs float32 [B]).

    ``key`` is ``seed_key(seed, device)``; ``uids``/``steps`` (int64 [B]) name each row's sequence and
    step, which with the key fully determine the row's noise. One fused kernel where ``noise`` has it
    (``TokenNoise.fused_sampling``), else the torch path.
    """
    out = noise.fused_sample(logits, params, key, uids, steps)
    return out if out is not None else torch_sample(logits, params, noise, key, uids, steps)


class StepSampler:
    """The sampling of one ``generate`` call: its parameters, noise and seed key, callable on logits.

    ``key_value`` is the seed key as a host int, so a CUDA graph that captured the sampler (reading a
    static key buffer) is given a new call's key by one ``fill_`` instead of a copy per step. With
    ``params.entropy`` it samples through ``sample`` (torch, with entropies) and is not captured."""

    def __init__(self, params: SamplingParams, noise: TokenNoise, seed: int, device: torch.device) -> None:
        self.params = params
        self.noise = noise
        self.key_value = int(seed_key(seed, torch.device("cpu")))
        self.key = torch.tensor(self.key_value, dtype=torch.int64, device=device)

    @property
    def signature(self) -> tuple:
        """What a captured graph bakes in (the kernel's scalar arguments and constexprs)."""
        p = self.params
        return (p.temperature, p.top_k, p.top_p)

    @property
    def capturable(self) -> bool:
        return not self.params.entropy and self.noise.capturable(self.params)

    def __call__(self, logits: torch.Tensor, uids: torch.Tensor, steps: torch.Tensor,
                 key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_tokens(logits, self.params, self.noise, self.key if key is None else key, uids, steps)

    def with_entropy(self, logits: torch.Tensor, uids: torch.Tensor, steps: torch.Tensor) -> Sampled:
        """Tokens, log-probs and (with ``params.entropy``) entropies; the fused kernel where no entropy is asked."""
        if self.params.entropy:
            return sample(logits, self.params, self.noise, self.key, uids, steps)
        return Sampled(*self(logits, uids, steps), None)
