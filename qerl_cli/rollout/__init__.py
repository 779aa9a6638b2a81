"""Rollout engines: generate completions (tokens + processed-distribution log-probs) for RL.

``make_engine("builtin", model, tokenizer, ...)`` returns a :class:`BuiltinEngine`, which runs on the
trainer's own modules (LoRA and quantized layers apply, nothing is copied). ``make_engine("vllm", model,
tokenizer, model_dir=...)`` returns a :class:`~qerl_cli.rollout.vllm_engine.VllmEngine`: a colocated vLLM on
the checkpoint in ``model_dir`` that receives the model's current LoRA tensors before every generate.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from qerl_cli.errors import QerlError
from qerl_cli.rollout.engine import BuiltinEngine, RolloutResult, Sample
from qerl_cli.rollout.sampling import SamplingParams

__all__ = ["BuiltinEngine", "Engine", "RolloutResult", "Sample", "SamplingParams", "make_engine"]

ENGINE_KINDS = ("builtin", "vllm")


@runtime_checkable
class Engine(Protocol):
    def generate(self, prompts: list[list[int]] | list[str], sampling: SamplingParams) -> RolloutResult: ...

    def release(self) -> None: ...


def make_engine(kind: str = "builtin", model: Any = None, tokenizer: Any = None, **kwargs: Any) -> Engine:
    """Build a rollout engine. ``kwargs`` go to the engine (see :class:`BuiltinEngine`, ``VllmEngine``);
    ``model_dir`` (the checkpoint vLLM serves) is needed by "vllm" and ignored by "builtin"."""
    if kind == "builtin":
        if model is None:
            raise QerlError("the builtin rollout engine needs the model it should generate with")
        kwargs.pop("model_dir", None)  # builtin generates with the model's own modules
        return BuiltinEngine(model, tokenizer, **kwargs)
    if kind == "vllm":
        from qerl_cli.rollout.vllm_engine import VllmEngine

        if model is None:
            raise QerlError("the vllm rollout engine needs the peft model whose LoRA it should serve")
        return VllmEngine(model, tokenizer, **kwargs)
    raise QerlError(f"unknown rollout engine {kind!r}; choose one of {', '.join(ENGINE_KINDS)}")
