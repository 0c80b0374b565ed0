"""Causal depthwise conv1d decode update in Triton, in place over the conv-state pool
(one read of the K-1 history, the new input and the weights; one write of the shifted
history). The prefill path stays on the vectorised reference until a kernel beats it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.ops import conv1d
from mstar.ops.registry import register_backend


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, b_ptr, state_ptr, slot_ptr, out_ptr, C, x_stride,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    slot = tl.load(slot_ptr + row).to(tl.int64)
    base = state_ptr + (slot * C + cols) * (K - 1)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + cols * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    prev = tl.load(base, mask=mask, other=0.0)
    for j in tl.static_range(K - 1):
        acc += prev.to(tl.float32) * tl.load(w_ptr + cols * K + j, mask=mask, other=0.0).to(tl.float32)
        if j + 1 < K - 1:
            nxt = tl.load(base + j + 1, mask=mask, other=0.0)
            tl.store(base + j, nxt, mask=mask)
            prev = nxt
    tl.store(base + (K - 2), x.to(state_ptr.dtype.element_ty), mask=mask)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + row * C + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(x, weight, bias, conv_state_pool, slots, silu):
    b, c = x.shape
    k = weight.shape[1]
    out = torch.empty((b, c), dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    if k < 2 or not conv_state_pool.is_contiguous() or not weight.is_contiguous():
        return conv1d.causal_conv1d_update.backends["reference"].fn(x, weight, bias, conv_state_pool, slots, silu)
    if x.stride(-1) != 1:
        x = x.contiguous()
    block = 256
    _conv_update_kernel[(b, triton.cdiv(c, block))](x, weight, bias if bias is not None else weight,
                                                    conv_state_pool, slots, out, c, x.stride(0), K=k,
                                                    HAS_BIAS=bias is not None, SILU=silu, BLOCK=block)
    return out


register_backend(conv1d.causal_conv1d_update, "triton", causal_conv1d_update, available=torch.cuda.is_available,
                 priority=20, note="in place over the conv-state pool")
