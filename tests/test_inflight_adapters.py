"""New adapters installed between decode windows (the asynchronous rollout ranks of --rollout-gpus).

The builtin engine polls ``adapter_updates`` after every decode window; a newer version is copied into the LoRA
shadows in place and the running sequences' later tokens sample from it. Checked against the peft model's own
teacher-forced log-probs under the old and the new factors: tokens before the change are the old policy's, a
sequence admitted after it (or a prompt's later samples, whose kept prefill is dropped and recomputed) is the new
policy's from its first token, every sample carries the versions of its first and last token, and the shadows keep
their addresses (captured CUDA graphs stay valid).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qerl_cli.rollout import BuiltinEngine, SamplingParams
from tests.test_fast_decode import PROMPTS, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[])
TOL = 1e-4  # fp32 throughout; the peft forward in float64 log-softmax differs by <= 3e-5 (GEMM order)


def _factors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _load(model: nn.Module, factors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in factors:
                p.copy_(factors[n])


def _teacher_forced(model: nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].double(), -1)
    return logp[len(prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0].float()


def _matching_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    close = (a - b).abs() < TOL
    return int(close.long().cumprod(0).sum())


def _swap_engine(model: nn.Module, new: dict[str, torch.Tensor], at_window: int, slots: int
                 ) -> tuple[BuiltinEngine, list[int]]:
    engine = BuiltinEngine(model, None, max_batch_slots=slots, max_model_len=64)
    engine.generate([[60]], GREEDY)  # warm: the plan and its shadows exist before the measured call
    calls = [0]

    def updates() -> tuple[int, None] | None:
        calls[0] += 1
        if calls[0] != at_window:
            return None
        _load(model, new)  # what AdapterSubscriber.apply does: the factors, in place
        return 1, None

    engine.adapter_updates = updates
    return engine, calls


def test_adapters_change_between_decode_windows() -> None:
    model = tiny()
    old = _factors(model)
    new = {n: t + 0.3 * torch.randn_like(t) for n, t in old.items()}
    # 3 slots for 4 prompts: the 4th is admitted when the first sequence stops, after the change at window 3
    engine, _ = _swap_engine(model, new, at_window=3, slots=3)
    shadows = [t.data_ptr() for g in engine.runner.plan.groups() for t in g.shadows()]
    result = engine.generate(PROMPTS, GREEDY)
    assert [t.data_ptr() for g in engine.runner.plan.groups() for t in g.shadows()] == shadows

    want_old, want_new = [], []
    _load(model, old)
    for s in result.samples:
        want_old.append(_teacher_forced(model, s.prompt_token_ids, s.token_ids))
    _load(model, new)
    for s in result.samples:
        want_new.append(_teacher_forced(model, s.prompt_token_ids, s.token_ids))

    mixed = after = 0
    for s, lo, ln in zip(result.samples, want_old, want_new, strict=True):
        n = len(s.token_ids)
        if s.policy_version == 0:
            # admitted under version 0: its first tokens are the old policy's, exactly
            k = _matching_prefix(s.logprobs, lo)
            assert k >= 3, (s.prompt_index, k)  # the change came after 3 windows of one token each (CPU)
            if s.policy_version_last == 0:
                assert k == n
            else:
                assert s.policy_version_last == 1 and k < n  # later tokens saw the new adapters
                mixed += 1
        else:
            # admitted after the change: the new policy's from its prompt's prefill on
            assert (s.policy_version, s.policy_version_last) == (1, 1)
            assert _matching_prefix(s.logprobs, ln) == n
            after += 1
    assert mixed >= 1 and after >= 1


def test_a_kept_prefill_is_recomputed_after_a_change() -> None:
    """n=3 samples on 2 slots: the prompt's third sample waits on a kept prefill (the stash); a change before it is
    admitted drops that prefill, and the third sample starts from a prefill under the new adapters."""
    model = tiny()
    old = _factors(model)
    new = {n: t + 0.3 * torch.randn_like(t) for n, t in old.items()}
    engine, _ = _swap_engine(model, new, at_window=1, slots=2)
    _load(model, old)
    sampling = SamplingParams(n=3, temperature=0.0, max_tokens=4, stop_token_ids=[])
    result = engine.generate([[5, 17, 3]], sampling)
    third = [s for s in result.samples if s.sample_index == 2]
    assert len(third) == 1 and (third[0].policy_version, third[0].policy_version_last) == (1, 1)
    _load(model, new)
    s = third[0]
    assert _matching_prefix(s.logprobs, _teacher_forced(model, s.prompt_token_ids, s.token_ids)) == len(s.token_ids)
    assert engine.adapter_version == 1


def test_without_updates_nothing_changes() -> None:
    model = tiny()
    plain = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64).generate(PROMPTS, GREEDY)
    polled = BuiltinEngine(model, None, max_batch_slots=3, max_model_len=64)
    polled.adapter_updates = lambda: None
    got = polled.generate(PROMPTS, GREEDY)
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in plain.samples]
    assert all(s.policy_version is None for s in plain.samples)
    assert all((s.policy_version, s.policy_version_last) == (0, 0) for s in got.samples)
