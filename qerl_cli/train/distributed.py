"""Data-parallel RL with torchrun: one process per GPU (NCCL) or, for CPU tests, per core (gloo).

How a step runs on N ranks (the single-process trainer is the N = 1 case of the same code):

* Every rank holds the quantized base and the same LoRA adapters (same seed), takes the same global prompt
  indices from the same seeded PromptStream, and derives the same rollout seed per (seed, step, round).
* Rollout: the round's prompts are handed out in chunks through an atomic counter on the c10d store
  (guided self-scheduling: a chunk is 1/(2N) of what is left, so the first chunks are large, which keeps the
  engine's batches big, and the last ones small, so a rank that finishes early steals the tail instead of
  idling). A chunk starting at global position p is generated with ``SamplingParams.prompt_offset=p``, so
  each sample's noise key is that of the 1-process run: which rank generated a prompt does not change
  its completions (up to floating-point differences of batching).
* Every rank scores its own chunks, then ``all_gather_object`` gives EVERY rank all samples and rewards in
  global prompt order: advantages, dynamic-sampling refill decisions and metrics are computed identically.
* Training: each rank recomputes pi_old and trains on its contiguous shard of the batch rows. The loss
  normaliser is that of the WHOLE batch (tokens, rows), so the SUM over ranks of the shard gradients is the
  1-process gradient; one flat ``all_reduce(SUM)`` of the LoRA gradients after backward does that. Why not
  DDP: the adapters are small (tens of MB), the rollout dominates the step, the engine drives the same
  modules outside any DDP forward, and DDP's averaging would need the loss rescaled by N; an explicit sum
  is exact and also makes fp16 overflow agree (an inf on any rank is an inf in the sum on every rank).
  Grad clipping and the optimizer step then run on identical gradients, so the adapters stay bitwise
  identical across ranks without any broadcast.
* Only rank 0 writes (metrics, rollouts, checkpoints, manifest, the run lock); the others only read.
  Checkpoints hold no per-rank state, so resume works on any number of ranks.
* With ``--sharding fsdp2`` (train/fsdp.py) the model's weights are sharded instead of replicated: rollouts,
  gathering and row shards are as above, but every forward/backward pass all-gathers each layer, so all
  ranks run the SAME number of passes (a rank with fewer rows runs stand-in passes whose loss is scaled by
  0), and the gradients are already summed by FSDP's reduce-scatter in backward (nothing to all-reduce).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from qerl_cli.errors import Preempted, QerlError
from qerl_cli.options import DEFAULT_DIST_TIMEOUT_S, options
from qerl_cli.train.phases import ROLE_BOTH
from qerl_cli.train.step_backend import (
    LocalBackend,
    LogProbs,
    MicroBatch,
    RolloutRound,
    RolloutWorker,
    StepBackend,
    StepSides,
    UpdateWorker,
    micro_batches,
)

if TYPE_CHECKING:
    from qerl_cli.train.batch import RolloutBatch

# Some shared hosts are harmed by NVLink multicast (NVLS / symmetric-memory multicast): keep it off.
SAFE_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
DEFAULT_TIMEOUT_S = DEFAULT_DIST_TIMEOUT_S


class DistributedAbort(QerlError):
    """Another rank failed and rank 0 printed why; this rank exits with the same code, silently."""

    quiet = True


@dataclass
class DistContext:
    """This process's place in the job; world_size 1 (no torchrun) makes every method a no-op."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    # --rollout-gpus (train/disagg.py): the trainers' own process group (None: every rank of the job) and the
    # job's size, when the collectives below cover only some of its ranks
    group: Any = None
    job_size: int = 0
    # what this process runs of a step (train/phases.py): "both", or under --rollout-gpus "train" / "rollout"; the
    # memory plan counts what the role holds (train/memory_plan.py)
    role: str = ROLE_BOTH

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> str | None:
        """The device this rank trains on (None: the trainer's default)."""
        if self.backend == "nccl":
            return f"cuda:{self.local_rank}"
        return "cpu" if self.enabled else None

    def barrier(self) -> None:
        if self.enabled:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.local_rank], group=self.group)
            else:
                dist.barrier(group=self.group)

    def gather_objects(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (picklable objects; CPU tensors inside are fine)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable; what the others pass is ignored)."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)  # global rank 0 is rank 0 of every group here
        return box[0]

    def any_true(self, flag: bool) -> bool:
        if not self.enabled:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    @contextlib.contextmanager
    def agree(self, what: str) -> Iterator[None]:
        """Run a block on every rank, then make all ranks agree it worked: a failure on any rank raises on
        every rank (rank 0 prints the reason, the others exit quietly), instead of leaving the healthy
        ranks blocked in the next collective until the timeout. With --rollout-gpus it covers the whole job (the
        rollout ranks too), not only the trainers' group."""
        job = max(self.world_size, self.job_size)
        if job <= 1:
            yield
            return
        err: BaseException | None = None
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - re-raised below on this rank
            err = exc
        mine = None if err is None else f"{err.__class__.__name__}: {err}" if not isinstance(err, QerlError) \
            else str(err)
        errors: list[Any] = [None] * job
        dist.all_gather_object(errors, mine)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        if dist.get_rank() != 0:  # rank 0 says why; the others leave quietly
            raise DistributedAbort(f"{what} failed on rank {failed[0][0]}") from err
        if err is not None:
            raise err
        r, msg = failed[0]
        raise QerlError(f"{what} failed on rank {r}: {msg}")


