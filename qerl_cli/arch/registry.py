"""model_type -> :class:`ArchSpec`: the built-in architectures and any ``register()``-ed since."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qerl_cli.arch import dense, mixtral, qwen3_moe
from qerl_cli.arch.spec import ArchSpec, Projections
from qerl_cli.errors import QerlError

_SPECS: dict[str, ArchSpec] = {s.model_type: s for s in (*dense.SPECS, *qwen3_moe.SPECS, *mixtral.SPECS)}

# every built-in architecture names its projections as transformers' dense decoders do: the vocabulary of
# lora_targets (its default, run configs, the CLI), which another architecture maps by role (lora.arch_targets), and
# what a model's dimensions are keyed by when built without a config (the memory plan's tests and benches)
DEFAULT_PROJECTIONS: Projections = dense.PROJECTIONS
DEFAULT_LORA_TARGETS: tuple[str, ...] = DEFAULT_PROJECTIONS.names
# what sizes a config qerl has no spec for (a hand-written one, a model another engine runs): a dense decoder of the
# built-in layout, its q/k/v bias as the config's attention_bias says; only sizing reads it, never the engine
GENERIC_DENSE: ArchSpec = dense.LLAMA


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


def model_types(where: Callable[[ArchSpec], bool] | None = None) -> tuple[str, ...]:
    """The registered model types (those whose spec passes ``where``), sorted."""
    return tuple(sorted(t for t, s in _SPECS.items() if where is None or where(s)))


def _model_type(config_or_model: Any) -> str | None:
    # a model_type itself, a model (transformers', peft's, qerl's wrappers all expose .config) or its config
    if isinstance(config_or_model, str):
        return config_or_model
    config = getattr(config_or_model, "config", config_or_model)
    return getattr(config, "model_type", None)


def find_spec(config_or_model: Any) -> ArchSpec | None:
    """The spec of a model, a config or a model_type, or None where qerl has none (callers with a generic fallback)."""
    return _SPECS.get(_model_type(config_or_model) or "")


def layout_of(config_or_model: Any) -> ArchSpec:
    """The spec, or the generic dense layout where there is none: for what only reads the layout (sizes, the groups
    a checkpoint writer shares a scale across), which worked on any transformers decoder before and still does."""
    return find_spec(config_or_model) or GENERIC_DENSE


def spec_for(config_or_model: Any) -> ArchSpec:
    """The spec of a model, a config or a model_type; an unknown ``model_type`` is one error that says how to add it."""
    spec = find_spec(config_or_model)
    if spec is None:
        raise QerlError(f"qerl has no architecture for model_type {_model_type(config_or_model)!r} (it runs "
                        f"{', '.join(model_types())}): add one under qerl_cli/arch/ (docs/DEVELOPING.md, "
                        "'How to add an architecture')")
    return spec


__all__ = ["DEFAULT_LORA_TARGETS", "DEFAULT_PROJECTIONS", "GENERIC_DENSE", "find_spec",
           "layout_of", "model_types", "register", "spec_for", "unregister"]
