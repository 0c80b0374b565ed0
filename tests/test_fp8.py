"""The float8 ops (mstar/ops/fp8.py): quantize_rows and fp8_matmul's references against float64
computations of their definitions, the scaled_mm backend's call of torch._scaled_mm (it runs on
CPU too) and the Triton quantize kernel (Triton's CPU interpreter; on a GPU with -m gpu) against
the references, Fp8Linear against a bf16 linear layer.

Tolerances:
  quantize_rows      |q * scale - act(x)| <= half a float8 step: 2^-4 |act(x)| (3 mantissa bits)
                     or 2^-10 scale for the subnormals; the row's largest value maps to 448.
  fp8_matmul ref     float32 sums of exact products: 1e-5 relative to float64 + the final rounding
                     (half a bfloat16 ulp, 2^-8).
  scaled_mm, Triton  the reference's bits but for one rounding: float8 values at most one step
                     apart (float32 division on a GPU may differ in the last bit; the interpreter's
                     cast loses the carry of a rounding up to a power of two: those are excused
                     there), outputs within one bfloat16 ulp (2^-7) + 1e-3 of the
                     row's scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_interpreted

from mstar import ops
from mstar.ops.fp8 import (FP8, FP8_MAX, _fp8_matmul_ref, _fp8_matmul_scaled_mm, _quantize_rows_ref,
                           quantize_weight)

ACTS = ("none", "gelu_tanh", "relu_square")


def act64(x: torch.Tensor, act: str) -> torch.Tensor:
    a = x.double()
    if act == "gelu_tanh":
        return 0.5 * a * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (a + 0.044715 * a ** 3)))
    return F.relu(a) ** 2 if act == "relu_square" else a


def make_x(seed: int, M: int, K: int, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 8  # rows of different scales
    x[0] = 0  # an all-zero row
    return x.to(dtype).to(device)


def fp8_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float8 e4m3 steps apart two float8 tensors are (their bit patterns' distance, same signs)."""
    ia, ib = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    same_sign = (ia >> 7) == (ib >> 7)
    return torch.where(same_sign, (ia - ib).abs(), (ia & 127) + (ib & 127))


@pytest.mark.parametrize("act", ACTS)
def test_quantize_rows_reference_vs_float64(act):
    x = make_x(1, 9, 200)
    q, scale = _quantize_rows_ref(x, act)
    assert q.dtype == FP8 and q.shape == x.shape and scale.shape == (9, 1) and scale.dtype == torch.float32
    a = act64(x, act)
    amax = a.abs().amax(1, keepdim=True)
    assert torch.allclose(scale.double()[1:], amax[1:] / FP8_MAX, rtol=2e-6)
    assert torch.equal(q[0].float(), torch.zeros(200)) and scale[0].item() > 0  # the zero row
    assert torch.equal(q.float().abs().amax(1)[1:], torch.full((8,), FP8_MAX))  # each row's max -> 448
    err = (q.double() * scale.double() - a).abs()
    assert (err <= 2 ** -4 * a.abs() * (1 + 1e-6) + 2 ** -10 * scale.double()).all()


def test_quantize_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="quantize_rows"):
        _quantize_rows_ref(torch.randn(2, 3, 4), "none")
    with pytest.raises(ValueError, match="quantize_rows"):
        _quantize_rows_ref(torch.randn(2, 4), "gelu")


def test_fp8_matmul_reference_vs_float64():
    x, w = make_x(2, 12, 96), make_x(3, 40, 96)
    bias = torch.randn(40).bfloat16()
    q, s = _quantize_rows_ref(x, "none")
    wq, ws = quantize_weight(w)
    got = _fp8_matmul_ref(q, s, wq, ws, bias, torch.bfloat16)
    want = (q.double() * s.double()) @ (wq.double() * ws.double()[:, None]).t() + bias.double()
    scale = want.abs().amax(1, keepdim=True) + 1e-30
    assert got.dtype == torch.bfloat16 and got.shape == (12, 40)
    assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * scale).all()
    # and close to the unquantized product (float8's ~3% per element)
    exact = x.double() @ w.double().t() + bias.double()
    assert (got.double() - exact).norm() <= 0.06 * exact.norm()


