"""Per-step phase timing (MSTAR_PHASE_TIMING=1): where the engine's time goes, step by step.

The engine core marks phase boundaries inside `step()`; the engine process notes the two
parts of its loop between steps (draining the command queue, emitting outputs and stats).
One JSON line per step goes to MSTAR_PHASE_LOG (appended; empty: stderr), written in
batches of FLUSH_EVERY steps and when the engine closes or the process exits:

    {"run": {"pid": ..., "model": ..., "device": ..., "started": ...}}          once per engine
    {"pid": 123, "step": 7, "decode": 8, "prefill_tokens": 0, "prefill_rows": 0,
     "schedule_us": 41.2, "prepare_us": 60.1, "plan_us": 0.0, "forward_us": 2210.4,
     "logits_us": 80.3, "sample_us": 95.0, "output_us": 30.2, "idle_us": 57.9,
     "idle_drain_us": 9.1, "idle_emit_us": 30.5}

Phases (host wall time, microseconds):
  schedule  scheduler.schedule(), preemption / admission bookkeeping, sampler rows of
            admitted requests, the encoder of admitted requests (Whisper)
  prepare   the step's rows (page lists, slots, token slices) and StepInputBuilder.build
            (host arrays, the two host-to-device copies)
  plan      host time of attention plan() calls (FlashInfer), which happen inside the first
            attention layer of the forward; 0 where the backend has no separate plan (CPU)
  forward   model.forward minus plan; on CUDA it ends with a synchronize, so it covers the
            kernels' execution, not only their launch
  logits    model.compute_logits over the sampling rows (the LM head); synchronized on CUDA
  sample    suppression masks and Sampler.sample, including the copy of the tokens to the host
  output    computed lengths, prefix-cache commits, appending tokens, stop checks, CoreOutputs,
            freeing finished requests
  idle      from the end of the previous step() to the start of this one, when the previous
            step left work to do (null after the engine ran dry: that gap is waiting for
            requests, not overhead). In the engine process idle_drain (command queue and
            add_request / abort) and idle_emit (stats, output queue put) are the known parts.

Off (the default) the engine holds no timer: `step()` tests `is not None` at each boundary
and calls no clock and no synchronize, so the default path is unchanged.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import time

import torch

from mstar.ops import phase_clock

PHASES = ("schedule", "prepare", "plan", "forward", "logits", "sample", "output")
FLUSH_EVERY = 256

_now = time.perf_counter_ns


class PhaseTimer:
    """Marks of one step: start() -> mark(1..6) -> end(...). Records are tuples in a
    preallocated list, turned into JSON at flush."""

    def __init__(self, path: str, device: torch.device, meta: dict | None = None, flush_every: int = FLUSH_EVERY):
        self.path = path
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.meta = dict(meta or {})
        self.flush_every = max(1, int(flush_every))
        self._buf: list = [None] * self.flush_every
        self._n = 0
        self._t = [0] * 7  # start, after schedule, after prepare, after forward, after logits, after sample, end
        self._plan = 0
        self._prev_end: int | None = None
        self._drain = 0
        self._emit = 0
        self.steps = 0
        self._header = False
        self._closed = False
        phase_clock.enabled = True
        atexit.register(self.close)

    # -- the engine core --------------------------------------------------------------------
    def start(self) -> None:
        self._t[0] = _now()

    def mark(self, i: int, sync: bool = False) -> None:
        if sync and self._cuda:
            torch.cuda.synchronize(self.device)
        self._t[i] = _now()

    def before_forward(self) -> None:
        self._t[2] = _now()
        phase_clock.take_plan_ns()  # drop anything planned outside the forward

    def after_forward(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._t[3] = _now()
        self._plan = phase_clock.take_plan_ns()

    def end(self, decode: int, prefill_tokens: int, prefill_rows: int, busy: bool) -> None:
        t = self._t
        t[6] = end = _now()
        idle = None if self._prev_end is None else t[0] - self._prev_end
        plan = self._plan
        rec = (self.steps, decode, prefill_tokens, prefill_rows,
               t[1] - t[0], t[2] - t[1], plan, t[3] - t[2] - plan, t[4] - t[3], t[5] - t[4], end - t[5],
               idle, self._drain if idle is not None else None, self._emit if idle is not None else None)
        self._buf[self._n] = rec
        self._n += 1
        self.steps += 1
        self._plan = self._drain = self._emit = 0
        self._prev_end = end if busy else None
        if self._n == self.flush_every:
            self.flush()

    # -- the engine process loop ------------------------------------------------------------
    def note_loop(self, drain_ns: int = 0, emit_ns: int = 0) -> None:
        """Parts of the gap before the next step (engine_process's loop)."""
        self._drain += drain_ns
        self._emit += emit_ns

    # -- output ---------------------------------------------------------------------------
    def flush(self) -> None:
        if not self._n and self._header:
            return
        lines = []
        if not self._header:
            run = {"pid": os.getpid(), "started": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "device": str(self.device), **self.meta}
            lines.append(json.dumps({"run": run}))
            self._header = True
        pid = os.getpid()
        us = _us
        for rec in self._buf[:self._n]:
            d = {"pid": pid, "step": rec[0], "decode": rec[1], "prefill_tokens": rec[2], "prefill_rows": rec[3]}
            for name, ns in zip(PHASES, rec[4:11]):
                d[name + "_us"] = us(ns)
            d["idle_us"] = us(rec[11])
            if rec[12] is not None and (rec[12] or rec[13]):
                d["idle_drain_us"] = us(rec[12])
                d["idle_emit_us"] = us(rec[13])
            lines.append(json.dumps(d))
        self._n = 0
        text = "\n".join(lines) + "\n"
        if not self.path:
            sys.stderr.write(text)
            sys.stderr.flush()
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            atexit.unregister(self.close)


def _us(ns: int | None) -> float | None:
    return None if ns is None else round(max(ns, 0) / 1000.0, 1)


def from_knobs(device: torch.device, meta: dict | None = None) -> PhaseTimer | None:
    """A timer when MSTAR_PHASE_TIMING is on, else None."""
    from mstar import knobs
    if not knobs.value("MSTAR_PHASE_TIMING"):
        return None
    return PhaseTimer(knobs.value("MSTAR_PHASE_LOG"), device, meta)
