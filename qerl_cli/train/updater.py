"""The update side of an RL step: group-relative advantages, pi_old (the update's own forward, or a no-grad pass),
the policy loss of the run's algorithm (qerl_cli/train/algos/) over micro-batches, the optimizer step (clipped, fp16
loss scaling, LR schedule) and what the rollout reads brought up to the new weights (the training mode's).

It owns the optimizer, its schedule and AQN's noise schedule (whose draws the rollout side makes), and counts the
updates it made: :attr:`PolicyUpdater.step`. The rollout side (train/rollouter.py) hands it a batch; the step
backend (train/step_backend.py) decides which rows this process trains on and sums the ranks' gradients.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.moe import router_metrics
from qerl_cli.precision import uses_loss_scaling
from qerl_cli.train import checkpointing
from qerl_cli.train.corrections import is_weights
from qerl_cli.train.logprobs import sampled_logprobs
from qerl_cli.train.losses import policy_loss
from qerl_cli.train.phases import FWD_BWD, OPTIMIZER, RECOMPUTE, TRAIN_PHASES, PhaseClock, peak_key, timing_key

if TYPE_CHECKING:
    from pathlib import Path

    from qerl_cli.train.batch import RolloutBatch
    from qerl_cli.train.config import TrainConfig
    from qerl_cli.train.distributed import DistContext
    from qerl_cli.train.memory_plan import ResolvedSettings
    from qerl_cli.train.modes import TrainingMode
    from qerl_cli.train.rollouter import Group
    from qerl_cli.train.step_backend import LogProbs, MicroBatch, StepBackend


class NonFiniteLoss(QerlError):
    """NaN/inf in the loss, the gradients or the updated parameters; the last good checkpoint stays the newest."""


def nonfinite_cause(cfg: TrainConfig) -> str:
    """The likely cause of a non-finite step: an option set to a non-finite number, else the learning rate."""
    import dataclasses

    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, list) else [value])):
            return f"--{f.name.replace('_', '-')} is {value}"
    return f"--lr {cfg.lr:g} is too high for this run"


def nonfinite_message(what: str, step: int, cfg: TrainConfig, newest: int | None) -> str:
    """One line for a step stopped by a NaN/inf: what, the likely cause, and the checkpoint that stays the newest."""
    if newest is None:
        after = "no checkpoint was written yet: fix the cause and train again (`--resume` starts the run over)"
    else:
        after = (f"step_{newest} stays the newest checkpoint: `--resume` continues from it, `--resume-from step_N` "
                 "from an earlier one")
    return f"{what} at step {step} (likely cause: {nonfinite_cause(cfg)}); nothing of step {step} was saved; {after}"


def params_finite(params: list[torch.Tensor], dist: DistContext | None = None) -> bool:
    """Whether every trainable value is finite: one fused max-abs per tensor, one device sync. ``dist``: the
    context whose ranks hold different shards (they must agree, or one rank would stop alone)."""
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in params]
    local = [t for t in local if t.numel()]
    bad = bool(local) and not bool(torch.isfinite(torch.stack(
        [n.float() for n in torch._foreach_norm(local, float("inf"))])).all())
    return not (dist.any_true(bad) if dist is not None else bad)


def sampling_entropy(samples: list[Any], mask: torch.Tensor) -> float | None:
    """Mean entropy of the distributions the rollout engine sampled from (under AQN the noisy policy's), over the
    completion tokens of ``mask`` [B, T], as ``entropy`` averages the training policy's; None when the engine
    reports no entropies (vLLM)."""
    if not samples or any(getattr(s, "entropies", None) is None for s in samples):
        return None
    m = mask.detach().float().cpu()
    total = 0.0
    for i, s in enumerate(samples):
        n = min(len(s.entropies), m.shape[1])
        total += float((s.entropies[:n].float() * m[i, :n]).sum())
    return total / max(float(m.sum()), 1.0)


@dataclass
class OldPolicy:
    """What the no-grad passes before the update computed: pi_old and its entropies (None: the update's own forward
    supplies them) and the reference log-probs (beta > 0)."""

    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    entropies: torch.Tensor | None = None


class PolicyUpdater:
    """The update side (module docstring): one optimizer step per batch, phase by phase."""

    def __init__(self, cfg: TrainConfig, mode: TrainingMode, params: list[torch.nn.Parameter],
                 settings: ResolvedSettings, phases: PhaseClock, checkpoints: checkpointing.CheckpointSink) -> None:
        """AQN's noise schedule, the optimizer, its LR schedule (linear warm-up) and the fp16 loss scaler, for the
        trainable ``params`` of the model ``mode`` built. ``checkpoints``: the run's, whose newest a non-finite step
        names."""
        from qerl_cli.train.aqn import AQN

        c = cfg
        self.cfg, self.mode, self.model, self.params = cfg, mode, mode.model, params
        self.settings, self.phases, self.device, self.checkpoints = settings, phases, phases.device, checkpoints
        self.step = 0  # the updates made: the step a run is at
        self.backend: StepBackend  # set once both sides exist (train/distributed.py's make_backend)
        self.aqn = (AQN(mode.aqn_model(), c.steps, sigma_start=c.aqn_sigma_start, sigma_end=c.aqn_sigma_end,
                        stages=c.aqn_stages, seed=c.seed) if c.aqn else None)
        self.optimizer = self._make_optimizer(**mode.optimizer_options())
        warm = max(0, c.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=uses_loss_scaling(c.precision))

    def _make_optimizer(self, **options: Any) -> torch.optim.Optimizer:
        """AdamW, with its moments in pinned host memory when the plan (or --optimizer-offload) says so: the
        same numbers either way (train/host_offload.py). ``options``: AdamW options a sharding engine asks for."""
        kw = dict(lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, betas=(0.9, 0.99), **options)
        if self.cfg.optimizer_offload and options:
            raise QerlError("--optimizer-offload moves replicated AdamW state to the host; FSDP2's sharded state "
                            "goes there with --fsdp-offload")
        if self.settings.optimizer_offload:
            from qerl_cli.train.host_offload import HostOffloadAdamW

            optimizer = HostOffloadAdamW(self.params, **kw)
            # its pinned moments allocated while the first step's rollout runs, not in that step's optimizer phase
            optimizer.prepare_state()
            return optimizer
        return torch.optim.AdamW(self.params, **kw)

    @property
    def micro_batch_size(self) -> int:
        return self.settings.micro_batch_size

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a checkpoint holds of the update besides the weights and the optimizer."""
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load(self, ckpt: Path, state: dict[str, Any]) -> None:
        """The weights, optimizer, LR schedule, loss scale and AQN schedule of a verified checkpoint (the update
        count is the caller's to set, with the RNG)."""
        self.mode.load(ckpt, state, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if self.aqn is not None and state.get("aqn"):
            aqn_state = state["aqn"]
            if self.cfg.steps > aqn_state.get("total_steps", self.cfg.steps):
                # an extended run keeps the schedule it was started with: the added steps run at sigma_end
                self.aqn.total_steps = int(aqn_state["total_steps"])
            self.aqn.load_state_dict(aqn_state)

    # ---- one update -----------------------------------------------------------------------------------------
    def advantages(self, groups: list[Group], metrics: dict[str, Any]) -> torch.Tensor:
        """Group-relative advantages of the shaped rewards; accuracy and mean of the raw ones."""
        from qerl_cli.train.advantages import group_advantages

        raw = torch.cat([r for _, _, r, _ in groups])
        shaped = torch.cat([s for _, _, _, s in groups])
        adv, adv_stats = group_advantages(shaped, self.cfg.num_generations, self.cfg.scale_rewards)
        metrics.update(adv_stats)
        metrics["accuracy"] = (raw >= 1.0 - 1e-6).float().mean().item()
        metrics["reward/raw_mean"] = raw.mean().item()
        return adv

    def update(self, batch: RolloutBatch, adv: torch.Tensor, samples: list[Any], metrics: dict[str, Any]) -> None:
        """The update on one step's batch, phase by phase: pi_old (recompute), the policy update (fwd_bwd,
        optimizer, requant); counts the step; its metrics go into ``metrics``."""
        old, t_recompute = self.recompute(batch, metrics)
        t_train = self.policy_update(batch, old, adv, samples, metrics)
        self.end_step(metrics, t_recompute, t_train)

    def recompute(self, batch: RolloutBatch, metrics: dict[str, Any]) -> tuple[OldPolicy, float]:
        """pi_old: the update forward's own log-probs (one optimizer step per batch, so pi_old is the policy the
        update starts from); a separate no-grad pass only where it is needed (reference model, LoRA dropout,
        asked). What it computed and its seconds."""
        self.phases.enter(RECOMPUTE)
        t1 = self.phases.clock()
        old = self.old_pass(batch)
        seconds = self.phases.clock() - t1
        metrics["timing/pi_old_pass"] = float(old.old is not None or old.ref is not None)
        self.phases.record_peak(metrics, RECOMPUTE)
        return old, seconds

    def policy_update(self, batch: RolloutBatch, old: OldPolicy, adv: torch.Tensor, samples: list[Any],
                      metrics: dict[str, Any]) -> float:
        """Forward+backward, then the optimizer (timed apart inside :meth:`_update`), then what the rollout reads
        brought up to the new weights (the mode's requant); the seconds of all of it."""
        self.phases.enter(FWD_BWD)
        t2 = self.phases.clock()
        valid = batch.sampled  # the model's tokens: an episode's observations are no policy's samples
        loss_metrics, own = self._update(batch, old, adv.to(self.device), valid)
        metrics.update(loss_metrics)
        old_logp, entropies = (old.old, old.entropies) if old.old is not None else own
        metrics.update(self.sampling_metrics(batch, samples, old_logp, entropies, valid))
        metrics.update(router_metrics(self.model))  # a mixture of experts' routing in this update (router/*)
        metrics.update(self.mode.after_update())
        return self.phases.clock() - t2

    def end_step(self, metrics: dict[str, Any], t_recompute: float, t_train: float) -> None:
        """Count the step; its learning rate, the update's times and the step's memory peaks."""
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            metrics["memory/train_peak_gb"] = max(metrics.get(peak_key(p), 0.0) for p in TRAIN_PHASES)
        self.step += 1
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        metrics[timing_key(RECOMPUTE)] = t_recompute
        metrics["timing/train_s"] = t_train
        if on_cuda:
            metrics["memory/peak_gb"] = max(v for k, v in metrics.items()
                                            if k.startswith("memory/") and k.endswith("_peak_gb"))

    # ---- pi_old and the reference ----------------------------------------------------------------------------
    def forward_no_grad(self, batch: RolloutBatch, with_ref: bool, with_old: bool = True) -> LogProbs:
        """pi_old (and reference, adapters off) log-probs and entropies of `batch`, without gradients; without
        ``with_old`` only the reference (pi_old and entropies come back empty, [B, 0])."""
        mb = self.micro_batch_size
        old, ref, ent = [], [], []
        rows = batch.input_ids.shape[0]
        with torch.no_grad():
            for i in range(0, rows, mb):
                if i:
                    self.phases.progress(f"no-grad pass, micro-batch {i // mb}/{-(-rows // mb)} done")
                part = batch.rows(slice(i, i + mb))
                if with_old:
                    with self.replaying(part):
                        lp, e = sampled_logprobs(self.model, part, self.cfg.temperature, with_entropy=True,
                                                 chunk_tokens=self.cfg.logprob_chunk_tokens,
                                                 packed=self.cfg.pack_sequences)
                    old.append(lp)
                    ent.append(e)
                if with_ref:
                    with self.model.disable_adapter(), self.replaying(part):
                        ref.append(sampled_logprobs(self.model, part, self.cfg.temperature,
                                                    chunk_tokens=self.cfg.logprob_chunk_tokens,
                                                    packed=self.cfg.pack_sequences)[0])
        empty = batch.mask.new_zeros(batch.mask.shape[0], 0)
        return (torch.cat(old) if with_old else empty, (torch.cat(ref) if with_ref else None),
                torch.cat(ent) if with_old else empty)

    def needs_old_pass(self) -> bool:
        """Whether pi_old needs a no-grad pass of its own: asked for (--recompute-logprobs), or the update's forward
        is not the policy pi_old stands for (LoRA dropout samples a different network in train mode)."""
        return self.cfg.recompute_logprobs or self.cfg.lora_dropout > 0

    def old_pass(self, batch: RolloutBatch) -> OldPolicy:
        """The no-grad passes before the update: pi_old where :meth:`needs_old_pass`, the reference for beta > 0,
        and the IS weights from that pi_old; nothing at all otherwise (the update supplies pi_old itself)."""
        with_old, with_ref = self.needs_old_pass(), self.cfg.beta > 0
        if not (with_old or with_ref):
            return OldPolicy()
        old, ref, ent = self.backend.old_logprobs(batch, with_ref, with_old)
        if not with_old:
            return OldPolicy(ref=ref)
        return OldPolicy(old=old, ref=ref, entropies=ent)

    def sampling_metrics(self, batch: RolloutBatch, samples: list[Any], old_logp: torch.Tensor,
                         entropies: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
        """Mismatch between the rollout's mu and pi_old, the IS-weight statistics, and the entropies."""
        from qerl_cli.train.corrections import mismatch_metrics

        c = self.cfg
        metrics = mismatch_metrics(old_logp, batch.rollout_logp, valid)
        if c.correction != "none":
            metrics.update(is_weights(c.correction, old_logp, batch.rollout_logp, valid, cap=c.correction_cap)[1])
        metrics["entropy"] = ((entropies * batch.mask).sum() / batch.mask.sum().clamp(min=1)).item()
        s_ent = sampling_entropy(samples, batch.mask)
        if s_ent is not None:
            metrics["sampling/entropy"] = s_ent
        return metrics

    # ---- forward, backward, optimizer ----------------------------------------------------------------------
    def _update(self, batch: RolloutBatch, old: OldPolicy, adv: torch.Tensor,
                valid: torch.Tensor) -> tuple[dict[str, float], tuple[torch.Tensor, torch.Tensor] | None]:
        """One optimizer step over this process's micro-batches (the backend's; normalisers stay the whole
        batch's, so the ranks' summed gradients are the 1-process gradient). Without a pi_old pass (``old.old``
        None) each micro-batch's own detached log-probs are pi_old and give its IS weights; they come back with
        the entropies, gathered over the whole batch, for the step's metrics."""
        bsz = batch.input_ids.shape[0]
        own = old.old is None
        isw = None if own or self.cfg.correction == "none" else self._is_weights(old.old, batch.rollout_logp, valid)
        normalizer = self.cfg.algorithm.normalizer(batch.mask, self.cfg.completion_tokens)
        self.model.train()
        t_fb = self.phases.clock()
        self.optimizer.zero_grad(set_to_none=True)
        agg: dict[str, float] = {}
        total_loss = 0.0
        own_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        micros = self.backend.update_micro_batches(bsz, self.micro_batch_size)
        for k, micro in enumerate(micros):
            part = batch.rows(micro.rows)
            with self.replaying(part):  # the backward too: a checkpointed layer recomputes its forward there
                loss, m, own_part = self._forward_backward(part, micro, old, isw, adv, valid, normalizer)
            self.phases.progress(f"forward+backward, micro-batch {k + 1}/{len(micros)} done")
            if not micro.counts:
                continue
            if own_part is not None:
                own_parts.append(own_part)
            total_loss += loss
            w = micro.rows.stop - micro.rows.start
            for k, v in m.items():
                agg[k] = agg.get(k, 0.0) + v * w / bsz
        self.backend.reduce_gradients(self.params)  # nothing to do on one process
        total_loss, agg = self.backend.reduce_loss_metrics(total_loss, agg)
        t_opt = self.phases.clock()
        agg[timing_key(FWD_BWD)] = t_opt - t_fb
        self.phases.record_peak(agg, FWD_BWD)
        agg.update(self._optimizer_step())
        agg[timing_key(OPTIMIZER)] = self.phases.clock() - t_opt
        self.phases.record_peak(agg, OPTIMIZER)
        self.model.eval()
        agg["loss"] = total_loss
        return agg, (self.backend.gather_rows(own_parts, batch) if own else None)

    def replaying(self, part: RolloutBatch) -> AbstractContextManager[None]:
        """Routing replay (--routing-replay) around the forwards of ``part``; with it off only the disagreement
        metric is measured (nothing at all without a recorded routing: dense models, vLLM)."""
        from qerl_cli.train.replay import replaying

        return replaying(self.model, part, chunk_tokens=self.cfg.logprob_chunk_tokens,
                         packed=self.cfg.pack_sequences, replay=bool(self.cfg.routing_replay))

    def _forward_backward(self, part: RolloutBatch, micro: MicroBatch, old: OldPolicy, isw: torch.Tensor | None,
                          adv: torch.Tensor, valid: torch.Tensor, normalizer: float,
                          ) -> tuple[float, dict[str, float], tuple[torch.Tensor, torch.Tensor] | None]:
        """Forward and backward of one micro-batch: its loss (0 for a stand-in pass), its loss metrics, and without
        a pi_old pass its own detached log-probs (its pi_old) and entropies."""
        c = self.cfg
        sl = micro.rows
        own = old.old is None
        logp, ent = sampled_logprobs(self.model, part, c.temperature, chunk_tokens=c.logprob_chunk_tokens,
                                     packed=c.pack_sequences, backend=c.logprob_backend, with_entropy=own)
        if own:
            old_part = logp.detach()
            isw_part = None if c.correction == "none" else self._is_weights(old_part, part.rollout_logp, valid[sl])
        else:
            old_part, isw_part = old.old[sl], None if isw is None else isw[sl]
        loss, m = policy_loss(
            c.algorithm, logp, old_part, adv[sl], part.mask, epsilon=c.epsilon, epsilon_high=c.epsilon_high,
            max_completion_length=c.completion_tokens, is_weights=isw_part,
            ref_logp=None if old.ref is None else old.ref[sl], beta=c.beta, rollout_logp=part.rollout_logp,
            loss_normalizer=normalizer)
        if not torch.isfinite(loss):
            raise self.nonfinite(f"the loss became {loss.item()}")
        if not micro.counts:  # a stand-in pass: it runs only so that the ranks' collectives match
            loss = loss * 0.0
        self.scaler.scale(loss).backward()
        if not micro.counts:
            return 0.0, m, None
        return loss.item(), m, (old_part, ent) if own else None

    def _is_weights(self, old_logp: torch.Tensor, rollout_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The importance weights of --correction (pi_old over the rollout's mu), capped."""
        return is_weights(self.cfg.correction, old_logp, rollout_logp, valid, cap=self.cfg.correction_cap)[0]

    def nonfinite(self, what: str) -> NonFiniteLoss:
        """The error that stops a step with a NaN/inf, after the previous step's checkpoint write (if one is in
        flight) has finished, so that the checkpoint it names is complete."""
        self.checkpoints.wait()
        return NonFiniteLoss(nonfinite_message(what, self.step + 1, self.cfg,
                                               checkpointing.latest_step(self.checkpoints.run)))

    def _optimizer_step(self) -> dict[str, float]:
        """Clip, step (skipped by the fp16 scaler when its gradients overflowed), schedule. A non-finite gradient
        or update stops the run here, before anything of this step is logged or checkpointed."""
        c = self.cfg
        self.phases.enter(OPTIMIZER)
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, c.max_grad_norm)
        finite = bool(torch.isfinite(grad_norm))
        if not finite and not uses_loss_scaling(c.precision):
            raise self.nonfinite(f"the gradient norm became {grad_norm.item()}")
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        try:
            self.scaler.step(self.optimizer)
        except RuntimeError as exc:  # torch refuses a step size past float32's range ("... without overflow")
            if "overflow" not in str(exc):
                raise
            raise self.nonfinite("the optimizer step overflowed float32") from exc
        if not params_finite(self.params, self.mode.finite_ctx()):
            raise self.nonfinite("the optimizer step made trainable parameters NaN or inf")
        self.scaler.update()
        self.scheduler.step()
        # nothing reads the gradients after the step: freed now, they stay out of the next rollout's memory
        self.optimizer.zero_grad(set_to_none=True)
        out = {"grad_norm": grad_norm.item() if finite else float("nan")}
        if self.scaler.is_enabled():
            out["fp16/loss_scale"] = scale_before
            out["fp16/step_skipped"] = float(not finite)
        return out
