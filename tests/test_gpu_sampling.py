"""`sample`'s fast backends on the GPU against the full-sort reference on the same device, token
for token; the Sampler's planned path without host syncs (sync debug mode, CUDA-graph capture).
Marked `gpu`: skipped on a CPU machine, run on the GPU host (`pytest -m gpu`)."""

from __future__ import annotations

import importlib

import pytest
import torch

from mstar import knobs, ops
from mstar.ops import sampling
from mstar.ops.sampling import uniform_noise
from mstar.models.shape_graphs import capture_after_first_use
from test_ops_sampling import _assert_same, _exact_tie, _pick

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _load_triton():
    try:
        return importlib.import_module("mstar.ops.backends.triton_sampling")  # registers "triton" once
    except Exception:  # no Triton here
        return None


def _fast_backends():
    _load_triton()
    return [b for b in ("torch_topk", "triton")
            if b in ops.sample.backends and ops.sample.backends[b].is_available()]


def _params(B, V, gen, mix="random"):
    if mix != "random":
        T, k, p, mp = {"temperature": (0.8, 0, 1.0, 0.0), "top-k": (0.8, 50, 1.0, 0.0),
                       "top-p": (0.8, 0, 0.9, 0.0), "min-p": (1.0, 0, 1.0, 0.05)}[mix]
        f = lambda v, dt: torch.full((B,), v, dtype=dt, device=DEV)  # noqa: E731
        t, k, p, mp = f(T, torch.float32), f(k, torch.int64), f(p, torch.float32), f(mp, torch.float32)
    else:
        t = _pick(gen, B, [0.0, 0.05, 0.7, 1.0, 1.9], torch.float32).to(DEV)
        k = _pick(gen, B, [-1, 0, 0, 0, 1, 7, 50, 1500, V - 1, V, V + 3, 5000], torch.int64).to(DEV)
        p = _pick(gen, B, [1.0, 1.0, 1.0, 0.0, 1e-7, 0.3, 0.9, 0.999, 1 - 1e-7], torch.float32).to(DEV)
        mp = _pick(gen, B, [0.0, 0.0, 0.0, 0.01, 0.2, 1.0], torch.float32).to(DEV)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (B,), generator=gen).to(DEV)
    steps = torch.randint(0, 5000, (B,), generator=gen).to(DEV)
    return t, k, p, mp, seeds, steps


def _lm_logits(B, V, gen):
    lg = torch.randn(B, V, generator=gen) * 2
    head = torch.randint(0, V, (B, 64), generator=gen)
    lg = lg.scatter_add(1, head, 10 + 3 * torch.randn(B, 64, generator=gen))
    return lg.to(torch.bfloat16).float().to(DEV)  # compute_logits: bf16 values in float32


@pytest.mark.parametrize("mix", ["random", "temperature", "top-k", "top-p", "min-p"])
@pytest.mark.parametrize("V", [3000, 248320])
def test_fast_backends_same_tokens_as_reference(mix, V):
    gen = torch.Generator().manual_seed(V + len(mix))
    B = 64
    ref = ops.sample.backends["reference"].fn
    for kind in ("lm", "randn"):
        logits = _lm_logits(B, V, gen) if kind == "lm" else torch.randn(B, V, generator=gen).to(DEV) * 3
        args = (logits, *_params(B, V, gen, mix))
        want = ref(*args, 5)
        for b in _fast_backends():
            _assert_same(ops.sample.backends[b].fn(*args, 5), want)


def test_triton_pass_matches_torch_pass():
    ts = _load_triton()
    assert ts is not None, "the Triton sampling backend did not load (CUDA tests run where Triton is installed)"
    gen = torch.Generator().manual_seed(3)
    R, V = 96, 248320
    lf = _lm_logits(R, V, gen)
    lf[:32] = torch.randn(32, V, generator=gen).to(DEV) * 3
    lf[5] = 0.0  # every logit tied
    lf[6] = float("-inf")
    lf[6, 123] = 1.0
    t = (torch.rand(R, generator=gen) * 1.5 + 0.05).to(DEV)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (R,), generator=gen).to(DEV)
    steps = torch.randint(0, 5000, (R,), generator=gen).to(DEV)
    assert torch.equal(ts.gumbel_argmax(lf, t, seeds, steps), sampling._gumbel_argmax(lf / t[:, None], seeds, steps))


