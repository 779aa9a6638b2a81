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

Every kind also holds the trainer state as ``trainer_state.safetensors`` + ``trainer_state.json`` (optimizer,
scheduler, scaler, RNG, data order, AQN and, with ``--rollout-quant int8 --requant-scales fixed``, the FlashRL
fixed INT8 scales under ``rollout_quant``: calibration state, not weights, so they add no kind; written and read
by qerl_cli/statefile.py, no pickle), ``config.json`` (the run's TrainConfig) and, written last,
``checkpoint.json``: the checkpoint's record, with the sha256 and size of every other file in it.

Nothing a checkpoint holds is trusted unread: :func:`verify_checkpoint` checks every file against the record
(and the record against the manifest's copy, for the checkpoint the train record names) before `--resume`,
`qerl eval` or `qerl report` use it; a damaged one is refused with one line naming the file and the newest
checkpoint that still verifies. Checkpoints of older qerl versions (no record, ``trainer_state.pt``) are read
with ``torch.load(weights_only=True)`` and an allow-list of the numpy types their RNG state needs.

Writes are staged: the checkpoint is written into a temporary sibling and renamed whole; the `latest`
pointer is written last, so a crash at any point leaves the previous checkpoint as the one resumed.

Background writes (:class:`CheckpointWriter`): the trainer copies the adapter, optimizer, scheduler,
scaler and RNG state to host memory at the step boundary (:class:`HostSnapshot`; the next step updates the
live tensors in place), then a thread serialises that copy, hashes the files it wrote into the record, and
follows the same staged-directory / `latest`-last protocol while the next step runs. AdamW moments that already
live in host memory (train/host_offload.py) are not copied: the writer reads the live tensors, and the
optimizer's next step waits until the writer has serialised them (``state_written``). One write is in flight
at a time; the trainer waits for it before it logs the next step, so a metrics line of step N+1 always means
step N's checkpoint is complete.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qerl_cli.errors import OutsideRunError, QerlError
from qerl_cli.manifest import (
    RunDir,
    atomic_write_json,
    atomic_write_text,
    now_iso,
    read_regular,
    read_regular_text,
    sha256_file,
    staged_directory,
)
from qerl_cli.runlayout import checkpoints_dir
from qerl_cli.statefile import StateFileError, read_state, state_paths, write_state

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
TRAINER_STATE = "trainer_state"  # trainer_state.safetensors + trainer_state.json (qerl_cli/statefile.py)
LEGACY_TRAINER_STATE_FILE = "trainer_state.pt"  # before the record: read with torch.load(weights_only=True)
CONFIG_FILE = "config.json"
RECORD_FILE = "checkpoint.json"  # written last: every other file's sha256 and size
RECORD_FORMAT = "qerl-checkpoint"
RECORD_VERSION = 1
ROLLOUT_QUANT_KEY = "rollout_quant"  # FlashRL's state (fixed INT8 scales) inside the trainer state
ABANDONED_PREFIX = "checkpoints.abandoned-"  # train/checkpoints.abandoned-<time>/: what --resume-from set aside


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


class NoCheckpointError(QerlError):
    """The run has no training checkpoint yet (`--resume` then starts over; `qerl eval` says how to get one)."""


def list_checkpoints(run: RunDir, kind: str | None = None) -> dict[int, Path]:
    """Complete checkpoints by step, ascending (only those of `kind` when given); a step_N that is a symbolic
    link leading out of the run is refused."""
    root = checkpoints_dir(run)
    if not root.is_dir():
        return {}
    out = {}
    for p in root.iterdir():
        step = checkpoint_step(p)
        if step is not None:
            p = run.inside(p)
        found = checkpoint_kind(p) if step is not None and p.is_dir() else None
        if found is not None and (kind is None or found == kind):
            out[step] = p
    return dict(sorted(out.items()))


def _named_step(run: RunDir, name: str, option: str) -> int:
    """The step a ``step_N`` names: a bare name, or a path (absolute or from the working directory) to a step_N
    folder in this run's checkpoints; anything else is refused, so ``/elsewhere/step_8`` never stands for this run's
    step_8."""
    ref = Path(name)
    step = checkpoint_step(ref)
    if step is None:
        raise QerlError(f"{option} must be latest, base or step_N, not {name!r}")
    if name == ref.name:
        return step
    try:
        folder = ref.expanduser().absolute().parent.resolve()
        here = folder == checkpoints_dir(run).resolve()
    except (OSError, RuntimeError, ValueError):  # a NUL byte, a loop of links
        here = False
    if not here:
        raise QerlError(f"{option} {name} is not in this run's checkpoints ({checkpoints_dir(run)}): give a "
                        f"checkpoint of --run {run.path} by its name, e.g. {option} {checkpoint_name(step)}")
    return step


def resolve_checkpoint(run: RunDir, name: str, option: str = "--checkpoint") -> Path | None:
    """`latest`, `step_N` (or a path to one in this run) or `base` (None: the base model alone), confined to the
    run with every file in it. Raises a clear error for a missing one (NoCheckpointError: the run has none);
    ``option`` names the command-line option in a refusal."""
    if name == "base":
        return None
    ckpts = list_checkpoints(run)
    if name == "latest":
        target = read_latest(run)
        if target is not None and checkpoint_kind(target) is not None:
            return run.inside_tree(target)
        if ckpts:
            return run.inside_tree(ckpts[max(ckpts)])
        raise NoCheckpointError(f"run {run.path} has no training checkpoint: run `qerl train --run {run.path}` first "
                                "or pass --checkpoint base")
    step = _named_step(run, name, option)
    if step not in ckpts:
        have = ", ".join(checkpoint_name(s) for s in ckpts) or "none"
        raise QerlError(f"checkpoint {name} does not exist in {checkpoints_dir(run)} (have: {have})")
    return run.inside_tree(ckpts[step])


def read_latest(run: RunDir) -> Path | None:
    """The checkpoint folder `latest` names (None: no `latest` file). qerl writes a bare ``step_N`` there; anything
    else (an absolute path, ``..``) is refused with one line, never followed."""
    pointer = run.inside(checkpoints_dir(run) / LATEST_FILE)
    try:
        text = read_regular(pointer).decode(errors="replace").strip()  # a FIFO there is refused, not waited on
    except FileNotFoundError:
        return None
    if checkpoint_step(Path(text)) is not None and Path(text).name == text:
        return run.inside(pointer.parent / text)  # a step_N that is a link out of the run is named as such
    try:
        run.inside(pointer.parent / text)
        why = "not the name of a checkpoint beside it (step_N)"
    except OutsideRunError:
        why = f"a path that leads outside the run directory {run.path}"
    raise OutsideRunError(f"{pointer} holds {text!r}, {why}: qerl writes a bare step_N there and follows nothing "
                          "else; write the newest step_N into it or delete it (qerl then takes the newest checkpoint)")


def latest_step(run: RunDir) -> int | None:
    """The step of the checkpoint `--resume` continues from (None: no checkpoint yet)."""
    try:
        ckpt = resolve_checkpoint(run, "latest")
    except NoCheckpointError:
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


class HostSnapshot:
    """Host copies of a checkpoint's tensors taken without stopping the device, for a background write.

    A device tensor is copied into a pinned host buffer with a non-blocking copy queued on the current stream: the
    copies run in stream order before the next step's kernels (which change the adapters and AdamW's moments in
    place), and the writer thread waits for their event before it reads the buffers. The buffers are kept for the
    next checkpoint (same names, shapes and dtypes), so the host allocates them once; the caller waits for the
    previous write before it takes a new snapshot. Host tensors are cloned, except those ``take`` is told are lent
    (offloaded AdamW moments, :meth:`HostOffloadAdamW.lend_state`): cloning those was 2.2 s of 10 GB on the step's
    critical path at Qwen3-30B-A3B, and their owner already guarantees they stay unchanged until the writer
    releases them.
    """

    def __init__(self) -> None:
        self._pinned: dict[str, torch.Tensor] = {}
        self._preparing: threading.Thread | None = None

    def prepare(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Allocate the pinned buffers of the keys a later :meth:`take` copies (:func:`snapshot_specs`) in a
        background thread. Pinning host memory runs at 1-3 GB/s: the first checkpoint of a mixture of experts'
        adapter (1.29 B LoRA parameters + AdamW's moments at Qwen3-30B-A3B r32, 15.4 GB) spent 9-10 s allocating
        them on the step's critical path (docs/moe.md); here that happens while the first step runs. Keys
        :meth:`take` never asks for only cost host memory; a shape that differs is allocated again there."""
        def alloc() -> None:
            for key, (shape, dtype) in specs.items():
                if key not in self._pinned:
                    self._pinned[key] = torch.empty(shape, dtype=dtype, pin_memory=True)

        if specs and torch.cuda.is_available():
            self._preparing = threading.Thread(target=alloc, name="qerl-pin", daemon=True)
            self._preparing.start()

    def _prepared(self) -> None:
        if self._preparing is not None:  # the buffers are read and replaced here: never while the thread fills them
            self._preparing.join()
            self._preparing = None

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cuda":
            return t.to("cpu", copy=True)
        self._prepared()
        buf = self._pinned.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._pinned[key] = buf
        return buf.copy_(t, non_blocking=True)

    def take(self, obj: Any, key: str = "", lent: Collection[int] = frozenset()) -> Any:
        """``obj`` (nested dicts, lists, tuples of tensors and plain values) with every tensor copied to the host,
        but host tensors whose ``id`` is in ``lent``, which are handed on as they are (their owner keeps them
        unchanged until the writer is done with them)."""
        if isinstance(obj, torch.Tensor):
            if id(obj) in lent and obj.device.type == "cpu":
                return obj
            return self._copy(key, obj)
        if isinstance(obj, dict):
            return {k: self.take(v, f"{key}/{k}", lent) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.take(v, f"{key}/{i}", lent) for i, v in enumerate(obj))
        return obj

    @staticmethod
    def ready() -> Callable[[], None]:
        """A wait for the copies queued so far (called on the writer thread before it reads the buffers)."""
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return lambda: None
        event = torch.cuda.Event()
        event.record()
        return event.synchronize


def snapshot_specs(adapter: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer
                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) of every device tensor a LoRA checkpoint's :meth:`HostSnapshot.take` will copy, under its
    keys: ``adapter/NAME`` for ``adapter`` (``lora_state_dict``: the experts' ``ParamWrapper`` factors included) and
    ``state/optimizer/state/I/exp_avg|exp_avg_sq`` for AdamW's moments of the I-th parameter (the shape and dtype of
    the parameter; torch.optim.AdamW only: other optimizers keep their state elsewhere, e.g. in host memory)."""
    specs = {f"adapter/{k}": (tuple(v.shape), v.dtype) for k, v in adapter.items() if v.device.type == "cuda"}
    if type(optimizer) is torch.optim.AdamW:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for i, p in enumerate(params):
            if p.device.type == "cuda":
                for moment in ("exp_avg", "exp_avg_sq"):
                    specs[f"state/optimizer/state/{i}/{moment}"] = (tuple(p.shape), p.dtype)
    return specs


def adapter_snapshot(peft_model: Any) -> dict[str, torch.Tensor]:
    """The LoRA tensors of ``peft_model.state_dict()`` (its key names), copied to host memory."""
    from qerl_cli.lora import lora_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in lora_state_dict(peft_model).items()}


# ---- write -----------------------------------------------------------------------------------------------
def save_checkpoint(run: RunDir, step: int, peft_model: Any, state: dict[str, Any], config: dict[str, Any],
                    keep: int, *, full_weights: Mapping[str, torch.Tensor] | None = None,
                    adapter_state: dict[str, torch.Tensor] | None = None,
                    rng: dict[str, Any] | None = None,
                    weights_writer: Callable[[Path], None] | None = None,
                    state_written: Callable[[], None] | None = None) -> Path:
    """Write `step_N` of one kind, move `latest` to it, then prune to `keep` per kind.

    ``full_weights`` (name -> tensor) makes it a FULL checkpoint; otherwise it is an ADAPTER one, written
    from ``adapter_state`` (from :func:`adapter_snapshot`: a background write saves the state of the step it
    was taken at) or from the live ``peft_model``. ``rng`` replaces the current RNG state the same way.
    ``state`` may hold the FlashRL state under ROLLOUT_QUANT_KEY (read back by :func:`rollout_quant_state`).
    ``weights_writer(staging_dir)`` makes it a FULL_SHARDED checkpoint: it writes the weights (and the sharded
    optimizer state) into the staging directory, together with the other ranks (train/fsdp.py).
    ``state_written()`` is called once the trainer state's file is written: a background write's signal that the
    live tensors it was lent (offloaded AdamW moments) may change again, before the slower hashing and renames.
    """
    final = checkpoint_path(run, step)
    if weights_writer is None and full_weights is None and adapter_state is None:
        adapter_state = adapter_snapshot(peft_model)
    # the last line of defence against a NaN/inf update (the trainer stops at the step itself): never a checkpoint
    # that `latest`, --resume and `qerl eval` would take for a good one (sharded weights are checked per rank there)
    refuse_nonfinite(run, step, full_weights if full_weights is not None else adapter_state)
    from qerl_cli.manifest import write_errors

    with write_errors(final.parent):
        final.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(final) as tmp:
        if weights_writer is not None:
            weights_writer(tmp)
        elif full_weights is not None:
            write_full_weights(tmp, full_weights)
        else:
            peft_model.save_pretrained(str(tmp / ADAPTER_DIR), state_dict=adapter_state)
        write_state(tmp, TRAINER_STATE, {**state, "rng": rng if rng is not None else rng_state(), "step": step})
        if state_written is not None:
            state_written()
        atomic_write_json(tmp / CONFIG_FILE, config)
        write_record(tmp, step)  # last: it hashes what was written above (in this thread, for a background write)
    write_latest(run, step)
    prune_checkpoints(run, keep)
    return final


def first_nonfinite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or inf, or None."""
    return next((name for name, t in tensors.items() if not _finite(t)), None)


def refuse_nonfinite(run: RunDir, step: int, weights: Mapping[str, torch.Tensor] | None) -> None:
    """Refuse to write checkpoint ``step`` from weights holding NaN or inf; `latest` stays where it is."""
    bad = first_nonfinite(weights) if weights is not None else None
    if bad is None:
        return
    newest = latest_step(run)
    kept = f"{checkpoint_name(newest)} stays the newest checkpoint" if newest is not None else "no checkpoint exists"
    raise QerlError(f"{checkpoint_name(step)} was not written: its weights hold NaN or inf ({bad}), the sign of a "
                    f"diverged update (check --lr and any non-finite option); {kept}")


def write_record(ckpt: Path, step: int) -> dict[str, Any]:
    """Hash every file of a (staged) checkpoint into its ``checkpoint.json``; the record written."""
    files = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != RECORD_FILE):
        rel = path.relative_to(ckpt).as_posix()
        files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    record = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "step": step, "kind": checkpoint_kind(ckpt),
              "written": now_iso(), "files": files}
    atomic_write_json(ckpt / RECORD_FILE, record)
    return record


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


class CheckpointSink:
    """Where a run's checkpoints go: its run directory, the background writer and its reused host copies, and what
    the last write cost (seconds, and by part for a background write: its critical path). One object the training
    mode writes through and the update side waits on (a non-finite step names the checkpoint that stays newest
    only once the write in flight is complete)."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.writer = CheckpointWriter()
        self.snapshot = HostSnapshot()
        self.last_checkpoint_s = 0.0
        self.last_checkpoint_parts: dict[str, float] = {}

    def wait(self) -> Path | None:
        """Wait for the write in flight; its checkpoint (None if none was in flight)."""
        return self.writer.wait()


# ---- verify ----------------------------------------------------------------------------------------------
class CheckpointDamaged(QerlError):
    """A checkpoint file that is missing, truncated, changed since it was written, or unreadable."""

    def __init__(self, ckpt: Path, path: Path, why: str) -> None:
        super().__init__(f"{path} {why}")
        self.ckpt, self.path, self.why = ckpt, path, why


def read_record(ckpt: Path) -> dict[str, Any] | None:
    """A checkpoint's ``checkpoint.json`` (None: an older qerl wrote the checkpoint without one)."""
    path = ckpt / RECORD_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(read_regular_text(path))
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(ckpt, path, f"is unreadable ({type(exc).__name__})") from exc
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise CheckpointDamaged(ckpt, path, "is not a qerl checkpoint record")
    if not isinstance(record.get("version"), int) or record["version"] > RECORD_VERSION:
        raise CheckpointDamaged(ckpt, path, f"has record version {record.get('version')!r}, which this qerl does not "
                                            f"read ({RECORD_VERSION}): upgrade qerl")
    files = record.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) and isinstance(v.get("sha256"), str)
                                              and isinstance(v.get("bytes"), int) for v in files.values()):
        raise CheckpointDamaged(ckpt, path, "is not a complete checkpoint record")
    return record


def required_files(ckpt: Path, record: dict[str, Any] | None) -> list[str]:
    """The files (relative to the checkpoint) a record must list: the weights eval reads and the trainer state
    resume reads. An older checkpoint without a record needs only its weights here (eval reads nothing else;
    resume's reader refuses a missing trainer state itself)."""
    weights = weights_path(ckpt).relative_to(ckpt).as_posix()
    kind_files = [weights] + ([f"{ADAPTER_DIR}/adapter_config.json"] if checkpoint_kind(ckpt) == ADAPTER else [])
    if record is None:
        return kind_files
    return [*kind_files, *(p.name for p in state_paths(ckpt, TRAINER_STATE)), CONFIG_FILE]


def verify_checkpoint(run: RunDir, ckpt: Path) -> dict[str, Any] | None:
    """Check every file of a checkpoint against its record: present, its recorded size and sha256, and the
    record itself equal to the manifest's copy when the train record names this checkpoint. Returns the record
    (None for an older checkpoint without one: its weights are then checked against the manifest's sha256
    where it has one, and opened to see that they are whole). Raises CheckpointDamaged naming the first bad
    file."""
    run.inside_tree(ckpt)
    record = read_record(ckpt)
    if record is not None:
        files = record["files"]
        for rel in required_files(ckpt, record):
            if rel not in files:
                raise CheckpointDamaged(ckpt, ckpt / RECORD_FILE, f"does not list {rel}")
        for rel, want in files.items():
            path = ckpt / rel
            if ".." in Path(rel).parts or Path(rel).is_absolute():
                raise CheckpointDamaged(ckpt, ckpt / RECORD_FILE, f"names a file outside the checkpoint ({rel})")
            if not path.is_file():
                raise CheckpointDamaged(ckpt, path, "is missing")
            size = path.stat().st_size
            if size != want["bytes"]:
                raise CheckpointDamaged(ckpt, path, f"has {size} bytes, not the {want['bytes']} written (truncated "
                                                    "or replaced)")
            if sha256_file(path) != want["sha256"]:
                raise CheckpointDamaged(ckpt, path, "does not match the sha256 recorded when it was written "
                                                    "(corrupted or replaced)")
        outputs = _manifest_outputs_for(run, ckpt)
        manifest_files = outputs.get("checkpoint_files")
        weights = weights_path(ckpt).relative_to(ckpt).as_posix()
        if (manifest_files and manifest_files != {rel: v["sha256"] for rel, v in files.items()}) or (
                outputs.get(weights_key(ckpt)) not in (None, files.get(weights, {}).get("sha256"))):
            raise CheckpointDamaged(ckpt, ckpt / RECORD_FILE, "does not match the copy in the manifest's train record "
                                                              "(replaced)")
        check_weights(ckpt)
        return record
    if state_paths(ckpt, TRAINER_STATE)[1].exists():  # written by this qerl, which always writes the record
        raise CheckpointDamaged(ckpt, ckpt / RECORD_FILE, "is missing")
    for rel in required_files(ckpt, None):
        if not (ckpt / rel).is_file():
            raise CheckpointDamaged(ckpt, ckpt / rel, "is missing (the checkpoint is incomplete)")
    path = weights_path(ckpt)
    recorded = _manifest_outputs_for(run, ckpt).get(weights_key(ckpt))
    if recorded and sha256_file(path) != recorded:
        raise CheckpointDamaged(ckpt, path, "does not match the sha256 the manifest recorded for it (corrupted or "
                                            "replaced)")
    check_weights(ckpt)
    return None


def _manifest_outputs_for(run: RunDir, ckpt: Path) -> dict[str, Any]:
    outputs = (run.record("train") or {}).get("outputs", {})
    return outputs if outputs.get("checkpoint") == run.rel(ckpt) else {}


def weight_files(ckpt: Path) -> list[Path]:
    """The safetensors files holding a checkpoint's trained weights (a sharded one: every rank's rows)."""
    if checkpoint_kind(ckpt) == FULL_SHARDED:
        return sorted(ckpt.glob(f"{SHARDED_WEIGHTS_STEM}-r*.safetensors"))
    return [weights_path(ckpt)]


def check_weights(ckpt: Path) -> None:
    """Open every weights file and look at every value: a header that does not parse (a file crafted or damaged
    with its hash updated to match) or a NaN/inf from a diverged update is CheckpointDamaged, so every reader
    refuses it and points to the newest checkpoint that passes."""
    from safetensors import SafetensorError, safe_open

    for path in weight_files(ckpt):
        try:
            with safe_open(str(path), framework="pt") as f:
                bad = next((k for k in f.keys() if not _finite(f.get_tensor(k))), None)
        except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointDamaged(ckpt, path, f"is unreadable ({why})") from exc
        if bad is not None:
            raise CheckpointDamaged(ckpt, path, f"holds NaN or inf ({bad}): the update that wrote it diverged")


def _finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


def newest_intact(run: RunDir, *, skip: Path | None = None) -> Path | None:
    """The newest checkpoint that verifies (``skip``: one already found damaged), or None."""
    for _step, ckpt in sorted(list_checkpoints(run).items(), reverse=True):
        if skip is not None and ckpt == skip:
            continue
        try:
            verify_checkpoint(run, ckpt)
        except CheckpointDamaged:
            continue
        return ckpt
    return None


def how_to_use(run: RunDir, ckpt: Path, use: str) -> str:
    """How a command continues with another checkpoint: the flag to pass (``use``: resume, eval or report)."""
    name = ckpt.name
    if use == "eval":
        return f"evaluate it with --checkpoint {name}"
    resume = f"`qerl train --run {run.path} --resume-from {name}` continues from it (later checkpoints are moved aside)"
    if use == "report":
        return f"{resume}, or move the damaged checkpoint out of {checkpoints_dir(run)} to write the report"
    return resume


def damaged_message(run: RunDir, err: CheckpointDamaged, use: str) -> str:
    """One line: the damaged file, and the newest checkpoint that verifies with the flag that uses it."""
    other = newest_intact(run, skip=err.ckpt)
    if other is None:
        fallback = "--checkpoint base scores the base model" if use == "eval" else \
            "train again in a new --run directory"
        return f"{err}: no other checkpoint in {checkpoints_dir(run)} verifies; {fallback}"
    return f"{err}: the newest intact checkpoint is {other.name}; {how_to_use(run, other, use)}"


def require_intact(run: RunDir, ckpt: Path, use: str) -> dict[str, Any] | None:
    """:func:`verify_checkpoint`, with a damaged checkpoint turned into the one line ``use`` prints."""
    try:
        return verify_checkpoint(run, ckpt)
    except CheckpointDamaged as err:
        raise QerlError(damaged_message(run, err, use)) from err


def verify_all(run: RunDir) -> list[dict[str, Any]]:
    """Every checkpoint verified (`qerl report`): step, kind, files, bytes and whether a record covered them.
    Raises the one line of :func:`damaged_message` at the first damaged one."""
    rows = []
    for step, ckpt in list_checkpoints(run).items():
        record = require_intact(run, ckpt, "report")
        files = record["files"] if record else {}
        rows.append({"step": step, "kind": checkpoint_kind(ckpt), "files": len(files),
                     "bytes": sum(v["bytes"] for v in files.values()), "sha256_verified": record is not None})
    return rows


# ---- read ------------------------------------------------------------------------------------------------
def _legacy_allow_list() -> list[Any]:
    """What an older ``trainer_state.pt`` holds besides tensors and plain values: numpy's RNG state array."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint (optimizer, scheduler, ..., "step", "config"), read without running
    anything it holds: safetensors + JSON, or an older ``trainer_state.pt`` through ``weights_only=True``.
    Callers verify the checkpoint first (:func:`require_intact`)."""
    legacy = path / LEGACY_TRAINER_STATE_FILE
    if not state_paths(path, TRAINER_STATE)[1].exists() and legacy.exists():
        import pickle

        try:
            with torch.serialization.safe_globals(_legacy_allow_list()):
                state = torch.load(legacy, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, TypeError, AttributeError,
                KeyError, IndexError) as exc:
            raise CheckpointDamaged(path, legacy, "holds something other than tensors and plain values, or is "
                                                  "damaged: it is not read (reading it could run code)") from exc
    else:
        try:
            state = read_state(path, TRAINER_STATE)
        except StateFileError as exc:
            raise CheckpointDamaged(path, path, f"has an unreadable trainer state ({exc})") from exc
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointDamaged(path, path, "has a trainer state without its step")
    return state


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


# what `--finetune full` leaves frozen (train/full_finetune.py): a FULL checkpoint holds every other parameter
FROZEN = ("embed_tokens", "lm_head")


def trained_names(model: nn.Module) -> set[str]:
    """The parameters --finetune full trains and a FULL checkpoint holds (all but the embeddings / lm_head)."""
    return {n for n, _ in model.named_parameters() if not any(part in FROZEN for part in n.split("."))}


@torch.no_grad()
def load_weights(model: nn.Module, ckpt: Path) -> None:
    """Put a FULL checkpoint's trained weights into `model` (`qerl eval`: no masters, no grads)."""
    params = dict(model.named_parameters())
    for name, t in read_full_weights(ckpt, trained_names(model)).items():
        params[name].copy_(t)  # copy_ casts the fp32 masters to the model's dtype


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
    """Put a checkpoint's trained weights on a freshly loaded base (`qerl eval`; verified by the caller).

    Returns (model, adapter_info, weights_info): an ADAPTER checkpoint wraps the model in peft
    (adapter_info: path and LoRA settings); a FULL one copies its weights into the model in place
    (weights_info: path and sha256)."""
    if checkpoint_kind(ckpt) in (FULL, FULL_SHARDED):
        load_weights(model, ckpt)
        path = weights_path(ckpt)
        return model, None, {"path": run.rel(path), "sha256": weights_sha256(ckpt)}
    from qerl_cli.lora import adapter_summary, load_adapter

    adapter_dir = ckpt / ADAPTER_DIR
    model = load_adapter(model, adapter_dir)
    return model, {"path": run.rel(adapter_dir), **adapter_summary(adapter_dir)}, None


def weights_key(ckpt: Path) -> str:
    """The train record's outputs key for a checkpoint's weights sha256."""
    return "weights_sha256" if checkpoint_kind(ckpt) in (FULL, FULL_SHARDED) else "adapter_sha256"


def weights_sha256(ckpt: Path) -> str:
    """The sha256 of a checkpoint's weights file: from its record (hashed when written), else computed."""
    record = read_record(ckpt)
    rel = weights_path(ckpt).relative_to(ckpt).as_posix()
    if record is not None and rel in record["files"]:
        return record["files"][rel]["sha256"]
    return sha256_file(weights_path(ckpt))


def weights_record(ckpt: Path) -> dict[str, str]:
    """What the train record's outputs hold about a checkpoint's weights: its sha256 under the kind's key."""
    return {weights_key(ckpt): weights_sha256(ckpt)}


def checkpoint_outputs(run: RunDir, ckpt: Path) -> dict[str, Any]:
    """The train record's outputs for the checkpoint it names: path, the weights' sha256 and (from the
    checkpoint's record) every file's sha256, so the manifest holds its own copy to check the record against."""
    record = read_record(ckpt)
    files = {rel: v["sha256"] for rel, v in record["files"].items()} if record else {}
    return {"checkpoint": run.rel(ckpt), **weights_record(ckpt), **({"checkpoint_files": files} if files else {})}


# ---- --resume-from: later checkpoints set aside ------------------------------------------------------------
def abandoned_dir(run: RunDir) -> Path:
    """A new ``train/checkpoints.abandoned-<time>/`` for what `--resume-from` sets aside (never deleted)."""
    base = checkpoints_dir(run).parent / f"{ABANDONED_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def set_aside_checkpoints_after(run: RunDir, step: int, dest: Path) -> list[str]:
    """Move every checkpoint (complete or not) after ``step`` into ``dest`` and point `latest` at step_N."""
    moved = []
    root = checkpoints_dir(run)
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        later = checkpoint_step(p)
        if later is not None and later > step and p.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.move(str(p), str(dest / p.name))
            moved.append(p.name)
    write_latest(run, step)
    return moved