_CTX = DistContext()


def current() -> DistContext:
    return _CTX


def set_current(ctx: DistContext) -> None:
    """Replace this process's context: the asynchronous mode narrows it to its role's process group (disagg.py)."""
    global _CTX
    _CTX = ctx


def init_from_env(timeout_s: float | None = None) -> DistContext:
    """Join the torchrun job described by RANK/WORLD_SIZE/LOCAL_RANK (no-op without torchrun).

    NCCL on CUDA (device cuda:LOCAL_RANK), gloo on CPU or with the dist_backend option gloo (QERL_DIST_BACKEND).
    The process group's timeout (dist_timeout_s, QERL_DIST_TIMEOUT_S, default 10 min) bounds how long a rank
    waits for a dead peer.
    """
    global _CTX
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _CTX
    if dist.is_initialized():
        return _CTX
    for k, v in SAFE_NCCL_ENV.items():
        os.environ.setdefault(k, v)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    opts = options()  # checked when read: dist_backend is nccl, gloo or unset
    use_nccl = torch.cuda.is_available() and opts.dist_backend != "gloo"
    timeout = datetime.timedelta(seconds=timeout_s or opts.dist_timeout_s)
    if use_nccl:
        if local >= torch.cuda.device_count():
            raise QerlError(f"rank {rank} needs cuda:{local} but only {torch.cuda.device_count()} GPUs are visible: "
                            "lower --nproc-per-node / --gpus")
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device(f"cuda:{local}"))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    _CTX = DistContext(rank=rank, world_size=world, local_rank=local, backend="nccl" if use_nccl else "gloo")
    return _CTX


def shutdown() -> None:
    global _CTX
    if dist.is_initialized():
        dist.destroy_process_group()
    _CTX = DistContext()


# ---- rollout load balancing -----------------------------------------------------------------------
def claim_chunks(total: int, world_size: int, counter: Callable[[int], int], *, first_share: float = 1.0,
                 factor: int = 2, min_chunk: int = 1) -> Iterator[tuple[int, int]]:
    """Chunks [start, end) of ``range(total)`` for this rank, claimed through a shared atomic counter.

    ``counter(k)`` adds k to the shared count and returns the new value (c10d ``store.add``). Each rank's
    first claim is its static share, ``floor(first_share * total / world_size)`` prompts: one engine call
    costs about as many decode steps as its longest sample, so a rank should generate its share in one
    call. What is left (the remainder of the division, and shares not yet claimed by a rank that starts
    late) goes by guided self-scheduling: ceil(remaining / (factor * world_size)), read just before the
    claim; the read may be stale, which only changes a size, never the ranges, since the range comes from
    the atomic add itself. One rank takes everything in one chunk.
    """
    if total <= 0:
        return
    if world_size <= 1:
        yield 0, total
        return
    first = int(first_share * total / world_size)
    while True:
        remaining = total - counter(0)
        if remaining <= 0:
            return
        size = first if first >= min_chunk else max(min_chunk, math.ceil(remaining / (factor * world_size)))
        first = 0
        end = counter(size)
        start = end - size
        if start >= total:
            return
        yield start, min(end, total)


