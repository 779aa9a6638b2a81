"""Asynchronous RL across GPUs with adapter-only sync (``--rollout-gpus R``, issue 46; docs/distributed.md).

Under torchrun with N processes, ranks 0..N-R-1 train and ranks N-R..N-1 only roll out:

* rollout ranks run the builtin engine continuously: ask trainer rank 0 for a chunk of prompts and start one
  engine call on it; between decode windows, send each group (all ``num_generations`` samples of a prompt) as its
  last sample ends, scored, with the adapter versions that sampled it, and ask for as many prompts as the free
  slots can start, which join the running call (:class:`StreamFeed`);
* trainer rank 0 runs a *hub* thread that answers those requests (gloo point-to-point on a process group of its
  own: pickled groups, CPU only): groups go into the :class:`~qerl_cli.train.async_queue.SampleQueue`, prompts
  come out of a pool that only the training thread refills from the trainer's PromptStream;
* each step, trainer rank 0 takes ``batch_prompts`` groups the staleness gate lets through (``--max-staleness``),
  hands them to the other trainers (one broadcast on the trainers' process group), and the trainers run the same
  update as the synchronous data-parallel mode on them (row shards, one gradient all-reduce among trainers only);
* after the update, trainer rank 0 publishes the new adapters to the rollout ranks (train/adapter_sync.py);
* a rollout rank beats a heartbeat counter on the c10d store; a rank whose counter stops is named in one line
  and the run stops (no hang on a dead peer);
* a stop (steps done, Ctrl-C, SIGTERM on ANY rank) ends the trainers at a step boundary as in the synchronous
  mode; a rollout rank's signal reaches the trainers through its next request. Then the hub tells each rollout
  rank to stop at its next request (a rank asks at its next decode window and abandons its running call); the
  groups still queued are dropped and counted, and so are the prompts cut mid-generation (manifest
  ``train.extra.async``): nothing is lost without a count.

Why this layout: the rollout is decode-bound and the update compute-bound; on separate GPUs neither waits for the
other except through the staleness bound, and only the LoRA factors cross between them. Checkpoints are the
trainers' (no rollout-rank state), so a run resumes on any world size and role split, or synchronously.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from qerl_cli.errors import Preempted, QerlError
from qerl_cli.options import options
from qerl_cli.rollout.scheduler import StreamStopped
from qerl_cli.train import distributed
from qerl_cli.train.adapter_sync import AdapterPublisher, AdapterSubscriber
from qerl_cli.train.async_queue import (
    GroupItem,
    IdleClock,
    PromptPool,
    QueueFailed,
    SampleQueue,
    chunk_prompts,
    prompt_target,
)
from qerl_cli.train.phases import ROLE_ROLLOUT, ROLE_TRAIN
from qerl_cli.train.rollouter import NormOverrides, Rollouter, Rollouts, rollout_metrics

if TYPE_CHECKING:
    from qerl_cli.train.trainer import Trainer
    from qerl_cli.train.updater import PolicyUpdater

TRAIN, ROLLOUT = ROLE_TRAIN, ROLE_ROLLOUT
HEARTBEAT_S = 0.5  # a rollout rank's heartbeat period
# no heartbeat for this long (or the process group timeout, if shorter): the rank died. Long enough for a live rank
# whose heartbeat thread waits on the GIL through a Triton compile (seconds each), short enough to name the dead
# rank before torchrun's agent tears the job down (~30 s after a worker dies)
HEARTBEAT_TIMEOUT_S = 20.0
GOODBYE_TIMEOUT_S = 120.0  # at the stop, how long rank 0 waits for each rollout rank to finish its chunk
_TAG_HEAD, _TAG_BODY = 11, 12  # rollout -> hub
_TAG_REPLY_HEAD, _TAG_REPLY_BODY = 13, 14  # hub -> rollout


def check_split(rollout_gpus: int, world_size: int) -> None:
    """One line for a role split that cannot work."""
    if rollout_gpus <= 0:
        return
    if world_size <= 1:
        raise QerlError(f"--rollout-gpus {rollout_gpus} splits the GPUs of a multi-process run: add --gpus N with "
                        f"N > {rollout_gpus} (or run under torchrun --nproc-per-node N)")
    if rollout_gpus >= world_size:
        raise QerlError(f"--rollout-gpus {rollout_gpus} leaves no trainer among {world_size} processes: use "
                        f"--rollout-gpus <= {world_size - 1}")


@dataclass
class Roles:
    """This process's role and the process groups of the split (created on every rank, in the same order)."""

    rank: int
    world_size: int
    trainers: int
    train_group: Any
    sync_group: Any  # rank 0 + rollout ranks, the job's backend: adapter broadcasts
    flow_group: Any  # rank 0 + rollout ranks, gloo: requests, prompts and scored groups
    bell_group: Any  # rank 0 + rollout ranks, gloo: each adapter version's header (adapter_sync.py says why)

    @property
    def role(self) -> str:
        return TRAIN if self.rank < self.trainers else ROLLOUT

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(self.trainers, self.world_size))

    def record(self) -> dict[str, Any]:
        return {"trainer_ranks": list(range(self.trainers)), "rollout_ranks": self.rollout_ranks}