def test_fp8_matmul_rejects_bad_shapes():
    q, s = _quantize_rows_ref(make_x(4, 4, 32), "none")
    wq, ws = quantize_weight(make_x(5, 16, 32))
    with pytest.raises(ValueError, match="fp8_matmul"):
        _fp8_matmul_ref(q, s, wq[:, :16], ws, None, torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_matmul"):
        _fp8_matmul_ref(q, s.view(-1), wq, ws, None, torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_matmul"):
        _fp8_matmul_ref(q.float(), s, wq, ws, None, torch.bfloat16)


def _within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = want.float().abs().amax(1, keepdim=True) + 1e-30
    return bool(((got.float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 1e-3 * scale).all())


@pytest.mark.parametrize("bias", [True, False])
def test_scaled_mm_backend_on_cpu(bias):
    """The backend's torch._scaled_mm call (layouts, scale shapes, bias) against the reference."""
    x, w = make_x(6, 33, 64), make_x(7, 48, 64)
    b = torch.randn(48).bfloat16() if bias else None
    q, s = _quantize_rows_ref(x, "gelu_tanh")
    wq, ws = quantize_weight(w)
    got = _fp8_matmul_scaled_mm(q, s, wq, ws, b, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (33, 48)
    assert _within_one_ulp(got, _fp8_matmul_ref(q, s, wq, ws, b, torch.bfloat16))
    # shapes the row-wise kernel does not take go to the reference
    q2, s2 = _quantize_rows_ref(make_x(8, 5, 24), "none")
    wq2, ws2 = quantize_weight(make_x(9, 8, 24))
    assert torch.equal(_fp8_matmul_scaled_mm(q2, s2, wq2, ws2, None, torch.bfloat16),
                       _fp8_matmul_ref(q2, s2, wq2, ws2, None, torch.bfloat16))


def test_fake_gives_the_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = make_x(10, 6, 32)
    wq, ws = quantize_weight(make_x(11, 16, 32))
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, s = torch.ops.mstar.quantize_rows(x, "none")
        out = torch.ops.mstar.fp8_matmul(q, s, wq, ws, None, torch.bfloat16)
    assert q.shape == (6, 32) and q.dtype == FP8 and s.shape == (6, 1) and s.dtype == torch.float32
    assert out.shape == (6, 16) and out.dtype == torch.bfloat16


_SCRIPT = r"""
import json
import torch
from test_fp8 import fp8_steps, make_x
from mstar.ops.fp8 import _quantize_rows_ref
from mstar.ops.backends import triton_fp8 as tf
out = []
for seed, (M, K, act, dtype) in enumerate(((5, 96, "none", torch.bfloat16), (4, 100, "gelu_tanh", torch.bfloat16),
                                          (3, 130, "relu_square", torch.float32), (2, 3072, "gelu_tanh", torch.bfloat16))):
    x = make_x(20 + seed, M, K, dtype)
    q, s = tf.quantize_rows(x, act)
    rq, rs = _quantize_rows_ref(x, act)
    steps = fp8_steps(q, rq)
    # the interpreter's float8 cast drops a rounding's carry into the exponent (7.96 -> 4, not 8)
    carry = (rq.float().abs().log2().frac() == 0) & (q.float() * 2 == rq.float())
    steps = torch.where(carry, 0, steps)
    out.append([act, K, float((s / rs - 1).abs().max()), int(steps.max()), float((steps > 0).float().mean())])
print(json.dumps(out))
"""


def test_triton_quantize_in_the_interpreter():
    for act, K, scale_err, max_steps, frac in run_interpreted(_SCRIPT):
        assert scale_err <= 1e-6 and max_steps <= 1 and frac <= 0.1, (act, K, scale_err, max_steps, frac)


def test_fp8_linear_layer_against_bf16():
    from mstar.models.layers.fp8 import Fp8Linear, project, to_fp8
    torch.manual_seed(12)
    lin = torch.nn.Linear(64, 32).bfloat16()
    x = torch.randn(2, 5, 64).bfloat16()
    f = Fp8Linear.of(lin)
    want = lin(x).float()
    got = f(x)
    assert got.shape == (2, 5, 32) and got.dtype == torch.bfloat16
    assert (got.float() - want).norm() <= 0.06 * want.norm()
    # the activation inside the quantization: act(x) @ W.T + b
    gelu_want = lin(F.gelu(x.float(), approximate="tanh").bfloat16()).float()
    assert (f(x, "gelu_tanh").float() - gelu_want).norm() <= 0.06 * gelu_want.norm()
    # several layers of one quantization give each layer's own call
    g = Fp8Linear.of(torch.nn.Linear(64, 16).bfloat16())
    a, b = project(x, f, g)
    assert torch.equal(a, f(x)) and torch.equal(b, g(x))
    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(8, 8)
    to_fp8(holder, ["proj"])
    assert isinstance(holder.proj, Fp8Linear)
    with pytest.raises(TypeError, match="proj"):
        to_fp8(holder, ["proj"])


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_triton_and_scaled_mm_on_gpu(act):
    """Wan2.2's FFN shape at 832x480x33, two rows: quantize 7020 x 14336, multiply to 3072."""
    from mstar.ops.backends import triton_fp8 as tf
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 tensor cores need sm89 or newer")
    x = make_x(30, 7020, 14336, device="cuda")
    q, s = tf.quantize_rows(x, act)
    rq, rs = _quantize_rows_ref(x, act)
    steps = fp8_steps(q, rq)
    assert (s / rs - 1).abs().max() <= 1e-6 and steps.max() <= 1 and (steps > 0).float().mean() <= 1e-3
    wq, ws = quantize_weight(make_x(31, 3072, 14336, device="cuda"))
    bias = torch.randn(3072, device="cuda").bfloat16()
    got = ops.fp8_matmul(q, s, wq, ws, bias, torch.bfloat16)
    assert _within_one_ulp(got, _fp8_matmul_ref(q, s, wq, ws, bias, torch.bfloat16))
