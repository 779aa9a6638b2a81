"""The benches' grids of TrainConfig overrides: ``--grid key=v1,v2`` axes and their cells.

A ``--set key=value`` and each grid value are parsed by ``qerl_cli.train.config.parse_value`` (the one parser of
``qerl train --set`` and the benches), so fields added to TrainConfig later work here without touching the benches.
"""

from __future__ import annotations

import itertools
import typing
from collections.abc import Iterable
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.train.config import TrainConfig, field_types, parse_value, split_optional, split_pair


def _valid_list() -> str:
    return ", ".join(sorted(field_types()))


def parse_grid(items: Iterable[str] | None, formats: Iterable[str]) -> dict[str, list[Any]]:
    """``["format=bf16,nvfp4", "aqn=false,true"]`` -> axes in the order given.

    ``format`` is the quantized-model format (checked against ``formats``); every other key is a
    TrainConfig field whose values are parsed to its type. List-typed fields cannot be grid axes.
    """
    fmts = tuple(formats)
    axes: dict[str, list[Any]] = {}
    for item in items or ():
        key, value = split_pair(item, "--grid")
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
        if typing.get_origin(split_optional(types_[key])[0]) is list:
            raise QerlError(f"--grid axis {key!r} is a list option; set it once with --set instead")
        axes[key] = list(dict.fromkeys(parse_value(key, v, "--grid") for v in values))
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
