"""A room per model architecture: what qerl needs to know about each, declared once (spec.py), one module per family
(dense.py, qwen3_moe.py, mixtral.py), found by ``spec_for(config_or_model)`` (registry.py). docs/DEVELOPING.md."""

from qerl_cli.arch.registry import (
    DEFAULT_LORA_TARGETS,
    DEFAULT_PROJECTIONS,
    GENERIC_DENSE,
    find_spec,
    layout_of,
    model_types,
    register,
    spec_for,
    unregister,
)
from qerl_cli.arch.spec import ArchDims, ArchSpec, MoeSpec, Projections

__all__ = ["DEFAULT_LORA_TARGETS", "DEFAULT_PROJECTIONS", "GENERIC_DENSE", "ArchDims", "ArchSpec", "MoeSpec",
           "Projections", "find_spec", "layout_of", "model_types", "register", "spec_for", "unregister"]