def store_counter(key: str) -> Callable[[int], int]:
    store = dist.distributed_c10d._get_default_store()
    return lambda k: int(store.add(key, k))


def shard_rows(n: int, rank: int, world_size: int) -> slice:
    """This rank's contiguous share of n batch rows (sizes differ by at most one)."""
    return slice(n * rank // world_size, n * (rank + 1) // world_size)


@dataclass
class _Chunk:
    start: int
    end: int
    samples: list[Any]
    raw: torch.Tensor
    shaped: torch.Tensor
    timings: dict[str, float]


def merge_chunks(per_rank: list[list[_Chunk]], total: int) -> tuple[list[_Chunk], list[tuple[int, int, int]]]:
    """All ranks' chunks sorted by start; they must tile [0, total) exactly (else the counter was misused)."""
    tagged = sorted(((c.start, r, c) for r, part in enumerate(per_rank) for c in part), key=lambda t: t[0])
    pos = 0
    owners = []
    for start, r, c in tagged:
        n = c.end - c.start
        if start != pos:
            raise QerlError(f"distributed rollout: chunks do not tile the batch (expected {pos}, got {start}); "
                            "a stale rollout counter? report this")
        owners.append((r, start, start + n))
        pos += n
    if pos != total:
        raise QerlError(f"distributed rollout covered {pos} of {total} prompts; report this")
    return [c for _, _, c in tagged], owners


def rollout_round(worker: RolloutWorker, ctx: DistContext, indices: list[int], round_: int,
                  overrides: Any, session: int = 0) -> RolloutRound:
    """Generate and score ``indices`` (one round of one step) across all ranks; every rank gets all of it.
    ``session`` tells apart trainers built one after the other in the same job (their counters must not meet)."""
    counter = (store_counter(f"qerl/rollout/{session}/{worker.rollout_step}/{round_}") if ctx.enabled
               else (lambda k: 0))
    mine: list[_Chunk] = []
    busy = 0.0
    for start, end in claim_chunks(len(indices), ctx.world_size, counter):
        t = time.perf_counter()
        part = indices[start:end]
        res = worker.generate(part, round_, overrides, prompt_offset=start)
        raw, shaped = worker.score(part, res.samples)
        # prompt tokens are known to every rank: do not ship them (an episode's own prompt, with its environment's
        # reset() text, is shipped)
        mine.append(_Chunk(start, end, [replace(s, prompt_token_ids=[]) if s.prompt_token_ids == worker.prompt_ids[
            part[s.prompt_index]] else s for s in res.samples], raw, shaped,
                           {k: float(v) for k, v in res.timings.items()}))
        busy += time.perf_counter() - t
    gathered = ctx.gather_objects((mine, busy))
    chunks, owners = merge_chunks([g[0] for g in gathered], len(indices))
    samples = [replace(s, prompt_index=c.start + s.prompt_index,
                       prompt_token_ids=s.prompt_token_ids or worker.prompt_ids[indices[c.start + s.prompt_index]])
               for c in chunks for s in c.samples]
    timings: dict[str, float] = {}
    for c in chunks:
        for k in ("tokens", "prefill_s", "decode_s"):
            timings[k] = timings.get(k, 0.0) + c.timings.get(k, 0.0)
    return RolloutRound(samples, torch.cat([c.raw for c in chunks]), torch.cat([c.shaped for c in chunks]),
                        timings, [g[1] for g in gathered], owners)


def rollout_metrics(world_size: int, busy_s: list[float]) -> dict[str, float]:
    """dist/* metrics of one step from each rank's busy rollout seconds (summed over refill rounds)."""
    hi, lo = max(busy_s), min(busy_s)
    return {"dist/world_size": float(world_size), "dist/rollout_s_max": hi, "dist/rollout_s_min": lo,
            # share of the ranks' rollout wall time spent waiting for the slowest rank
            "dist/rollout_idle_frac": 1.0 - (sum(busy_s) / len(busy_s)) / hi if hi > 0 else 0.0}


# ---- training ---------------------------------------------------------------------------------------
def forward_no_grad_sharded(worker: UpdateWorker, ctx: DistContext, batch: RolloutBatch, with_ref: bool,
                            lockstep: bool = False, with_old: bool = True) -> LogProbs:
    """pi_old (and ref) log-probs and entropies of the whole batch: each rank computes its row shard, then
    all ranks gather every shard (the IS weights and mismatch metrics need the whole batch). ``lockstep``
    (a sharded model): one pass per micro-batch, padded with stand-in passes to the same count on every rank."""
    n, t = batch.completion_ids.shape
    rows = shard_rows(n, ctx.rank, ctx.world_size)
    if lockstep:
        size = worker.micro_batch_size
        passes = micro_batches(rows, size, lockstep_passes(n, ctx.world_size, size))
    else:  # the whole shard in one call (the worker splits it into micro-batches)
        passes = micro_batches(rows, max(1, rows.stop - rows.start))
    outs = []
    for mb in passes:
        res = worker.forward_no_grad(batch.rows(mb.rows), with_ref, with_old)
        if mb.counts:
            outs.append(res)
    if outs:
        old, ref, ent = (None if outs[0][i] is None else torch.cat([o[i] for o in outs]) for i in range(3))
    else:
        z = torch.zeros(0, t, device=batch.input_ids.device)
        none = torch.zeros(0, t if with_old else 0, device=batch.input_ids.device)
        old, ref, ent = none, (z if with_ref else None), none
    parts = ctx.gather_objects(tuple(None if x is None else x.cpu() for x in (old, ref, ent)))
    dev = batch.input_ids.device

    def cat(i: int) -> torch.Tensor | None:
        return None if parts[0][i] is None else torch.cat([p[i] for p in parts]).to(dev)

    return cat(0), cat(1), cat(2)


def lockstep_passes(n: int, world_size: int, size: int) -> int:
    """Forward/backward passes every rank runs over a batch of ``n`` rows with a sharded model: those of
    the largest row shard (shard sizes differ by at most one row)."""
    largest = math.ceil(n / world_size)
    return math.ceil(largest / size)


def reduce_gradients(params: list[torch.nn.Parameter], ctx: DistContext) -> None:
    """Sum the (loss-scaled) gradients over ranks in one flat all_reduce; missing grads count as zero."""
    if not ctx.enabled:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group)
    for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        p.grad = g.view_as(p)


