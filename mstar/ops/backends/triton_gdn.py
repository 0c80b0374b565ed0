"""Gated DeltaNet recurrent decode in Triton, updating the state pool in place.

fla's fused recurrent kernel takes a dense batch of states, so serving with it means a
gather from the pool before and a scatter after: three passes over the state, which is
what a decode step at large batch is bound by (at batch 128 the state, not the
weights, dominates the bytes a decode step moves). This kernel reads each row's state once from
its slot and writes it back once.

Grid: (rows, heads, Dv blocks). A program holds the [Dk, BV] block of one head's state in
registers: S <- S * exp(g); delta = beta * (v - S^T k); S <- S + k delta^T; o = S^T (scale q).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mstar.ops import gdn
from mstar.ops.backends import pdl
from mstar.ops.registry import register_backend


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, o_ptr, scale,
                       H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/backends/pdl.py: nothing read or written before the wait
        gdc_wait()
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
    o = _state_step(state_ptr, slot, h, H, DK, DV, kk, vv, vmask, q, k, v, g, beta)
    if PDL:
        gdc_launch_dependents()
    tl.store(o_ptr + row * DV + vv, o.to(o_ptr.dtype.element_ty), mask=vmask)


@triton.jit
def _state_step(state_ptr, slot, h, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, kk, vv, vmask, q, k, v, g,
                beta):
    """The delta-rule update of one head's [DK, BV] state block in place; returns o (fp32)."""
    s_ptrs = state_ptr + ((slot * H + h) * DK + kk[:, None]) * DV + vv[None, :]
    smask = vmask[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)
    S = S * tl.exp(g)
    pred = tl.sum(S * k[:, None], axis=0)
    delta = beta * (v - pred)
    S = S + k[:, None] * delta[None, :]
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)
    return tl.sum(S * q[:, None], axis=0)


def _launch_config(dk: int, row_heads: int, state: torch.Tensor) -> tuple[int, int]:
    """(BV, warps): value columns per program (a [dk, BV] block of one head's state) and its warps.
    At dk 128: BV 64 once a step has 512 (row, head) pairs or more, 32 below (more, smaller
    programs for small batches); 2 warps for a bfloat16 state, 4 for float32. Each is the best or
    within 4 % of the best configuration at every 0.8B / 4B shape from 1 to 256 rows on an H100
    (`python -m mstar.bench.tools.probe_gdn_decode`, notes/llm-serving.md)."""
    bv = 64 if dk < 128 or row_heads >= 512 else 32
    return bv, 2 if state.element_size() == 2 else 4


def gdn_decode(q, k, v, g, beta, state_pool, slots, scale):
    b, h, dk = q.shape
    dv = v.shape[-1]
    o = torch.empty_like(v)
    if b == 0:
        return o
    if dk != triton.next_power_of_2(dk) or not state_pool.is_contiguous():
        return gdn.gdn_decode.backends["reference"].fn(q, k, v, g, beta, state_pool, slots, scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    bv, warps = _launch_config(dk, b * h, state_pool)
    _gdn_decode_kernel[(b, h, triton.cdiv(dv, bv))](q, k, v, g.contiguous(), beta.contiguous(), state_pool, slots,
                                                    o, scale, H=h, DK=dk, DV=dv, BV=bv, num_warps=warps,
                                                    **pdl.launch_options(q))
    return o


@triton.jit
def _gdn_decode_fused_kernel(mixed_ptr, mixed_stride, a_ptr, a_stride, b_ptr, b_stride, alog_ptr, dtb_ptr,
                             state_ptr, slot_ptr, o_ptr, scale, eps, HK: tl.constexpr, HV: tl.constexpr,
                             DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/backends/pdl.py: nothing read or written before the wait
        gdc_wait()
    # what split_qkv + gdn_gates + the decode step compute, in one program per (row, value
    # head, Dv block); the rounding points of the composed path are kept (q, k normalised in
    # fp32 then stored in the input dtype; beta = sigmoid(b) in b's dtype)
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // (HV // HK)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    kk = tl.arange(0, DK)
    vv = vb * BV + tl.arange(0, BV)
    vmask = vv < DV
    base = mixed_ptr + r * mixed_stride
    q = tl.load(base + hk * DK + kk).to(tl.float32)
    k = tl.load(base + HK * DK + hk * DK + kk).to(tl.float32)
    v = tl.load(base + 2 * HK * DK + h * DV + vv, mask=vmask, other=0.0).to(tl.float32)
    q = (q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps))).to(mixed_ptr.dtype.element_ty).to(tl.float32) * scale
    k = (k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))).to(mixed_ptr.dtype.element_ty).to(tl.float32)
    x = tl.load(a_ptr + r * a_stride + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus
    bb = tl.load(b_ptr + r * b_stride + h).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-bb))).to(b_ptr.dtype.element_ty).to(tl.float32)
    o = _state_step(state_ptr, slot, h, HV, DK, DV, kk, vv, vmask, q, k, v, g, beta)
    if PDL:
        gdc_launch_dependents()
    tl.store(o_ptr + (r * HV + h) * DV + vv, o.to(o_ptr.dtype.element_ty), mask=vmask)


