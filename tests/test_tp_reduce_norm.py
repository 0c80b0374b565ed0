"""The row-parallel sums deferred to the next RMSNorm (models/base.py `_defer_reduces`) and the
fused all-reduce + add + RMSNorm kernel (ops/backends/triton_allreduce_norm.py,
MSTAR_TP_ALLREDUCE=symm_mem_norm).

On CPU: every sum of a tp=2 rank's forward reaches a norm, site after site (consecutive sites
alternate buffers); a fused function that declines leaves the plain path (one all-reduce per
sum, then the norm); one that takes them replaces those. The kernel runs in Triton's CPU
interpreter as one rank of two and of four, with its peers' rows and flags laid out as they would
have left them: the output against the reference ops on the sum in rank order, the flags it
consumed and set, its own row in its buffer. On two GPUs (tests/test_tp_allreduce.py) the tokens
equal NCCL's."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import model_dir
from triton_interpreter import run_interpreted

from mstar.models import parallel


def _rank_model(kind, monkeypatch, calls):
    from model_harness import Harness

    from mstar.models import build_model, resolve_config

    def reduce(x, group=None):
        calls.append("reduce")
        return x

    monkeypatch.setattr(parallel, "all_reduce", reduce)
    monkeypatch.setattr(parallel, "all_gather_last", lambda x, size, group=None: torch.cat([x] * size, dim=-1))
    cfg = resolve_config(model_dir(kind))
    with parallel.building(1, 2):
        m = build_model(cfg, device="cpu")
    m.init_random(0)
    return cfg, m, Harness(m, max_seqs=2, max_len=32, page_size=4)


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3"])
def test_every_sum_reaches_a_norm_site_by_site(kind, monkeypatch):
    calls: list = []
    cfg, m, h = _rank_model(kind, monkeypatch, calls)
    layers = cfg.num_hidden_layers
    assert m.model.layers[0].input_layernorm.reduce_site is None  # the embedding sums itself
    sites = []
    parallel.install_fused_reduce_norm(lambda x, r, w, eps, zc, site: sites.append(site))  # declines: None
    try:
        h.step(prefill={0: [1, 2, 3, 4, 5]})
        sites.clear()
        calls.clear()
        h.step(decode={0: 6}, prefill={1: [7, 8, 9]})
    finally:
        parallel.install_fused_reduce_norm(None)
    assert sites == list(range(2 * layers))  # consecutive sums alternate buffers (site % 2)
    assert calls == ["reduce"] * (1 + 2 * layers)  # declined: each sum still runs, once


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3"])
def test_a_fused_sum_replaces_the_reduce_and_the_norm(kind, monkeypatch):
    """A fused function computing what the plain path computes gives the same bits, and the
    only all-reduce left is the embedding's."""
    from mstar import ops

    def fused(x, residual, weight, eps, zero_centered, site):
        return ops.fused_add_rms_norm(x, residual, weight, eps, zero_centered)  # the fake reduce is the identity

    calls: list = []
    cfg, m, h = _rank_model(kind, monkeypatch, calls)
    prompt = [int(t) for t in torch.randint(1, cfg.vocab_size, (7,))]
    plain = h.step(prefill={0: prompt})
    calls.clear()
    _, m2, h2 = _rank_model(kind, monkeypatch, calls)
    parallel.install_fused_reduce_norm(fused)
    try:
        got = h2.step(prefill={0: prompt})
    finally:
        parallel.install_fused_reduce_norm(None)
    assert calls == ["reduce"]
    assert torch.equal(plain[0], got[0])


def test_tp1_defers_nothing():
    from mstar.models import build_model, resolve_config
    from mstar.models.layers import RMSNorm, RowParallelLinear
    m = build_model(resolve_config(model_dir("qwen3.5")), device="meta")
    assert not any(isinstance(x, RowParallelLinear) and x.deferred for x in m.modules())
    assert all(x.reduce_site is None for x in m.modules() if isinstance(x, RMSNorm))