def reduce_loss_metrics(total_loss: float, agg: dict[str, float], ctx: DistContext) -> tuple[float, dict[str, float]]:
    """Shard losses/metrics are already weighted by the global batch size: the global value is their sum."""
    if not ctx.enabled:
        return total_loss, agg
    loss = 0.0
    out: dict[str, float] = {}
    for part_loss, part in ctx.gather_objects((total_loss, agg)):
        loss += part_loss
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return loss, out


_SESSIONS = itertools.count()


class DistributedBackend:
    """The step's layout-dependent parts on N ranks (the module docstring says how); see train/step_backend.py.
    ``sharded_model``: the weights are FSDP-sharded (train/fsdp.py): passes in lockstep, no gradient all-reduce."""

    def __init__(self, sides: StepSides, ctx: DistContext, *, sharded_model: bool = False) -> None:
        self.sides = sides
        self.ctx = ctx
        self.world_size = ctx.world_size
        self.sharded_model = sharded_model
        # every rank builds its trainers in the same order, so this numbers them alike on all ranks
        self.session = next(_SESSIONS)

    def rollout_round(self, indices: list[int], round_: int, overrides: Any) -> RolloutRound:
        return rollout_round(self.sides.rollout, self.ctx, indices, round_, overrides, self.session)

    def old_logprobs(self, batch: RolloutBatch, with_ref: bool, with_old: bool = True) -> LogProbs:
        return forward_no_grad_sharded(self.sides.update, self.ctx, batch, with_ref, lockstep=self.sharded_model,
                                       with_old=with_old)

    def gather_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]],
                    batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        t = batch.completion_ids.shape[1]
        mine = tuple(torch.cat([p[i] for p in parts]) if parts else batch.mask.new_zeros(0, t) for i in range(2))
        gathered = self.ctx.gather_objects(tuple(x.detach().cpu() for x in mine))
        dev = batch.input_ids.device
        return tuple(torch.cat([g[i] for g in gathered]).to(dev) for i in range(2))  # type: ignore[return-value]

    def update_micro_batches(self, n: int, size: int) -> list[MicroBatch]:
        rows = shard_rows(n, self.ctx.rank, self.ctx.world_size)
        return micro_batches(rows, size, lockstep_passes(n, self.ctx.world_size, size) if self.sharded_model
                             else None)

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        if not self.sharded_model:  # FSDP's reduce-scatter summed them in backward already
            reduce_gradients(params, self.ctx)

    def reduce_loss_metrics(self, total_loss: float, agg: dict[str, float]) -> tuple[float, dict[str, float]]:
        return reduce_loss_metrics(total_loss, agg, self.ctx)

    def step_metrics(self, busy_s: list[float]) -> dict[str, float]:
        return rollout_metrics(self.ctx.world_size, busy_s)