def init_roles(rollout_gpus: int) -> Roles | None:
    """Split the job (None without --rollout-gpus): the groups, and this process's DistContext set to its role's
    (trainers: their own group; a rollout rank: a 1-process context, so its Trainer never joins a collective)."""
    if not rollout_gpus:
        return None
    ctx = distributed.current()
    check_split(rollout_gpus, ctx.world_size)
    world, trainers = ctx.world_size, ctx.world_size - rollout_gpus
    train_group = dist.new_group(list(range(trainers)))
    sync_group = dist.new_group([0, *range(trainers, world)])
    flow_group = dist.new_group([0, *range(trainers, world)], backend="gloo")
    bell_group = dist.new_group([0, *range(trainers, world)], backend="gloo")
    roles = Roles(ctx.rank, world, trainers, train_group, sync_group, flow_group, bell_group)
    sub = distributed.DistContext(rank=ctx.rank, world_size=trainers if roles.role == TRAIN else 1,
                                  local_rank=ctx.local_rank, backend=ctx.backend,
                                  group=train_group if roles.role == TRAIN else None, job_size=world,
                                  role=roles.role)
    # the Trainer reads its context from current() (train/distributed.py), and plans its memory for the role
    distributed.set_current(sub)
    return roles


# ---- messages: pickled objects over gloo point-to-point (only between qerl's own processes, in memory) --------
def send_obj(obj: Any, dst: int, group: Any, tags: tuple[int, int]) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.long), dst=dst, group=group, tag=tags[0])
    dist.send(data, dst=dst, group=group, tag=tags[1])


def recv_obj(src: int | None, group: Any, tags: tuple[int, int]) -> tuple[Any, int]:
    """(object, sender); ``src`` None: from any sender (its body is then read from that same sender)."""
    head = torch.zeros(1, dtype=torch.long)
    sender = dist.recv(head, src=src, group=group, tag=tags[0])
    body = torch.empty(int(head.item()), dtype=torch.uint8)
    dist.recv(body, src=sender, group=group, tag=tags[1])
    return pickle.loads(body.numpy().tobytes()), sender  # noqa: S301 - our own ranks' messages


# ---- heartbeats -------------------------------------------------------------------------------------------------
def _heartbeat_key(rank: int) -> str:
    return f"qerl/async/heartbeat/{rank}"


def _progress_key(rank: int) -> str:
    return f"qerl/async/progress/{rank}"


class Heartbeat:
    """A rollout rank's two store counters. Its thread adds 1 to the heartbeat every HEARTBEAT_S (stopped by
    :meth:`stop`): the process lives. Its rollout loop calls :meth:`progress` at every request and after every
    decode window: the work moves. Why both: a rank stuck in a CUDA wait (the first two-GPU run's deadlock, an
    NCCL kernel that never completes) releases the GIL there, so its heartbeat thread goes on beating while
    nothing moves; only the second counter shows it."""

    def __init__(self, rank: int, store: Any = None) -> None:
        self._store = store if store is not None else dist.distributed_c10d._get_default_store()
        self._key, self._progress_key = _heartbeat_key(rank), _progress_key(rank)
        self._last_progress = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qerl-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a store hiccup is not a death; the watcher decides
                self._store.add(self._key, 1)

    def progress(self) -> None:
        """The rollout moved (at most one store round trip per HEARTBEAT_S: decode windows come every few ms)."""
        now = time.monotonic()
        if now - self._last_progress >= HEARTBEAT_S:
            self._last_progress = now
            with contextlib.suppress(Exception):
                self._store.add(self._progress_key, 1)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