def gdn_decode_fused(mixed, a, b, A_log, dt_bias, state_pool, slots, num_k_heads, scale, eps):
    rows = mixed.shape[0]
    hv, dk, dv = state_pool.shape[1:]
    o = mixed.new_empty((rows, hv, dv))
    if rows == 0:
        return o
    if (dk != triton.next_power_of_2(dk) or not state_pool.is_contiguous() or mixed.stride(1) != 1
            or a.stride(1) != 1 or b.stride(1) != 1 or hv % num_k_heads):
        return gdn.gdn_decode_fused.backends["reference"].fn(mixed, a, b, A_log, dt_bias, state_pool, slots,
                                                              num_k_heads, scale, eps)
    bv, warps = _launch_config(dk, rows * hv, state_pool)
    _gdn_decode_fused_kernel[(rows, hv, triton.cdiv(dv, bv))](
        mixed, mixed.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, state_pool, slots, o, scale, eps,
        HK=num_k_heads, HV=hv, DK=dk, DV=dv, BV=bv, num_warps=warps, **pdl.launch_options(mixed))
    return o


@triton.jit
def _gdn_prefill_prep_kernel(mixed_ptr, mixed_stride, a_ptr, a_stride, b_ptr, b_stride, alog_ptr, dtb_ptr,
                             q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, T, eps, HK: tl.constexpr, HV: tl.constexpr,
                             DK: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr):
    # split_qkv + gdn_gates for BLOCK_T token rows and one head slot (q heads, then k heads,
    # then v heads with their gates), with the composed path's rounding points: q, k
    # normalised in fp32 and stored in the input dtype, g in fp32, beta = sigmoid(b) in b's
    # dtype. q and k keep their HK heads (the chunk kernel maps value head h to key head
    # h // (HV // HK)). One row per program took 85 us a layer at 4B (377e7af)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < T
    j = tl.program_id(1)
    base = mixed_ptr + rows[:, None] * mixed_stride
    if j < 2 * HK:
        kk = tl.arange(0, DK)
        x = tl.load(base + j * DK + kk[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        y = (x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps))[:, None]).to(q_ptr.dtype.element_ty)
        if j < HK:
            tl.store(q_ptr + (rows[:, None] * HK + j) * DK + kk[None, :], y, mask=live[:, None])
        else:
            tl.store(k_ptr + (rows[:, None] * HK + j - HK) * DK + kk[None, :], y, mask=live[:, None])
    else:
        # (names apart from the other branch's: Triton types a name across both branches)
        h = j - 2 * HK
        vv = tl.arange(0, DV)
        vals = tl.load(base + 2 * HK * DK + h * DV + vv[None, :], mask=live[:, None], other=0.0)
        tl.store(v_ptr + (rows[:, None] * HV + h) * DV + vv[None, :], vals, mask=live[:, None])
        ax = tl.load(a_ptr + rows * a_stride + h, mask=live, other=0.0).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
        softplus = tl.where(ax > 20.0, ax, tl.log(1.0 + tl.exp(ax)))  # torch's threshold
        tl.store(g_ptr + rows * HV + h, -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus, mask=live)
        bb = tl.load(b_ptr + rows * b_stride + h, mask=live, other=0.0).to(tl.float32)
        tl.store(beta_ptr + rows * HV + h, (1.0 / (1.0 + tl.exp(-bb))).to(beta_ptr.dtype.element_ty), mask=live)


PREP_BLOCK_T = 16  # rows per program: 16 x 128 elements of one head


def gdn_prefill_prep(mixed, a, b, A_log, dt_bias, num_k_heads: int, dk: int, hv: int, dv: int, eps: float):
    """(q, k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] float32, beta [T, Hv]) from the conv output
    and the gate inputs, in one launch; None where the kernel does not take the shapes (Dk or Dv
    not a power of two, strided feature dims)."""
    t = mixed.shape[0]
    if (dk != triton.next_power_of_2(dk) or dv != triton.next_power_of_2(dv) or mixed.stride(1) != 1
            or a.stride(1) != 1 or b.stride(1) != 1 or hv % num_k_heads):
        return None
    q = mixed.new_empty((t, num_k_heads, dk))
    k = torch.empty_like(q)
    v = mixed.new_empty((t, hv, dv))
    g = torch.empty((t, hv), dtype=torch.float32, device=mixed.device)
    beta = b.new_empty((t, hv))
    if t:
        _gdn_prefill_prep_kernel[(triton.cdiv(t, PREP_BLOCK_T), 2 * num_k_heads + hv)](
            mixed, mixed.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, q, k, v, g, beta, t, eps,
            HK=num_k_heads, HV=hv, DK=dk, DV=dv, BLOCK_T=PREP_BLOCK_T, num_warps=4)
    return q, k, v, g, beta


register_backend(gdn.gdn_decode, "triton", gdn_decode, available=torch.cuda.is_available, priority=30,
                 note="in place over the state pool")
register_backend(gdn.gdn_decode_fused, "triton", gdn_decode_fused, available=torch.cuda.is_available, priority=30,
                 note="l2 norms, gates and the step in one kernel, in place over the state pool")
