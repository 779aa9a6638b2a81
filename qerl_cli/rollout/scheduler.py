"""Continuous batching over a fixed number of KV-cache slots.

* Each prompt is prefilled ONCE; its K/V is copied into one slot per sample (``n`` samples share the
  prefill, and the first token of each sample is drawn from the shared last-token logits with that
  sample's own noise key). If fewer than ``n`` slots are free, the prompt's K/V and logits wait in a
  stash (at most one prompt at a time) until slots free up.
* Running sequences always occupy slots ``0..B-1``: when a sequence finishes, the sequence in the
  highest slot moves into its slot (one slot copy per finished sequence, not a gather per step), so the
  decode step works on a contiguous prefix of the cache.
* The decode loop runs ``k`` steps on the device between host syncs (``sync_every``), sampling on
  device. ``k`` never exceeds the smallest remaining length budget, so length limits are exact without
  a sync; a stop token found at a sync truncates the sequence there and the few steps computed past it
  are dropped (they cannot change anything: noise is keyed per sequence and step, and a sequence only
  reads its own slot).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from qerl_cli.rollout.kv_cache import KVCache, bucket_for
from qerl_cli.rollout.model_runner import ModelRunner
from qerl_cli.rollout.sampling import SamplingParams, StepSampler, TokenNoise

DecodeFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
# Prompts streaming into a running call (the asynchronous rollout ranks): (the sequences of the groups that
# completed since the last call, in (prompt, sample) order; how many more prompts the free slots could start now;
# the call's progress so far: prefill_s, decode_s, decode_steps) -> new prompts as (token ids, max new tokens, noise
# key). Raising StreamStopped ends the call at once.
Feed = Callable[[list["Sequence"], int, dict[str, float]], list[tuple[list[int], int, int]]]
# (sequence, number of tokens already checked) -> completion length ending at the stop string, or None
StopCheck = Callable[["Sequence", int], "int | None"]


class StreamStopped(Exception):
    """Raised by a :data:`Feed` to end the call it feeds: what was running or waiting is abandoned."""


@dataclass
class Sequence:
    prompt_index: int
    sample_index: int
    uid: int
    prompt: list[int]
    max_new: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)  # with SamplingParams.entropy
    finish_reason: str | None = None
    # Episodes (rollout/episode.py): where the current model turn starts in ``tokens`` (stop strings are looked
    # for in this turn only: an observation may contain one), the token count that ends the turn (None: a stop
    # ends it), the observation spans [start, end) of ``tokens`` and what each tool step returned.
    turn_start: int = 0
    turn_end: int | None = None
    observation_spans: list[tuple[int, int]] = field(default_factory=list)
    steps: list[Any] = field(default_factory=list)
    # a mixture of experts' recorded top-k per cached position [cache_len, layers, k] (routing replay), taken when
    # the sequence leaves its slot; None for a dense model
    routing: torch.Tensor | None = None
    # the adapter versions (``Scheduler.version``) it was admitted (its prompt's K/V computed) and retired under:
    # they differ when new adapters were applied between decode windows while it ran
    version_first: int = 0
    version_last: int = 0

    @property
    def cache_len(self) -> int:
        """Positions already in the KV cache (the last sampled token is not yet)."""
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def limit(self) -> int:
        """The token count at which the sequence stops decoding now: its budget, or the end of its turn."""
        return self.max_new if self.turn_end is None else min(self.max_new, self.turn_end)


@dataclass
class _Stash:
    prompt_index: int
    next_sample: int
    logits: torch.Tensor  # [V]
    k: torch.Tensor  # [layers, len, kv_heads, head_dim]
    v: torch.Tensor
    routing: torch.Tensor | None = None  # [len, layers, k]


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: KVCache,
        decode_fn: DecodeFn,
        params: SamplingParams,
        seed: int,
        noise: TokenNoise,
        stop_token_ids: set[int],
        stop_check: StopCheck | None,
        sync_every: int,
        max_prefill_tokens: int,
        kv_buckets: list[int],
        on_window: Callable[[], int | None] | None = None,
        version: int = 0,
        feed: Feed | None = None,
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.decode_fn = decode_fn
        self.params = params
        self.sampler = StepSampler(params, noise, seed, runner.device)
        self.noise = noise
        self.stop_ids = stop_token_ids
        self.stop_check = stop_check
        self.sync_every = max(1, sync_every)
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_buckets = kv_buckets
        # between decode windows: new adapters applied (their version), else None (engine.adapter_updates)
        self.on_window = on_window
        self.version = version
        # between decode windows: finished groups out, more prompts in (engine.prompt_feed); None: the call's
        # prompts are all it runs
        self.feed = feed
        # a prompt whose first samples were admitted before an adapter change: the sample its re-prefill starts at
        self.first_sample: dict[int, int] = {}
        self.num_slots = cache.num_slots
        device = runner.device
        # Per-slot decode state, on device.
        self.tok = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        self.pos = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        self.uid = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        self.step = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        self.rows: list[Sequence] = []
        self.done: list[Sequence] = []
        self.stash: _Stash | None = None
        self.waiting: deque[int] = deque()
        self.prompts: list[list[int]] = []
        self.max_new: list[int] = []
        # per prompt: the index its samples' noise is keyed by (uid = key * n + sample), and its samples not finished
        self.keys: list[int] = []
        self.left: list[int] = []
        self.stats = {
            "prefill_prompts": 0,
            "prefill_batches": 0,
            "prefill_tokens": 0,
            "prefill_padded_tokens": 0,
            "decode_steps": 0,
            "decode_row_steps": 0,
            "syncs": 0,
            "discarded_tokens": 0,
        }
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.ttft: float | None = None
        self._t0 = 0.0

    # ----- main loop ----------------------------------------------------------------------------------

    def run(self, prompts: list[list[int]], max_new: list[int]) -> list[Sequence]:
        self.prompts, self.max_new = list(prompts), list(max_new)
        self.keys = [self.params.prompt_offset + i for i in range(len(prompts))]
        self.left = [self.params.n] * len(prompts)
        self.waiting = deque(range(len(prompts)))
        self._t0 = time.perf_counter()
        while self._busy():
            self._poll()
            if self._free_slots() > 0 and (self.waiting or self.stash is not None):
                t = time.perf_counter()
                self._admit()
                self.prefill_s += time.perf_counter() - t
            if self.rows:
                t = time.perf_counter()
                self._decode_window()
                self.decode_s += time.perf_counter() - t
                self._new_adapters()
            self._stream()
        self.done.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return self.done

    def _stream(self) -> None:
        """Between decode windows, with a feed: hand it the groups whose samples all finished, and take the prompts
        it streams in as the slots free up (continuous batching across the engine calls' prompt lists). Asked for
        prompts only once every prompt it gave has been admitted, so a prompt waits here as little as possible and
        the staleness clock (its admission's adapter version) starts when it runs."""
        if self.feed is None:
            return
        complete = [s for s in self.done if self.left[s.prompt_index] == 0]
        want = 0
        if not self.waiting and self.stash is None and self._free_slots() > 0:
            want = -(-self._free_slots() // self.params.n)
        if not complete and not want:
            return
        self.done = [s for s in self.done if self.left[s.prompt_index] > 0]
        complete.sort(key=lambda s: (s.prompt_index, s.sample_index))
        progress = {"prefill_s": self.prefill_s, "decode_s": self.decode_s,
                    "decode_steps": float(self.stats["decode_steps"])}
        for ids, max_new, key in self.feed(complete, want, progress):
            self.waiting.append(len(self.prompts))
            self.prompts.append(ids)
            self.max_new.append(max_new)
            self.keys.append(key)
            self.left.append(self.params.n)

    def _new_adapters(self) -> None:
        """New adapters between decode windows (the asynchronous rollout ranks): later tokens of the running
        sequences are sampled under them. A prompt prefill kept for the prompt's later samples was computed under the
        old adapters, so it is dropped and that prompt prefilled again: K/V reuse never crosses a version."""
        if self.on_window is None:
            return
        version = self.on_window()
        if version is None or version == self.version:
            return
        self.version = version
        if self.stash is not None:
            self.first_sample[self.stash.prompt_index] = self.stash.next_sample
            self.waiting.appendleft(self.stash.prompt_index)
            self.stash = None

    def _busy(self) -> bool:
        return bool(self.waiting or self.stash is not None or self.rows)

    def _poll(self) -> None:
        """Between decode windows: nothing here (the episode scheduler resumes sequences whose tool returned)."""

    def _free_slots(self) -> int:
        return self.num_slots - len(self.rows)

    # ----- admission: prefill and first token ---------------------------------------------------------

    def _new_sequence(self, prompt_index: int, sample_index: int) -> Sequence:
        return Sequence(
            prompt_index=prompt_index,
            sample_index=sample_index,
            uid=self.keys[prompt_index] * self.params.n + sample_index,
            prompt=self.prompts[prompt_index],
            max_new=self.max_new[prompt_index],
            version_first=self.version,
        )

    def _take_from_stash(self, free: int, new: list[Sequence], logit_rows: list[torch.Tensor]) -> int:
        stash = self.stash
        assert stash is not None
        while free > 0 and stash.next_sample < self.params.n:
            seq = self._new_sequence(stash.prompt_index, stash.next_sample)
            self.cache.write_prompt(len(self.rows) + len(new), stash.k, stash.v, stash.routing)
            new.append(seq)
            logit_rows.append(stash.logits)
            stash.next_sample += 1
            free -= 1
        if stash.next_sample == self.params.n:
            self.stash = None
        return free

    def _pick_prefill_batch(self, free: int) -> list[int]:
        batch: list[int] = []
        longest = 0
        slots = 0
        while self.waiting and slots < free:
            idx = self.waiting[0]
            length = len(self.prompts[idx])
            padded = (len(batch) + 1) * max(longest, length)
            if batch and padded > self.max_prefill_tokens:
                break
            batch.append(self.waiting.popleft())
            longest = max(longest, length)
            slots += self.params.n - self.first_sample.get(idx, 0)
        return batch

    def _admit(self) -> None:
        free = self._free_slots()
        new: list[Sequence] = []
        logit_rows: list[torch.Tensor] = []
        if self.stash is not None:
            free = self._take_from_stash(free, new, logit_rows)
        while free > 0 and self.waiting and self.stash is None:
            batch = self._pick_prefill_batch(free)
            free -= self._prefill(batch, free, new, logit_rows)
        if not new:
            return
        self._start(new, logit_rows)

    def _prefill(self, batch: list[int], free: int, new: list[Sequence], logit_rows: list[torch.Tensor]) -> int:
        """Prefill ``batch`` and hand its samples up to ``free`` slots; returns the slots taken."""
        taken = free
        device = self.runner.device
        lengths = [len(self.prompts[i]) for i in batch]
        width = max(lengths)
        ids = torch.zeros((len(batch), width), dtype=torch.int64)
        for row, i in enumerate(batch):
            ids[row, : lengths[row]] = torch.tensor(self.prompts[i], dtype=torch.int64)
        logits, k, v = self.runner.prefill(ids.to(device), torch.tensor(lengths, device=device))
        self.stats["prefill_prompts"] += len(batch)
        self.stats["prefill_batches"] += 1
        self.stats["prefill_tokens"] += sum(lengths)
        self.stats["prefill_padded_tokens"] += len(batch) * width
        routing = self.runner.prefill_routing
        for row, i in enumerate(batch):
            pk, pv = k[:, row, : lengths[row]], v[:, row, : lengths[row]]
            pr = routing[row, : lengths[row]] if routing is not None else None
            sample = self.first_sample.pop(i, 0)
            while sample < self.params.n and free > 0:
                self.cache.write_prompt(len(self.rows) + len(new), pk, pv, pr)
                new.append(self._new_sequence(i, sample))
                logit_rows.append(logits[row])
                sample += 1
                free -= 1
            if sample < self.params.n:
                # Only the last prompt of a batch can overflow: the batch was sized to the free slots.
                self.stash = _Stash(i, sample, logits[row].clone(), pk.clone(), pv.clone(),
                                    pr.clone() if pr is not None else None)
        return taken - free

    def _start(self, new: list[Sequence], logit_rows: list[torch.Tensor]) -> None:
        device = self.runner.device
        b0, m = len(self.rows), len(new)
        uids = torch.tensor([s.uid for s in new], dtype=torch.int64, device=device)
        steps = torch.zeros(m, dtype=torch.int64, device=device)
        tokens, logprobs, entropies = self.sampler.with_entropy(torch.stack(logit_rows), uids, steps)
        self.tok[b0 : b0 + m] = tokens
        self.pos[b0 : b0 + m] = torch.tensor([len(s.prompt) for s in new], dtype=torch.int64, device=device)
        self.uid[b0 : b0 + m] = uids
        self.step[b0 : b0 + m] = 1
        host_tokens = tokens.tolist()
        host_lps, host_ents = self._floats(logprobs, entropies)
        self.stats["syncs"] += 1
        if self.ttft is None:
            self.ttft = time.perf_counter() - self._t0
        self.rows.extend(new)
        finished = []
        for j, seq in enumerate(new):
            if self._append(seq, [host_tokens[j]], [host_lps[j]], [host_ents[j]] if host_ents else None):
                finished.append(b0 + j)
        self._retire(finished)

    # ----- decode -------------------------------------------------------------------------------------

    def _kv_bucket(self, need: int) -> int:
        return bucket_for(self.kv_buckets, need, "decode attention length (tokens cached per sequence)")

    def _decode_window(self) -> None:
        b = len(self.rows)
        k = min(self.sync_every, min(s.limit - len(s.tokens) for s in self.rows))
        # The last step of the window processes the token at position cache_len + k - 1.
        kv_len = self._kv_bucket(max(s.cache_len for s in self.rows) + k)
        tok, pos, uid, step = self.tok[:b], self.pos[:b], self.uid[:b], self.step[:b]
        out_tokens, out_lps, out_ents = [], [], []
        # the sampler inside the decode graph where it is one checked kernel (CudaGraphDecoder.sample)
        in_graph = hasattr(self.decode_fn, "sample") and self.sampler.capturable
        # an attention backend planned on the host (FlashInfer) is told each step's positions, known here
        plan = self.runner.attention.needs_host_positions
        base = [s.cache_len for s in self.rows] if plan else []
        for j in range(k):
            host = {"host_positions": [p + j for p in base]} if plan else {}
            ent = None
            if in_graph:
                t, lp = self.decode_fn.sample(tok, pos, kv_len, self.sampler, uid, step, **host)  # type: ignore[attr-defined]
            else:
                t, lp, ent = self.sampler.with_entropy(self.decode_fn(tok, pos, kv_len, **host), uid, step)
            out_tokens.append(t)
            out_lps.append(lp)
            if ent is not None:
                out_ents.append(ent)
            tok.copy_(t)
            pos.add_(1)
            step.add_(1)
        host_tokens = torch.stack(out_tokens, dim=1).cpu().tolist()  # [B, k]
        host_lps, host_ents = self._floats(torch.stack(out_lps, dim=1),
                                           torch.stack(out_ents, dim=1) if out_ents else None)
        self.stats["decode_steps"] += k
        self.stats["decode_row_steps"] += k * b
        self.stats["syncs"] += 1
        finished = [i for i, seq in enumerate(self.rows)
                    if self._append(seq, host_tokens[i], host_lps[i], host_ents[i] if host_ents else None)]
        self._retire(finished)

    @staticmethod
    def _floats(logprobs: torch.Tensor, entropies: torch.Tensor | None) -> tuple[list[Any], list[Any] | None]:
        """Log-probs (and entropies) on the host, in one transfer."""
        if entropies is None:
            return logprobs.float().cpu().tolist(), None
        both = torch.stack([logprobs.float(), entropies.float()]).cpu().tolist()
        return both[0], both[1]

    def _append(self, seq: Sequence, tokens: list[int], lps: list[float], ents: list[float] | None = None) -> bool:
        """Add a window's tokens to ``seq`` up to its first finish; True if it finished."""
        checked = len(seq.tokens)
        for j, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
            seq.tokens.append(token)
            seq.logprobs.append(lp)
            if ents is not None:
                seq.entropies.append(ents[j])
            if token in self.stop_ids:
                seq.finish_reason = "stop"
            elif len(seq.tokens) >= seq.max_new:
                seq.finish_reason = "length"
            elif seq.turn_end is not None and len(seq.tokens) >= seq.turn_end:
                seq.finish_reason = "stop"  # a turn with a fixed token budget (synthetic episodes)
            if seq.finish_reason is not None:
                self.stats["discarded_tokens"] += len(tokens) - j - 1
                break
        if self.stop_check is not None:
            cut = self.stop_check(seq, checked)
            if cut is not None:
                self.stats["discarded_tokens"] += len(seq.tokens) - cut
                del seq.tokens[cut:]
                del seq.logprobs[cut:]
                del seq.entropies[cut:]
                seq.finish_reason = "stop"
        return seq.finish_reason is not None

    def _retire(self, finished: list[int]) -> None:
        """Drop finished rows; refill their slots from the highest running slots (compaction)."""
        if not finished:
            return
        gone = set(finished)
        keep_b = len(self.rows) - len(gone)
        holes = [i for i in range(keep_b) if i in gone]
        movers = [i for i in range(keep_b, len(self.rows)) if i not in gone]
        for i in sorted(gone):
            self._finished(i, self.rows[i])
        for dst, src in zip(holes, movers, strict=True):
            seq = self.rows[src]
            self.cache.copy_slot(src, dst, seq.cache_len)
            self.rows[dst] = seq
        if holes:
            device = self.runner.device
            dst_t = torch.tensor(holes, device=device)
            src_t = torch.tensor(movers, device=device)
            for state in (self.tok, self.pos, self.uid, self.step):
                state[dst_t] = state[src_t]
        del self.rows[keep_b:]

    def _finished(self, slot: int, seq: Sequence) -> None:
        """A sequence in ``slot`` stopped; its slot is reused right after this returns."""
        seq.version_last = self.version
        self._keep_routing(slot, seq)
        self._done(seq)

    def _done(self, seq: Sequence) -> None:
        """``seq`` is final: the call returns it (or hands it to the feed once its group is complete)."""
        self.left[seq.prompt_index] -= 1
        self.done.append(seq)

    def _keep_routing(self, slot: int, seq: Sequence) -> None:
        """The recorded routing of ``seq``'s cached positions, copied out of ``slot`` before the slot is reused."""
        seq.routing = self.cache.read_routing(slot, seq.cache_len)
