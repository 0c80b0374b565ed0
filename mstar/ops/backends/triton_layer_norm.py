"""Triton kernels for the LayerNorm ops (Whisper): one program per row, the whole row in
registers, float32 arithmetic. The reference makes five or six kernels of one LayerNorm in a
half dtype (the input, weight and bias cast to float32, the norm, the cast back, and the
residual add): in Whisper's decoder step they were ~1500 of ~3300 us of device time at batch 1
(notes/gpu-2026-11-30-gate-knobs-whisper.md). Here it is one kernel, one read of each input, one write of each
output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.ops.layer_norm import fused_add_layer_norm as fused_add_layer_norm_op
from mstar.ops.layer_norm import layer_norm as layer_norm_op
from mstar.ops.backends.triton_norm import launch_row_norm, load_row
from mstar.ops.registry import register_backend


def _cuda() -> bool:
    return torch.cuda.is_available()


@triton.jit
def _layer_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, n_cols, x_stride, res_stride,
                       out_stride, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = load_row(x_ptr, res_ptr, res_out_ptr, row, cols, mask, x_stride, res_stride, out_stride, HAS_RES)
    mean = tl.sum(x, axis=0) / n_cols
    d = tl.where(mask, x - mean, 0.0)
    var = tl.sum(d * d, axis=0) / n_cols  # two passes over registers: no cancellation
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = d * tl.rsqrt(var + eps) * w + b
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm(x, weight, bias, eps):
    return launch_row_norm(_layer_norm_kernel, x, None, (weight, bias), eps)[0]


def fused_add_layer_norm(x, residual, weight, bias, eps):
    return launch_row_norm(_layer_norm_kernel, x, residual, (weight, bias), eps)


for _op, _fn in ((layer_norm_op, layer_norm), (fused_add_layer_norm_op, fused_add_layer_norm)):
    register_backend(_op, "triton", _fn, devices=("cuda",), available=_cuda, priority=20,
                     note="one program per row")
