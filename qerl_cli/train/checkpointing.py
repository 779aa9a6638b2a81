"""Training checkpoints: the one module that knows their kinds, files and lifecycle.

Everything that writes or reads a `DIR/train/checkpoints/step_N/` goes through here: the trainer's save and
`--resume`, pruning (`--keep-checkpoints`), the `latest` pointer, the manifest's weight hashes, `qerl eval`
and `qerl report`. Other modules ask this one (which kind, which step, load it into this model) and never
open a checkpoint file themselves.

Kinds (a checkpoint holds exactly one; the directory is renamed into place whole, so a checkpoint is
either complete or absent):

=========  ==========================================================  =======================
kind       weights                                                     written by
=========  ==========================================================  =======================
adapter    ``adapter/`` (peft: adapter_config.json,                    ``--finetune lora``
           adapter_model.safetensors)
full       ``weights.safetensors`` (every trained non-embedding         ``--finetune full``
           weight, fp32 masters)
full_      ``weights.index.json`` + ``weights-rRRRRR-PPP.safetensors``  ``--finetune full
sharded    (each rank's rows of the fp32 masters) and the same for      --sharding fsdp2``
           the AdamW state (``optimizer.*``); readable on any number
           of ranks (train/sharded_checkpoint.py, train/fsdp.py)
=========  ==========================================================  =======================

Every kind also holds ``trainer_state.pt`` (optimizer, scheduler, scaler, RNG, data order, AQN and, with
``--rollout-quant int8 --requant-scales fixed``, the FlashRL fixed INT8 scales under ``rollout_quant``:
calibration state, not weights, so they add no kind) and ``config.json`` (the run's TrainConfig).

Writes are staged: the checkpoint is written into a temporary sibling and renamed whole; the `latest`
pointer is written last, so a crash at any point leaves the previous checkpoint as the one resumed.

Background writes (:class:`CheckpointWriter`): the trainer copies the adapter, optimizer, scheduler,
scaler and RNG state to host memory at the step boundary (:func:`snapshot`; the next step updates the
live tensors in place), then a thread serialises that copy with the same staged-directory / `latest`-last
protocol while the next step runs. One write is in flight at a time; the trainer waits for it before it
logs the next step, so a metrics line of step N+1 always means step N's checkpoint is complete.
"""

from __future__ import annotations

import random
import re
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qerl_cli.errors import QerlError
from qerl_cli.manifest import RunDir, atomic_write_json, atomic_write_text, sha256_file, staged_directory
from qerl_cli.runlayout import checkpoints_dir

CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
LATEST_FILE = "latest"

ADAPTER = "adapter"  # kind: --finetune lora
FULL = "full"  # kind: --finetune full
FULL_SHARDED = "full_sharded"  # kind: --finetune full --sharding fsdp2 (every rank's rows; train/fsdp.py)
KINDS = (ADAPTER, FULL, FULL_SHARDED)
ADAPTER_DIR = "adapter"  # peft's adapter_config.json + adapter_model.safetensors
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
FULL_WEIGHTS_FILE = "weights.safetensors"
SHARDED_WEIGHTS_STEM = "weights"  # weights.index.json + weights-rRRRRR-PPP.safetensors (train/sharded_checkpoint.py)
SHARDED_WEIGHTS_INDEX = SHARDED_WEIGHTS_STEM + ".index.json"
TRAINER_STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.json"
ROLLOUT_QUANT_KEY = "rollout_quant"  # FlashRL's state (fixed INT8 scales) inside TRAINER_STATE_FILE


# ---- kinds, names, lookup -------------------------------------------------------------------------------
def checkpoint_kind(ckpt: Path) -> str | None:
    """ADAPTER, FULL, or None when `ckpt` is not a complete checkpoint."""
    if (ckpt / ADAPTER_DIR / "adapter_config.json").is_file():
        return ADAPTER
    if (ckpt / FULL_WEIGHTS_FILE).is_file():
        return FULL
    if (ckpt / SHARDED_WEIGHTS_INDEX).is_file():
        return FULL_SHARDED
    return None


def weights_path(ckpt: Path) -> Path:
    """The file holding a checkpoint's trained weights (what the manifest hashes; a sharded checkpoint's index
    holds the sha256 of each of its shard files, checked when they are read)."""
    kind = checkpoint_kind(ckpt)
    if kind == FULL:
        return ckpt / FULL_WEIGHTS_FILE
    if kind == FULL_SHARDED:
        return ckpt / SHARDED_WEIGHTS_INDEX
    return ckpt / ADAPTER_DIR / ADAPTER_WEIGHTS_FILE


def checkpoint_name(step: int) -> str:
    return f"step_{step}"


def checkpoint_step(ckpt: Path) -> int | None:
    m = CHECKPOINT_RE.match(ckpt.name)
    return int(m.group(1)) if m else None


