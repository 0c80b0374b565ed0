"""Sampler.sample_device, the draw of overlapped decode: `sample`'s tokens and penalty counts
without reading anything back, for every mix of parameters `on_device` accepts, including rows
the planned stages leave undecided (redone on the host by `sample`, on the device here)."""

from __future__ import annotations

import pytest
import torch

from mstar import knobs
from mstar.ops import sampling
from mstar.runtime.engine.request import SamplingParams
from mstar.runtime.engine.sampler import Sampler

from engine_helpers import NoHostSync

PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
          SamplingParams(temperature=0.8, top_k=50), SamplingParams(temperature=0.8, top_p=0.9),
          SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=1.0, top_p=0.99),
          SamplingParams(temperature=0.7, top_k=4500),
          SamplingParams(temperature=1.2, top_k=7, top_p=0.5, min_p=0.1, repetition_penalty=1.3),
          SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3),
          SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.5)]


def _sampler(V, plist):
    s = Sampler(16, V, "cpu")
    return s, [s.add(p, 100 + i, [1, 2, 3], []) for i, p in enumerate(plist)]


def _logits(gen, B, V, flat=()):
    lg = torch.randn(B, V, generator=gen) * 2
    lg[:, :40] += 9  # a peaked head for most rows
    for b in flat:  # flat: top-p 0.99 keeps far more than the candidates (undecided by them)
        lg[b] = torch.randn(V, generator=gen)
    return lg


@pytest.mark.parametrize("backend", ["torch_topk", "reference"])
def test_sample_device_equals_sample(backend):
    V = 6000
    host, rows = _sampler(V, PARAMS)
    dev, rows_d = _sampler(V, PARAMS)
    assert rows == rows_d and dev.on_device(rows)
    gen = torch.Generator().manual_seed(7)
    undecided = 0
    with knobs.override(MSTAR_BACKENDS=f"sample={backend}"):
        for step in range(5):
            lg = _logits(gen, len(rows), V, flat=(5,))
            steps = [step + b for b in range(len(rows))]
            if backend == "torch_topk":
                plan = dev._plan(dev._gather(rows, steps).rows_np, V)
                assert not plan.complete and plan.ref_rows == (6,)
                st = dev._gather(rows, steps)
                out = sampling.sample_planned(*dev._sample_args(dev._penalize(lg.clone(), st), st), 0, plan)
                undecided += int((~out[4]).sum())
            want = host.sample(lg.clone(), rows, steps).tokens
            with NoHostSync():
                got = dev.sample_device(lg.clone(), rows, steps)
            assert got.dtype == torch.int64 and got.shape == (len(rows),)
            assert got.tolist() == want
            assert torch.equal(dev.output_counts, host.output_counts)  # counted once, with the final tokens
    assert backend == "reference" or undecided >= 1  # the device-side answer for undecided rows ran


def test_sample_device_subsets_complete_plans_and_greedy():
    """Subsets of the rows: all greedy (with and without penalties), a complete plan (temperature /
    min-p only), a small vocabulary (the candidates are the whole row)."""
    for V in (6000, 300):
        host, rows = _sampler(V, PARAMS)
        dev, _ = _sampler(V, PARAMS)
        gen = torch.Generator().manual_seed(V)
        for sub in ([0], [0, 8], [1, 4], [4, 1, 0], [9, 3, 2], rows[::-1]):
            r = [rows[i] for i in sub]
            for step in range(3):
                lg = _logits(gen, len(r), V)
                want = host.sample(lg.clone(), r, [step] * len(r)).tokens
                with NoHostSync():
                    got = dev.sample_device(lg.clone(), r, [step] * len(r))
                assert got.tolist() == want, (V, sub, step)
        assert torch.equal(dev.output_counts, host.output_counts)


def test_on_device_refuses_logprobs_and_syncing_backends():
    s = Sampler(8, 100, "cpu")
    g = s.add(SamplingParams(temperature=0.0), 0, [], [])
    gp = s.add(SamplingParams(temperature=0.0, repetition_penalty=1.2), 0, [1], [])
    hot = s.add(SamplingParams(temperature=0.8, top_p=0.9), 0, [], [])
    lp = s.add(SamplingParams(temperature=0.0, logprobs=0), 0, [], [])
    assert s.on_device([g, gp, hot]) and not s.on_device([g, lp]) and not s.on_device([hot, lp])
    assert s.all_plain_greedy([g]) and not s.all_plain_greedy([g, gp]) and not s.all_plain_greedy([hot])
    with knobs.override(MSTAR_VERIFY=True):  # the op is verified against the reference: syncs
        assert s.on_device([g, gp]) and not s.on_device([g, hot])
    with knobs.override(MSTAR_BACKENDS="sample=reference", MSTAR_VERIFY=True):
        assert s.on_device([g, hot])


@pytest.mark.parametrize("finite", [4097, 700])
def test_max_finite_makes_the_plan_complete_with_the_reference_tokens(finite):
    """Rows with at most `finite` finite logits (a family's constraint; the rest -inf): the plan
    with max_finite is complete (no candidate stage short of the row's tokens, nothing redone), and
    sample / sample_device draw exactly the reference's tokens, near-uniform logits included
    (top-p mass far beyond the default 1,024 candidates)."""
    V = 30000
    assert not sampling.make_plan([0.8], [0], [0.8], [0.0], V).complete
    plan = sampling.make_plan([0.8], [0], [0.8], [0.0], V, max_finite=finite)
    assert plan.complete and plan.candidates >= finite
    params = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.9, top_k=20, top_p=0.95), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, min_p=0.02, top_p=0.9)]
    a, b = Sampler(8, V, "cpu"), Sampler(8, V, "cpu")
    rows = [a.add(p, 40 + i, [3, 4], []) for i, p in enumerate(params)]
    assert [b.add(p, 40 + i, [3, 4], []) for i, p in enumerate(params)] == rows
    g = torch.Generator().manual_seed(finite)
    ref = sampling.sample.backends["reference"].fn
    for step in range(6):
        logits = torch.full((len(rows), V), float("-inf"))
        for r in range(len(rows)):
            cols = torch.randperm(V, generator=g)[:finite - r]
            logits[r, cols] = 0.05 * torch.randn(len(cols), generator=g)  # near-uniform: top-p needs many
        want_logits = a._penalize(logits.clone(), a._gather(rows, [step] * len(rows)))
        args = a._sample_args(want_logits, a._gather(rows, [step] * len(rows)))
        want = ref(*args, 0)[0].tolist()
        got = a.sample(logits.clone(), rows, [step] * len(rows), max_finite=finite).tokens
        with NoHostSync():
            dev = b.sample_device(logits.clone(), rows, [step] * len(rows), max_finite=finite)
        assert got == want and dev.tolist() == want, (step, got, want)
    assert b.on_device(rows * 2, max_finite=finite)  # complete: any number of rows overlaps
    assert torch.equal(a.output_counts, b.output_counts)
