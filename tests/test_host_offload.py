"""HostOffloadAdamW against torch.optim.AdamW, bit for bit (CPU): several steps over several buckets and two
parameter groups with a changing learning rate and weight decay, and a resume through state_dict() in both
directions (tests/test_memory_plan.py trains 2 steps with the state offloaded vs on the device); the state prepared
in a background thread (prepare_state) and the moments lent to a reader that step() waits for (lend_state; a
trainer's background checkpoint through it: tests/test_checkpointing.py)."""

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


# ---- the state prepared in the background, and the moments lent to a checkpoint writer ------------------------
def _prepared(params: list[torch.nn.Parameter], **kw) -> HostOffloadAdamW:
    opt = HostOffloadAdamW(_groups(params), betas=(0.9, 0.99), eps=1e-8, **kw)
    opt.prepare_state()
    return opt


def test_prepared_state_is_what_adamws_lazy_init_creates() -> None:
    """Right after prepare_state(): the state dict has AdamW's keys, shapes and dtypes (those of an AdamW after a
    step) with AdamW's initial values (step 0, zero moments); after a step both are equal bit for bit."""
    ref_p, off_p = _params(), _params()
    ref = _run(torch.optim.AdamW, ref_p, range(1))
    off = _prepared(off_p, bucket_bytes=1024)
    sd_ref, sd_off = ref.state_dict(), off.state_dict()
    assert off._preparing is None  # state_dict() joined the thread
    assert sd_ref["param_groups"] == sd_off["param_groups"]
    assert sd_ref["state"].keys() == sd_off["state"].keys() == set(range(len(off_p)))
    for i, s in sd_ref["state"].items():
        assert list(s) == list(sd_off["state"][i]) == ["step", "exp_avg", "exp_avg_sq"]
        for k, v in s.items():
            got = sd_off["state"][i][k]
            assert (got.shape, got.dtype, got.device) == (v.shape, v.dtype, v.device), (i, k)
            assert torch.equal(got, torch.zeros_like(got))
    _run(HostOffloadAdamW, off_p, range(1), opt=off)
    _same(ref_p, off_p)
    sd_off = off.state_dict()
    for i, s in ref.state_dict()["state"].items():
        _same(list(s.values()), list(sd_off["state"][i].values()))


@pytest.mark.parametrize("foreach", [None, True])
def test_bit_identical_to_adamw_after_prepare_state(foreach) -> None:
    ref_p, off_p = _params(), _params()
    ref = _run(torch.optim.AdamW, ref_p, range(6), foreach=foreach)
    off = _run(HostOffloadAdamW, off_p, range(6), opt=_prepared(off_p, bucket_bytes=1024, foreach=foreach))
    _same(ref_p, off_p)
    _same(_moments(ref, ref_p), _moments(off, off_p))
    assert float(off.state[off_p[2]]["step"]) == 5.0  # prepared at 0, skipped in the step without a gradient


def test_a_parameter_without_a_gradient_holds_adamws_initial_state() -> None:
    """AdamW has no state for a parameter that never had a gradient; the prepared one holds AdamW's initial state
    for it (step 0, zero moments), which AdamW loads and then updates exactly as its own lazy init would."""
    ref_p, off_p = _params(), _params()
    ref = torch.optim.AdamW(_groups(ref_p), betas=(0.9, 0.99), eps=1e-8)
    off = _prepared(off_p)
    for opt, ps in ((ref, ref_p), (off, off_p)):
        for step in range(2):
            _grads(ps, step)
            ps[1].grad = None
            opt.step()
    assert 1 not in ref.state_dict()["state"]
    assert float(off.state[off_p[1]]["step"]) == 0.0 and not off.state[off_p[1]]["exp_avg_sq"].any()
    _same(ref_p, off_p)
    # the prepared state in AdamW and AdamW's own go on identically, now with a gradient for parameter 1 too
    into_p = [torch.nn.Parameter(p.detach().clone()) for p in off_p]
    into = torch.optim.AdamW(_groups(into_p), betas=(0.9, 0.99), eps=1e-8)
    into.load_state_dict(off.state_dict())
    _run(torch.optim.AdamW, into_p, range(2, 5), opt=into)
    _run(torch.optim.AdamW, ref_p, range(2, 5), opt=ref)
    _same(ref_p, into_p)
    _same(_moments(ref, ref_p), _moments(into, into_p))


