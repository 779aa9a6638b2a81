"""HostOffloadAdamW against torch.optim.AdamW, bit for bit (CPU): several steps over several buckets and two
parameter groups with a changing learning rate and weight decay, and a resume through state_dict() in both
directions (tests/test_memory_plan.py trains 2 steps with the state offloaded vs on the device)."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.train.host_offload import HostOffloadAdamW, host_state_bytes


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(32, 64), (64, 32), (7,), (128, 16), (3, 5, 2), (256,)]
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [{"params": params[:3], "lr": BASE_LR[0], "weight_decay": 0.1},
            {"params": params[3:], "lr": BASE_LR[1], "weight_decay": 0.0}]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * (1 + step)
    params[2].grad = None if step == 2 else params[2].grad  # a parameter without a gradient in one step


BASE_LR = (3e-3, 1e-2)


def _run(opt_cls, params, steps: range, opt=None, **kw):
    opt = opt or opt_cls(_groups(params), betas=(0.9, 0.99), eps=1e-8, **kw)
    for step in steps:
        for group, lr in zip(opt.param_groups, BASE_LR, strict=True):
            group["lr"] = lr / (1 + step)  # a decaying schedule, as an LR scheduler would set it
        _grads(params, step)
        opt.step()
    return opt


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def _moments(opt, params) -> list[torch.Tensor]:
    return [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")] + \
        [opt.state[p]["step"] for p in params]


@pytest.mark.parametrize("foreach", [None, True])  # None: per-tensor on CPU; True: the multi-tensor path CUDA takes
def test_bit_identical_to_adamw_over_buckets_groups_and_steps(foreach) -> None:
    ref_p, off_p = _params(), _params()
    ref = _run(torch.optim.AdamW, ref_p, range(6), foreach=foreach)
    # 1 KiB buckets: every group is split into several buckets (the largest parameter alone exceeds one)
    off = _run(HostOffloadAdamW, off_p, range(6), bucket_bytes=1024, foreach=foreach)
    assert len(off._buckets(list(off_p))) > 3
    _same(ref_p, off_p)
    _same(_moments(ref, ref_p), _moments(off, off_p))
    assert float(off.state[off_p[2]]["step"]) == 5.0  # no gradient in one step: that step was skipped
    sd_ref, sd_off = ref.state_dict(), off.state_dict()
    assert sd_ref["param_groups"] == sd_off["param_groups"]
    assert sd_ref["state"].keys() == sd_off["state"].keys()
    for k, v in sd_ref["state"].items():
        assert v.keys() == sd_off["state"][k].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert sd_off["state"][k]["exp_avg"].device.type == "cpu"
    assert host_state_bytes(off_p) == 8 * sum(p.numel() for p in off_p)


@pytest.mark.parametrize("resume_into", [HostOffloadAdamW, torch.optim.AdamW])
def test_resume_through_state_dict_continues_exactly(resume_into) -> None:
    ref_p = _params()
    _run(torch.optim.AdamW, ref_p, range(6))
    # 3 steps offloaded, the state dict deep-copied (as a checkpoint would be), then 3 more steps in a fresh
    # optimizer of either class over fresh parameter objects holding the same values
    first_p = _params()
    first = _run(HostOffloadAdamW, first_p, range(3), bucket_bytes=4096)
    saved = {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in first.state_dict()["state"].items()},
             "param_groups": first.state_dict()["param_groups"]}
    second_p = [torch.nn.Parameter(p.detach().clone()) for p in first_p]
    kw = {"bucket_bytes": 4096} if resume_into is HostOffloadAdamW else {}
    second = resume_into(_groups(second_p), betas=(0.9, 0.99), eps=1e-8, **kw)
    second.load_state_dict(saved)
    _run(resume_into, second_p, range(3, 6), opt=second)
    _same(ref_p, second_p)


def test_adamw_checkpoint_loads_into_host_offload() -> None:
    ref_p = _params()
    _run(torch.optim.AdamW, ref_p, range(6))
    a_p = _params()
    a = _run(torch.optim.AdamW, a_p, range(3))
    b_p = [torch.nn.Parameter(p.detach().clone()) for p in a_p]
    b = HostOffloadAdamW(_groups(b_p), betas=(0.9, 0.99), eps=1e-8, bucket_bytes=512)
    b.load_state_dict(a.state_dict())
    assert all(b.state[p]["exp_avg"] is not a.state[q]["exp_avg"] for p, q in zip(b_p, a_p, strict=True))
    _run(HostOffloadAdamW, b_p, range(3, 6), opt=b)
    _same(ref_p, b_p)


def test_refuses_what_it_does_not_implement() -> None:
    with pytest.raises(ValueError, match="amsgrad"):
        HostOffloadAdamW(_params(), amsgrad=True)
    with pytest.raises(ValueError, match="bucket_bytes"):
        HostOffloadAdamW(_params(), bucket_bytes=0)
