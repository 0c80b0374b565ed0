"""gdn_decode_fused: Qwen3.5's decode step from the conv output (q/k split and L2 norm,
gates, recurrent update) as one op. The reference is the composed path the model used
before (bit for bit); the Triton kernel runs here in Triton's CPU interpreter
(TRITON_INTERPRET=1, in a subprocess: the variable is read when kernels are defined)."""

from __future__ import annotations

import pytest
import torch

from mstar.ops import gdn
from mstar.ops.norm import _l2_norm_ref
from triton_interpreter import run_interpreted


def _inputs(hk, hv, dk, dv, rows, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    width = 2 * hk * dk + hv * dv
    mixed = torch.randn(rows, width + 5, generator=g).to(dtype)[:, :width]  # row stride > width, as a view
    zba = torch.randn(rows, 2 * hv + 3, generator=g).to(dtype)
    a, b = zba[:, :hv], zba[:, hv:2 * hv]
    A_log = torch.empty(hv).uniform_(0.01, 16.0, generator=g).log().to(dtype)
    dt_bias = torch.randn(hv, generator=g).to(dtype)
    pool = torch.randn(rows + 4, hv, dk, dv, generator=g) * 0.5
    slots = torch.randperm(rows + 4, generator=g)[:rows]
    return mixed, a, b, A_log, dt_bias, pool, slots


@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
def test_reference_is_the_composed_path(hk, hv):
    dk, dv, rows = 16, 32, 6
    mixed, a, b, A_log, dt_bias, pool, slots = _inputs(hk, hv, dk, dv, rows, torch.float32, seed=hk * 10 + hv)
    p1, p2 = pool.clone(), pool.clone()
    o = gdn.gdn_decode_fused.backends["reference"].fn(mixed, a, b, A_log, dt_bias, p1, slots, hk, dk ** -0.5, 1e-6)
    q, k, v = gdn.split_qkv(mixed, hk, dk, hv, dv, 1e-6, _l2_norm_ref)
    gg, beta = gdn.gdn_gates(a, b, A_log, dt_bias)
    o2 = gdn.gdn_decode.backends["reference"].fn(q, k, v, gg, beta, p2, slots, dk ** -0.5)
    assert torch.equal(o, o2) and torch.equal(p1, p2)
    # and against a float64 recurrence written out here
    kd = hk * dk
    qd = mixed[:, :kd].double().reshape(rows, hk, dk)
    kd_ = mixed[:, kd:2 * kd].double().reshape(rows, hk, dk)
    qd = (qd / (qd.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(hv // hk, 1)
    kd_ = (kd_ / (kd_.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(hv // hk, 1)
    vd = mixed[:, 2 * kd:].double().reshape(rows, hv, dv)
    gd = -A_log.double().exp() * torch.nn.functional.softplus(a.double() + dt_bias.double())
    bd = torch.sigmoid(b.double())
    S = pool.double()[slots] * gd.exp()[..., None, None]
    delta = bd[..., None] * (vd - torch.einsum("bhk,bhkv->bhv", kd_, S))
    S = S + kd_[..., None] * delta[..., None, :]
    od = torch.einsum("bhk,bhkv->bhv", qd * dk ** -0.5, S)
    assert (o.double() - od).abs().max().item() < 1e-4
    assert (p1[slots].double() - S).abs().max().item() < 1e-4
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(p1[untouched], pool[untouched])


_SCRIPT = r"""
import json, torch
from test_ops_gdn_fused import _inputs
from mstar.ops import gdn
from mstar.ops.backends import triton_gdn
out = []
for dtype, hk, hv, dk, dv in ((torch.float32, 2, 4, 16, 32), (torch.float32, 4, 4, 32, 16),
                              (torch.bfloat16, 2, 4, 16, 32), (torch.bfloat16, 2, 2, 32, 64)):
    mixed, a, b, A_log, dt_bias, pool, slots = _inputs(hk, hv, dk, dv, 5, dtype, seed=dk + dv)
    p1, p2 = pool.clone(), pool.clone()
    ref = gdn.gdn_decode_fused.backends["reference"].fn(mixed, a, b, A_log, dt_bias, p1, slots, hk, dk ** -0.5, 1e-6)
    got = triton_gdn.gdn_decode_fused(mixed, a, b, A_log, dt_bias, p2, slots, hk, dk ** -0.5, 1e-6)
    out.append([str(dtype), (ref.float() - got.float()).abs().max().item(), (p1 - p2).abs().max().item(),
                p2.abs().max().item()])
# a bfloat16 state pool at dk 128: few (row, head) pairs take BV 32, many take BV 64 (_launch_config)
for rows in (5, 64):
    m16, a16, b16, alog16, dtb16, pool16, slots16 = _inputs(2, 8, 128, 128, rows, torch.bfloat16, seed=rows)
    pool16 = pool16.to(torch.bfloat16)
    assert triton_gdn._launch_config(128, rows * 8, pool16) == (64 if rows * 8 >= 512 else 32, 2)
    p1, p2 = pool16.clone(), pool16.clone()
    ref = gdn.gdn_decode_fused.backends["reference"].fn(m16, a16, b16, alog16, dtb16, p1, slots16, 2, 128 ** -0.5, 1e-6)
    got = triton_gdn.gdn_decode_fused(m16, a16, b16, alog16, dtb16, p2, slots16, 2, 128 ** -0.5, 1e-6)
    out.append(["state bf16", (ref.float() - got.float()).abs().max().item(), (p1.float() - p2.float()).abs().max().item(),
                p2.abs().max().item()])
# the plain decode kernel (q, k, v, g, beta given) shares the state step with the fused one
q, k, v = gdn.split_qkv(mixed.float(), 2, 32, 2, 64, 1e-6)
g, beta = gdn.gdn_gates(a.float(), b.float(), A_log.float(), dt_bias.float())
p1, p2 = pool.clone(), pool.clone()
ref = gdn.gdn_decode.backends["reference"].fn(q, k, v, g, beta, p1, slots, 32 ** -0.5)
got = triton_gdn.gdn_decode(q, k, v, g, beta, p2, slots, 32 ** -0.5)
out.append(["torch.float32", (ref - got).abs().max().item(), (p1 - p2).abs().max().item(), p2.abs().max().item()])
print(json.dumps(out))
"""


def test_triton_kernel_in_the_interpreter():
    for dtype, d_out, d_state, scale in run_interpreted(_SCRIPT):
        if dtype == "torch.float32":
            assert d_out < 1e-5 and d_state < 1e-5, (dtype, d_out, d_state)
        elif dtype == "state bf16":  # both round the same float32 update once; an ulp of bf16 apart
            assert d_out < 0.02 and d_state <= 2 ** -7 * scale, (dtype, d_out, d_state, scale)
        else:  # bf16 q/k: one rounding step apart now and then (1 / sqrt vs rsqrt)
            assert d_out < 0.02 and d_state < 0.02 * max(scale, 1.0), (dtype, d_out, d_state)
