"""Row-sharded tensors on disk: every rank writes the rows it holds, any number of ranks reads them back.

FSDP2 shards each parameter (and its AdamW moments) along dim 0: rank r of W holds rows
[r * c, min(n, (r + 1) * c)) with c = ceil(n / W) (torch.chunk's split, DTensor's ``Shard(0)``). A
checkpoint of that state is written here without gathering anything: each rank saves its rows as
safetensors files (``STEM-rRRRRR-PPP.safetensors``, at most ``max_file_bytes`` each, so host memory holds
one file's tensors at a time), and rank 0 writes ``STEM.index.json``:

    {"format": "qerl-row-shards", "version": 1, "world_size": W,
     "files": {"STEM-r00000-000.safetensors": "<sha256>", ...},
     "tensors": {"model.layers.0.mlp.up_proj.weight": {"shape": [n, k], "dtype": "float32",
                 "pieces": [[start, stop, "STEM-r00000-000.safetensors"], ...]}, ...},
     "meta": {...}}                     # JSON the caller adds (optimizer param groups, steps)

Reading needs only the index: :class:`ShardReader` returns any row range of any tensor, taking the rows
from whichever files hold them (safetensors slices: only those bytes are read), so a checkpoint written on
N ranks loads on M (each new rank reads its own new rows) or whole (``qerl eval``). Every file is checked
against the sha256 in the index the first time it is opened, and the index itself is what the manifest
hashes, so one recorded sha256 pins every byte. Nothing here unpickles: safetensors and JSON only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.manifest import atomic_write_json, read_regular_text, sha256_file

FORMAT = "qerl-row-shards"
VERSION = 1
INDEX_SUFFIX = ".index.json"
MAX_FILE_BYTES = 2 * 2**30
_FILE_RE = re.compile(r"^[A-Za-z0-9_.-]+-r\d{5}-\d{3}\.safetensors$")


@dataclass
class RowShard:
    """One rank's rows of a tensor: ``tensor`` holds global rows [start, start + len(tensor)) of ``shape``."""

    tensor: torch.Tensor
    start: int
    shape: tuple[int, ...]


def chunk_rows(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the rows rank ``rank`` of ``world_size`` holds of a dim-0 size ``n`` (torch.chunk's split;
    trailing ranks may hold none)."""
    size = -(-n // world_size) if n else 0
    start = min(rank * size, n)
    return start, min(start + size, n)


def index_path(directory: Path, stem: str) -> Path:
    return Path(directory) / f"{stem}{INDEX_SUFFIX}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_rank(directory: Path, stem: str, rank: int, shards: Mapping[str, RowShard],
               max_file_bytes: int = MAX_FILE_BYTES) -> dict[str, Any]:
    """Write this rank's rows of every tensor into ``directory``; returns its part of the index (for
    :func:`write_index` on rank 0): the files with their sha256 and each tensor's shape, dtype and rows."""
    from safetensors.torch import save_file

    directory = Path(directory)
    files: dict[str, str] = {}
    tensors: dict[str, dict[str, Any]] = {}
    batch: dict[str, torch.Tensor] = {}
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if not batch:
            return
        name = f"{stem}-r{rank:05d}-{len(files):03d}.safetensors"
        save_file(batch, str(directory / name), metadata={"format": FORMAT, "rank": str(rank)})
        files[name] = sha256_file(directory / name)
        for key in batch:
            tensors[key]["file"] = name
        batch, batch_bytes = {}, 0

    for key, shard in shards.items():
        t = shard.tensor
        if t.dim() == 0 or len(shard.shape) == 0:
            raise QerlError(f"{key}: a 0-dim tensor has no rows to shard; store it in the index meta")
        if tuple(t.shape[1:]) != tuple(shard.shape[1:]) or not 0 <= shard.start <= shard.start + t.shape[0] \
                <= shard.shape[0]:
            raise QerlError(f"{key}: rows [{shard.start}, {shard.start + t.shape[0]}) of shape {tuple(t.shape)} do "
                            f"not fit the global shape {tuple(shard.shape)}")
        tensors[key] = {"shape": list(shard.shape), "dtype": _dtype_name(t.dtype),
                        "rows": [shard.start, shard.start + t.shape[0]], "file": None}
        if t.shape[0] == 0:
            continue
        if batch and batch_bytes + t.numel() * t.element_size() > max_file_bytes:
            flush()
        batch[key] = t.detach().to("cpu").contiguous()
        batch_bytes += t.numel() * t.element_size()
    flush()
    return {"rank": rank, "files": files, "tensors": tensors}