def checkpoint_path(run: RunDir, step: int) -> Path:
    return checkpoints_dir(run) / checkpoint_name(step)


def write_latest(run: RunDir, step: int) -> None:
    """Point `latest` at a complete checkpoint; written last, after the checkpoint itself."""
    atomic_write_text(checkpoints_dir(run) / LATEST_FILE, checkpoint_name(step) + "\n")


def list_checkpoints(run: RunDir, kind: str | None = None) -> dict[int, Path]:
    """Complete checkpoints by step, ascending (only those of `kind` when given)."""
    root = checkpoints_dir(run)
    if not root.is_dir():
        return {}
    out = {}
    for p in root.iterdir():
        step = checkpoint_step(p)
        found = checkpoint_kind(p) if step is not None and p.is_dir() else None
        if found is not None and (kind is None or found == kind):
            out[step] = p
    return dict(sorted(out.items()))


def resolve_checkpoint(run: RunDir, name: str) -> Path | None:
    """`latest`, `step_N` or `base` (None: the base model alone). Raises a clear error for a missing one."""
    if name == "base":
        return None
    ckpts = list_checkpoints(run)
    if name == "latest":
        pointer = checkpoints_dir(run) / LATEST_FILE
        if pointer.is_file():
            target = checkpoints_dir(run) / pointer.read_text().strip()
            if checkpoint_kind(target) is not None:
                return target
        if ckpts:
            return ckpts[max(ckpts)]
        raise QerlError(f"run {run.path} has no training checkpoint: run `qerl train --run {run.path}` first "
                        "or pass --checkpoint base")
    step = checkpoint_step(Path(name))
    if step is None:
        raise QerlError(f"--checkpoint must be latest, base or step_N, not {name!r}")
    if step not in ckpts:
        have = ", ".join(checkpoint_name(s) for s in ckpts) or "none"
        raise QerlError(f"checkpoint {name} does not exist in {checkpoints_dir(run)} (have: {have})")
    return ckpts[step]


def latest_step(run: RunDir) -> int | None:
    """The step of the checkpoint `--resume` continues from (None: no checkpoint yet)."""
    try:
        ckpt = resolve_checkpoint(run, "latest")
    except QerlError:
        return None
    return checkpoint_step(ckpt) if ckpt is not None else None


def prune_checkpoints(run: RunDir, keep: int) -> list[Path]:
    """Keep the newest `keep` complete checkpoints of each kind (keep <= 0: all); the removed paths."""
    if keep <= 0:
        return []
    removed = []
    for kind in KINDS:
        ckpts = list_checkpoints(run, kind)
        for old in sorted(ckpts)[:-keep]:
            shutil.rmtree(ckpts[old], ignore_errors=True)
            removed.append(ckpts[old])
    return removed


# ---- state that is not weights --------------------------------------------------------------------------
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