def make_backend(sides: StepSides, ctx: DistContext, *, sharded_model: bool = False) -> StepBackend:
    """The backend for this process's place in the job: one process (any sharding degree 1) or N ranks."""
    if ctx.enabled:
        return DistributedBackend(sides, ctx, sharded_model=sharded_model)
    return LocalBackend(sides)


@contextlib.contextmanager
def follower_stage(stage: str) -> Iterator[Any]:
    """What ranks other than 0 use instead of ``RunDir.stage``: a record nobody writes (no lock taken)."""
    from qerl_cli.manifest import StageRecord

    yield StageRecord(stage=stage, key=stage)


# ---- launcher ---------------------------------------------------------------------------------------
def strip_option(argv: list[str], name: str) -> list[str]:
    """argv without ``name VALUE`` / ``name=VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def launch(nproc: int, argv: list[str], *, debug: bool = False) -> int:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node N -m qerl_cli ARGV`` with NVLink
    multicast off; torchrun's own failure report (a traceback of the elastic agent) is hidden unless
    --debug, since the failing rank already printed one clear line. A SIGTERM to this process is passed to
    torchrun, which passes it to every rank (each finishes its step and checkpoints, docs/checkpoints.md); the
    exit code is then 143. Returns the exit code to use."""
    env = {**os.environ, **SAFE_NCCL_ENV}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "qerl_cli", "--", *argv]  # `--`: else torchrun reads qerl's --run as its --run-path
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stderr is not None
    saw_error = hiding = False
    terminated: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        # a scheduler's SIGTERM reaches the ranks through torchrun, which passes it on to every rank
        terminated.append(signum)
        proc.send_signal(signum)

    old = signal.signal(signal.SIGTERM, forward)
    try:
        for line in proc.stderr:
            if line.startswith("error:") or "error:" in line[:40]:
                saw_error = True
            if not debug and (hiding or "Traceback (most recent call last)" in line
                              or "torch.distributed.elastic" in line or "ChildFailedError" in line):
                hiding = True
                continue
            sys.stderr.write(line)
        rc = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, old)
    if terminated:
        return Preempted.exit_code
    if rc == 0:
        return 0
    if not saw_error:
        sys.stderr.write(f"error: a training process failed (torchrun exit code {rc}); rerun with --debug for "
                         "torchrun's report\n")
    return 2 if saw_error else 1


def replica_digests(params: list[torch.nn.Parameter], ctx: DistContext, step: int) -> list[str]:
    """sha256 of every rank's trainable parameters; raises on every rank if the replicas diverged (they must
    stay bitwise identical: same init, same summed gradients, same optimizer arithmetic)."""
    import hashlib

    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().contiguous().cpu().numpy().tobytes())
    digests = ctx.gather_objects(h.hexdigest())
    if len(set(digests)) > 1:
        raise QerlError(f"LoRA adapters diverged across ranks at step {step} ({len(set(digests))} different "
                        "replicas): report this; the last consistent checkpoint is the one before "
                        "(--resume-from step_N)")
    return digests
