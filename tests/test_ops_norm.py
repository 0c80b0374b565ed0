"""Norm ops (mstar/ops/norm.py) vs float64 math, vs transformers' Qwen3 / Qwen3.5 norm modules,
and torch.library.opcheck.

Tolerances: float32 inputs vs the float64 computation on the same values: rtol 1e-5,
atol 1e-5. bfloat16 inputs: the float64 result rounded once to bf16 differs from ours by at
most ~1 bf16 ulp (2^-8 relative), so rtol 1.6e-2, atol 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from mstar import ops

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(7, 64), (5, 3, 128), (2, 3, 4, 256)]  # hidden states and per-head (q/k norm) shapes
EPS = 1e-6


def _rand(*shape, dtype=torch.float32, scale=1.0, offset=0.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale + offset).to(dtype)


def _rms64(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_vs_float64(dtype, shape, zero_centered):
    x = _rand(*shape, dtype=dtype, scale=3.0, offset=0.5)
    w = _rand(shape[-1], dtype=dtype, scale=0.3, offset=0.0 if zero_centered else 1.0)
    out = ops.rms_norm(x, w, EPS, zero_centered)
    w64 = w.double() + (1.0 if zero_centered else 0.0)
    ref = _rms64(x, EPS) * w64
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_fused_add_rms_norm_vs_float64(dtype, shape, zero_centered):
    x = _rand(*shape, dtype=dtype, scale=2.0)
    res = _rand(*shape, dtype=dtype, scale=4.0, offset=-0.25)
    w = _rand(shape[-1], dtype=dtype, scale=0.3, offset=0.0 if zero_centered else 1.0)
    out, new_res = ops.fused_add_rms_norm(x, res, w, EPS, zero_centered)
    s64 = x.double() + res.double()
    w64 = w.double() + (1.0 if zero_centered else 0.0)
    assert out.dtype == dtype and new_res.dtype == dtype
    torch.testing.assert_close(new_res.double(), s64, **TOL[dtype])
    # the norm is taken of the residual sum as stored (rounded to dtype), like the next layer sees it
    torch.testing.assert_close(out.double(), _rms64(new_res, EPS) * w64, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_rms_norm_vs_float64(dtype, shape):
    x = _rand(*shape, dtype=dtype, scale=2.0, offset=0.1)
    z = _rand(*shape, dtype=dtype, scale=2.0)
    w = _rand(shape[-1], dtype=dtype, scale=0.3, offset=1.0)
    out = ops.gated_rms_norm(x, z, w, EPS)
    ref = _rms64(x, EPS) * w.double() * F.silu(z.double())
    assert out.dtype == dtype and out.shape == x.shape
    # bf16: the op rounds the normalised x to bf16 before the weight (as transformers does): 2 ulps
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=2 * 1.6e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_l2_norm_vs_float64(dtype, shape):
    x = _rand(*shape, dtype=dtype, scale=2.0, offset=-0.3)
    out = ops.l2_norm(x, EPS)
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.pow(2).sum(-1, keepdim=True) + EPS)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


# --- vs transformers ------------------------------------------------------------------------
# float32: same math, tight. bfloat16: transformers' modules run in the model dtype and may
# round once more than the op (Qwen3RMSNorm and Qwen3_5RMSNormGated multiply the weight in
# bf16), so up to 2 bf16 ulps: rtol 3.2e-2, atol 2e-2.
HF_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3.2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_vs_qwen3(dtype):
    d = 128
    m = Qwen3RMSNorm(d, eps=EPS)
    with torch.no_grad():
        m.weight.copy_(_rand(d, scale=0.3, offset=1.0))
    m = m.to(dtype)
    x = _rand(9, 4, d, dtype=dtype, scale=3.0)
    with torch.no_grad():
        ref = m(x)
    out = ops.rms_norm(x, m.weight.detach(), EPS, False)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **HF_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centered_rms_norm_vs_qwen3_5(dtype):
    d = 256
    m = Qwen3_5RMSNorm(d, eps=EPS)
    with torch.no_grad():
        m.weight.copy_(_rand(d, scale=0.3))
    m = m.to(dtype)
    x = _rand(11, d, dtype=dtype, scale=3.0, offset=0.2)
    with torch.no_grad():
        ref = m(x)
    out = ops.rms_norm(x, m.weight.detach(), EPS, True)
    # identical arithmetic (fp32, one final rounding): rtol 1e-5 / atol 1e-6 in both dtypes,
    # which for bf16 means the same bf16 values (one bf16 ulp is 2^-8 relative)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_vs_qwen3_5(dtype):
    d = 128
    m = Qwen3_5RMSNormGated(d, eps=EPS)
    with torch.no_grad():
        m.weight.copy_(_rand(d, scale=0.3, offset=1.0))
    m = m.to(dtype)
    x = _rand(6, 8, d, dtype=dtype, scale=2.0)
    z = _rand(6, 8, d, dtype=dtype, scale=2.0)
    with torch.no_grad():
        ref = m(x, z)
    out = ops.gated_rms_norm(x, z, m.weight.detach(), EPS)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **HF_TOL[dtype])


# --- opcheck --------------------------------------------------------------------------------
def _norm_cases(dtype):
    x = _rand(5, 3, 64, dtype=dtype, scale=2.0)
    y = _rand(5, 3, 64, dtype=dtype)
    w = _rand(64, dtype=dtype, scale=0.3, offset=1.0)
    return [
        (ops.rms_norm, (x, w, EPS, False)),
        (ops.rms_norm, (x, w, EPS, True)),
        (ops.fused_add_rms_norm, (x, y, w, EPS, False)),
        (ops.fused_add_rms_norm, (x, y, w, EPS, True)),
        (ops.gated_rms_norm, (x, y, w, EPS)),
        (ops.l2_norm, (x, EPS)),
        (ops.rms_norm_fp32_weight, (x, w, EPS)),
        (ops.fused_add_rms_norm_fp32_weight, (x, y, w, EPS)),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fp32_weight_rounds_once(dtype):
    """The weight in float32 and one rounding: float64 within one rounding; and where the plain
    form (rounded before the weight) differs, this one is the nearer to float64."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 96, generator=g) * 3).to(dtype)
    w = (1 + 0.5 * torch.randn(96, generator=g)).to(dtype)
    got = ops.rms_norm_fp32_weight(x, w, EPS)
    y64 = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    step = torch.finfo(dtype).eps * y64.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got.double() - y64).abs() <= step + 1e-6 * y64.abs()).all()
    plain = ops.rms_norm(x, w, EPS, False)
    if dtype != torch.float32:
        assert (got.double() - y64).abs().sum() < (plain.double() - y64).abs().sum()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_fp32_weight_is_the_add_then_the_norm(dtype):
    g = torch.Generator().manual_seed(4)
    x, r = ((torch.randn(33, 80, generator=g) * 2).to(dtype) for _ in range(2))
    w = (1 + 0.5 * torch.randn(80, generator=g)).to(dtype)
    y, s = ops.fused_add_rms_norm_fp32_weight(x, r, w, EPS)
    assert torch.equal(s, x + r) and torch.equal(y, ops.rms_norm_fp32_weight(x + r, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_norm_ops(dtype):
    for op, args in _norm_cases(dtype):
        torch.library.opcheck(op.overload, args)
