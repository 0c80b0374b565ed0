"""Triton kernel for rms_norm_rotary (mstar/ops/rms_norm_rotary.py): one program per token row, the
whole row (heads * head_dim, 3072 for Wan2.2 TI2V-5B) in registers as its even and odd elements, so
each rotated pair sits in one thread's registers: the sum of squares, the scale, the two roundings
of the RMSNorm (as the reference's), the rotation by the token's cos / sin row, one store. The
reference runs a dozen kernels with [B, S, width] float32 temporaries (the norm's cast, square,
mean, scale, the rounding and weight, the unbind, four products, two sums, the stack, the cast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.ops.registry import register_backend
from mstar.ops.rms_norm_rotary import _rms_norm_rotary_ref, check_rms_norm_rotary
from mstar.ops.rms_norm_rotary import rms_norm_rotary as rms_norm_rotary_op

# Rows wider than this would spill the registers of one program; they take the reference.
MAX_COLS = 16384


def _cuda() -> bool:
    return torch.cuda.is_available()


@triton.jit
def _rms_norm_rotary_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, S, n_cols, half_d, cos_stride, sin_stride,
                            eps, HALF_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = row % S
    p = tl.arange(0, HALF_BLOCK)  # pair index over the whole row
    mask = p < n_cols // 2
    even = 2 * p
    base = x_ptr + row * n_cols
    x0 = tl.load(base + even, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(base + even + 1, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x0 * x0, axis=0) + tl.sum(x1 * x1, axis=0)) / n_cols + eps)
    dt = out_ptr.dtype.element_ty
    w0 = tl.load(w_ptr + even, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + even + 1, mask=mask, other=0.0).to(tl.float32)
    # the reference's roundings: the normalised x to x's dtype, then the weighted product
    n0 = ((x0 * rstd).to(dt).to(tl.float32) * w0).to(dt).to(tl.float32)
    n1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
    i = p % half_d  # the pair's index within its head
    c = tl.load(cos_ptr + s * cos_stride + i, mask=mask, other=0.0)
    sn = tl.load(sin_ptr + s * sin_stride + i, mask=mask, other=0.0)
    out = out_ptr + row * n_cols
    tl.store(out + even, (n0 * c - n1 * sn).to(dt), mask=mask)
    tl.store(out + even + 1, (n0 * sn + n1 * c).to(dt), mask=mask)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_rotary(x, weight, cos, sin, heads, eps):
    check_rms_norm_rotary(x, weight, cos, sin, heads)
    B, S, width = x.shape
    if width > MAX_COLS:
        return _rms_norm_rotary_ref(x, weight, cos, sin, heads, eps)
    x, weight = x.contiguous(), weight.contiguous()
    cos, sin = _rows_contiguous(cos), _rows_contiguous(sin)
    out = torch.empty_like(x)
    if x.numel():
        half_block = triton.next_power_of_2(width // 2)
        _rms_norm_rotary_kernel[(B * S,)](x, weight, cos, sin, out, S, width, width // heads // 2, cos.stride(0),
                                          sin.stride(0), float(eps), HALF_BLOCK=half_block,
                                          num_warps=min(max(half_block // 128, 1), 8))
    return out


register_backend(rms_norm_rotary_op, "triton", rms_norm_rotary, devices=("cuda",), available=_cuda, priority=20,
                 note="one program per row: norm, weight and rotary in registers, one read and one write")