def write_index(directory: Path, stem: str, parts: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> Path:
    """Rank 0: merge every rank's :func:`write_rank` part into ``STEM.index.json``; each tensor's rows must
    tile [0, n) exactly, with one shape and dtype across ranks."""
    files: dict[str, str] = {}
    merged: dict[str, dict[str, Any]] = {}
    for part in sorted(parts, key=lambda p: p["rank"]):
        files.update(part["files"])
        for key, e in part["tensors"].items():
            m = merged.setdefault(key, {"shape": e["shape"], "dtype": e["dtype"], "pieces": []})
            if m["shape"] != e["shape"] or m["dtype"] != e["dtype"]:
                raise QerlError(f"{key}: ranks disagree on its shape/dtype ({m['shape']} {m['dtype']} vs "
                                f"{e['shape']} {e['dtype']}); report this")
            start, stop = e["rows"]
            if stop > start:
                m["pieces"].append([start, stop, e["file"]])
    for key, m in merged.items():
        m["pieces"].sort()
        pos = 0
        for start, stop, _ in m["pieces"]:
            if start != pos:
                raise QerlError(f"{key}: the ranks' rows do not tile the tensor (gap or overlap at row {pos}); "
                                "report this")
            pos = stop
        if pos != m["shape"][0]:
            raise QerlError(f"{key}: the ranks wrote {pos} of its {m['shape'][0]} rows; report this")
    path = index_path(directory, stem)
    atomic_write_json(path, {"format": FORMAT, "version": VERSION, "world_size": len(parts), "files": files,
                             "tensors": merged, "meta": meta or {}})
    return path


@dataclass
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    pieces: list[tuple[int, int, str]]


class ShardReader:
    """Rows of the tensors in ``STEM.index.json`` (any range, from whichever files hold them).

    Each file is verified against the index's sha256 when it is first opened (``verify=False`` skips it:
    the caller checked them all already). Use as a context manager, or call :meth:`close`."""

    def __init__(self, directory: Path, stem: str, *, verify: bool = True) -> None:
        self.directory = Path(directory)
        self.path = index_path(self.directory, stem)
        self.verify = verify
        try:
            raw = json.loads(read_regular_text(self.path))
        except (OSError, ValueError) as exc:
            raise QerlError(f"{self.path} is unreadable ({exc}): resume from another checkpoint") from exc
        try:
            if raw.get("format") != FORMAT or int(raw.get("version", 0)) > VERSION:
                raise ValueError(f"not a {FORMAT} v{VERSION} index")
            self.files: dict[str, str] = {str(k): str(v) for k, v in raw["files"].items()}
            self.meta: dict[str, Any] = dict(raw.get("meta") or {})
            self.world_size = int(raw["world_size"])
            self.tensors: dict[str, TensorEntry] = {
                str(k): TensorEntry(tuple(int(x) for x in e["shape"]), str(e["dtype"]),
                                    [(int(a), int(b), str(f)) for a, b, f in e["pieces"]])
                for k, e in raw["tensors"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise QerlError(f"{self.path} is not a sharded-checkpoint index ({exc}): it was not written by qerl "
                            "or is damaged") from exc
        for name in self.files:
            if not _FILE_RE.match(name):  # names come from a file on disk: never a path outside the directory
                raise QerlError(f"{self.path} names a shard file {name!r} that qerl does not write")
        for key, e in self.tensors.items():
            if any(f not in self.files for _, _, f in e.pieces):
                raise QerlError(f"{self.path}: {key} points to a file the index does not list")
        self._open: dict[str, Any] = {}

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._open.clear()

    def verify_all(self) -> None:
        """Check every file against its sha256 (``qerl eval`` reads everything anyway)."""
        for name in self.files:
            self._handle(name)

    def _handle(self, name: str) -> Any:
        h = self._open.get(name)
        if h is None:
            from safetensors import safe_open

            path = self.directory / name
            if not path.is_file():
                raise QerlError(f"{path} is missing: the checkpoint is incomplete; resume from another one")
            if self.verify and sha256_file(path) != self.files[name]:
                raise QerlError(f"{path} does not match the sha256 its index recorded (corrupted or replaced): "
                                "resume from another checkpoint")
            h = self._open[name] = safe_open(str(path), framework="pt", device="cpu")
        return h

    def entry(self, key: str) -> TensorEntry:
        e = self.tensors.get(key)
        if e is None:
            raise QerlError(f"{self.path} holds no tensor {key}: the checkpoint belongs to another model")
        return e

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of ``key`` (a CPU tensor of the saved dtype)."""
        e = self.entry(key)
        if not 0 <= start <= stop <= e.shape[0]:
            raise QerlError(f"{key}: rows [{start}, {stop}) are outside its {e.shape[0]} rows")
        parts = []
        for a, b, f in e.pieces:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                parts.append(self._handle(f).get_slice(key)[lo - a:hi - a])
        if not parts:
            dtype = getattr(torch, e.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise QerlError(f"{self.path}: {key} has an unknown dtype {e.dtype!r}")
            return torch.empty((0, *e.shape[1:]), dtype=dtype)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if tuple(out.shape) != (stop - start, *e.shape[1:]):
            raise QerlError(f"{key}: the shard files hold shape {tuple(out.shape)} where the index says "
                            f"{(stop - start, *e.shape[1:])}; the checkpoint is damaged")
        return out

    def full(self, key: str) -> torch.Tensor:
        return self.rows(key, 0, self.entry(key).shape[0])

    def keys(self) -> Iterator[str]:
        return iter(self.tensors)


__all__ = ["FORMAT", "INDEX_SUFFIX", "MAX_FILE_BYTES", "RowShard", "ShardReader", "chunk_rows", "index_path",
           "write_index", "write_rank"]
