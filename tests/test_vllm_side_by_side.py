"""scripts/vllm_side_by_side.py (issue 25): the builtin engine's memory fraction from the memory plan, vLLM's share
beside the resident model, the cells and the time guard. Arithmetic only (no model is built): the whole script on
CPU (`--shape tiny --engines builtin`) takes ~35 s here and is run by hand (docs/vllm.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from torch import nn

from qerl_cli.rollout.kv_cache import KVBudget, activation_reserve

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
H100 = int(79.6 * GIB)  # what torch reports for an 80 GB H100 (docs/benchmarks.md's cap)


@pytest.fixture(scope="module")
def sbs():
    spec = importlib.util.spec_from_file_location("vllm_side_by_side", ROOT / "scripts" / "vllm_side_by_side.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Shape(nn.Module):
    """Stands in for the random model: its config, no tensors (``module_bytes`` 0)."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        from qerl_cli.bench.shapes import get_shape

        self.config = get_shape(shape).config()
        self.qerl_format = "nvfp4"


def _engine_fit(plan: dict, util: float, batch: int, max_len: int, model: nn.Module) -> int:
    """The slots the builtin engine's own budget (kv_cache.kv_budget) gives with ``util``, once the shadows and the
    kernels' derived data are in use as the fraction assumed."""
    c = model.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    hd = c.hidden_size // heads
    reserve = activation_reserve(hidden=c.hidden_size, intermediate=c.intermediate_size, heads=heads, kv_heads=kv,
                                 head_dim=hd, layers=c.num_hidden_layers, vocab=c.vocab_size, elem=2,
                                 prefill_tokens=8192, slots=batch)
    cache_len = -(-max_len // 64) * 64
    per_slot = 2 * c.num_hidden_layers * cache_len * kv * hd * 2
    in_use = plan["in_use"] + plan["lora_shadows"] + plan["kernel_derived_pending"]
    return KVBudget(total=plan["total"], utilization=util, in_use=in_use, reserve=reserve, per_slot=per_slot,
                    max_len=cache_len).fit


@pytest.mark.parametrize(("batch", "max_len"), [(8, 512), (64, 512), (8, 1280)])
def test_builtin_fraction_holds_the_cells_batch_beside_32b_weights(sbs, batch, max_len) -> None:
    model = _Shape("qwen2.5-32b")
    resident = int(24.4 * GIB)  # 19.25 GiB NVFP4 weights + 3.6 derived scales + 1.0 LoRA fp32 + context
    # before the first forward (kernel data pending) and after it (resident, counted in use)
    for in_use, allocated in ((int(20.8 * GIB), 0), (resident, resident)):
        util, plan = sbs.builtin_memory_fraction(model, batch, max_len, 32, total=H100, in_use=in_use,
                                                 allocated=allocated)
        assert plan["fits"] and util <= 0.98
        assert _engine_fit(plan, util, batch, max_len, model) >= batch
        # the old fixed 0.3: no room for even one slot beside the resident 32B model
        assert _engine_fit(plan, 0.3, batch, max_len, model) < 1
    assert plan["kernel_derived_pending"] == 0
    assert 3.5 * GIB < sbs.builtin_memory_fraction(model, batch, max_len, 32, total=H100, in_use=resident,
                                                   allocated=0)[1]["kernel_derived_pending"] < 3.8 * GIB


def test_builtin_fraction_refuses_what_cannot_fit(sbs) -> None:
    util, plan = sbs.builtin_memory_fraction(_Shape("qwen2.5-32b"), 256, 4096, 32, total=H100,
                                             in_use=int(24.4 * GIB), allocated=int(24.4 * GIB))
    assert not plan["fits"] and util == 0.98  # 256 x 4096 tokens: 256 GiB of KV cache


def test_vllm_fraction_beside_the_resident_model(sbs) -> None:
    free = H100 - int(24.4 * GIB)  # the 32B model + adapter stay resident while vLLM starts
    util, plan = sbs.vllm_memory_fraction(0.5, free, H100)
    assert util == 0.5 and not plan["lowered"]
    util, plan = sbs.vllm_memory_fraction(0.8, free, H100)  # 63.7 GiB asked, 55.2 free: vLLM would refuse
    assert plan["lowered"] and util == pytest.approx((free - GIB) / H100)


def test_cells_and_args(sbs) -> None:
    a = sbs.parse_args(["--out", "x", "--shape", "qwen2.5-32b"])
    assert a.modes == ["fixed", "eos", "long"] and a.long_batches == [8] and a.ckpt == "/tmp/qerl_sbs_qwen2.5-32b"
    assert sbs.plan_cells(a.batches, a.modes + ["queue"], a.long_batches) == [
        (8, "fixed"), (64, "fixed"), (8, "eos"), (64, "eos"), (8, "long"), (64, "queue")]


def test_builtin_cells_leave_vllm_its_turn(sbs) -> None:
    assert sbs.may_start_builtin(286, [], [], 170)  # 170 + (40 + 5) + 60 + 10
    assert not sbs.may_start_builtin(284, [], [], 170)
    # the first cell's wall (70 s, kernel compiles) is not the guess once another ran: 170 + 16 + 25 + 25 + 45 + 10
    assert sbs.may_start_builtin(292, [70.0, 45.0], [11.0, 20.0], 170)
    assert not sbs.may_start_builtin(290, [70.0, 45.0], [11.0, 20.0], 170)
    assert sbs.may_start_builtin(71, [], [], None) and not sbs.may_start_builtin(69, [], [], None)  # builtin only