def test_an_older_checkpoint_loads_into_the_prepared_state_in_place() -> None:
    """A state dict of before this change (AdamW's lazy state: a parameter without a gradient has none) loads into
    the host tensors already prepared (no second allocation), the missing state is prepared again, and training
    continues as AdamW's would."""
    ref_p = _params()
    _run(torch.optim.AdamW, ref_p, range(6))
    a_p = _params()
    a = _run(torch.optim.AdamW, a_p, range(1))
    old = a.state_dict()
    del old["state"][5]  # as if parameter 5 had had no gradient yet: AdamW wrote no state for it
    b_p = [torch.nn.Parameter(p.detach().clone()) for p in a_p]
    b = _prepared(b_p, bucket_bytes=512)
    b.state_dict()  # the prepared state in place
    held = {i: b.state[p]["exp_avg"] for i, p in enumerate(b_p)}
    b.load_state_dict(old)
    assert all(b.state[b_p[i]]["exp_avg"] is held[i] for i in range(5))  # written into, not allocated again
    sd = b.state_dict()  # joins the preparation of parameter 5's state
    assert float(sd["state"][5]["step"]) == 0.0 and not sd["state"][5]["exp_avg"].any()
    for i in range(5):
        _same(list(old["state"][i].values()), list(sd["state"][i].values()))
    # AdamW resumed from the same state for reference (parameter 5 starting over at step 0, as its lazy init would)
    ref2_p = [torch.nn.Parameter(p.detach().clone()) for p in a_p]
    ref2 = torch.optim.AdamW(_groups(ref2_p), betas=(0.9, 0.99), eps=1e-8)
    ref2.load_state_dict(old)
    _run(torch.optim.AdamW, ref2_p, range(1, 6), opt=ref2)
    _run(HostOffloadAdamW, b_p, range(1, 6), opt=b)
    _same(ref2_p, b_p)
    _same(_moments(ref2, ref2_p), _moments(b, b_p))


def test_step_waits_for_the_moments_lent_to_a_reader() -> None:
    """lend_state() hands out the live moments (the very tensors state_dict() returns); step() on another thread
    does not touch them until the reader releases them, then updates them as AdamW would."""
    import threading

    ref_p, off_p = _params(), _params()
    ref = _run(torch.optim.AdamW, ref_p, range(3))
    off = _run(HostOffloadAdamW, off_p, range(2), opt=_prepared(off_p, bucket_bytes=1024))
    loan = off.lend_state()
    sd = off.state_dict()["state"]
    assert loan.ids == {id(s[k]) for s in sd.values() for k in ("exp_avg", "exp_avg_sq")}
    frozen = [t.clone() for t in _moments(off, off_p)]
    reached = threading.Event()
    off.register_step_pre_hook(lambda *_: reached.set())
    stepper = threading.Thread(target=_run, args=(HostOffloadAdamW, off_p, range(2, 3), off))
    stepper.start()
    assert reached.wait(60)
    stepper.join(0.5)
    assert stepper.is_alive()  # in step(), held by the loan
    _same(frozen, _moments(off, off_p))  # what the reader sees is still the previous step's
    loan.release()
    stepper.join(60)
    assert not stepper.is_alive() and off.last_loan_wait_s >= 0.4
    _same(ref_p, off_p)
    _same(_moments(ref, ref_p), _moments(off, off_p))
    assert off.lend_state() is not loan and off._loans  # a new loan each checkpoint
    off._loans[0].release()
