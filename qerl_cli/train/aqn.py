"""Adaptive quantization noise (AQN, from QeRL, arXiv 2510.11696).

A channel-wise Gaussian vector Z ~ N(0, sigma^2) of the hidden size is added to each RMSNorm weight
that feeds a quantized projection: ``input_layernorm`` (feeds q/k/v) and the norm that feeds the MLP
(``post_attention_layernorm`` in Llama/Qwen2/Qwen3; ``pre_feedforward_layernorm`` where a layer has
one, as in Gemma 2/3 whose ``post_attention_layernorm`` normalises the attention OUTPUT). Because
RMSNorm(x) * (w + Z) = RMSNorm(x) * w * (1 + Z/w), the noise multiplies the inputs of q/k/v and
gate/up channel-wise, which is what QeRL merges into the norm so that it costs nothing at run time.
o_proj and down_proj get no noise. The noise goes into the ROLLOUT policy only and is redrawn every
update step; the training forward uses the clean weights.

The norms are found by structure (a decoder layer has ``input_layernorm``, ``self_attn``, ``mlp``
and a post-attention norm), not by class name: the released QeRL code matched Hugging Face RMSNorm
class names on the vLLM model and so most likely added no noise at all. A model without such
norms raises instead of silently training without AQN.

Precision caveat, measured by ``aqn/applied_noise_norm``: in a bf16 model a norm weight near 1.0 has a
spacing of 2^-8 below 1 and 2^-7 above, so noise of sigma 5e-4 (the paper's final value) rounds to
zero except in rare > 3.9 sigma draws and the rollout sees practically no AQN; fp16 keeps most of it
(spacing 2^-11 below 1, 2^-10 above). The metric reports the L2 norm of what actually differs in
the weight dtype, next to ``aqn/noise_norm`` (the drawn sigma * Z in fp32).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from qerl_cli.arch import find_spec
from qerl_cli.errors import QerlError


def aqn_stage(step: int, total_steps: int, stages: int = 10) -> int:
    """Stage index of update step ``step`` (0-based): training cut into ``stages`` equal parts.

    stage = floor(step * K / total_steps), clamped to K-1 for steps at or past the end.
    """
    if total_steps < 1 or stages < 1 or step < 0:
        raise QerlError(f"AQN schedule needs total_steps >= 1, stages >= 1, step >= 0; got {total_steps}, "
                        f"{stages}, {step}")
    return min(step * stages // total_steps, stages - 1)


def aqn_sigma(
    step: int,
    total_steps: int,
    sigma_start: float = 1e-2,
    sigma_end: float = 5e-4,
    stages: int = 10,
) -> float:
    """QeRL's exponential AQN schedule.

    Stage 0 has sigma 0 (quantization noise only); stage k >= 1 has
    sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2)), decaying from sigma_start at stage 1
    to sigma_end at stage K-1. Guards: K = 1 is stage 0 throughout (no AQN); K = 2 has a single noisy
    stage, which gets sigma_start (the exponent 0/0 is taken as 0).
    """
    if sigma_start < 0 or sigma_end < 0:
        raise QerlError(f"AQN sigmas must be >= 0; got {sigma_start}, {sigma_end}")
    k = aqn_stage(step, total_steps, stages)
    if k == 0:
        return 0.0
    if stages <= 2:
        return float(sigma_start)
    if sigma_start == 0.0 or sigma_end == 0.0:
        raise QerlError("the exponential AQN schedule needs sigma_start > 0 and sigma_end > 0")
    return float(sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (stages - 2)))


def _structural_norms(layer: nn.Module) -> tuple[str, str] | None:
    """The pre-attention and pre-MLP norms of a decoder layer recognised by its attributes (a Gemma-style layer
    has a pre-feedforward norm of its own), or None."""
    if not all(hasattr(layer, a) for a in ("input_layernorm", "self_attn", "mlp")):
        return None
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    mlp_norm = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
    return ("input_layernorm", mlp_norm) if hasattr(layer, mlp_norm) else None


def find_aqn_norms(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameter name -> weight of every norm that feeds q/k/v or gate/up: in each decoder layer, the two its
    architecture declares (``ArchSpec.aqn_norms``); in a model without a known architecture (no transformers config,
    e.g. a module tree built by hand), found by the layer's structure."""
    spec = find_spec(model)
    found: dict[str, nn.Parameter] = {}
    for layer_name, layer in model.named_modules():
        norms = spec.aqn_norms if spec is not None else _structural_norms(layer)
        if norms is None or not all(hasattr(layer, a) for a in (*norms, "self_attn", "mlp")):
            continue
        for attr in norms:
            weight = getattr(getattr(layer, attr), "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
                raise QerlError(
                    f"{layer_name}.{attr} has no 1-D weight to add AQN noise to "
                    "(a norm without an affine weight cannot carry the noise)"
                )
            prefix = f"{layer_name}." if layer_name else ""
            found[f"{prefix}{attr}.weight"] = weight
    return found


class AQN:
    """Draws and applies the per-step AQN noise for one model.

    Usage in the trainer::

        aqn = AQN(model, total_steps, seed=cfg.seed)
        noisy = aqn.noisy_norm_weights(step)         # one Z per norm, redrawn per step
        with aqn.apply(model, noisy):                # builtin rollout on the HF model
            rollouts = generate(...)
        log(aqn.last_metrics)                         # aqn/sigma, aqn/noise_norm, ...

    With an external rollout engine (vLLM) the trainer loads ``noisy`` into the engine instead and
    ``clean_norm_weights()`` afterwards. Noise comes from a CPU ``torch.Generator`` seeded with ``seed``
    (device-independent); Z is drawn even at sigma 0 so the stream position depends only on how many
    steps were drawn, and a repeated call for the same step (a dynamic-sampling refill round) returns
    the same noise. ``state_dict()`` / ``load_state_dict()`` carry the generator for exact resume.
    """

    def __init__(
        self,
        model: nn.Module,
        total_steps: int,
        *,
        sigma_start: float = 1e-2,
        sigma_end: float = 5e-4,
        stages: int = 10,
        seed: int = 0,
    ) -> None:
        self.norms = find_aqn_norms(model)
        if not self.norms:
            raise QerlError(
                f"AQN found no input_layernorm/post_attention_layernorm in {type(model).__name__}: "
                "it would add no noise; disable AQN or use a Llama/Qwen-style decoder"
            )
        self.model = model
        self.total_steps = total_steps
        self.sigma_start = sigma_start
        self.sigma_end = sigma_end
        self.stages = stages
        self.seed = seed
        aqn_sigma(0, total_steps, sigma_start, sigma_end, stages)  # validate the schedule now
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        self._cached_step: int | None = None
        self._cached: dict[str, torch.Tensor] = {}
        self._active = False
        self.last_metrics: dict[str, float] = {}

    @property
    def names(self) -> list[str]:
        return list(self.norms)

    def sigma(self, step: int) -> float:
        return aqn_sigma(step, self.total_steps, self.sigma_start, self.sigma_end, self.stages)

    def clean_norm_weights(self) -> dict[str, torch.Tensor]:
        """Copies of the current (clean) norm weights."""
        self._check_clean("clean_norm_weights")
        return {name: w.detach().clone() for name, w in self.norms.items()}

    def _check_clean(self, what: str) -> None:
        if self._active:
            raise QerlError(f"AQN.{what} called while the noisy weights are applied to the model")

    def noisy_norm_weights(
        self, step: int, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Name -> w + sigma(step) * N(0, 1) for every AQN norm, in the weight's dtype and device.

        ``generator`` overrides the instance's generator (and bypasses the per-step cache).
        """
        self._check_clean("noisy_norm_weights")
        if generator is None and step == self._cached_step:
            return {name: t.clone() for name, t in self._cached.items()}
        gen = self.generator if generator is None else generator
        sigma = self.sigma(step)
        names = list(self.norms)
        weights = [self.norms[n].detach() for n in names]
        # every norm in one device->host and one host->device copy: a copy or a .norm() per norm is a device
        # sync each, which under several processes sharing a GPU made an AQN step markedly slower
        clean = torch.cat([w.reshape(-1) for w in weights]).cpu()  # __init__ made sure there is at least one
        z = torch.cat([torch.randn(w.shape, generator=gen, dtype=torch.float32).reshape(-1) * sigma for w in weights])
        new = (clean.float() + z).to(clean.dtype)
        sizes = [w.numel() for w in weights]
        per_norm = [float(part.norm()) for part in z.split(sizes)]
        sq_total = sum(zn * zn for zn in per_norm)
        applied_sq = float((new.float() - clean.float()).norm()) ** 2
        devices = {w.device for w in weights}
        if len(devices) == 1:
            on_device = new.to(weights[0].device).split(sizes)
        else:
            on_device = tuple(part.to(w.device) for part, w in zip(new.split(sizes), weights, strict=True))
        noisy = {n: part.view(w.shape) for n, part, w in zip(names, on_device, weights, strict=True)}
        self.last_metrics = {
            "aqn/sigma": sigma,
            "aqn/stage": float(aqn_stage(step, self.total_steps, self.stages)),
            "aqn/noise_norm": math.sqrt(sq_total),
            "aqn/noise_norm_mean": sum(per_norm) / len(per_norm),
            "aqn/applied_noise_norm": math.sqrt(applied_sq),
            "aqn/num_norms": float(len(per_norm)),
        }
        if generator is None:
            self._cached_step = step
            self._cached = {name: t.clone() for name, t in noisy.items()}
        return noisy

    @contextlib.contextmanager
    def apply(self, model: nn.Module, weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Swap the norm weights of ``model`` for ``weights`` in place; restore the exact originals on exit.

        ``model`` is the model the AQN was built on, or one with the same parameter names (a rollout
        copy). The weights are copied into the existing parameter storage so compiled graphs / CUDA
        graphs that captured the pointers see the noise. ``aqn/model_noise_norm`` in ``last_metrics``
        is measured on the model itself after the swap: the proof that the rollout ran with noise.
        """
        self._check_clean("apply")
        unknown = set(weights) - set(self.norms)
        if unknown:
            raise QerlError(f"AQN.apply got weights for non-AQN parameters: {sorted(unknown)[:3]}")
        params: dict[str, torch.Tensor] = {}
        for name in weights:
            try:
                params[name] = model.get_parameter(name)
            except AttributeError as exc:
                raise QerlError(f"AQN.apply: the model has no parameter {name}") from exc
        saved = {name: p.detach().clone() for name, p in params.items()}
        self._active = True
        try:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name])
                live_sq = sum(
                    float((p.detach().float() - saved[n].float()).norm()) ** 2 for n, p in params.items()
                )
            self.last_metrics["aqn/model_noise_norm"] = math.sqrt(live_sq)
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(saved[name])
            self._active = False

    def noisy(self, step: int) -> contextlib.AbstractContextManager[None]:
        """``apply(self.model, noisy_norm_weights(step))``."""
        return self.apply(self.model, self.noisy_norm_weights(step))

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "generator": self.generator.get_state(),
            "cached_step": self._cached_step,
            "cached": {k: v.detach().cpu() for k, v in self._cached.items()},
            "sigma_start": self.sigma_start,
            "sigma_end": self.sigma_end,
            "stages": self.stages,
            "total_steps": self.total_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("sigma_start", "sigma_end", "stages", "total_steps"):
            if key in state and state[key] != getattr(self, key):
                raise QerlError(
                    f"AQN checkpoint has {key}={state[key]} but this run uses {getattr(self, key)}: "
                    "resume with the same schedule"
                )
        self.seed = int(state["seed"])
        self.generator.set_state(state["generator"])
        self._cached_step = state.get("cached_step")
        self._cached = {
            k: v.to(device=self.norms[k].device, dtype=self.norms[k].dtype)
            for k, v in state.get("cached", {}).items()
        }


__all__ = ["AQN", "aqn_sigma", "aqn_stage", "find_aqn_norms"]
