"""Triton kernels for the snake and snake_beta ops: one pass over x, float32 arithmetic, the
per-channel parameters read once per program (the references make five or more elementwise
kernels and their temporaries)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mstar.ops.snake import snake as snake_op  # the op (mstar.ops.snake, the attribute, is the op too)
from mstar.ops.snake_beta import snake_beta as snake_beta_op
from mstar.ops.registry import register_backend


def _cuda() -> bool:
    return torch.cuda.is_available()


@triton.jit
def _snake_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, n_channels, length, LOG_PARAMS: tl.constexpr,
                  BLOCK: tl.constexpr):
    # one program per (row of B * C, block of the trailing length)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < length
    a = tl.load(alpha_ptr + row % n_channels).to(tl.float32)
    b = tl.load(beta_ptr + row % n_channels).to(tl.float32)
    if LOG_PARAMS:  # snake_beta: frequency and magnitude stored as logarithms
        a = tl.exp(a)
        b = tl.exp(b)
    x = tl.load(x_ptr + row * length + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sin(a * x)
    y = x + (1.0 / (b + 1e-9)) * (s * s)
    tl.store(out_ptr + row * length + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, alpha, beta, log_params: bool):
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, channels = x.shape[0] * x.shape[1], x.shape[1]
    length = math.prod(x.shape[2:])
    if x.numel():
        block = min(2048, triton.next_power_of_2(length))
        _snake_kernel[(rows, triton.cdiv(length, block))](x, alpha.contiguous(), beta.contiguous(), out, channels,
                                                          length, LOG_PARAMS=log_params, BLOCK=block)
    return out


def snake(x, alpha):
    if x.dim() < 2 or alpha.dim() != 1 or alpha.shape[0] != x.shape[1]:
        raise ValueError(f"snake: x must be [B, C, ...] and alpha [C]; got {tuple(x.shape)} and {tuple(alpha.shape)}")
    return _launch(x, alpha, alpha, False)


def snake_beta(x, log_alpha, log_beta):
    if x.dim() < 2 or log_alpha.shape != (x.shape[1],) or log_beta.shape != (x.shape[1],):
        raise ValueError(f"snake_beta: x must be [B, C, ...] and log_alpha, log_beta [C]; got {tuple(x.shape)}, "
                         f"{tuple(log_alpha.shape)} and {tuple(log_beta.shape)}")
    return _launch(x, log_alpha, log_beta, True)


register_backend(snake_op, "triton", snake, devices=("cuda",), available=_cuda, priority=20,
                 note="one pass, float32 math")
register_backend(snake_beta_op, "triton", snake_beta, devices=("cuda",), available=_cuda, priority=20,
                 note="one pass, float32 math")
