"""Training checkpoints (the kinds and their files: qerl_cli/runlayout.py): adapter (peft format) or full
weights, optimizer, scheduler, scaler, RNG, data and AQN state.

`DIR/train/checkpoints/step_N/` is written into a temporary sibling and renamed whole; the `latest`
pointer is written last, so a crash at any point leaves the previous checkpoint as the one resumed.

Background writes (:class:`CheckpointWriter`): the trainer copies the adapter, optimizer, scheduler,
scaler and RNG state to host memory at the step boundary (:func:`snapshot`; the next step updates the
live tensors in place), then a thread serialises that copy with the same staged-directory / `latest`-last
protocol while the next step runs. One write is in flight at a time; the trainer waits for it before it
logs the next step, so a metrics line of step N+1 always means step N's checkpoint is complete.
"""

from __future__ import annotations

import random
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir, atomic_write_json, staged_directory
from qerl_cli.runlayout import (
    ADAPTER_DIR,
    TRAINER_STATE_FILE,
    checkpoint_name,
    checkpoints_dir,
    list_checkpoints,
    write_latest,
)


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


def snapshot(obj: Any) -> Any:
    """A host-memory copy of every tensor in a nested dict/list/tuple (other values kept as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def adapter_snapshot(peft_model: Any) -> dict[str, torch.Tensor]:
    """The LoRA tensors of ``peft_model.state_dict()`` (its key names), copied to host memory."""
    from qerl_cli.lora import lora_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in lora_state_dict(peft_model).items()}


def save_checkpoint(run: RunDir, step: int, peft_model: Any, state: dict[str, Any], config: dict[str, Any],
                    keep: int, *, write_weights: Callable[[Path], None] | None = None,
                    adapter_state: dict[str, torch.Tensor] | None = None,
                    rng: dict[str, Any] | None = None) -> Path:
    """`write_weights(dir)` replaces the adapter save (--finetune full writes its trained weights).

    ``adapter_state`` (from :func:`adapter_snapshot`) is written instead of the live adapter and ``rng``
    instead of the current RNG state: a background write saves the state of the step it was taken at.
    """
    final = checkpoints_dir(run) / checkpoint_name(step)
    final.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(final) as tmp:
        if write_weights is not None:
            write_weights(tmp)
        elif adapter_state is not None:
            peft_model.save_pretrained(str(tmp / ADAPTER_DIR), state_dict=adapter_state)
        else:
            peft_model.save_pretrained(str(tmp / ADAPTER_DIR), state_dict=adapter_snapshot(peft_model))
        torch.save({**state, "rng": rng if rng is not None else rng_state(), "step": step}, tmp / TRAINER_STATE_FILE)
        atomic_write_json(tmp / "config.json", config)
    write_latest(run, step)
    ckpts = list_checkpoints(run)
    for old in sorted(ckpts)[:-keep] if keep > 0 else []:
        shutil.rmtree(ckpts[old], ignore_errors=True)
    return final


class CheckpointWriter:
    """Runs one checkpoint write at a time in a (non-daemon) thread; errors surface at :meth:`wait`."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None
        self.last_completed: Path | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def submit(self, write: Callable[[], Path]) -> None:
        self.wait()

        def run() -> None:
            try:
                self._result = write()
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread at wait()
                self._error = exc

        # not a daemon: an exiting interpreter still finishes the write (and `latest`) it started
        self._thread = threading.Thread(target=run, name="qerl-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the write in flight is done; return its checkpoint (None if none was in flight)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        err, self._error = self._error, None
        if err is not None:
            if isinstance(err, QerlError):
                raise err
            raise QerlError(f"writing the checkpoint failed ({type(err).__name__}: {err}); the previous "
                            "checkpoint is intact: fix the cause and --resume") from err
        self.last_completed = self._result
        return self._result


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / TRAINER_STATE_FILE, map_location="cpu", weights_only=False)
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