class _Counters:
    """When each rank's store counter last changed, as seen by the reader."""

    def __init__(self, store: Any, key: Callable[[int], str], ranks: list[int]) -> None:
        self._store, self._key = store, key
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in ranks}

    def still_for(self, gone: set[int], limit_s: float) -> int | None:
        """The first rank (not in ``gone``) whose counter has not moved for more than ``limit_s``."""
        now = time.monotonic()
        for r, (count, since) in self._seen.items():
            if r in gone:
                continue
            c = int(self._store.add(self._key(r), 0))
            if c != count:
                self._seen[r] = (c, now)
            elif now - since > limit_s:
                return r
        return None


class HeartbeatWatch:
    """Trainer rank 0's view of the rollout ranks: the first one silent (no heartbeat for ``timeout_s``: dead or
    frozen) or stalled (alive, but no request or decode window for ``stall_s``: hung in a wait)."""

    def __init__(self, ranks: list[int], timeout_s: float, stall_s: float, store: Any = None) -> None:
        store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.timeout_s, self.stall_s = timeout_s, stall_s
        self._beats = _Counters(store, _heartbeat_key, ranks)
        self._progress = _Counters(store, _progress_key, ranks)

    def silent(self, gone: set[int]) -> int | None:
        return self._beats.still_for(gone, self.timeout_s)

    def stalled(self, gone: set[int]) -> int | None:
        return self._progress.still_for(gone, self.stall_s)


