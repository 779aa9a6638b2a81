"""Background checkpoint writes: the write holds the state of the step it was taken at while training goes on
(with AdamW's moments in host memory too, lent to the writer rather than copied), and a process killed in the
middle of a write still has `latest` on the previous, complete checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qerl_cli.manifest import RunDir
from qerl_cli.train.checkpointing import HostSnapshot, load_checkpoint
from qerl_cli.train.host_offload import HostOffloadAdamW

TRAINER = textwrap.dedent("""
    import torch
    from qerl_cli.bench.shapes import get_shape
    from qerl_cli.bench.step import _synthetic_task, build_shape_model, synthetic_prompts, synthetic_reward
    from qerl_cli.manifest import RunDir
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.trainer import Trainer

    def make(run, steps=3, **kw):
        spec = get_shape("tiny")
        cfg = TrainConfig(batch_prompts=2, num_generations=2, max_completion_length=4, lora_rank=4, precision="fp32",
                          lr=1e-2, steps=steps, aqn=False, log_rollouts=False, seed=2, **kw)
        t = Trainer(RunDir(run), cfg, device="cpu")
        n = cfg.batch_prompts * steps
        t.setup(model=build_shape_model(spec, "bf16", torch.device("cpu"), torch.float32, seed=0), tokenizer=None,
                task=_synthetic_task(n, 4, 4), prompt_ids=synthetic_prompts(n, 4, spec.vocab, 0),
                reward_fn=synthetic_reward(0))
        return t
""")


def _make(run: Path, **kw: Any):
    ns: dict = {}
    exec(TRAINER, ns)  # noqa: S102 - the same trainer factory the killed subprocess uses
    return ns["make"](run, **kw)


def _adapter(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter" / "adapter_model.safetensors"))


def test_background_write_saves_the_step_it_was_taken_at(tmp_path: Path) -> None:
    t = _make(tmp_path / "a")
    t.train_step()
    live = {k: v.detach().clone() for k, v in t.model.named_parameters() if v.requires_grad}
    opt_before = {i: {k: v.clone() for k, v in s.items()} for i, s in t.optimizer.state_dict()["state"].items()}
    path = t.save(background=True)
    t.train_step()  # updates the live adapter and optimizer state in place while (or before) the write runs
    assert t.wait_checkpoint() == path and not t.writer.busy
    changed = {k: v for k, v in t.model.named_parameters() if v.requires_grad}
    assert any((changed[k] - live[k]).abs().max() > 0 for k in live)  # step 2 really moved the weights
    saved = _adapter(path)
    assert len(saved) == len(live) == 2 * 7 * 2  # A and B of 7 projections x 2 layers, nothing else
    for k, v in live.items():  # peft's saved name drops the adapter name ("default")
        torch.testing.assert_close(saved[k.replace(".default", "")], v, rtol=0, atol=0)
    state = load_checkpoint(path)
    assert state["step"] == 1
    for i, s in opt_before.items():
        for k, v in s.items():
            torch.testing.assert_close(state["optimizer"]["state"][i][k], v, rtol=0, atol=0)
    assert (path.parent / "latest").read_text().strip() == "step_1"
    # and a synchronous save of the same step writes the same tensors
    u = _make(tmp_path / "b")
    u.train_step()
    sync = _adapter(u.save(background=False))
    assert sync.keys() == saved.keys() and all(torch.equal(sync[k], saved[k]) for k in sync)


class _HeldSnapshot(HostSnapshot):
    """A snapshot whose host copies "land" only once ``gate`` opens: the writer thread waits there before it writes
    anything, i.e. a writer slower than the step that follows the checkpoint."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def ready(self) -> Callable[[], None]:
        landed = HostSnapshot.ready()

        def wait() -> None:
            assert self.gate.wait(300), "the test never opened the gate"
            landed()

        return wait


def _moments(t) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {k: v.clone() for k, v in s.items()} for i, s in t.optimizer.state_dict()["state"].items()}


def _assert_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for i, s in want.items():
        assert got[i].keys() == s.keys()
        for k, v in s.items():
            torch.testing.assert_close(got[i][k], v, rtol=0, atol=0)


