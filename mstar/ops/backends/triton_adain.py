"""Triton kernel for adain_act: one program per (row, channel) reads x three times (mean, variance,
output) and writes once, all in float32; the reference makes about fifteen elementwise passes
over the tensor and its float32 temporaries."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.ops.adain import _check
from mstar.ops.adain import adain_act as adain_act_op
from mstar.ops.registry import register_backend


def _cuda() -> bool:
    return torch.cuda.is_available()


@triton.jit
def _adain_act_kernel(x_ptr, m_ptr, g_ptr, be_ptr, w_ptr, bi_ptr, a_ptr, out_ptr, C, T, slope, eps,
                      SNAKE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * C + c
    b = row // C
    c = row % C
    x_row = x_ptr + row * T
    m_row = m_ptr + b * T
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    cnt = tl.zeros([BLOCK], dtype=tl.float32)
    for t0 in range(0, T, BLOCK):
        t = t0 + offs
        ok = t < T
        m = tl.load(m_row + t, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(x_row + t, mask=ok, other=0.0).to(tl.float32) * m
        cnt += m
    n = tl.maximum(tl.sum(cnt, axis=0), 1.0)
    mean = tl.sum(acc, axis=0) / n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for t0 in range(0, T, BLOCK):
        t = t0 + offs
        ok = t < T
        m = tl.load(m_row + t, mask=ok, other=0.0).to(tl.float32)
        d = (tl.load(x_row + t, mask=ok, other=0.0).to(tl.float32) - mean) * m
        acc += d * d
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n + eps)
    g1 = 1.0 + tl.load(g_ptr + row).to(tl.float32)
    scale = rstd * tl.load(w_ptr + c).to(tl.float32) * g1
    shift = tl.load(bi_ptr + c).to(tl.float32) * g1 + tl.load(be_ptr + row).to(tl.float32) - mean * scale
    if SNAKE:
        a = tl.load(a_ptr + c).to(tl.float32)
        inv_a = 1.0 / (a + 1e-9)
    for t0 in range(0, T, BLOCK):
        t = t0 + offs
        ok = t < T
        m = tl.load(m_row + t, mask=ok, other=0.0).to(tl.float32)
        y = tl.load(x_row + t, mask=ok, other=0.0).to(tl.float32) * scale + shift
        if SNAKE:
            s = tl.sin(a * y)
            y = y + inv_a * (s * s)
        else:
            y = tl.where(y >= 0, y, y * slope)
        tl.store(out_ptr + row * T + t, (y * m).to(out_ptr.dtype.element_ty), mask=ok)


def adain_act(x, mask, gamma, beta, weight, bias, alpha, slope, eps):
    _check(x, mask, gamma, beta, weight, bias, alpha)
    x, mask = x.contiguous(), mask.contiguous()
    B, C, T = x.shape
    out = torch.empty_like(x)
    if x.numel():
        snake = alpha.numel() > 0
        block = min(1024, triton.next_power_of_2(T))
        _adain_act_kernel[(B * C,)](x, mask, gamma.contiguous(), beta.contiguous(), weight.contiguous(),
                                    bias.contiguous(), alpha.contiguous() if snake else weight, out, C, T,
                                    float(slope), float(eps), SNAKE=snake, BLOCK=block)
    return out


register_backend(adain_act_op, "triton", adain_act, devices=("cuda",), available=_cuda, priority=20,
                 note="three reads of x, one write, float32 math")
