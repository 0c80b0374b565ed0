"""Continuous batching: which sequences run this step, and how many tokens each.

A step is decode rows first (one token each: the last sampled token of a sequence whose
history is all in the caches), then prefill rows (a chunk of the tokens not yet computed:
a new prompt, the rest of a long prompt, or a preempted sequence being recomputed). The
prefill chunks share a token budget per step (`max_num_batched_tokens`); decode rows are
bounded by `max_num_seqs` only.

Memory policy:
  * admission: a waiting sequence gets a state slot and its cached prefix (CacheManager.
    admit), then pages for all of its known tokens at once (ensure_capacity), so a prefill
    never runs out of pages half-way. No room: it stays at the head of the queue (FIFO).
  * decode: each running sequence needs room for one more token; when the pool is dry
    the most recently admitted running sequence is preempted, repeatedly, until the
    request fits (the sequence itself goes last if it is the most recent).
  * preemption "recompute": the sequence's pages and slot are freed (full pages stay in
    the prefix cache, so the recompute is mostly hits) and it goes back to the front of
    the queue with its generated tokens, to be prefilled again. "offload": the cache
    manager moves its pages and state to host memory; on re-admission it is reloaded and
    resumes where it stopped.
  * no admissions in a step that preempted (the pool is known to be tight).

Admission batching (`admit_min_free` > 0): while decode rows are running, new requests
are admitted only once a batch of them can be admitted together (that many rows free and
that many waiting), or once they have been held `admit_max_wait` steps. The batch is
`admit_min_free`, or a quarter of the requests in the engine (running + waiting) if that is
smaller: a server at low concurrency (8 requests in flight, max_num_seqs 256) admits a
burst at once instead of holding it for rows it will never fill. Decode-only steps replay
CUDA graphs and a step with prefill rows runs eagerly, so admitting the requests that
finish a few at a time in one batch turns many small eager steps into a few large ones. Tokens do not
change (a row's tokens do not depend on its batch), only when prefills run.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mstar.runtime.engine.request import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request inside the core: its tokens and where it stands."""

    request_id: str
    token_ids: list[int]  # prompt + generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]  # eos (unless ignore_eos) and stop_token_ids
    seed: int
    max_len: int  # hard cap on len(token_ids) (max_model_len)
    arrival: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV / state are in the caches
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    admitted_once: bool = False
    in_cache: bool = False  # the cache manager holds something for it (slot, pages, offload)
    offloaded: bool = False
    sampler_row: int = -1
    sampler_values: Any = None  # Sampler.row_values, built when the request is added
    # the admission stage's input (run again at every admission) and the token-suppression
    # lists (every step / first generated token)
    encoder_input: Any = None
    suppress_ids: tuple[int, ...] = ()
    begin_suppress_ids: tuple[int, ...] = ()
    media: bool = False  # a media request: its tokens pass through the family's output stage

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class PrefillRow:
    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token: its logits give the next token."""
        return self.end == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillRow] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # got a slot this step
    preempted: list[Sequence] = field(default_factory=list)  # lost it this step
    failed: list[Sequence] = field(default_factory=list)  # can never fit: the core finishes them

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(r.end - r.start for r in self.prefill)


class Scheduler:
    def __init__(self, cache_manager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute", admit_min_free: int = 0, admit_max_wait: int = 16):
        self.cm = cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.admit_min_free = admit_min_free
        self.admit_max_wait = admit_max_wait
        self._held_steps = 0  # steps admissions were held back while requests waited
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- queue changes -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free everything it holds."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SeqStatus.FINISHED
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.in_cache:
            self.cm.free(seq.request_id)
            seq.in_cache = False
        seq.offloaded = False

    # --- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        cm = self.cm
        running = self.running

        # 1. running sequences, in admission order; preempt from the back when pages run out
        i = 0
        while i < len(running):
            seq = running[i]
            total = len(seq.token_ids)
            if total - seq.num_computed == 1 and seq.num_computed > 0:
                while not cm.ensure_capacity(seq.request_id, total):
                    victim = running[-1]
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                else:
                    out.decode.append(seq)
                    i += 1
                continue
            # a prefill in progress (its pages were taken at admission)
            if budget > 0:
                end = min(total, seq.num_computed + budget)
                out.prefill.append(PrefillRow(seq, seq.num_computed, end))
                budget -= end - seq.num_computed
            i += 1

        # 2. admissions, FIFO, while there is budget, a free row, a slot and pages
        if not out.preempted and self._admitting(out):
            while self.waiting and budget > 0 and len(running) < self.max_num_seqs:
                seq = self.waiting[0]
                if not self._admit(seq):
                    if not running and not out.decode and not out.prefill:
                        # nothing holds memory and it still does not fit: it never will
                        self.waiting.popleft()
                        out.failed.append(seq)
                        continue
                    break
                self.waiting.popleft()
                seq.status = SeqStatus.RUNNING
                running.append(seq)
                out.admitted.append(seq)
                total = len(seq.token_ids)
                if total - seq.num_computed == 1 and seq.num_computed > 0:
                    out.decode.append(seq)  # reloaded in the middle of decoding
                    continue
                end = min(total, seq.num_computed + budget)
                out.prefill.append(PrefillRow(seq, seq.num_computed, end))
                budget -= end - seq.num_computed
        return out

    def _batch_ready(self) -> bool:
        """Enough rows free and enough requests waiting to admit a batch at once (module docstring)."""
        want = min(self.admit_min_free, -(-(len(self.running) + len(self.waiting)) // 4))
        return min(self.max_num_seqs - len(self.running), len(self.waiting)) >= want

    def admission_held(self) -> bool:
        """Would the next schedule() (with decode rows running) hold the waiting requests back?"""
        return bool(self.admit_min_free) and not self._batch_ready() and self._held_steps < self.admit_max_wait

    def _admitting(self, out: SchedulerOutput) -> bool:
        """Admission batching (module docstring): admit now, or hold for a bigger batch."""
        if not self.admit_min_free or not self.waiting or not out.decode or out.prefill:
            self._held_steps = 0
            return True
        if self._batch_ready() or self._held_steps >= self.admit_max_wait:
            self._held_steps = 0
            return True
        self._held_steps += 1
        return False

    def _admit(self, seq: Sequence) -> bool:
        cm = self.cm
        rid = seq.request_id
        total = len(seq.token_ids)
        if seq.offloaded:
            if not cm.reload(rid):
                return False
            seq.offloaded = False
            if not cm.ensure_capacity(rid, total):
                cm.offload(rid)
                seq.offloaded = True
                return False
            return True
        hit = cm.admit(rid, seq.token_ids)
        if hit is None:
            return False
        if not cm.ensure_capacity(rid, total):
            cm.free(rid)
            return False
        seq.in_cache = True
        seq.num_computed = hit
        if not seq.admitted_once:
            seq.num_cached_tokens = hit
            seq.admitted_once = True
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        if self.preemption_mode == "offload" and seq.num_computed > 0:
            self.cm.offload(seq.request_id)
            seq.offloaded = True
        else:
            self._release(seq)
            seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        # a victim already scheduled for a prefill chunk this step loses it
        out.prefill = [r for r in out.prefill if r.seq is not seq]