# ---- write -----------------------------------------------------------------------------------------------
def save_checkpoint(run: RunDir, step: int, peft_model: Any, state: dict[str, Any], config: dict[str, Any],
                    keep: int, *, full_weights: Mapping[str, torch.Tensor] | None = None,
                    adapter_state: dict[str, torch.Tensor] | None = None,
                    rng: dict[str, Any] | None = None,
                    weights_writer: Callable[[Path], None] | None = None) -> Path:
    """Write `step_N` of one kind, move `latest` to it, then prune to `keep` per kind.

    ``full_weights`` (name -> tensor) makes it a FULL checkpoint; otherwise it is an ADAPTER one, written
    from ``adapter_state`` (from :func:`adapter_snapshot`: a background write saves the state of the step it
    was taken at) or from the live ``peft_model``. ``rng`` replaces the current RNG state the same way.
    ``state`` may hold the FlashRL state under ROLLOUT_QUANT_KEY (read back by :func:`rollout_quant_state`).
    ``weights_writer(staging_dir)`` makes it a FULL_SHARDED checkpoint: it writes the weights (and the sharded
    optimizer state) into the staging directory, together with the other ranks (train/fsdp.py).
    """
    final = checkpoint_path(run, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(final) as tmp:
        if weights_writer is not None:
            weights_writer(tmp)
        elif full_weights is not None:
            write_full_weights(tmp, full_weights)
        else:
            peft_model.save_pretrained(str(tmp / ADAPTER_DIR),
                                       state_dict=adapter_state if adapter_state is not None
                                       else adapter_snapshot(peft_model))
        torch.save({**state, "rng": rng if rng is not None else rng_state(), "step": step}, tmp / TRAINER_STATE_FILE)
        atomic_write_json(tmp / CONFIG_FILE, config)
    write_latest(run, step)
    prune_checkpoints(run, keep)
    return final


def write_full_weights(directory: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, str(directory / FULL_WEIGHTS_FILE))


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


# ---- read ------------------------------------------------------------------------------------------------
def load_checkpoint(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint (optimizer, scheduler, ..., "step", "config")."""
    try:
        return torch.load(path / TRAINER_STATE_FILE, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise QerlError(f"checkpoint {path} is unreadable ({exc}): resume from an earlier step_N") from exc


def rollout_quant_state(state: dict[str, Any]) -> dict[str, Any] | None:
    """FlashRL's saved state (the fixed INT8 scales) from a loaded trainer state; None when it had none."""
    return state.get(ROLLOUT_QUANT_KEY)


def load_adapter_weights(peft_model: Any, ckpt: Path) -> None:
    """Copy an ADAPTER checkpoint's tensors into the live (trainable) adapter parameters, exactly (resume)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    adapter_dir = ckpt / ADAPTER_DIR
    sd = load_file(str(adapter_dir / ADAPTER_WEIGHTS_FILE))
    result = set_peft_model_state_dict(peft_model, sd)
    if getattr(result, "unexpected_keys", None):
        raise QerlError(f"checkpoint adapter {adapter_dir} does not match this run's LoRA config")
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()


def read_full_weights(ckpt: Path, expected: set[str]) -> dict[str, torch.Tensor]:
    """A FULL (or FULL_SHARDED, assembled from its rows) checkpoint's trained weights; refused unless they are
    exactly the parameters `expected`."""
    from safetensors.torch import load_file

    if checkpoint_kind(ckpt) == FULL_SHARDED:
        from qerl_cli.train.sharded_checkpoint import ShardReader

        with ShardReader(ckpt, SHARDED_WEIGHTS_STEM) as reader:
            if set(reader.keys()) != expected:
                raise QerlError(f"checkpoint {ckpt} was trained with other parameters than this model has: "
                                "evaluate it on the run it was trained in")
            return {k: reader.full(k) for k in reader.keys()}
    path = ckpt / FULL_WEIGHTS_FILE
    if not path.is_file():
        raise QerlError(f"checkpoint {ckpt} has no {FULL_WEIGHTS_FILE}: it is not a --finetune full checkpoint")
    sd = load_file(str(path))
    if set(sd) != expected:
        raise QerlError(f"checkpoint {ckpt} was trained with other parameters than this model has: evaluate "
                        "it on the run it was trained in")
    return sd


def apply_to_model(run: RunDir, model: Any, ckpt: Path) -> tuple[Any, dict[str, Any] | None, dict[str, Any] | None]:
    """Put a checkpoint's trained weights on a freshly loaded base (`qerl eval`).

    Returns (model, adapter_info, weights_info): an ADAPTER checkpoint wraps the model in peft
    (adapter_info: path and LoRA settings); a FULL one copies its weights into the model in place
    (weights_info: path and sha256)."""
    if checkpoint_kind(ckpt) in (FULL, FULL_SHARDED):
        from qerl_cli.train.full_finetune import load_weights

        load_weights(model, ckpt)
        path = weights_path(ckpt)
        return model, None, {"path": run.rel(path), "sha256": sha256_file(path)}
    from qerl_cli.lora import adapter_summary, load_adapter

    adapter_dir = ckpt / ADAPTER_DIR
    model = load_adapter(model, adapter_dir)
    return model, {"path": run.rel(adapter_dir), **adapter_summary(adapter_dir)}, None


def weights_key(ckpt: Path) -> str:
    """The train record's outputs key for a checkpoint's weights sha256."""
    return "weights_sha256" if checkpoint_kind(ckpt) in (FULL, FULL_SHARDED) else "adapter_sha256"


def weights_record(ckpt: Path) -> dict[str, str]:
    """What the train record's outputs hold about a checkpoint's weights: its sha256 under the kind's key."""
    return {weights_key(ckpt): sha256_file(weights_path(ckpt))}


def require_weights(ckpt: Path) -> None:
    """Refuse a checkpoint whose weights file is missing (an adapter_config.json alone is not a checkpoint)."""
    path = weights_path(ckpt)
    if not path.is_file():
        raise QerlError(f"checkpoint {ckpt} has no {path.relative_to(ckpt)}: the checkpoint is incomplete; pick "
                        "another with --checkpoint step_N or --checkpoint base")


def verify_weights(run: RunDir, ckpt: Path) -> None:
    """Refuse a checkpoint whose weights no longer have the sha256 the manifest's train record holds for it
    (only the checkpoint that record names has one; older step_N are not hashed)."""
    outputs = (run.record("train") or {}).get("outputs", {})
    recorded = outputs.get(weights_key(ckpt))
    path = weights_path(ckpt)
    if recorded and outputs.get("checkpoint") == run.rel(ckpt) and sha256_file(path) != recorded:
        raise QerlError(f"{path} does not match the sha256 the manifest recorded for it (corrupted or replaced): "
                        "evaluate another --checkpoint step_N or train again")
