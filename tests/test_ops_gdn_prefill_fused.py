"""gdn_prefill_fused: Qwen3.5's prefill rows from the conv output (split, L2 norms, gates, the
chunked recurrence) as one op. The reference is the composed reference path bit for bit;
the Triton prep kernel (split + norms + gates in one launch, q and k left at the key heads)
runs here in Triton's CPU interpreter against split_qkv + gdn_gates; the fla backend, which
feeds it to fla's grouped chunk kernel, is checked on the GPU (test_gpu_backends.py)."""

from __future__ import annotations

import pytest
import torch

from mstar import ops
from mstar.ops import gdn
from mstar.ops.norm import _l2_norm_ref
from triton_interpreter import run_interpreted


def _inputs(hk, hv, dk, dv, t, dtype, g):
    width = 2 * hk * dk + hv * dv
    mixed = torch.randn(t, width + 5, generator=g).to(dtype)[:, :width]  # a row stride past the width
    zba = torch.randn(t, 2 * hv + 3, generator=g).to(dtype)
    A_log = torch.empty(hv).uniform_(0.01, 16.0, generator=g).log().to(dtype)
    return mixed, zba[:, :hv], zba[:, hv:2 * hv], A_log, torch.randn(hv, generator=g).to(dtype)


@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
def test_reference_is_the_composed_reference_path(hk, hv):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,))))
    dk, dv, t = 16, 32, 70
    mixed, a, b, A_log, dt_bias = _inputs(hk, hv, dk, dv, t, torch.float32, g)
    pool = torch.randn(6, hv, dk, dv, generator=g) * 0.3
    cu = torch.tensor([0, 1, 40, 70])
    slots = torch.tensor([4, 0, 2])
    snap_t, snap_s = torch.tensor([20, 39]), torch.tensor([5, 3])
    p1, p2 = pool.clone(), pool.clone()
    o = gdn.gdn_prefill_fused.backends["reference"].fn(mixed, a, b, A_log, dt_bias, p1, cu, slots, snap_t, snap_s,
                                                       hk, dk ** -0.5, 1e-6)
    q, k, v = gdn.split_qkv(mixed, hk, dk, hv, dv, 1e-6, _l2_norm_ref)
    gg, beta = gdn.gdn_gates(a, b, A_log, dt_bias)
    o2 = gdn.gdn_prefill.backends["reference"].fn(q, k, v, gg, beta, p2, cu, slots, snap_t, snap_s, dk ** -0.5)
    assert torch.equal(o, o2) and torch.equal(p1, p2)
    # on CPU the op runs the reference, and the composed backend (ops dispatched) agrees bit for bit
    p3 = pool.clone()
    o3 = ops.gdn_prefill_fused(mixed, a, b, A_log, dt_bias, p3, cu, slots, snap_t, snap_s, hk, dk ** -0.5, 1e-6)
    assert ops.get("gdn_prefill_fused").selected("cpu") == "reference"
    assert torch.equal(o3, o) and torch.equal(p3, p1)
    p4 = pool.clone()
    o4 = gdn.gdn_prefill_fused.backends["composed"].fn(mixed, a, b, A_log, dt_bias, p4, cu, slots, snap_t, snap_s,
                                                       hk, dk ** -0.5, 1e-6)
    assert torch.equal(o4, o) and torch.equal(p4, p1)


_SCRIPT = r"""
import json, torch
from mstar.ops import gdn
from mstar.ops.backends import triton_gdn
from test_ops_gdn_prefill_fused import _inputs
g = torch.Generator().manual_seed(%d)
out = {}
for dtype in (torch.float16, torch.float32):
    for hk, hv in ((2, 2), (2, 4)):
        dk, dv, t = 16, 32, 37  # two blocks of 16 rows and a ragged third
        mixed, a, b, A_log, dt_bias = _inputs(hk, hv, dk, dv, t, dtype, g)
        q, k, v, gg, beta = triton_gdn.gdn_prefill_prep(mixed, a, b, A_log, dt_bias, hk, dk, hv, dv, 1e-6)
        rq, rk, rv = gdn.split_qkv(mixed, hk, dk, hk, dv * hv // hk, 1e-6)  # q, k at the key heads
        rv = mixed[:, 2 * hk * dk:].reshape(t, hv, dv)
        rg, rbeta = gdn.gdn_gates(a, b, A_log, dt_bias)
        key = f"{str(dtype)[6:]}-{hk}-{hv}"
        out[key] = dict(shapes=[list(x.shape) for x in (q, k, v, gg, beta)],
                        dtypes=[str(x.dtype) for x in (q, k, v, gg, beta)],
                        q=float((q.double() - rq.double()).abs().max()), k=float((k.double() - rk.double()).abs().max()),
                        v=bool(torch.equal(v, rv)), g=float((gg.double() - rg.double()).abs().max()),
                        beta=float((beta.double() - rbeta.double()).abs().max()))
print(json.dumps(out))
"""


def test_prep_kernel_matches_split_and_gates_in_the_interpreter():
    seed = int(torch.randint(0, 2 ** 31 - 1, (1,)))
    got = run_interpreted(_SCRIPT % seed)
    for key, r in got.items():
        dtype, hk, hv = key.split("-")
        hk, hv = int(hk), int(hv)
        want_dt = "torch.float16" if dtype == "float16" else "torch.float32"
        assert r["shapes"] == [[37, hk, 16], [37, hk, 16], [37, hv, 32], [37, hv], [37, hv]], (seed, key, r)
        assert r["dtypes"] == [want_dt, want_dt, want_dt, "torch.float32", want_dt], (seed, key, r)
        assert r["v"], (seed, key)
        tol = 1e-3 if dtype == "float16" else 1e-6  # one rounding of the output dtype
        assert max(r["q"], r["k"], r["beta"]) <= tol and r["g"] <= 1e-5 * 16, (seed, key, r)
