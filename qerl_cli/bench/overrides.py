"""Generic TrainConfig overrides for benches: ``--set key=value`` and ``--grid key=v1,v2``.

Values are parsed to the field's declared type, so fields added to TrainConfig later (FlashRL's
``finetune``, ``rollout_quant``, ...) work here without touching the benches. ``null`` means None for
optional fields; for optional non-string fields ``none`` does too (string fields keep ``"none"``: it is
a real value of ``correction`` and ``scale_rewards``).
"""

from __future__ import annotations

import dataclasses
import itertools
import types
import typing
from collections.abc import Iterable
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.train.config import TrainConfig

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def field_types() -> dict[str, Any]:
    """TrainConfig field name -> resolved type annotation."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _valid_list() -> str:
    return ", ".join(sorted(field_types()))


def _split_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def parse_value(key: str, text: str) -> Any:
    """Parse ``text`` to the type of TrainConfig field ``key`` (QerlError naming the field if it cannot)."""
    types_ = field_types()
    if key not in types_:
        raise QerlError(f"unknown train option {key!r}; valid options: {_valid_list()}")
    tp, optional = _split_optional(types_[key])
    t = text.strip()
    if optional and (t.lower() == "null" or (t.lower() == "none" and tp is not str)):
        return None
    try:
        if tp is bool:
            if t.lower() in _TRUE:
                return True
            if t.lower() in _FALSE:
                return False
            raise ValueError(t)
        if tp is int:
            return int(t)
        if tp is float:
            return float(t)
        if tp is str:
            return t
        if typing.get_origin(tp) is list:
            return [x.strip() for x in t.split(",") if x.strip()]
    except ValueError:
        raise QerlError(f"{key}={text!r}: expected {getattr(tp, '__name__', tp)}") from None
    raise QerlError(f"{key} has type {tp} that --set cannot parse")


def _split_pair(item: str, flag: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise QerlError(f"{flag} {item!r}: expected KEY=VALUE")
    return key, value


def parse_sets(items: Iterable[str] | None) -> dict[str, Any]:
    """``["lr=1e-4", "aqn=true"]`` -> ``{"lr": 1e-4, "aqn": True}`` (types from TrainConfig)."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, value = _split_pair(item, "--set")
        out[key] = parse_value(key, value)
    return out


def parse_grid(items: Iterable[str] | None, formats: Iterable[str]) -> dict[str, list[Any]]:
    """``["format=bf16,nvfp4", "aqn=false,true"]`` -> axes in the order given.

    ``format`` is the quantized-model format (checked against ``formats``); every other key is a
    TrainConfig field whose values are parsed to its type. List-typed fields cannot be grid axes.
    """
    fmts = tuple(formats)
    axes: dict[str, list[Any]] = {}
    for item in items or ():
        key, value = _split_pair(item, "--grid")
        if key in axes:
            raise QerlError(f"--grid axis {key!r} given twice: list its values once, comma-separated")
        values = [v.strip() for v in value.split(",") if v.strip()]
        if not values:
            raise QerlError(f"--grid {key}= has no values: give them comma-separated, e.g. {key}=a,b")
        if key == "format":
            bad = [v for v in values if v not in fmts]
            if bad:
                raise QerlError(f"--grid format: unknown format(s) {', '.join(bad)}; choose from {', '.join(fmts)}")
            axes[key] = list(dict.fromkeys(values))
            continue
        types_ = field_types()
        if key not in types_:
            raise QerlError(f"--grid axis {key!r} is neither 'format' nor a train option; valid options: "
                            f"{_valid_list()}")
        if typing.get_origin(_split_optional(types_[key])[0]) is list:
            raise QerlError(f"--grid axis {key!r} is a list option; set it once with --set instead")
        axes[key] = list(dict.fromkeys(parse_value(key, v) for v in values))
    return axes


def grid_cells(axes: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The cartesian product of the axes, first axis slowest; one empty cell when there are no axes."""
    keys = list(axes)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(axes[k] for k in keys))]


def build_bench_config(defaults: dict[str, Any], overrides: dict[str, Any]) -> TrainConfig:
    """TrainConfig from a bench's defaults with the user's overrides on top, validated."""
    data = {**defaults, **overrides}
    unknown = sorted(set(data) - set(field_types()))
    if unknown:
        raise QerlError(f"unknown train option(s) {', '.join(unknown)}; valid options: {_valid_list()}")
    cfg = TrainConfig(**data)
    cfg.validate()
    return cfg