def test_noisy_ties_break_like_the_reference():
    """Logit + noise equal for two tokens far apart: the larger logit wins, as in sorted order.
    Bit-exact only if every path computes the noise and the division exactly like the reference."""
    ts = _load_triton()
    V = 248320
    seeds, steps = torch.tensor([77], device=DEV), torch.tensor([5], device=DEV)
    g = -torch.log(-torch.log(uniform_noise(seeds, steps, V)))[0]
    for i, j, li in [(100, 200000, 3.0), (200000, 100, 3.0), (100, 200000, -3.0)]:
        li, x = _exact_tie(torch.tensor(li, device=DEV), g[i], g[j])
        logits = torch.full((1, V), -50.0, device=DEV)
        logits[0, i] = li
        logits[0, j] = x
        params = (torch.ones(1, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV), torch.ones(1, device=DEV),
                  torch.zeros(1, device=DEV), seeds, steps)
        want = ops.sample.backends["reference"].fn(logits, *params, 0)[0].item()
        assert want == (i if li > x.item() else j)
        for b in _fast_backends():
            assert ops.sample.backends[b].fn(logits, *params, 0)[0].item() == want, b
        if ts is not None:
            assert ts.gumbel_argmax(logits, params[0], seeds, steps).item() == want


@pytest.mark.parametrize("mix", ["random", "temperature", "top-k", "top-p", "min-p"])
def test_planned_path_has_no_host_sync(mix):
    gen = torch.Generator().manual_seed(9)
    B, V = 32, 248320
    logits = _lm_logits(B, V, gen)
    params = _params(B, V, gen, mix)
    host = [x.cpu().numpy() for x in params[:4]]
    plan = sampling.make_plan(*host, V)
    impls = [None] + ([_load_triton().gumbel_argmax] if _load_triton() is not None else [])
    want = ops.sample.backends["reference"].fn(logits, *params, 3)
    for impl in impls:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = sampling.sample_planned(logits, *params, 3, plan, impl)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ex = out[4]
        assert torch.equal(out[0][ex], want[0][ex])
        if mix != "random":  # language-model-like logits: every row decided on the device
            assert bool(ex.all())


def test_planned_path_captures_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(10)
    B, V = 32, 248320
    for mix in ("temperature", "top-k", "top-p"):
        logits = _lm_logits(B, V, gen)
        params = _params(B, V, gen, mix)
        plan = sampling.make_plan(*(x.cpu().numpy() for x in params[:4]), V)

        def fn(logits=logits, params=params, plan=plan):
            return sampling.sample_planned(logits, *params, 0, plan)

        graph, out = capture_after_first_use(fn, torch.cuda.Stream(), on_stream=False)
        graph.replay()
        torch.cuda.synchronize()
        want = ops.sample.backends["reference"].fn(logits, *params, 0)
        assert bool(out[4].all()) and torch.equal(out[0], want[0]), mix


def test_sampler_on_cuda_matches_the_reference():
    from mstar.runtime.engine.request import SamplingParams
    from mstar.runtime.engine.sampler import Sampler

    gen = torch.Generator().manual_seed(11)
    V = 248320
    s = Sampler(16, V, DEV)
    plist = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
             SamplingParams(temperature=0.8, top_k=50), SamplingParams(temperature=0.8, top_p=0.9),
             SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=1.0, top_p=0.99),
             SamplingParams(temperature=0.7, top_k=6000)]
    rows = [s.add(p, 1000 + i, [], []) for i, p in enumerate(plist)]
    logits = _lm_logits(len(rows), V, gen)
    logits[5] = torch.randn(V, generator=gen).to(DEV)  # flat: top-p 0.99 escapes the candidates
    steps = list(range(len(rows)))
    got = s.sample(logits.clone(), rows, steps).tokens
    with knobs.override(MSTAR_BACKENDS="sample=reference"):
        want = s.sample(logits.clone(), rows, steps).tokens
    assert got == want