_KERNEL = r"""
import json, random, torch
from mstar.ops.backends import triton_allreduce_norm as k
from mstar.ops import norm
seed = random.randrange(1 << 30)
g = torch.Generator().manual_seed(seed)
res = []
for dtype in (torch.float32, torch.bfloat16):
    for world, rank, rows, h, zc in ((2, 1, 3, 64, True), (4, 2, 5, 80, False), (2, 0, 1, 1280, True)):
        parts = [(torch.randn(rows, h, generator=g) * 2).to(dtype) for _ in range(world)]
        x = torch.zeros(rows, h + 8, dtype=dtype)[:, :h]  # a row stride past the width
        x.copy_(parts[rank])
        r = (torch.randn(rows, h, generator=g) * 3).to(dtype)
        w = (0.2 * torch.randn(h, generator=g)).to(dtype)
        bufs = [torch.full((rows * h + 16,), float("nan"), dtype=dtype) for _ in range(world)]
        flags = [torch.zeros(rows * world, dtype=torch.int32) for _ in range(world)]
        for q in range(world):
            if q != rank:
                bufs[q][:rows * h] = parts[q].reshape(-1)  # the peers' rows, and their signals to us
                flags[rank].view(rows, world)[:, q] = 1
        out, r_out = k.reduce_add_rms_norm(x, r, w, 1e-6, zc, torch.tensor([b.data_ptr() for b in bufs]),
                                           torch.tensor([f.data_ptr() for f in flags]), rank, world)
        s = parts[0].float()
        for q in range(1, world):
            s = s + parts[q].float()
        ry, rs = norm.fused_add_rms_norm.backends["reference"].fn(s.to(dtype), r, w, 1e-6, zc)
        signalled = all(flags[q].view(rows, world)[:, rank].eq(1).all() for q in range(world) if q != rank)
        res.append(dict(dtype=str(dtype), world=world, rank=rank, seed=seed,
                        d_out=(out.float() - ry.float()).abs().max().item(), out_scale=ry.float().abs().max().item(),
                        d_res=(r_out.float() - rs.float()).abs().max().item(), res_scale=rs.float().abs().max().item(),
                        own=torch.equal(bufs[rank][:rows * h].view(rows, h), parts[rank]),
                        consumed=bool(flags[rank].eq(0).all()), signalled=bool(signalled)))
print(json.dumps(res))
"""


def test_fused_kernel_as_one_rank_of_two_and_four():
    """Tolerances: fp32 1e-5 of the scale (the same sums in another order). bf16: the sum is
    rounded, then sum + residual (two roundings where the reference rounds the sum in float32 then
    adds: two bf16 steps of the residual's scale; the interpreter truncates), the output four steps
    of its scale (the residual's steps carried through the norm, as test_ops_norm_triton)."""
    for r in run_interpreted(_KERNEL):
        assert r["own"] and r["consumed"] and r["signalled"], r
        if r["dtype"] == "torch.float32":
            assert r["d_res"] <= 1e-5 * r["res_scale"] and r["d_out"] <= 1e-5 * r["out_scale"], r
        else:
            assert r["d_res"] <= 2 * 2.0 ** -7 * r["res_scale"], r
            assert r["d_out"] <= 4 * 2.0 ** -7 * r["out_scale"], r


def test_the_runtime_declines_what_the_kernel_cannot_take():
    """Shapes and dtypes only (never pointers: every rank must decide alike)."""
    from mstar.runtime.parallel import tp_allreduce
    f = tp_allreduce.SymmMemReduceNorm.__new__(tp_allreduce.SymmMemReduceNorm)
    f.dtype, f.capacity = torch.bfloat16, 64 * 8
    f.kernel = lambda *a: "fused"
    f.buf_addrs, f.flag_addrs, f.rank, f.world, f.timeout_s = (torch.zeros(2), torch.ones(2)), None, 0, 2, 60.0
    bf = torch.bfloat16
    x, r, w = torch.ones(8, 64, dtype=bf), torch.ones(8, 64, dtype=bf), torch.ones(64, dtype=bf)
    assert f(x, r, w, 1e-6, True, 3) == "fused"
    assert f(x, None, w, 1e-6, True, 3) is None  # no residual
    assert f(x.float(), r.float(), w, 1e-6, True, 3) is None  # another dtype
    assert f(torch.ones(9, 64, dtype=bf), torch.ones(9, 64, dtype=bf), w, 1e-6, True, 3) is None  # too large
    assert f(x.t(), r.t(), w, 1e-6, True, 3) is None  # columns not contiguous
