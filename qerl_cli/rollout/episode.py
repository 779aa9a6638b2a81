"""Episodes in the builtin engine: a sequence pauses at the end of a model turn, a tool (or a user environment)
answers off the decode thread, and the answer resumes the sequence in the same KV cache.

What happens to one sequence (docs/tools.md):

* A model turn ends at a stop string or stop token (or, for synthetic benches, after ``turn_tokens`` tokens).
  The hooks are asked whether the turn is a step (``wants_step``: a tool call for a tool, every turn for an
  environment). If not, the sequence is finished as before.
* If it is, the sequence leaves the decode batch and is *parked*: its K/V stays in the cache, in a slot at the
  top of the cache (slot ``num_slots - 1 - j`` holds the j-th parked sequence; running sequences keep slots
  ``0..B-1``, admissions take the slots between). ``hooks.step`` runs in a worker thread; the other sequences
  keep decoding.
* When the step returns, the observation's tokens (truncated to the episode's token budget) are appended: the
  turn's last sampled token and the observation are prefilled into the slot at the positions that follow
  (``ModelRunner.extend``, several resumed sequences in one batch), and the next token is sampled from the last
  observation token's logits, with the same per-sequence noise keys as every other token. The observation's
  tokens carry no log-prob (0.0) and are listed in ``Sequence.observation_spans``: the trainer masks them.
* ``done`` from the step, ``max_turns`` turns, or a budget with no room left finish the episode; the last
  step's observation is then not appended.

A CUDA-graph decode pads its batch with rows that write position 0 of the slots above the batch, which may be
parked slots: a parked sequence keeps a copy of its position-0 K/V and writes it back when it resumes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from qerl_cli.errors import QerlError
from qerl_cli.rollout.scheduler import Scheduler, Sequence


@dataclass
class StepResult:
    """What one step of an episode returned. ``observation`` is appended after the turn (masked from the loss)
    unless ``done``; ``observation_ids`` (token ids) replace its encoding when given. ``error``: the tool failed
    (the observation says how, to the model). ``reward`` is summed over the episode's steps (environments)."""

    observation: str = ""
    done: bool = False
    reward: float = 0.0
    error: str | None = None
    action: str = ""
    observation_ids: list[int] | None = None
    seconds: float = 0.0
    observation_tokens: int = 0  # set by the engine: tokens appended (after truncation to the budget)
    truncated: bool = False  # set by the engine: the observation was cut to fit the episode's token budget


class EpisodeHooks(Protocol):
    """What the engine asks of one generate call's episodes (tools/episodes.py implements it)."""

    stop: tuple[str, ...]  # strings that end a model turn, beside the sampling's own stops
    max_turns: int  # model turns per episode
    turn_tokens: int | None  # a model turn ends after this many tokens (synthetic benches); None: a stop ends it
    workers: int  # steps run at once

    def wants_step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> bool:
        """Is model turn ``turn`` (1-based), with text ``text``, a step? Called on the decode thread: cheap."""

    def step(self, prompt_index: int, sample_index: int, turn: int, text: str) -> StepResult:
        """Run the step (a tool, an environment); called in a worker thread."""


@dataclass
class _Parked:
    seq: Sequence
    kv0: tuple[torch.Tensor, torch.Tensor]  # position 0's K/V when it was parked (see the module docstring)


