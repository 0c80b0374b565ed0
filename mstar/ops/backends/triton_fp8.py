"""Triton kernel for quantize_rows (mstar/ops/fp8.py): one program per row holds the whole row in
registers, applies the activation, takes the row's absolute maximum and writes the float8 row and
its scale: one read of x and one write of a byte per element (the reference makes a float32 copy,
its absolute value, the quotient and the cast: five passes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.ops.fp8 import ACTIVATIONS, FP8, FP8_MAX, SCALE_FLOOR, _quantize_rows_ref
from mstar.ops.fp8 import quantize_rows as quantize_rows_op
from mstar.ops.registry import register_backend

MAX_COLS = 16384  # wider rows would spill one program's registers: they take the reference
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
_FP8_MAX = tl.constexpr(FP8_MAX)  # a jitted kernel reads module globals only as constexpr
_SCALE_FLOOR = tl.constexpr(SCALE_FLOOR)


def _cuda() -> bool:
    return torch.cuda.is_available()


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n_cols, x_stride, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:  # GELU tanh: a * (1 + tanh(z)) / 2 = a * sigmoid(2 z)
        z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        a = a / (1.0 + tl.exp(-2.0 * z))
    elif ACT == 2:  # relu(a)^2
        a = tl.maximum(a, 0.0)
        a = a * a
    amax = tl.maximum(tl.max(tl.abs(a), axis=0), _SCALE_FLOOR)
    scale = amax / _FP8_MAX
    q = tl.minimum(tl.maximum(a / scale, -_FP8_MAX), _FP8_MAX)
    tl.store(scale_ptr + row, scale)
    tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or act not in _ACT_CODE or x.shape[1] > MAX_COLS:
        return _quantize_rows_ref(x, act)  # it raises on bad input
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if x.numel():
        block = triton.next_power_of_2(K)
        _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), ACT=_ACT_CODE[act], BLOCK=block,
                                    num_warps=min(max(block // 512, 1), 16))
    return q, scale


register_backend(quantize_rows_op, "triton", quantize_rows, devices=("cuda",), available=_cuda, priority=10,
                 note="one program per row: activation, absolute max and float8 cast in one pass")
