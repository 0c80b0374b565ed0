"""Timing of tensor parallelism (tp.py): every rank's start-up phases and per-step statistics
(host clocks only, no device sync per step), and the lines they are logged as."""

from __future__ import annotations

import logging
import math
import sys
import time

import torch

log = logging.getLogger("mstar.runtime.parallel.tp")  # one logger for all of tensor parallelism

# every rank's start-up line names these phases, in this order (seconds; "-" where a phase did
# not happen). spawn: rank 0 starting the processes / a follower from that start to the first
# line of follower_main (interpreter start, unpickling: imports of the parent's __main__ and of
# tp_follower.py). init_process_group: the store rendezvous (waits for the slowest rank). load:
# model build + random init or checkpoint load. caches: allocating the KV pages / state slots.
# first_forward: the rank's first model.forward (on CUDA synchronised once: lazy NCCL
# communicator set-up, kernel compilation and autotuning land here). capture: decode graphs.
# total: spawn start until the rank could step, plus its first forward if that came later
# (the idle time before the first step is not counted).
STARTUP_PHASES = ("spawn", "init_process_group", "load", "caches", "first_forward", "capture", "total")


def now() -> float:
    return time.monotonic()  # CLOCK_MONOTONIC: comparable between the processes of one host


def dur(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1.0:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{1e3 * x:.2f} ms"
    return f"{1e6 * x:.1f} us"


def sync_once(device: torch.device) -> None:
    """Wait for the device (the first forward only), unless a CUDA graph is being captured."""
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize(device)


def startup_line(rank: int, ph: dict[str, float | None], extra: dict[str, float | None]) -> str:
    parts = ", ".join(f"{k} {dur(ph.get(k))}" for k in STARTUP_PHASES)
    more = ", ".join(f"{k} {dur(v)}" for k, v in extra.items() if v is not None)
    return f"tp start-up rank {rank}: {parts}" + (f" ({more})" if more else "")


class StepStat:
    """One per-step time (seconds): count, sum, the first value, and of the later ones the max
    (with its step number) and a log-scale histogram (16 bins per octave, with sums) for the
    median and the outliers. A few float operations per step: no list, no sync."""

    _PER_OCTAVE = 16
    _LO = 1e-7  # bin 0 holds everything below 0.1 us

    def __init__(self):
        self.n = 0
        self.total = 0.0
        self.first: float | None = None
        self.max = 0.0
        self.max_at = 0
        self.counts: dict[int, int] = {}
        self.sums: dict[int, float] = {}

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        if self.n == 1:
            self.first = x
            return
        if x > self.max:
            self.max, self.max_at = x, self.n
        b = int(math.log2(x / self._LO) * self._PER_OCTAVE) if x > self._LO else 0
        self.counts[b] = self.counts.get(b, 0) + 1
        self.sums[b] = self.sums.get(b, 0.0) + x

    def median(self) -> float | None:
        """Of the steps after the first (within a bin: about 4%)."""
        m = self.n - 1
        if m <= 0:
            return None
        seen = 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if 2 * seen >= m:
                return self.sums[b] / self.counts[b]
        return None

    def outliers(self, factor: float = 10.0) -> tuple[int, float]:
        """(count, sum) of the steps after the first that took over factor x the median."""
        med = self.median()
        if not med:
            return 0, 0.0
        lo = int(math.log2(factor * med / self._LO) * self._PER_OCTAVE) + 1
        n = sum(c for b, c in self.counts.items() if b >= lo)
        return n, sum(v for b, v in self.sums.items() if b >= lo)

    def summary(self) -> str:
        if not self.n:
            return "none"
        out = f"first {dur(self.first)}"
        if self.n > 1:
            rest = self.n - 1
            out += (f"; then {rest}: median {dur(self.median())}, mean {dur((self.total - self.first) / rest)}, "
                    f"max {dur(self.max)} (step {self.max_at})")
            k, tot = self.outliers()
            if k:
                out += f", {k} over 10x the median ({dur(tot)} in all)"
        return out


def emit(line: str) -> None:
    """A timing line: to the logger, or to stderr where no logging is configured."""
    if logging.getLogger().handlers or log.handlers:
        log.info("%s", line)
    else:  # e.g. the server's engine process, which configures no logging
        print(f"mstar.runtime.parallel.tp: {line}", file=sys.stderr, flush=True)