class EpisodeScheduler(Scheduler):
    """The scheduler with episodes: parked sequences, steps in a thread pool, batched resumes."""

    def __init__(self, *args: Any, hooks: EpisodeHooks, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if hooks.max_turns < 1:
            raise QerlError(f"max_turns must be >= 1, got {hooks.max_turns}")
        self.hooks = hooks
        self.encode = encode
        self.decode = decode
        self.parked: list[_Parked] = []  # parked[j] lives in slot num_slots - 1 - j
        self.to_park: list[tuple[Sequence, tuple[torch.Tensor, torch.Tensor]]] = []
        self.inflight: dict[Future, Sequence] = {}
        self.pool = ThreadPoolExecutor(max(1, hooks.workers), thread_name_prefix="qerl-tool")
        self.stats.update(steps=0, resumes=0, resume_batches=0, observation_tokens=0, parked_max=0)
        self.tool_wait_s = 0.0
        self.resume_s = 0.0

    def run(self, prompts: list[list[int]], max_new: list[int]) -> list[Sequence]:
        try:
            return super().run(prompts, max_new)
        finally:
            for f in self.inflight:
                f.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _new_sequence(self, prompt_index: int, sample_index: int) -> Sequence:
        seq = super()._new_sequence(prompt_index, sample_index)
        if self.hooks.turn_tokens is not None:
            seq.turn_end = self.hooks.turn_tokens
        return seq

    # ----- slots ----------------------------------------------------------------------------------------

    def _busy(self) -> bool:
        return super()._busy() or bool(self.parked)

    def _free_slots(self) -> int:
        return self.num_slots - len(self.rows) - len(self.parked)

    def _park_slot(self, j: int) -> int:
        return self.num_slots - 1 - j

    # ----- a turn ends ----------------------------------------------------------------------------------

    def _turn_text(self, seq: Sequence) -> str:
        return self.decode(seq.tokens[seq.turn_start:])

    def _finished(self, slot: int, seq: Sequence) -> None:
        seq.version_last = self.version  # a parked sequence's last turn so far; its final one overwrites it
        self._keep_routing(slot, seq)  # a parked sequence's too: its resume writes it back beside its K/V
        turn = len(seq.steps) + 1
        if seq.finish_reason == "stop" and turn <= self.hooks.max_turns:
            text = self._turn_text(seq)
            if self.hooks.wants_step(seq.prompt_index, seq.sample_index, turn, text):
                # its slot is refilled by the compaction that follows: keep its K/V until then
                self.to_park.append((seq, self.cache.read(slot, seq.cache_len)))
                future = self.pool.submit(timed_step, self.hooks, seq.prompt_index, seq.sample_index, turn, text)
                self.inflight[future] = seq
                self.stats["steps"] += 1
                return
        seq.turn_end = None
        self._done(seq)

    def _retire(self, finished: list[int]) -> None:
        super()._retire(finished)
        for seq, (k, v) in self.to_park:
            slot = self._park_slot(len(self.parked))
            self.cache.write_prompt(slot, k, v)
            self.parked.append(_Parked(seq, (k[:, :1].clone(), v[:, :1].clone())))
        self.to_park.clear()
        self.stats["parked_max"] = max(self.stats["parked_max"], len(self.parked))

    # ----- steps return -----------------------------------------------------------------------------------

    def _poll(self) -> None:
        if not self.inflight:
            return
        # wait only when nothing else can run: no row decodes and nothing can be admitted
        idle = not self.rows and not (self._free_slots() > 0 and (self.waiting or self.stash is not None))
        t0 = time.perf_counter()
        done, _ = wait(list(self.inflight), timeout=None if idle else 0, return_when=FIRST_COMPLETED)
        if idle:
            self.tool_wait_s += time.perf_counter() - t0
        if not done:
            return
        results: list[tuple[Sequence, StepResult]] = []
        for f in done:
            seq = self.inflight.pop(f)
            result = step_result(f)
            seq.steps.append(result)
            results.append((seq, result))
        t1 = time.perf_counter()
        self._resume(results)
        self.resume_s += time.perf_counter() - t1

    def _unpark(self, leaving: list[Sequence]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Take ``leaving`` out of the parked slots (their K/V, position 0 restored, by uid) and close the gaps."""
        gone = {id(s) for s in leaving}
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for j, p in enumerate(self.parked):
            if id(p.seq) in gone:
                k, v = self.cache.read(self._park_slot(j), p.seq.cache_len)
                k[:, :1], v[:, :1] = p.kv0
                out[id(p.seq)] = (k, v)
        kept = [p for p in self.parked if id(p.seq) not in gone]
        old = {id(p.seq): j for j, p in enumerate(self.parked)}
        for j, p in enumerate(kept):  # increasing j: each destination is already free
            src = old[id(p.seq)]
            if src != j:
                self.cache.copy_slot(self._park_slot(src), self._park_slot(j), p.seq.cache_len)
        self.parked = kept
        return out

    def _resume(self, results: list[tuple[Sequence, StepResult]]) -> None:
        obs = {id(seq): next_observation(seq, r, self.hooks.max_turns, self.encode) for seq, r in results}
        kv = self._unpark([seq for seq, _ in results])
        back: list[tuple[Sequence, list[int]]] = []
        for seq, _ in results:
            ids = obs[id(seq)]
            if ids is None:
                seq.turn_end = None
                self._done(seq)
            else:
                back.append((seq, ids))
        if back:
            self._prefill_observations(back, kv)

    def _prefill_observations(self, back: list[tuple[Sequence, list[int]]],
                              kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put ``back`` into the decode batch: K/V into slots B.., the turn's last token + observation prefilled,
        the next turn's first token sampled."""
        device = self.runner.device
        b0, r = len(self.rows), len(back)
        starts = [seq.cache_len for seq, _ in back]
        feeds = [[seq.tokens[-1], *ids] for seq, ids in back]
        for j, (seq, _) in enumerate(back):
            self.cache.write_prompt(b0 + j, *kv[id(seq)], seq.routing)
        width = max(len(f) for f in feeds)
        ids_t = torch.zeros((r, width), dtype=torch.int64)
        for j, f in enumerate(feeds):
            ids_t[j, : len(f)] = torch.tensor(f, dtype=torch.int64)
        lengths = torch.tensor([len(f) for f in feeds], device=device)
        kv_len = self._kv_bucket(max(s + len(f) for s, f in zip(starts, feeds, strict=True)))
        logits = self.runner.extend(ids_t.to(device), torch.tensor(starts, device=device), lengths, b0, kv_len)
        for seq, ids in back:
            start = len(seq.tokens)
            seq.tokens.extend(ids)
            seq.logprobs.extend([0.0] * len(ids))
            if self.params.entropy:
                seq.entropies.extend([0.0] * len(ids))
            seq.observation_spans.append((start, start + len(ids)))
            seq.turn_start = len(seq.tokens)
            if self.hooks.turn_tokens is not None:
                seq.turn_end = seq.turn_start + self.hooks.turn_tokens
            seq.finish_reason = None
            self.stats["observation_tokens"] += len(ids)
        self.stats["resumes"] += r
        self.stats["resume_batches"] += 1
        self._sample_resumed([seq for seq, _ in back], logits)

    def _sample_resumed(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """The first token of each resumed sequence's next turn, and its decode state (as ``_start`` does)."""
        device = self.runner.device
        b0, m = len(self.rows), len(seqs)
        uids = torch.tensor([s.uid for s in seqs], dtype=torch.int64, device=device)
        steps = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.int64, device=device)
        tokens, logprobs, entropies = self.sampler.with_entropy(logits, uids, steps)
        self.tok[b0:b0 + m] = tokens
        self.pos[b0:b0 + m] = torch.tensor([s.cache_len + 1 for s in seqs], dtype=torch.int64, device=device)
        self.uid[b0:b0 + m] = uids
        self.step[b0:b0 + m] = steps + 1
        host_tokens = tokens.tolist()
        host_lps, host_ents = self._floats(logprobs, entropies)
        self.stats["syncs"] += 1
        self.rows.extend(seqs)
        finished = [b0 + j for j, seq in enumerate(seqs)
                    if self._append(seq, [host_tokens[j]], [host_lps[j]], [host_ents[j]] if host_ents else None)]
        self._retire(finished)


# (prompt index, sample index, turn, prompt + episode token ids so far, max new tokens) -> one model turn
TurnRequest = tuple[int, int, int, list[int], int]
# a model turn: (token ids, their log-probs, finish reason "stop" | "length")
TurnOutput = tuple[list[int], list[float], str]


def run_turns(prompts: list[list[int]], n: int, budgets: list[int], hooks: EpisodeHooks,
              encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
              generate_turn: Callable[[list[TurnRequest]], list[TurnOutput]]) -> list[Sequence]:
    """Episodes turn by turn for an engine that generates whole turns (vLLM: one generate call per round, the
    prompt and the episode so far as the prompt, its prefix cache keeping their K/V): every running episode's
    next turn, then their steps in a thread pool, then the observations appended. Same bookkeeping as
    :class:`EpisodeScheduler`: ``observation_spans``, ``steps``, log-prob 0.0 on observation tokens."""
    seqs = [Sequence(p, s, 0, prompts[p], budgets[p]) for p in range(len(prompts)) for s in range(n)]
    running = list(seqs)
    with ThreadPoolExecutor(max(1, hooks.workers), thread_name_prefix="qerl-tool") as pool:
        turn = 1
        while running:
            budget = [q.max_new - len(q.tokens) if hooks.turn_tokens is None else
                      min(q.max_new - len(q.tokens), hooks.turn_tokens) for q in running]
            outs = generate_turn([(q.prompt_index, q.sample_index, turn, q.prompt + q.tokens, m)
                                  for q, m in zip(running, budget, strict=True)])
            pending: list[tuple[Sequence, Future]] = []
            for q, (tokens, lps, finish) in zip(running, outs, strict=True):
                q.turn_start = len(q.tokens)
                q.tokens.extend(tokens)
                q.logprobs.extend(lps)
                # a turn that used up its own token budget ended like a stop; the episode's budget ends it all
                q.finish_reason = "length" if len(q.tokens) >= q.max_new else \
                    "stop" if hooks.turn_tokens is not None and len(tokens) >= hooks.turn_tokens else finish
                text = decode(q.tokens[q.turn_start:])
                if q.finish_reason == "stop" and turn <= hooks.max_turns and \
                        hooks.wants_step(q.prompt_index, q.sample_index, turn, text):
                    pending.append((q, pool.submit(timed_step, hooks, q.prompt_index, q.sample_index, turn, text)))
            running = []
            for q, future in pending:
                q.steps.append(step_result(future))
                ids = next_observation(q, q.steps[-1], hooks.max_turns, encode)
                if ids is not None:
                    q.observation_spans.append((len(q.tokens), len(q.tokens) + len(ids)))
                    q.tokens.extend(ids)
                    q.logprobs.extend([0.0] * len(ids))
                    q.finish_reason = None
                    running.append(q)
            turn += 1
    return seqs


def timed_step(hooks: EpisodeHooks, prompt_index: int, sample_index: int, turn: int, text: str) -> StepResult:
    """``hooks.step`` in a worker thread, its wall time recorded in the result."""
    t0 = time.perf_counter()
    result = hooks.step(prompt_index, sample_index, turn, text)
    result.seconds = time.perf_counter() - t0
    return result


def step_result(future: Future) -> StepResult:
    """A finished step's result; a step that raised is a bug in the environment (a QerlError), not an observation
    (the built-in tools turn their own failures into observations)."""
    try:
        return future.result()
    except QerlError:
        raise
    except Exception as exc:
        raise QerlError(f"an episode step raised {type(exc).__name__}: {exc}") from exc


def next_observation(seq: Sequence, result: StepResult, max_turns: int,
                     encode: Callable[[str], list[int]]) -> list[int] | None:
    """The tokens to append after a step (``seq.steps`` ends with its ``result``), cut to the episode's budget;
    None when the episode ends there (done, ``max_turns`` turns, or no room left for another model token)."""
    if result.done or len(seq.steps) >= max_turns:
        return None
    ids = list(result.observation_ids) if result.observation_ids is not None else encode(result.observation)
    room = seq.max_new - len(seq.tokens) - 1  # the model needs at least one token after it
    if room < 1:
        seq.finish_reason = "length"
        return None
    if len(ids) > room:
        ids, result.truncated = ids[:room], True
    result.observation_tokens = len(ids)
    return ids
