"""qerl_cli/statefile.py: nested training state as safetensors + JSON. It round-trips everything a trainer state
holds bit for bit (an optimizer restored from it continues exactly), and reading a crafted file runs nothing."""

from __future__ import annotations

import json
import math
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qerl_cli.statefile import StateFileError, flatten_state, read_state, state_paths, unflatten_state, write_state


def _adamw_after(steps: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def test_every_kind_of_trainer_state_round_trips_exactly(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32)
    state = {
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "floats": [math.nan, math.inf, -math.inf, -0.0, 1 / 3, 1e-300],
        "dtypes": [torch.randn(5).bfloat16(), torch.randn(4).to(torch.float8_e4m3fn), torch.tensor([True, False]),
                   torch.tensor(7, dtype=torch.int64)],
        "views": [base[:6], base[6:], base.view(3, 4).t()],  # share one storage; safetensors needs copies
        "int_keys": {0: {"step": torch.tensor(3.0)}, 5: None}, "__dunder": "kept",
        "scaler": {}, "data": {"epoch": 2, "index": 11}, "big": 2**70, "numpy_scalars": [np.float64(2.5), np.int64(7)],
        "fixed_scales": {"model.layers.0.mlp.down_proj": torch.tensor([0.25, 0.5])},  # dotted names stay keys
    }
    written = write_state(tmp_path, "s", state)
    assert written == list(state_paths(tmp_path, "s")) and all(p.is_file() for p in written)
    out = read_state(tmp_path, "s")

    assert out["rng"]["python"] == state["rng"]["python"] and isinstance(out["rng"]["python"][1], tuple)
    random.setstate(out["rng"]["python"])  # the types the RNG setters insist on came back
    np.random.set_state(out["rng"]["numpy"])
    assert out["rng"]["numpy"][0] == "MT19937" and out["rng"]["numpy"][1].dtype == np.uint32
    assert np.array_equal(out["rng"]["numpy"][1], state["rng"]["numpy"][1]) and out["rng"]["numpy"][2:] == \
        state["rng"]["numpy"][2:]
    assert torch.equal(out["rng"]["torch"], state["rng"]["torch"])
    f = out["floats"]
    assert math.isnan(f[0]) and f[1:3] == [math.inf, -math.inf] and math.copysign(1, f[3]) == -1
    assert f[4] == 1 / 3 and f[5] == 1e-300  # repr reads back to the same bits
    for a, b in zip(out["dtypes"], state["dtypes"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(out["views"], state["views"], strict=True))
    assert list(out["int_keys"]) == [0, 5] and torch.equal(out["int_keys"][0]["step"], torch.tensor(3.0))
    assert out["__dunder"] == "kept" and out["scaler"] == {} and out["data"] == {"epoch": 2, "index": 11}
    assert out["big"] == 2**70 and out["numpy_scalars"] == [2.5, 7]
    assert torch.equal(out["fixed_scales"]["model.layers.0.mlp.down_proj"], torch.tensor([0.25, 0.5]))
    # the tensors are named by their path; the JSON is strict (no NaN literals) and holds no tensor bytes
    tensors, _ = flatten_state(state)
    assert "int_keys/0/step" in tensors and "rng/numpy/1" in tensors
    assert "NaN" not in state_paths(tmp_path, "s")[1].read_text()


def test_an_optimizer_and_scheduler_restored_from_it_continue_bit_identically(tmp_path: Path) -> None:
    model, opt, sched = _adamw_after(3)
    write_state(tmp_path, "t", {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()})
    # a fresh model with the same weights, restored optimizer and scheduler, against the original going on
    twin, opt2, sched2 = _adamw_after(0, seed=1)
    twin.load_state_dict(model.state_dict())
    saved = read_state(tmp_path, "t")
    opt2.load_state_dict(saved["optimizer"])
    sched2.load_state_dict(saved["scheduler"])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.99) and sched2.last_epoch == 3
    for _ in range(2):
        x = torch.randn(5, 4)
        for m, o, s in ((model, opt, sched), (twin, opt2, sched2)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
            s.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_unplaceable_values_are_refused_when_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="function"):
        flatten_state({"lr_lambda": lambda s: s})
    with pytest.raises(TypeError, match="dtype object"):
        flatten_state({"a": np.array([object()], dtype=object)})
    assert not any(tmp_path.iterdir())


class _CreatesAFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204 - unpickling this calls os.system
        return os.system, (f"touch {self.path}",)


def test_crafted_state_files_are_refused_and_run_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"optimizer": _CreatesAFile(marker)})
    good = tmp_path / "good"
    good.mkdir()
    write_state(good, "s", {"a": torch.ones(2), "b": 1})
    tensors_path, json_path = state_paths(good, "s")

    def case(name: str, tensors: bytes | None = None, doc: object | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / tensors_path.name).write_bytes(tensors if tensors is not None else tensors_path.read_bytes())
        (d / json_path.name).write_text(json_path.read_text() if doc is None else json.dumps(doc))
        return d

    valid = json.loads(json_path.read_text())
    cases = {
        "pickle as tensors": case("a", tensors=payload),
        "pickle as json": case("b", tensors=None, doc=None),
        "unknown tag": case("c", doc={**valid, "state": {"__reduce__": ["os.system", ["touch x"]]}}),
        "missing tensor": case("d", doc={**valid, "state": {"a": {"__tensor__": "nope"}}}),
        "unused tensor": case("e", doc={**valid, "state": {"b": 1}}),
        "object ndarray": case("f", doc={**valid, "state": {"a": {"__ndarray__": "a", "dtype": "|O"}, "b": 1}}),
        "not ours": case("g", doc={"state": {}}),
    }
    (cases["pickle as json"] / json_path.name).write_bytes(payload)
    for what, d in cases.items():
        with pytest.raises(StateFileError) as err:
            read_state(d, "s")
        assert str(d) in str(err.value), what
    assert not marker.exists()
    # the same payload hidden in the safetensors header's metadata is never unpickled either
    from safetensors.torch import save_file

    d = tmp_path / "h"
    d.mkdir()
    save_file({"a": torch.ones(2)}, str(d / tensors_path.name), metadata={"format": payload.hex()})
    (d / json_path.name).write_text(json.dumps({**valid, "state": {"a": {"__tensor__": "a"}}}))
    assert torch.equal(read_state(d, "s")["a"], torch.ones(2)) and not marker.exists()
    assert unflatten_state({"x": [1, {"__tuple__": [2.5]}]}, {}) == {"x": [1, (2.5,)]}
