"""Triton kernels for the norm ops: one program per row, the whole row in registers,
float32 arithmetic, one read of each input and one write of each output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.ops import norm
from mstar.ops.registry import register_backend


def _cuda() -> bool:
    return torch.cuda.is_available()


@triton.jit
def add_residual(x, res_ptr, res_out_ptr, row, cols, mask, res_stride, out_stride):
    """x (float32) + the row of the residual, stored as the new residual rounded to the activation
    dtype (as the reference's x + residual is) and returned as rounded."""
    x = x + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x_r = x.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * out_stride + cols, x_r, mask=mask)
    return x_r.to(tl.float32)


@triton.jit
def load_row(x_ptr, res_ptr, res_out_ptr, row, cols, mask, x_stride, res_stride, out_stride,
             HAS_RES: tl.constexpr):
    """A row of x in float32; with a residual, x + residual (add_residual)."""
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = add_residual(x, res_ptr, res_out_ptr, row, cols, mask, res_stride, out_stride)
    return x


@triton.jit
def store_rms_norm(x, w_ptr, out_ptr, row, cols, mask, n_cols, out_stride, eps, ZERO_CENTERED: tl.constexpr,
                   ROUND_ONCE: tl.constexpr):
    """RMSNorm of the float32 row x, weighted (by 1 + w when ZERO_CENTERED), stored in out's dtype;
    rounded once (ROUND_ONCE), or before the weight too, as transformers' Qwen3RMSNorm."""
    var = tl.sum(x * x, axis=0) / n_cols
    y = x * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    if not ROUND_ONCE:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, x_stride, res_stride, out_stride,
                     eps, ZERO_CENTERED: tl.constexpr, ROUND_ONCE: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = load_row(x_ptr, res_ptr, res_out_ptr, row, cols, mask, x_stride, res_stride, out_stride, HAS_RES)
    store_rms_norm(x, w_ptr, out_ptr, row, cols, mask, n_cols, out_stride, eps, ZERO_CENTERED, ROUND_ONCE)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def launch_row_norm(kernel, x, residual, params: tuple, eps: float, **meta):
    """(out, new residual) of a row-wise norm kernel whose arguments are (x, residual, *params,
    out, residual out, n_cols, x_stride, res_stride, out_stride, eps, *meta, HAS_RES, BLOCK),
    one program per row (load_row reads it). Without a residual, out stands in for the residual
    output (HAS_RES=False never touches it) and the second result is out."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    r2 = _rows(residual) if residual is not None else x2
    n, h = x2.shape
    if n:
        block = triton.next_power_of_2(h)
        kernel[(n,)](x2, r2, *params, out, res_out, h, x2.stride(0), r2.stride(0), out.stride(0), eps, **meta,
                     HAS_RES=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x, weight, eps, zero_centered):
    return launch_row_norm(_rms_norm_kernel, x, None, (weight,), eps, ZERO_CENTERED=zero_centered,
                           ROUND_ONCE=zero_centered)[0]


def rms_norm_fp32_weight(x, weight, eps):
    return launch_row_norm(_rms_norm_kernel, x, None, (weight,), eps, ZERO_CENTERED=False, ROUND_ONCE=True)[0]


def fused_add_rms_norm_fp32_weight(x, residual, weight, eps):
    return launch_row_norm(_rms_norm_kernel, x, residual, (weight,), eps, ZERO_CENTERED=False, ROUND_ONCE=True)


def fused_add_rms_norm(x, residual, weight, eps, zero_centered):
    return launch_row_norm(_rms_norm_kernel, x, residual, (weight,), eps, ZERO_CENTERED=zero_centered,
                           ROUND_ONCE=zero_centered)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, n_cols, x_stride, z_stride, z_head_stride, heads, eps,
                           BLOCK: tl.constexpr):
    # row = token * heads + head; z is read through its own (token, head) strides
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)  # HF rounds before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    z_row = z_ptr + (row // heads) * z_stride + (row % heads) * z_head_stride
    z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
    gate = z / (1.0 + tl.exp(-z))
    tl.store(out_ptr + row * n_cols + cols, (w * y * gate).to(out_ptr.dtype.element_ty), mask=mask)


def _token_head_rows(z: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(z, token stride, head stride, heads): a [T, H, D] gate with unit feature stride as it is
    (Qwen3.5's z is a column slice of the input projection, which no [T * H, D] view can hold),
    anything else as [rows, D] rows (heads 1)."""
    if z.dim() == 3 and z.stride(-1) == 1:
        return z, z.stride(0), z.stride(1), z.shape[1]
    z2 = _rows(z)
    return z2, z2.stride(0), 0, 1


def gated_rms_norm(x, z, weight, eps):
    x2 = _rows(x)
    z2, z_stride, z_head_stride, heads = _token_head_rows(z)
    n, h = x2.shape
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n:
        _gated_rms_norm_kernel[(n,)](x2, z2, weight, out, h, x2.stride(0), z_stride, z_head_stride, heads, eps,
                                     BLOCK=triton.next_power_of_2(h))
    return out.view(x.shape)


@triton.jit
def _l2_norm_kernel(x_ptr, out_ptr, n_cols, x_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) + eps)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def l2_norm(x, eps):
    x2 = _rows(x)
    n, h = x2.shape
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n:
        _l2_norm_kernel[(n,)](x2, out, h, x2.stride(0), eps, BLOCK=triton.next_power_of_2(h))
    return out.view(x.shape)


for _op, _fn in ((norm.rms_norm, rms_norm), (norm.rms_norm_fp32_weight, rms_norm_fp32_weight),
                 (norm.fused_add_rms_norm, fused_add_rms_norm),
                 (norm.fused_add_rms_norm_fp32_weight, fused_add_rms_norm_fp32_weight),
                 (norm.gated_rms_norm, gated_rms_norm), (norm.l2_norm, l2_norm)):
    register_backend(_op, "triton", _fn, devices=("cuda",), available=_cuda, priority=20,
                     note="one program per row")
