"""Training checkpoints: adapter (peft format), optimizer, scheduler, scaler, RNG, data and AQN state.

`DIR/train/checkpoints/step_N/` is written into a temporary sibling and renamed whole; the `latest`
pointer is written last, so a crash at any point leaves the previous checkpoint as the one resumed.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir, atomic_write_json, staged_directory
from qerl_cli.runlayout import checkpoint_name, checkpoints_dir, list_checkpoints, write_latest

STATE_FILE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run: RunDir, step: int, peft_model: Any, state: dict[str, Any], config: dict[str, Any],
                    keep: int, *, write_weights: Callable[[Path], None] | None = None) -> Path:
    """`write_weights(dir)` replaces the adapter save (--finetune full writes its trained weights)."""
    final = checkpoints_dir(run) / checkpoint_name(step)
    final.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(final) as tmp:
        if write_weights is not None:
            write_weights(tmp)
        else:
            peft_model.save_pretrained(str(tmp / "adapter"))
        torch.save({**state, "rng": rng_state(), "step": step}, tmp / STATE_FILE)
        atomic_write_json(tmp / "config.json", config)
    write_latest(run, step)
    ckpts = list_checkpoints(run)
    for old in sorted(ckpts)[:-keep] if keep > 0 else []:
        shutil.rmtree(ckpts[old], ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise QerlError(f"checkpoint {path} is unreadable ({exc}): resume from an earlier step_N") from exc


def load_adapter_weights(peft_model: Any, adapter_dir: Path) -> None:
    """Copy saved adapter tensors into the live (trainable) adapter parameters, exactly."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    sd = load_file(str(adapter_dir / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(peft_model, sd)
    if getattr(result, "unexpected_keys", None):
        raise QerlError(f"checkpoint adapter {adapter_dir} does not match this run's LoRA config")
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