def test_offloaded_moments_are_lent_to_a_slow_writer_and_the_next_step_waits(tmp_path: Path) -> None:
    """With the moments in host memory the snapshot hands the live tensors to the writer; the next step runs while
    the writer is held, its optimizer waits until the writer has read them, and the checkpoint holds the moments of
    the step it was taken at. A trainer resumed from it continues bit for bit."""
    t = _make(tmp_path / "a", optimizer_offload=True)
    assert isinstance(t.optimizer, HostOffloadAdamW)
    t.train_step()
    live = {k: v.detach().clone() for k, v in t.model.named_parameters() if v.requires_grad}
    before = _moments(t)
    gate = threading.Event()
    t.checkpoints.snapshot = _HeldSnapshot(gate)
    path = t.save(background=True)
    assert t.writer.busy
    reached = threading.Event()
    grads: dict[int, torch.Tensor] = {}  # what step 2's optimizer step is given, to give a resumed one the same
    lrs: list[float] = []

    def entered(opt: torch.optim.Optimizer, *_: Any) -> None:
        grads.update({i: p.grad.clone() for i, p in enumerate(t.params) if p.grad is not None})
        lrs.extend(g["lr"] for g in opt.param_groups)
        reached.set()

    t.optimizer.register_step_pre_hook(entered)
    errors: list[BaseException] = []

    def step() -> None:
        try:
            t.train_step()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread below
            errors.append(exc)

    stepper = threading.Thread(target=step)
    stepper.start()  # step 2: rollout and training pass while the writer is held
    assert reached.wait(300), errors
    stepper.join(0.5)
    assert stepper.is_alive() and t.writer.busy  # the optimizer step waits for the writer
    _assert_state(_moments(t), before)  # the writer's view is still step 1's
    gate.set()
    stepper.join(300)
    assert not stepper.is_alive() and not errors, errors
    assert t.optimizer.last_loan_wait_s >= 0.4
    assert t.wait_checkpoint() == path
    after = _moments(t)
    assert any(not torch.equal(after[i]["exp_avg"], before[i]["exp_avg"]) for i in before)  # step 2 moved them
    state = load_checkpoint(path)
    assert state["step"] == 1
    _assert_state(state["optimizer"]["state"], before)  # step 1's moments, not step 2's
    saved = _adapter(path)
    for k, v in live.items():
        torch.testing.assert_close(saved[k.replace(".default", "")], v, rtol=0, atol=0)
    # resumed from it: step 1's adapter and moments; given step 2's gradients, its optimizer takes step 2 exactly as
    # the first trainer's did (the whole train_step is not compared: its rollouts are not the focus here)
    u = _make(tmp_path / "a", optimizer_offload=True)
    assert u.resume() == 1
    _assert_state(_moments(u), before)
    resumed = dict(u.model.named_parameters())
    for k, v in live.items():
        torch.testing.assert_close(resumed[k].detach(), v, rtol=0, atol=0)
    assert grads and [g["lr"] for g in u.optimizer.param_groups] == lrs
    for i, p in enumerate(u.params):
        p.grad = grads.get(i)
    u.optimizer.step()
    _assert_state(_moments(u), after)
    now = dict(t.model.named_parameters())
    for k, v in resumed.items():
        if v.requires_grad:
            torch.testing.assert_close(v.detach(), now[k].detach(), rtol=0, atol=0)


def test_kill_mid_background_write_leaves_latest_on_the_previous_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    marker = tmp_path / "writing"
    script = TRAINER + textwrap.dedent(f"""
        import time
        import qerl_cli.train.checkpointing as ck
        t = make({str(run)!r})
        t.train_step()
        t.save(background=False)                      # step_1, complete
        t.train_step()
        real = ck.atomic_write_json
        def slow(path, obj):                          # the adapter and state are written: stall before config
            open({str(marker)!r}, "w").write(str(path))
            time.sleep(120)
            real(path, obj)
        ck.atomic_write_json = slow
        t.save(background=True)                       # step_2 in the background thread
        t.train_step()                                # the main thread goes on meanwhile
        time.sleep(120)
    """)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 300
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() < deadline, "the background write never started"
        time.sleep(0.1)
    staged = Path(marker.read_text()).parent
    assert (staged / "adapter" / "adapter_model.safetensors").is_file()  # really mid-write
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    ckpts = run / "train" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_1"
    assert not (ckpts / "step_2").exists()
    assert load_checkpoint(ckpts / "step_1")["step"] == 1
    # a new process resumes from step_1
    t = _make(run)
    assert t.resume() == 1
    assert RunDir(run, create=False).path == run


def test_adapter_saves_never_ask_the_quantized_base_for_its_state(tmp_path: Path, monkeypatch) -> None:
    """A full state_dict() hands every repacked FP4 weight back in checkpoint order: a transient copy of the whole
    base on the GPU (measured: the 72B step's checkpoint phase peaked 31 GiB above its optimizer phase). The adapter
    snapshot and the checkpoint save must read the LoRA tensors alone, under the same names."""
    from qerl_cli.bench.shapes import get_shape
    from qerl_cli.bench.step import build_shape_model
    from qerl_cli.lora import attach_lora, lora_state_dict, make_lora_config
    from qerl_cli.qlinear import QuantLinear
    from qerl_cli.train.checkpointing import adapter_snapshot, save_checkpoint

    base = build_shape_model(get_shape("tiny"), "nvfp4", torch.device("cpu"), torch.float32, seed=0)
    model = attach_lora(base, make_lora_config(rank=4), seed=0)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    assert expected and set(lora_state_dict(model)) == set(expected)
    calls = []
    original = QuantLinear._save_to_state_dict
    monkeypatch.setattr(QuantLinear, "_save_to_state_dict",
                        lambda self, *a, **k: (calls.append(1), original(self, *a, **k))[1])
    snap = adapter_snapshot(model)
    path = save_checkpoint(RunDir(tmp_path / "r"), 1, model, {}, {}, keep=2)
    assert calls == []
    assert all(torch.equal(snap[k], expected[k]) for k in expected) and set(snap) == set(expected)
    saved = _adapter(path)
    assert len(saved) == len(expected) and all(v.shape in {t.shape for t in expected.values()} for v in saved.values())
