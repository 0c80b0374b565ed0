"""The sampler's own path beside the `sample` op rows of test_ops.py: `sampling.sample_planned`
with the plan the Sampler makes on the host (no host sync, so on CUDA it is timed from a
CUDA-graph replay, as the op backends are), at the sampler cases of bench/cases.py.

Rows: op "sample", backend "planned" (torch one-pass stage) and "planned+triton" (the Triton
one-pass kernel, where it loads)."""

from __future__ import annotations

import importlib
import time

import pytest
import torch

from mstar.ops import sampling

from bench.cases import build_cases, rate_columns
from bench.conftest import ROWS, device
from bench.test_ops import _capture, _sync

DEV = device()
CASES = [c for c in build_cases(DEV, torch.float32) if c.op == "sample"]


def _impls():
    out = [("planned", None)]
    if DEV == "cuda":
        try:
            ts = importlib.import_module("mstar.ops.backends.triton_sampling")
            out.append(("planned+triton", ts.gumbel_argmax))
        except Exception:  # no Triton here
            pass
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.label.replace(" ", "_") for c in CASES])
@pytest.mark.parametrize("name,impl", _impls(), ids=[n for n, _ in _impls()])
def test_planned(benchmark, case, name, impl):
    args = case.make_args()
    logits, t, k, p, mp, seeds, steps, n = args
    plan = sampling.make_plan(t.cpu().numpy(), k.cpu().numpy(), p.cpu().numpy(), mp.cpu().numpy(), logits.shape[1])

    def fn():
        return sampling.sample_planned(logits, t, k, p, mp, seeds, steps, n, plan, impl)

    out = fn()
    want = sampling.sample.backends["reference"].fn(*args)
    decided = out[4]
    assert torch.equal(out[0][decided], want[0][decided]), f"{name} disagrees with the reference on {case.label}"
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    once = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, min(200, int(0.02 / once)))

    def run():
        for _ in range(inner):
            fn()
        _sync()

    mode = "eager"
    if DEV == "cuda":
        graph = _capture(lambda: fn(), (), inner)
        if graph is not None:
            mode = "graph"

            def run():
                graph.replay()
                _sync()

    benchmark.pedantic(run, rounds=5 if DEV == "cpu" else 20, iterations=1, warmup_rounds=1)
    median = benchmark.stats.stats.median / inner
    row = {"op": case.op, "case": case.label, "backend": name, "mode": mode, "median_us": median * 1e6,
           "decided": int(decided.sum()), **rate_columns(case, median, DEV)}
    benchmark.extra_info.update(row)
    ROWS.append(row)
