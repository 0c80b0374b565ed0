"""Microseconds a launch of a small GPU op, as a CUDA graph replays it (the probes' timer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def graph_us(fn: Callable, inputs: Sequence = (None,), reps: int = 20, replays: int = 5) -> float:
    """fn(x) for every x in inputs, reps times over, captured in one CUDA graph; the best of `replays`
    replays, per launch. Several inputs (e.g. copies of a weight) make the launches read past L2."""
    for x in inputs:
        fn(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for x in inputs:
                fn(x)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (reps * len(inputs)))
    return best
