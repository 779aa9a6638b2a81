"""Issue 45's loose ends on a tiny Qwen3-MoE (CPU): the router statistics are counted once per training forward
whether activation checkpointing recomputes it or not, and a MoE adapter's checkpoint (the experts' ParamWrapper
factors) goes through the background writer and resumes bit-exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from qerl_cli.moe import moe_blocks, router_metrics
from qerl_cli.train import checkpointing as ck


def _trainer(run: Path, **over: Any) -> Any:
    from qerl_cli.bench.shapes import get_shape
    from qerl_cli.bench.step import _synthetic_task, build_shape_model, synthetic_prompts, synthetic_reward
    from qerl_cli.manifest import RunDir
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.trainer import Trainer

    spec = get_shape("tiny-moe")
    steps = over.pop("steps", 3)
    cfg = TrainConfig(**{"batch_prompts": 2, "num_generations": 2, "max_completion_length": 4, "lora_rank": 4,
                         "precision": "fp32", "lr": 1e-2, "steps": steps, "aqn": False, "log_rollouts": False,
                         "seed": 2, "micro_batch_size": 2, **over})
    t = Trainer(RunDir(run), cfg, device="cpu")
    n = cfg.batch_prompts * steps
    t.setup(model=build_shape_model(spec, "nvfp4", torch.device("cpu"), torch.float32, seed=0), tokenizer=None,
            task=_synthetic_task(n, 4, 4), prompt_ids=synthetic_prompts(n, 4, spec.vocab, 0),
            reward_fn=synthetic_reward(0))
    return t


# ---- router statistics under activation checkpointing ----------------------------------------------------------
def _router_stats(gc: bool) -> tuple[dict[str, float], list[float]]:
    """One training forward + backward of a tiny MoE with LoRA: router_metrics and every layer's token count."""
    from qerl_cli.bench.shapes import get_shape
    from qerl_cli.bench.step import build_shape_model
    from qerl_cli.lora import attach_lora, make_lora_config

    model = attach_lora(build_shape_model(get_shape("tiny-moe"), "nvfp4", torch.device("cpu"), torch.float32,
                                          seed=0), make_lora_config(4, 8, None, 0.0), seed=0)
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, get_shape("tiny-moe").vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()
    tokens = [float(b.stats["tokens"]) for b in moe_blocks(model) if b.stats is not None]
    return router_metrics(model), tokens


def test_router_statistics_are_the_same_with_gradient_checkpointing() -> None:
    """Checkpointing recomputes every layer's forward in the backward; before the fix the recompute recorded the
    routing again: 48 counted tokens per layer for 24 run (measured with the check removed). The ratios logged
    (load, aux_loss) hide it as long as the recompute routes exactly as the first forward did; where it does not
    (bf16 kernels on a GPU) the recompute's routing was mixed into the step's statistics."""
    plain, plain_tokens = _router_stats(gc=False)
    ckpt, ckpt_tokens = _router_stats(gc=True)
    assert plain_tokens == ckpt_tokens == [24.0, 24.0]  # 2 sequences x 12 tokens, each layer counted once
    assert plain.keys() == ckpt.keys() and "router/aux_loss" in plain
    for k, v in plain.items():
        assert ckpt[k] == pytest.approx(v, rel=1e-12, abs=1e-12), k


def test_in_backward_is_true_only_inside_the_autograd_engine() -> None:
    from qerl_cli.moe import in_backward

    seen: list[bool] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(in_backward()) or g)
    assert not in_backward()
    y.sum().backward()
    assert seen == [True] and not in_backward()


# ---- a MoE adapter's background checkpoint -------------------------------------------------------------------
def _adapter(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter" / "adapter_model.safetensors"))


def test_moe_adapter_checkpoint_is_written_in_the_background_and_resumes_bit_exactly(tmp_path: Path) -> None:
    t = _trainer(tmp_path / "a")
    t.train_step()
    live = {k: v.detach().clone() for k, v in t.model.named_parameters() if v.requires_grad}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in t.optimizer.state_dict()["state"].items()}
    experts = [k for k in live if ".experts." in k]
    # the experts' factors: gate_up's (the inner wrapper, base_layer) and down's, A and B, per layer
    assert len(experts) == 2 * 2 * 2 and any("experts.base_layer.lora_A" in k for k in experts)
    path = t.save(background=True)
    assert "submit" in t.checkpoints.last_checkpoint_parts  # the writer thread took it (LoraMode.save_in_background)
    t.train_step()  # moves the live adapter and moments in place while (or before) the writer writes step 1
    assert t.wait_checkpoint() == path and not t.writer.busy
    assert (path.parent / "latest").read_text().strip() == "step_1"
    now = dict(t.model.named_parameters())
    assert all(not torch.equal(live[k], now[k]) for k in experts)  # step 2 really moved every expert factor
    saved = _adapter(path)
    assert len(saved) == len(live)
    for k, v in live.items():  # step 1's values, not step 2's
        torch.testing.assert_close(saved[k.replace(".default", "")], v, rtol=0, atol=0)
    # a fresh trainer resumed from it holds step 1's adapter and AdamW moments, bit for bit
    u = _trainer(tmp_path / "a")
    assert u.resume() == 1
    resumed = dict(u.model.named_parameters())
    for k, v in live.items():
        torch.testing.assert_close(resumed[k].detach(), v, rtol=0, atol=0)
    state = u.optimizer.state_dict()["state"]
    assert state.keys() == moments.keys()
    for i, s in moments.items():
        for k, v in s.items():
            torch.testing.assert_close(state[i][k], v, rtol=0, atol=0)


