"""A failure says what failed and why: no bare ``next()`` over a generator (a budget-dependent list that holds
nothing gives a message-less StopIteration, recorded as ``error: StopIteration``), bucket look-ups that name
what needed how much, and a KV budget that says why fewer slots than asked fit."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qerl_cli.errors import QerlError
from qerl_cli.rollout.kv_cache import KVBudget, bucket_for

ROOT = Path(__file__).resolve().parents[1]


def test_no_bare_next_over_a_generator() -> None:
    bare = []
    for path in sorted([*(ROOT / "qerl_cli").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "next"
                    and len(node.args) == 1 and isinstance(node.args[0], ast.GeneratorExp)):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bare, f"next(<generator>) without a default raises a message-less StopIteration: {bare}"


def test_bucket_for_names_what_needed_how_much() -> None:
    assert bucket_for([128, 256, 513], 129, "kv") == 256
    assert bucket_for([1, 2, 4, 5], 5, "batch") == 5
    with pytest.raises(QerlError, match=r"^decode batch: needs 8, the largest is 5$"):
        bucket_for([1, 2, 4, 5], 8, "decode batch")


def test_kv_budget_says_why_fewer_slots_fit() -> None:
    gib = 2**30
    # an 80 GB card at utilization 0.9: 72 GiB, of which 61 GiB in use and 2 GiB kept for activations leave
    # 9 GiB, i.e. 28 slots of 0.3125 GiB (1280 tokens of a 32B-like model's K/V)
    b = KVBudget(total=80 * gib, utilization=0.9, in_use=61 * gib, reserve=2 * gib, per_slot=gib * 5 // 16,
                 max_len=1280)
    assert b.budget == 9 * gib and b.fit == 28
    assert b.describe() == ("61.0 GiB in use (weights, adapters, optimizer) and 2.0 GiB kept for activations, of "
                            "0.9 x 80.0 GiB, leave KV room for 28 sequences of 1280 tokens (0.312 GiB each)")
    assert KVBudget(total=80 * gib, utilization=0.5, in_use=61 * gib, reserve=0, per_slot=gib, max_len=8).fit == 0
