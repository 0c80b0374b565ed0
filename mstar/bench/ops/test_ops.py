"""Every op and every backend available here, at the served models' shapes, checked against the
reference and then timed (median of rounds; each round runs the op several times and
synchronises once, so launch overhead is amortised as it is in a real step)."""

from __future__ import annotations

import time

import pytest
import torch

from mstar.ops import registry

from mstar.bench.ops.cases import ROWS, build_cases, device, rate_columns

DEV = device()
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
CASES = build_cases(DEV, DTYPE)


def _params():
    out = []
    for case in CASES:
        entry = registry.get(case.op)
        for b in entry.backends.values():
            if DEV in b.devices and b.is_available():
                out.append(pytest.param(case, b.name, id=f"{case.op}-{case.label.replace(' ', '_')}-{b.name}"))
    return out


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _close(a, b, tol) -> bool:
    if a is None:
        return True
    if isinstance(a, (tuple, list)):
        return all(_close(x, y, tol) for x, y in zip(a, b))
    if a.numel() == 0:  # e.g. sample's top ids / logprobs with num_logprobs = 0 (a mean would be NaN)
        return a.shape == b.shape
    if not a.is_floating_point():
        return bool((a == b).float().mean() > 0.99)  # sampled ids: ties may break differently
    if a.element_size() == 1:  # float8: a value may round one step the other way
        return bool((a.float() != b.float()).float().mean() < 1e-3)
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _capture(fn, args, inner):
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn(*args)
        graph.replay()
        _sync()
        return graph
    except Exception:  # not capturable: host syncs inside
        torch.cuda.synchronize()
        return None


@pytest.mark.parametrize("case,backend", _params())
def test_op(benchmark, case, backend):
    entry = registry.get(case.op)
    fn = entry.backends[backend].fn
    args = case.make_args()
    if backend != "reference":
        ref_args = _clone(args)
        tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
        assert _close(fn(*_clone(args)), entry.backends["reference"].fn(*ref_args), tol), \
            f"{backend} disagrees with the reference on {case.op} {case.label}"
    fn(*args)  # warm-up (compiles, caches)
    time_and_record(benchmark, case, backend, fn, args, graphs=backend != "reference")


def time_and_record(benchmark, case, name, fn, args, graphs=True, **extra) -> None:
    """Median time of fn(*args) over rounds of ~20 ms (so timer noise is small) -> one row.
    On CUDA (graphs=True) the round is a CUDA-graph replay: the kernels' time, not Python's
    launch cost, as in a decode step; what cannot be captured (host syncs) stays eager,
    marked as such."""
    _sync()
    t0 = time.perf_counter()
    fn(*args)
    _sync()
    once = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, min(200, int(0.02 / once)))

    def run():
        for _ in range(inner):
            fn(*args)
        _sync()

    mode = "eager"
    if DEV == "cuda" and graphs:
        graph = _capture(fn, args, inner)
        if graph is not None:
            mode = "graph"

            def run():
                graph.replay()
                _sync()

    benchmark.pedantic(run, rounds=5 if DEV == "cpu" else 20, iterations=1, warmup_rounds=1)
    if benchmark.stats is None:  # --benchmark-disable: the op ran and was checked, not timed
        return
    median = benchmark.stats.stats.median / inner
    row = {"op": case.op, "case": case.label, "backend": name, "mode": mode, "median_us": median * 1e6,
           **extra, **rate_columns(case, median, DEV)}
    benchmark.extra_info.update(row)
    ROWS.append(row)
