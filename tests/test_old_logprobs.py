"""pi_old without a pass of its own: with one optimizer step per batch, the update forward's detached log-probs are
pi_old. The loss, every adapter gradient, the mismatch and IS-weight metrics and the entropy must equal the path
that recomputes pi_old in a separate no-grad pass, for token- and sequence-level corrections alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_cli.bench.shapes import get_shape
from qerl_cli.bench.step import _synthetic_task, build_shape_model, synthetic_prompts, synthetic_reward
from qerl_cli.manifest import RunDir
from qerl_cli.train.config import TrainConfig
from qerl_cli.train.trainer import Trainer

STEP_KEYS = ("loss", "clip_ratio", "sampling/k1", "sampling/k3", "sampling/max_abs_dprob", "entropy",
             "sampling/is_weight_mean", "sampling/is_weight_max", "sampling/is_masked_frac", "grad_norm")


def _one_step(run: Path, recompute: bool, **over: object) -> tuple[dict, dict[str, torch.Tensor]]:
    spec = get_shape("tiny")
    cfg = TrainConfig(batch_prompts=2, num_generations=3, max_completion_length=5, lora_rank=4, precision="fp32",
                      lr=1e-2, steps=1, aqn=True, aqn_stages=1, log_rollouts=False, seed=4, micro_batch_size=2,
                      recompute_logprobs=recompute, **over)
    t = Trainer(RunDir(run), cfg, device="cpu")
    t.setup(model=build_shape_model(spec, "bf16", torch.device("cpu"), torch.float32, seed=0), tokenizer=None,
            task=_synthetic_task(2, 6, 5), prompt_ids=synthetic_prompts(2, 6, spec.vocab, 0),
            reward_fn=synthetic_reward(0))
    grads: dict[str, torch.Tensor] = {}
    for name, p in t.model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, n=name: grads.__setitem__(n, grads.get(n, 0) + g.detach().clone()))
    metrics = t.train_step()
    return metrics, grads


@pytest.mark.parametrize("over", [dict(algo="grpo"), dict(algo="dapo", correction="token_tis"),
                                  dict(algo="gspo", correction="seq_mis", correction_cap=1.5),
                                  dict(algo="grpo", correction="geo_mis", beta=0.05)],
                         ids=["grpo", "dapo-token_tis", "gspo-seq_mis", "grpo-geo_mis-beta"])
def test_update_forward_gives_pi_old_exactly(tmp_path: Path, over: dict) -> None:
    ref, ref_grads = _one_step(tmp_path / "recompute", True, **over)
    own, own_grads = _one_step(tmp_path / "own", False, **over)
    assert ref["batch/loss_tokens"] > 0 and ref_grads
    for key in STEP_KEYS:
        if key in ref:
            assert own[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), key
    assert set(own_grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(own_grads[name], g, rtol=1e-6, atol=1e-9, msg=name)
    assert any(g.abs().sum() > 0 for g in ref_grads.values())


def test_no_pi_old_pass_runs_unless_needed(tmp_path: Path) -> None:
    """The recompute phase is entered either way (its time is ~0 without a pass); what counts is that no pi_old
    forward runs in it: the log-prob forwards of the step are those of the update alone."""
    calls: list[bool] = []
    import qerl_cli.train.updater as trainer_module  # the update side runs the log-prob forwards

    real = trainer_module.sampled_logprobs

    def counting(*args: object, **kw: object) -> object:
        calls.append(torch.is_grad_enabled())
        return real(*args, **kw)

    trainer_module.sampled_logprobs = counting
    try:
        _one_step(tmp_path / "own", False)
        no_grad_own = calls.count(False)
        calls.clear()
        _one_step(tmp_path / "recompute", True)
        no_grad_recompute = calls.count(False)
    finally:
        trainer_module.sampled_logprobs = real
    assert (no_grad_own, no_grad_recompute) == (0, 3)  # 6 sequences in micro-batches of 2