# ---- trainer rank 0: the hub thread -------------------------------------------------------------------------
class Hub:
    """Answers the rollout ranks' requests (one thread on trainer rank 0); see the module docstring."""

    def __init__(self, roles: Roles, queue: SampleQueue, pool: PromptPool, clock: IdleClock) -> None:
        self.roles, self.queue, self.pool, self.clock = roles, queue, pool, clock
        self.stop_reason: str | None = None  # set at the stop: every later request is answered with it
        self.peer_signal: str | None = None  # a rollout rank's SIGTERM/SIGINT, for the trainers' stop check
        self.error: str | None = None  # a rollout rank's own failure, as it reported it
        # the flow's transport failing (a rank died: gloo closes its connection); the heartbeat names the rank
        self.transport_error: str | None = None
        self.transport_error_at = 0.0
        self.goodbyes: set[int] = set()
        self.plans: dict[int, dict[str, Any]] = {}  # each rollout rank's memory plan summary (its first request)
        self.timings: dict[str, float] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="qerl-async-hub", daemon=True)
        self._thread.start()

    def take_timings(self) -> dict[str, float]:
        with self._lock:
            out, self.timings = self.timings, {}
            return out

    def _run(self) -> None:
        try:
            while len(self.goodbyes) < len(self.roles.rollout_ranks):
                msg, src = recv_obj(None, self.roles.flow_group, (_TAG_HEAD, _TAG_BODY))
                self._handle(msg, src)
        except Exception as exc:  # noqa: BLE001 - reported to the training thread's wait
            self.transport_error_at = time.monotonic()
            self.transport_error = f"the sample flow from the rollout ranks failed: {exc.__class__.__name__}: {exc}"

    def _handle(self, msg: dict[str, Any], src: int) -> None:
        if "plan" in msg:
            self.plans[src] = msg["plan"]
        groups: list[GroupItem] = msg.get("groups", [])
        if groups:
            self.queue.put(groups)
        self.pool.returned(msg.get("prompts_done", 0))
        self.clock.add(msg.get("busy_s", 0.0), msg.get("idle_s", 0.0))
        with self._lock:
            for k, v in msg.get("timings", {}).items():
                self.timings[k] = self.timings.get(k, 0.0) + v
        if msg.get("signal") and self.peer_signal is None:
            self.peer_signal = msg["signal"]
        if msg.get("error"):
            self.error = f"rollout rank {src} failed: {msg['error']}"
            self.goodbyes.add(src)
            return
        if self.stop_reason is not None:
            send_obj({"stop": self.stop_reason}, src, self.roles.flow_group, (_TAG_REPLY_HEAD, _TAG_REPLY_BODY))
            self.goodbyes.add(src)
            return
        chunk, prompts = self.pool.hand_out(msg.get("want"))
        send_obj({"chunk": chunk, "prompts": prompts}, src, self.roles.flow_group, (_TAG_REPLY_HEAD, _TAG_REPLY_BODY))

    def wait_goodbyes(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


# ---- the trainers' side: where a step's rollouts come from -----------------------------------------------------
class TrainerSource:
    """The rollout side's ``source`` (train/rollouter.py's RolloutSource: ``Rollouter.take`` asks it instead of
    generating): the staleness-gated groups of each step, and the adapters published after each update."""

    def __init__(self, rollouter: Rollouter, updater: PolicyUpdater, ctx: distributed.DistContext, roles: Roles,
                 max_staleness: int) -> None:
        self.roles = roles
        self.ctx = ctx
        self.is_hub = roles.rank == 0
        self.max_staleness = max_staleness
        self.batch_prompts = rollouter.cfg.batch_prompts
        self.totals = {"dropped_stale": 0, "dropped_zero_std": 0}
        self.last_step_end = time.perf_counter()
        self.failed_line: str | None = None
        self.closing = threading.Event()
        self.watcher: threading.Thread | None = None
        if not self.is_hub:
            return
        cfg = rollouter.cfg
        self.queue = SampleQueue(max_staleness, drop_zero_std=bool(cfg.dynamic_sampling))
        self.pool = PromptPool(chunk=chunk_prompts(cfg.batch_prompts, len(roles.rollout_ranks)))
        self.stream = rollouter.stream
        self.clock = IdleClock()
        self.publisher = AdapterPublisher(updater.params, roles.sync_group, roles.bell_group, rollouter.device)
        self.watch = HeartbeatWatch(roles.rollout_ranks, min(HEARTBEAT_TIMEOUT_S, options().dist_timeout_s),
                                    options().dist_timeout_s)
        self.top_up()  # the rollout ranks have prompts from their first request on
        self.hub = Hub(roles, self.queue, self.pool, self.clock)
        self.publisher.publish(updater.step)  # every rollout rank starts from the trainers' adapters, exactly

    def top_up(self, waiting: bool = False) -> None:
        """Hand out what the staleness bound lets the next updates train (``prompt_target``); on the training thread
        only. ``waiting``: the trainer is inside its take, which the groups generated now may still serve."""
        target = prompt_target(self.batch_prompts, self.max_staleness, waiting)
        self.pool.top_up(target, self.queue.snapshot().queued, self.stream.take)

    def failed(self) -> str | None:
        """The line that stops the run, or None: a rank's own error; a silent rank (heartbeat); a transport failure
        only once the heartbeat had its time to name the rank behind it."""
        if self.hub.error is not None:
            return self.hub.error
        line = self._silent_line()
        if line is None and self.hub.transport_error is not None and \
                time.monotonic() - self.hub.transport_error_at > self.watch.timeout_s + 2 * HEARTBEAT_S:
            return self.hub.transport_error
        return line

    def _silent_line(self) -> str | None:
        r = self.watch.silent(self.hub.goodbyes)
        if r is not None:
            return (f"rollout rank {r} stopped responding (no heartbeat for {self.watch.timeout_s:.0f} s): it died or "
                    "hangs; the last checkpoint is intact (--resume, on any role split)")
        r = self.watch.stalled(self.hub.goodbyes)
        if r is not None:
            return (f"rollout rank {r} is alive but made no progress for {self.watch.stall_s:.0f} s (no request, no "
                    "decode window): it hangs in a wait; the last checkpoint is intact (--resume, on any role split; "
                    "QERL_DIST_TIMEOUT_S sets this limit)")
        return None

    def take(self, step: int) -> Rollouts:
        """The groups step ``step`` (the updates made) trains on, within the staleness bound of it."""
        payload: Any = None
        if self.is_hub:
            t0 = time.perf_counter()
            try:
                items, dropped = self.queue.take(self.batch_prompts, step, failed=self.failed,
                                                 on_wait=lambda: self.top_up(waiting=True))
            except QueueFailed as exc:
                self.failed_line = str(exc)
                raise QerlError(str(exc)) from None
            self.top_up()
            wait_s = time.perf_counter() - t0
            for k, v in dropped.items():
                self.totals[k] += v
            t = self.hub.take_timings()
            timing = {k: t.get(k, 0.0) for k in ("tokens", "prefill_s", "decode_s", "decode_steps")}
            staleness = [step - g.version for g in items]
            metrics = {**rollout_metrics(wait_s, timing),
                       "async/staleness_mean": sum(staleness) / len(staleness),
                       "async/staleness_max": float(max(staleness)),
                       "async/dropped_stale": float(dropped["dropped_stale"]),
                       "async/dropped_stale_total": float(self.totals["dropped_stale"]),
                       "async/dropped_zero_std": float(dropped["dropped_zero_std"]),
                       "async/rollout_idle_frac": self.clock.read(), "async/wait_s": wait_s}
            payload = ([(g.prompt_index, g.samples, g.raw, g.shaped, g.version) for g in items], metrics)
        if self.ctx.enabled:  # every trainer trains on the same groups (row shards of one batch)
            payload = self.ctx.broadcast_object(payload)
        groups, metrics = payload
        return Rollouts(step, min(g[4] for g in groups), [g[:4] for g in groups], metrics)

    def published(self, step: int) -> dict[str, float]:
        """After the update: the new adapters to the rollout ranks; the step's async/* metrics of it."""
        now = time.perf_counter()
        step_s, self.last_step_end = now - self.last_step_end, now
        if not self.is_hub:
            return {}
        try:
            sync_s = self.publisher.publish(step)
        except RuntimeError as exc:  # a rollout rank died under the broadcast (gloo: the connection closed)
            self.failed_line = self._death_line(exc)
            raise QerlError(self.failed_line) from None
        return {"async/sync_s": sync_s, "async/adapter_version": float(step),
                "async/sync_share": sync_s / max(step_s, 1e-9)}

    def _death_line(self, exc: BaseException) -> str:
        """The one line for a publish that failed: the heartbeat watch's (which rank, and that the checkpoint is
        intact) once it names the silent rank, at most its timeout later; else the transport's own words."""
        deadline = time.monotonic() + self.watch.timeout_s + 2 * HEARTBEAT_S
        while time.monotonic() < deadline:
            line = self._silent_line()
            if line is not None:
                return line
            time.sleep(HEARTBEAT_S)
        return f"publishing the adapters to the rollout ranks failed ({exc.__class__.__name__}: {exc})"

    def close(self, reason: str, *, clean: bool) -> dict[str, Any]:
        """The stop: the rollout ranks told (``clean``: they answer; after a failure nobody waits on them), what was
        still queued dropped and counted; the manifest's record of it."""
        if not self.is_hub:
            return {}
        self.hub.stop_reason = reason
        self.closing.set()
        if self.watcher is not None:
            self.watcher.join()
        done = True
        if clean:
            self.publisher.publish(self.publisher.version, stop=True)  # ends the rollout ranks' receiving threads
            done = self.hub.wait_goodbyes(GOODBYE_TIMEOUT_S)
        acc = self.queue.close()
        # every prompt handed out came back as a group (received) or did not: cut mid-generation at the stop, or
        # lost with a failed rank
        return {**acc.to_dict(), "prompts_handed": self.pool.prompts_handed,
                "prompts_cut_at_stop": self.pool.outstanding, "all_rollout_ranks_stopped": done, "stop": reason,
                "rollout_plans": dict(self.hub.plans)}


# ---- the rollout ranks ------------------------------------------------------------------------------------------
class _Signals:
    """A rollout rank's Ctrl-C / SIGTERM: noted and passed to the trainers with the next request (they stop the
    run at a step boundary and then tell this rank to stop); never an exception in the middle of a chunk."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.sent = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):
                self._old[sig] = signal.signal(sig, self._on)
        return self

    def _on(self, signum: int, frame: Any) -> None:
        self.name = self.name or signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def take(self) -> str | None:
        if self.name is None or self.sent:
            return None
        self.sent = True
        return self.name


def scored_groups(rollouter: Rollouter, prompts: list[int], samples: list[Any], rank: int) -> list[GroupItem]:
    """``samples`` (all samples of each of ``prompts``, in order) scored: one group per prompt. Each sample keeps
    the adapter versions the engine tagged it with (adapters applied between its decode windows: its first and
    last token's), and a group counts as its oldest sample's version."""
    g = rollouter.cfg.num_generations
    samples = [replace(s, prompt_index=j // g) for j, s in enumerate(samples)]
    raw, shaped = rollouter.score(prompts, samples)
    items = []
    for p, idx in enumerate(prompts):
        own = rollouter.prompt_ids[idx]
        # the prompt's tokens are known to the trainers: not shipped (an episode's own prompt would be)
        ss = [replace(s, prompt_token_ids=[] if s.prompt_token_ids == own else s.prompt_token_ids)
              for s in samples[p * g:(p + 1) * g]]
        items.append(GroupItem(idx, ss, raw[p * g:(p + 1) * g], shaped[p * g:(p + 1) * g],
                               min(s.policy_version for s in ss), rank, sum(len(s.token_ids) for s in ss)))
    return items


class StreamFeed:
    """The builtin engine's ``prompt_feed`` on a rollout rank: between decode windows of one
    long engine call, the groups that completed go to the hub with a request for as many prompts as the free slots
    can start, and the hub's answer joins the running call. So no slot idles through a chunk's tail while the hub
    has prompts, and a group reaches the trainers as soon as its last sample ends, not with its chunk.

    Sampling stays independent of timing: the call's seed is fixed for the run and a prompt's noise key is its
    place in the hand-out order (chunk number x the largest chunk + position), whichever call it lands in.
    ``exchange``: one request/reply with the hub; ``watch``: raises when the run must stop (a failed adapter
    receiver) and says whether the trainers' stop broadcast arrived (then the hub is asked at once, and answers
    stop)."""

    def __init__(self, rollouter: Rollouter, exchange: Callable[[dict[str, Any]], dict[str, Any]], stride: int,
                 rank: int, watch: Callable[[], bool]) -> None:
        self.rollouter, self.exchange, self.stride, self.rank, self.watch = rollouter, exchange, stride, rank, watch
        self.tasks: list[int] = []  # the running call's prompt positions -> task example indices
        self.progress: dict[str, float] = {}  # the running call's progress at the last message
        self.last_sent = 0.0  # when the last message went (the busy time each message reports runs from it)

    def start(self, chunk: int, prompts: list[int]) -> int:
        """A call starts on ``prompts`` (chunk ``chunk``): the noise key of its first prompt."""
        self.tasks, self.progress, self.last_sent = list(prompts), {}, time.perf_counter()
        return chunk * self.stride

    def __call__(self, done: list[Any], want: int, progress: dict[str, float]) -> list[tuple[list[int], int]]:
        stopping = self.watch()
        if not done and not want and not stopping:
            return []
        g = self.rollouter.cfg.num_generations
        prompts = [self.tasks[s.prompt_index] for s in done[::g]]
        items = scored_groups(self.rollouter, prompts, done, self.rank)
        timings = {k: v - self.progress.get(k, 0.0) for k, v in progress.items()}
        timings["tokens"] = float(sum(i.tokens for i in items))
        now = time.perf_counter()
        reply = self.exchange({"groups": items, "prompts_done": len(items), "timings": timings,
                               "busy_s": now - self.last_sent, "want": want})
        self.progress, self.last_sent = dict(progress), now
        if "stop" in reply:
            raise StreamStopped(reply["stop"])
        base = reply["chunk"] * self.stride
        self.tasks.extend(reply["prompts"])
        return [(self.rollouter.prompt_ids[idx], base + p) for p, idx in enumerate(reply["prompts"])]


def rollout_loop(rollouter: Rollouter, updater: PolicyUpdater, roles: Roles,
                 plan: dict[str, Any] | None = None) -> str:
    """A rollout rank's life after setup: chunks until the trainers say stop; the stop's reason. ``updater``: this
    rank's update side, whose adapters the trainers' publications overwrite (it never steps); ``plan``: this rank's
    memory plan summary, sent with its first request for trainer rank 0 to record in the manifest."""
    sub = AdapterSubscriber(updater.params, roles.sync_group, roles.bell_group, rollouter.device,
                            version=-1)
    beat = Heartbeat(roles.rank)
    version = updater.step
    overrides = rollouter.noise(version)
    engine = rollouter.engine  # the builtin engine (TrainConfig.check_rollout_gpus refuses any other)

    def install() -> bool:
        """The newest received version into the LoRA parameters, if newer: it becomes this rank's version (AQN:
        the noise of that version's step)."""
        nonlocal version, overrides
        v = sub.apply()
        if v is None:
            return False
        version, overrides = v, rollouter.noise(v)
        return True

    def updates() -> tuple[int, NormOverrides] | None:
        """After every decode window: a newer version installed between windows (the running sequences' later
        tokens sample from it)."""
        beat.progress()
        return (version, overrides) if install() else None

    engine.adapter_updates = updates
    engine.adapter_version = version
    out: dict[str, Any] = {} if plan is None else {"plan": plan}
    tags = (_TAG_HEAD, _TAG_BODY)

    try:
        with _Signals() as sig:

            def watch() -> bool:
                """Raises when adapters can no longer arrive; whether the hub must be asked now: the trainers'
                stop broadcast arrived, or a signal waits to be passed on."""
                beat.progress()
                if sub.error is not None:
                    raise QerlError(f"receiving adapters failed: {sub.error}")
                return sub.stopped or (sig.name is not None and not sig.sent)

            feed = StreamFeed(rollouter, lambda msg: _exchange(msg, roles, sig),
                              chunk_prompts(rollouter.cfg.batch_prompts, len(roles.rollout_ranks)), roles.rank,
                              watch)
            engine.prompt_feed = feed
            rollouter.rollout_step = 0  # one seed for the run: a prompt's noise is keyed by its hand-out place
            while True:
                beat.progress()
                reply = _exchange(out, roles, sig)
                if "stop" in reply:
                    break
                watch()
                if install():  # the engine refreshes its shadows from the parameters at the call's start
                    engine.adapter_version = version
                if not reply["prompts"]:  # the staleness bound holds the rollout back: wait for the trainers
                    t = time.perf_counter()
                    time.sleep(0.05)
                    out = {"idle_s": time.perf_counter() - t}
                    continue
                try:
                    rollouter.generate(reply["prompts"], 0, overrides, feed.start(reply["chunk"], reply["prompts"]))
                except StreamStopped as stopped:  # the hub answered stop; what ran is cut (counted there)
                    reply = {"stop": str(stopped)}
                    break
                out = {}  # the feed sent every group and its time
    except Exception as exc:
        # the trainers stop the run with this line (rank 0 prints it); this rank leaves quietly
        with contextlib.suppress(Exception):
            send_obj({"error": str(exc) if isinstance(exc, QerlError) else f"{exc.__class__.__name__}: {exc}"}, 0,
                     roles.flow_group, tags)
        raise distributed.DistributedAbort(f"rollout rank {roles.rank} failed") from exc
    finally:
        beat.stop()
    sub.join(GOODBYE_TIMEOUT_S)
    return reply["stop"]


def _exchange(msg: dict[str, Any], roles: Roles, sig: _Signals) -> dict[str, Any]:
    """One request to the hub (with this rank's pending signal) and its reply."""
    msg["signal"] = sig.take()
    send_obj(msg, 0, roles.flow_group, (_TAG_HEAD, _TAG_BODY))
    reply, _ = recv_obj(0, roles.flow_group, (_TAG_REPLY_HEAD, _TAG_REPLY_BODY))
    return reply


def run_rollout_rank(trainer: Trainer, roles: Roles, start_from: Any, resume: bool) -> None:
    """What a rollout rank runs instead of the stage: the same setup and resume as the trainers (agreed with them:
    a failure anywhere stops every rank with one line), then :func:`rollout_loop`; it ends as the trainers did."""
    ctx = trainer.dist
    with ctx.agree("setup"):
        trainer.setup()
    with ctx.agree("setup"):
        if resume:
            trainer.resume(*start_from) if start_from is not None else trainer.resume()
    # this rank never steps: the AdamW moments a resume restored would hold memory its plan gave the KV cache (the
    # cache is allocated at the first chunk, after this, from what is allocated then: rollout/kv_cache.py)
    trainer.updater.optimizer.state.clear()
    reason = rollout_loop(trainer.rollouter, trainer.updater, roles, _plan_summary(trainer))
    if reason == "SIGTERM":
        raise Preempted("preempted (SIGTERM)")
    if reason == "SIGINT":
        raise KeyboardInterrupt
    if reason == "error":
        raise distributed.DistributedAbort("the trainers failed")


@contextlib.contextmanager
def session(trainer: Trainer, roles: Roles | None, rec: Any, stop: Any) -> Iterator[None]:
    """Around the trainers' steps (after setup and resume): the rollout source attached, and at the end closed (the
    rollout ranks stopped, the queue accounted in the manifest's ``train.extra.async``). A rollout rank's signal is
    passed to ``stop`` (the GracefulStop) as if this process had received it."""
    if roles is None:
        yield
        return
    source = TrainerSource(trainer.rollouter, trainer.updater, trainer.dist, roles, trainer.cfg.max_staleness)
    trainer.rollouter.source = source
    if trainer.dist.is_main:
        rec.extra["async"] = {**roles.record(), "max_staleness": trainer.cfg.max_staleness,
                              "correction": trainer.cfg.correction, "correction_cap": trainer.cfg.correction_cap,
                              # each role's own memory plan (docs/distributed.md): this rank's now, the rollout
                              # ranks' as they report them (recorded at the stop)
                              "roles": {"train": _plan_summary(trainer), "rollout": None}}
        source.watcher = _watch_peer_signals(source, stop)
    reason, clean = "done", True
    try:
        yield
    except Preempted:
        reason = "SIGTERM"
        raise
    except KeyboardInterrupt:
        reason = "SIGINT"
        raise
    except BaseException:
        reason, clean = "error", False
        raise
    finally:
        record = source.close(reason, clean=clean and source.failed_line is None)
        trainer.rollouter.source = None
        if trainer.dist.is_main:
            a = rec.extra["async"]
            a["roles"]["rollout"] = _rollout_summary(record.pop("rollout_plans", {}))
            # evidence that this trainer's engine never decoded: no KV cache was ever allocated on it
            a["roles"]["train"]["engine_kv_cache_bytes"] = getattr(trainer.engine, "kv_cache_bytes", None)
            a.update(record)


def _plan_summary(trainer: Trainer) -> dict[str, Any] | None:
    """This process's memory plan for its role, as the manifest records it (None: no plan was made)."""
    from qerl_cli.train.memory_plan import role_summary

    if trainer.memory_plan is None or trainer.settings is None:
        return None
    return role_summary(trainer.memory_plan, trainer.settings)


def _rollout_summary(plans: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The rollout ranks' plans as one record: the lowest rank's (they plan the same config on the same kind of
    GPU), naming any rank whose plan came out otherwise; None when no rank reported one."""
    if not plans:
        return None
    first = min(plans)
    out = {**plans[first], "reported_by": sorted(plans)}
    others = {str(r): p for r, p in sorted(plans.items()) if p != plans[first]}
    if others:
        out["differs"] = others
    return out


def _watch_peer_signals(source: TrainerSource, stop: Any) -> threading.Thread:
    """A rollout rank's SIGTERM/SIGINT becomes this process's stop request (the trainers then agree on it as on
    their own, at the next step boundary). The thread ends at the stop (joined by :meth:`TrainerSource.close`)."""

    def watch() -> None:
        while not source.closing.wait(0.1):
            sig = source.hub.peer_signal
            if sig is not None:
                stop.requested = True
                stop.preempted = stop.preempted or sig == "SIGTERM"
                return

    thread = threading.Thread(target=watch, name="qerl-peer-signals", daemon=True)
    thread.start()
    return thread
