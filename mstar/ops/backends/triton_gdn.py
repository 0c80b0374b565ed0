"""Gated DeltaNet recurrent decode in Triton, updating the state pool in place.

fla's fused recurrent kernel takes a dense batch of states, so serving with it means a
gather from the pool before and a scatter after: three passes over the state, which is
what a decode step at large batch is bound by (ARCHITECTURE.md: the state, not the
weights, dominates the bytes at batch 128). This kernel reads each row's state once from
its slot and writes it back once.

Grid: (rows, heads, Dv blocks). A program holds the [Dk, BV] block of one head's state in
registers: S <- S * exp(g); delta = beta * (v - S^T k); S <- S + k delta^T; o = S^T (scale q).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.ops import gdn
from mstar.ops.registry import register_backend


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, o_ptr, scale,
                       H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    kk = tl.arange(0, DK)
    vv = vb * BV + tl.arange(0, BV)
    vmask = vv < DV
    row = b * H + h
    q = tl.load(q_ptr + row * DK + kk).to(tl.float32) * scale
    k = tl.load(k_ptr + row * DK + kk).to(tl.float32)
    v = tl.load(v_ptr + row * DV + vv, mask=vmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row).to(tl.float32)
    beta = tl.load(beta_ptr + row).to(tl.float32)
    s_ptrs = state_ptr + ((slot * H + h) * DK + kk[:, None]) * DV + vv[None, :]
    smask = vmask[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)
    S = S * tl.exp(g)
    pred = tl.sum(S * k[:, None], axis=0)
    delta = beta * (v - pred)
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)
    tl.store(o_ptr + row * DV + vv, o.to(o_ptr.dtype.element_ty), mask=vmask)


def gdn_decode(q, k, v, g, beta, state_pool, slots, scale):
    b, h, dk = q.shape
    dv = v.shape[-1]
    o = torch.empty_like(v)
    if b == 0:
        return o
    if dk != triton.next_power_of_2(dk) or not state_pool.is_contiguous():
        return gdn.gdn_decode.backends["reference"].fn(q, k, v, g, beta, state_pool, slots, scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    bv = 32 if dk >= 128 else 64
    _gdn_decode_kernel[(b, h, triton.cdiv(dv, bv))](q, k, v, g.contiguous(), beta.contiguous(), state_pool, slots,
                                                    o, scale, H=h, DK=dk, DV=dv, BV=bv, num_warps=4)
    return o


register_backend(gdn.gdn_decode, "triton", gdn_decode, available=torch.cuda.is_available, priority=30,
                 note="in place over the state pool")
