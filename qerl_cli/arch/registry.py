"""model_type -> :class:`ArchSpec`: the built-in architectures and any ``register()``-ed since."""

from __future__ import annotations

from typing import Any

from qerl_cli.arch import dense, qwen3_moe
from qerl_cli.arch.spec import ArchSpec
from qerl_cli.errors import QerlError

_SPECS: dict[str, ArchSpec] = {s.model_type: s for s in (*dense.SPECS, *qwen3_moe.SPECS)}

# lora_targets' default before a model is known: every built-in architecture's seven projections are these
DEFAULT_LORA_TARGETS: tuple[str, ...] = dense.PROJECTIONS.names


def register(spec: ArchSpec, *, replace: bool = False) -> ArchSpec:
    """Make ``spec`` the architecture of its ``model_type``; refuses to shadow one unless ``replace``."""
    if spec.model_type in _SPECS and not replace and _SPECS[spec.model_type] != spec:
        raise QerlError(f"model_type {spec.model_type!r} already has an architecture spec "
                        f"({_SPECS[spec.model_type].family}); pass replace=True to override it")
    _SPECS[spec.model_type] = spec
    return spec


def unregister(model_type: str) -> None:
    """Forget a registered architecture (a test's own)."""
    _SPECS.pop(model_type, None)


def model_types() -> tuple[str, ...]:
    return tuple(sorted(_SPECS))


def _model_type(config_or_model: Any) -> str | None:
    # a model (transformers', peft's, qerl's wrappers all expose .config) or its config
    config = getattr(config_or_model, "config", config_or_model)
    return getattr(config, "model_type", None)


def find_spec(config_or_model: Any) -> ArchSpec | None:
    """The spec of a model or config, or None where qerl has none (callers with a generic fallback)."""
    return _SPECS.get(_model_type(config_or_model) or "")


def spec_for(config_or_model: Any) -> ArchSpec:
    """The spec of a model or config; an unknown ``model_type`` is one error that says how to add it."""
    spec = find_spec(config_or_model)
    if spec is None:
        raise QerlError(f"qerl has no architecture for model_type {_model_type(config_or_model)!r} (it runs "
                        f"{', '.join(model_types())}): add one under qerl_cli/arch/ (docs/DEVELOPING.md, "
                        "'How to add an architecture')")
    return spec


__all__ = ["DEFAULT_LORA_TARGETS", "find_spec", "model_types", "register", "spec_for", "unregister"]
