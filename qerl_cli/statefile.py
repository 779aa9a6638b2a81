"""Nested state (dicts, lists, tuples of tensors, numbers, strings) <-> one safetensors file + one JSON file.

Everything a training checkpoint holds besides its weights (optimizer moments, scheduler, loss scaler, RNG
states, data position, AQN state, FlashRL's fixed scales) is a nested structure of this kind. It is stored
here, and nowhere else, without pickle: reading it back parses a JSON document and a safetensors file, so a
crafted file can at worst be refused, never run code.

``flatten_state`` splits a structure into ``name -> tensor`` (every tensor, named by its path, e.g.
``optimizer/state/0/exp_avg``) and a JSON-able *skeleton* in which each tensor is replaced by a reference
to its name. ``unflatten_state`` puts them back together. The skeleton keeps what plain JSON loses:

========================  ==================================================================
value                     skeleton
========================  ==================================================================
torch.Tensor              ``{"__tensor__": name}`` (dtype, shape and bytes exactly as saved)
numpy array (numeric)     ``{"__ndarray__": name, "dtype": "uint32"}``
tuple                     ``{"__tuple__": [...]}`` (``random.setstate`` wants tuples back)
NaN / +-inf               ``{"__float__": "nan" | "inf" | "-inf"}`` (strict JSON has none)
dict with a key that is   ``{"__items__": [[key, value], ...]}`` (optimizer state is keyed by
not a plain string        int; keys are encoded like values)
None, bool, int, float,   themselves (floats are written with ``repr``, which reads back to the
str, list, plain dict     same bits)
numpy scalar              its Python value (``.item()``)
========================  ==================================================================

Tensors come back on the CPU; the reader (``load_state_dict`` of an optimizer, AQN, ...) moves them where
they belong. Anything else (a module, a function, an object) is refused when writing: it has no place in a
state file. ``write_state`` / ``read_state`` put the two files side by side as ``STEM.safetensors`` and
``STEM.json``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qerl_cli.errors import QerlError
from qerl_cli.manifest import read_regular_text

FORMAT = "qerl-state"
VERSION = 1
TENSORS_SUFFIX = ".safetensors"
JSON_SUFFIX = ".json"

TENSOR_TAG = "__tensor__"
NDARRAY_TAG = "__ndarray__"
TUPLE_TAG = "__tuple__"
FLOAT_TAG = "__float__"
ITEMS_TAG = "__items__"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_NDARRAY_KINDS = "biuf"  # bool, signed, unsigned, float: dtypes whose bytes are plain numbers


class StateFileError(QerlError):
    """A state file that cannot be read as written by :func:`write_state` (damaged, or not ours)."""


# ---- flatten / unflatten ---------------------------------------------------------------------------------
def flatten_state(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """``(tensors, skeleton)``: every tensor of ``state`` by a unique path name, and the JSON-able rest.

    Tensors are detached, moved to the CPU and made contiguous; one that shares memory with another (a view)
    is copied, since safetensors stores each tensor's bytes once. Raises TypeError for a value with no place
    in a state file."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple[int, int]] = set()

    def add(path: str, t: torch.Tensor) -> str:
        name, n = path or "value", 1
        while name in tensors:  # "a.b" as one key and as a/b nesting could meet: names stay unique
            n += 1
            name = f"{path or 'value'}#{n}"
        t = t.detach().to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and key in storages:
            t = t.clone()
        elif t.numel():
            storages.add(key)
        tensors[name] = t
        return name

    def enc(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(f"{path or 'state'}: a {type(obj).__name__} is not a plain tensor (gather it first, "
                                "e.g. DTensor.full_tensor())")
            return {TENSOR_TAG: add(path, obj)}
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in _NDARRAY_KINDS:
                raise TypeError(f"{path or 'state'}: numpy arrays of dtype {obj.dtype} cannot be stored")
            return {NDARRAY_TAG: add(path, torch.from_numpy(np.ascontiguousarray(obj).copy())),
                    "dtype": obj.dtype.str}
        if isinstance(obj, np.generic):
            return enc(obj.item(), path)
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            if math.isfinite(obj):
                return float(obj)
            return {FLOAT_TAG: "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
        if isinstance(obj, tuple):
            return {TUPLE_TAG: [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: enc(v, f"{path}/{k}" if path else k) for k, v in obj.items()}
            return {ITEMS_TAG: [[enc_key(k, path), enc(v, f"{path}/{k}" if path else str(k))]
                                for k, v in obj.items()]}
        raise TypeError(f"{path or 'state'}: a {type(obj).__name__} has no place in a state file")

    def enc_key(k: Any, path: str) -> Any:
        if k is None or isinstance(k, (bool, int, float, str)) or (isinstance(k, tuple)):
            return enc(k, path)
        raise TypeError(f"{path or 'state'}: a dict key of type {type(k).__name__} cannot be stored")

    skeleton = enc(state, "")
    return tensors, skeleton


def unflatten_state(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The structure :func:`flatten_state` split into ``(tensors, skeleton)``. Raises StateFileError for a
    skeleton that refers to a missing tensor, leaves a tensor unused, or holds anything it would not write."""
    used: set[str] = set()

    def tensor(name: Any) -> torch.Tensor:
        if not isinstance(name, str) or name not in tensors:
            raise StateFileError(f"the state refers to a tensor {name!r} that its tensor file does not hold")
        if name in used:
            raise StateFileError(f"the state refers to tensor {name!r} twice")
        used.add(name)
        return tensors[name]

    def dec(obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        if not isinstance(obj, dict):
            raise StateFileError(f"the state holds a {type(obj).__name__}, which no state file has")
        tags = [k for k in obj if k.startswith("__")]
        if not tags:
            return {k: dec(v) for k, v in obj.items()}
        tag = tags[0]
        if tag == TENSOR_TAG and set(obj) == {TENSOR_TAG}:
            return tensor(obj[TENSOR_TAG])
        if tag == NDARRAY_TAG and set(obj) == {NDARRAY_TAG, "dtype"}:
            return ndarray(tensor(obj[NDARRAY_TAG]), obj["dtype"])
        if tag == TUPLE_TAG and set(obj) == {TUPLE_TAG} and isinstance(obj[TUPLE_TAG], list):
            return tuple(dec(v) for v in obj[TUPLE_TAG])
        if tag == FLOAT_TAG and set(obj) == {FLOAT_TAG} and obj[FLOAT_TAG] in _NONFINITE:
            return _NONFINITE[obj[FLOAT_TAG]]
        if tag == ITEMS_TAG and set(obj) == {ITEMS_TAG} and isinstance(obj[ITEMS_TAG], list):
            out = {}
            for item in obj[ITEMS_TAG]:
                if not (isinstance(item, list) and len(item) == 2):
                    raise StateFileError("the state holds a malformed dict item")
                key = dec(item[0])
                if isinstance(key, (dict, list, torch.Tensor, np.ndarray)) or (
                        isinstance(key, tuple) and not _hashable(key)):
                    raise StateFileError("the state holds a dict key that no state file has")
                out[key] = dec(item[1])
            return out
        raise StateFileError(f"the state holds an entry tagged {tag!r}, which no state file has")

    def ndarray(t: torch.Tensor, dtype: Any) -> np.ndarray:
        try:
            want = np.dtype(dtype) if isinstance(dtype, str) else None
        except TypeError:
            want = None
        if want is None or want.kind not in _NDARRAY_KINDS:
            raise StateFileError(f"the state holds a numpy array of dtype {dtype!r}, which no state file has")
        arr = t.numpy()
        if arr.dtype != want:
            raise StateFileError(f"the state's numpy array is {arr.dtype} in its tensor file but says {want}")
        return arr.copy()

    try:
        state = dec(skeleton)
    except RecursionError as exc:
        raise StateFileError("the state is nested too deeply to be one qerl wrote") from exc
    unused = set(tensors) - used
    if unused:
        raise StateFileError(f"the tensor file holds {len(unused)} tensor(s) the state does not refer to "
                             f"(e.g. {sorted(unused)[0]!r})")
    return state


def _hashable(key: tuple[Any, ...]) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


# ---- files -----------------------------------------------------------------------------------------------
def state_paths(directory: Path, stem: str) -> tuple[Path, Path]:
    """``(STEM.safetensors, STEM.json)`` in ``directory``: the two files of one state."""
    return Path(directory) / f"{stem}{TENSORS_SUFFIX}", Path(directory) / f"{stem}{JSON_SUFFIX}"


def write_state(directory: Path, stem: str, state: Any) -> list[Path]:
    """Write ``state`` as ``STEM.safetensors`` (its tensors) and ``STEM.json`` (the rest); the two paths.

    Each file is written under a temporary name and renamed into place (the JSON last), so a reader sees no
    half-written file; a checkpoint writes both inside its staged directory anyway."""
    from safetensors.torch import save_file

    from qerl_cli.manifest import atomic_write_text

    tensors_path, json_path = state_paths(directory, stem)
    tensors, skeleton = flatten_state(state)
    doc = {"format": FORMAT, "version": VERSION, "tensors": tensors_path.name, "state": skeleton}
    text = json.dumps(doc, allow_nan=False, separators=(",", ":")) + "\n"
    tmp = tensors_path.with_name(f".{tensors_path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
        os.replace(tmp, tensors_path)
    finally:
        tmp.unlink(missing_ok=True)
    atomic_write_text(json_path, text)
    return [tensors_path, json_path]


def read_state(directory: Path, stem: str) -> Any:
    """The state :func:`write_state` wrote as ``STEM.*`` in ``directory``. Nothing in the files is executed:
    a damaged or crafted file is refused with StateFileError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors_path, json_path = state_paths(directory, stem)

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not strict JSON")

    try:
        doc = json.loads(read_regular_text(json_path), parse_constant=no_constant)
    except FileNotFoundError as exc:
        raise StateFileError(f"{json_path} is missing") from exc
    except (OSError, ValueError, RecursionError) as exc:
        raise StateFileError(f"{json_path} is not a readable state file ({type(exc).__name__})") from exc
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT and isinstance(doc.get("version"), int)):
        raise StateFileError(f"{json_path} is not a qerl state file")
    if doc["version"] > VERSION:
        raise StateFileError(f"{json_path} has state format {doc['version']}, newer than this qerl reads "
                             f"({VERSION}): upgrade qerl")
    if doc.get("tensors") != tensors_path.name:
        raise StateFileError(f"{json_path} names another tensor file ({doc.get('tensors')!r})")
    try:
        tensors = load_file(str(tensors_path))
    except FileNotFoundError as exc:
        raise StateFileError(f"{tensors_path} is missing") from exc
    except (OSError, SafetensorError, ValueError) as exc:
        raise StateFileError(f"{tensors_path} is not a readable safetensors file ({exc})") from exc
    try:
        return unflatten_state(doc.get("state"), tensors)
    except StateFileError as exc:
        raise StateFileError(f"{json_path}: {exc}") from exc


__all__ = ["StateFileError", "flatten_state", "read_state", "state_paths", "unflatten_state", "write_state"]
