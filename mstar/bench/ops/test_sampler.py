"""The sampler's own path beside the `sample` op rows of test_ops.py: `sampling.sample_planned`
with the plan the Sampler makes on the host (no host sync, so on CUDA it is timed from a
CUDA-graph replay, as the op backends are), at the sampler cases of mstar/bench/ops/cases.py.

Rows: op "sample", backend "planned" (torch one-pass stage) and "planned+triton" (the Triton
one-pass kernel, where it loads)."""

from __future__ import annotations

import importlib

import pytest
import torch

from mstar.ops import sampling

from mstar.bench.ops.cases import build_cases, device
from mstar.bench.ops.test_ops import time_and_record

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
    time_and_record(benchmark, case, name, fn, (), decided=int(decided.sum()))