def test_snapshot_specs_name_what_the_snapshot_takes(tmp_path: Path) -> None:
    """The pinned buffers prepared before the first checkpoint are the ones take() copies into: same keys, shapes and
    dtypes as the adapter (the experts' factors included) and AdamW's moments after a step. Checked on the CPU by
    walking the state as take() does, with the device test relaxed (the CPU has no pinned memory)."""
    from qerl_cli.lora import lora_state_dict

    t = _trainer(tmp_path / "s")
    t.train_step()
    adapter = lora_state_dict(t.model)
    state = {"optimizer": t.optimizer.state_dict()}
    taken: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def walk(obj: Any, key: str) -> None:  # HostSnapshot.take's keys
        if isinstance(obj, torch.Tensor):
            taken[key] = (tuple(obj.shape), obj.dtype)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}/{k}")

    walk(state, "state")
    walk(adapter, "adapter")
    cuda = torch.device("cuda")
    fake = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in adapter.items()}
    specs = ck.snapshot_specs({k: _OnDevice(v, cuda) for k, v in fake.items()}, _OptOnDevice(t.optimizer, cuda))
    moments = {k for k in taken if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert len(moments) == 2 * len(adapter) and any(".experts." in k for k in specs)
    want = moments | {k for k in taken if k.startswith("adapter/")}
    assert set(specs) == want, (sorted(set(specs) - want)[:3], sorted(want - set(specs))[:3])
    assert all(specs[k] == taken[k] for k in specs)


class _OnDevice:
    """A tensor's shape and dtype, claiming another device (snapshot_specs reads only these)."""

    def __init__(self, t: torch.Tensor, device: torch.device) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, device


def _OptOnDevice(opt: torch.optim.Optimizer, device: torch.device) -> torch.optim.AdamW:
    """An AdamW (its very type: HostOffloadAdamW, a subclass, keeps host moments) whose parameters claim ``device``."""
    view = object.__new__(torch.optim.AdamW)
    view.param_groups = [{"params": [_OnDevice(p, device) for p in g["params"]]} for g in opt.param_groups]
    return view


# ---- the recorded routing in the memory plan -------------------------------------------------------------------
def test_memory_plan_counts_the_recorded_routing() -> None:
    """Qwen3-30B-A3B at 64 sequences x 1280 tokens, micro-batch 8: the batch's routing ids on the device, int16
    [64, 1280, 48, 8] = 62.9 MB, through the update; replay_routing's int64 copy of a micro-batch's, [8 x 1280, 48,
    8] x 8 B = 31.5 MB, in the recompute and fwd_bwd. A dense model has none."""
    from qerl_cli.bench.shapes import get_shape
    from qerl_cli.train.memory_plan import plan_memory, weight_bytes
    from qerl_cli.train.model_dims import ModelDims

    cfg = get_shape("qwen3-30b-a3b").config()
    dims = ModelDims.from_config(cfg)
    kw = dict(weights=weight_bytes(cfg, "nvfp4", 2, kernels=False), capacity=None, device_total=None, elem=2,
              sequences=64, prompt_tokens=256, completion_tokens=1024, lora_rank=32,
              lora_targets=["q_proj", "gate_proj"], micro_batch_size=8)
    p = plan_memory(dims, **kw)
    assert p.routing_batch == 64 * 1280 * 48 * 8 * 2 == 62_914_560
    assert p.routing_micro == 8 * 1280 * 48 * 8 * 8 == 31_457_280
    e = p.phase_estimates()
    q = plan_memory(dims, **kw)
    q.routing_batch = q.routing_micro = 0
    f = q.phase_estimates()
    assert e["fwd_bwd"] - f["fwd_bwd"] == e["recompute"] - f["recompute"] == 62_914_560 + 31_457_280
    assert e["optimizer"] - f["optimizer"] == 62_914_560 and e["rollout"] == f["rollout"]
    dense = dataclasses_replace_dense(dims)
    assert plan_memory(dense, **kw).routing_batch == 0


def dataclasses_replace_dense(dims: Any) -> Any:
    import dataclasses

    return dataclasses.replace(dims, experts=0, top_k=0)
