"""The modulated_layer_norm and gated_residual ops (mstar/ops/modulate.py): the reference against a
float64 computation of the definition and against the separate torch steps it replaces (bit for
bit), its Triton kernels (Triton's CPU interpreter; on a GPU with -m gpu, at a Wan2.2 TI2V-5B
shape) against the reference, for both index shapes ([B, S] per token, [B, 1] per batch row),
float32 and bfloat16 activations and widths that are not powers of two.

Tolerances, elementwise |got - want| <= ATOL + rtol * |want|:
  reference vs float64   float32: rtol 1e-5 (float32 sums over a row in another order);
                         bfloat16: rtol 2^-8 + 1e-5 (the final rounding, half an ulp, plus float32)
  Triton vs reference    float32: rtol 1e-5; bfloat16: rtol 2^-7 (one ulp: the two float32
                         results may round to neighbouring bfloat16 values; the interpreter
                         casts to bfloat16 by truncation, a GPU rounds to nearest)
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_interpreted

from mstar import ops
from mstar.ops.modulate import _gated_residual_ref, _modulated_layer_norm_ref

EPS = 1e-6
ATOL = 1e-5
EXACT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8 + 1e-5}
BACKEND_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


def make_case(seed: int, B: int = 2, S: int = 5, dim: int = 96, U: int = 3, per_token: bool = True,
              dtype=torch.float32, device="cpu"):
    """(x, y, table [U, 6, dim] float32, index [B, S] or [B, 1] int64)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, S, dim, generator=g) * 2 + 0.5).to(dtype)
    y = torch.randn(B, S, dim, generator=g).to(dtype)
    table = 0.5 * torch.randn(U, 6, dim, generator=g)
    index = torch.randint(0, U, (B, S if per_token else 1), generator=g)
    return tuple(t.to(device) for t in (x, y, table, index))


def excess(got: torch.Tensor, want: torch.Tensor, rtol: float) -> float:
    """max |got - want| / (ATOL + rtol |want|): at most 1 passes."""
    got, want = got.double(), want.double()
    return ((got - want).abs() / (ATOL + rtol * want.abs())).max().item()


def exact_modulated_layer_norm(x, table, index):
    x64 = x.double()
    mean = x64.mean(-1, keepdim=True)
    var = ((x64 - mean) ** 2).mean(-1, keepdim=True)
    t = table.double()[index]  # [B, S | 1, 6, dim]
    return (x64 - mean) / torch.sqrt(var + EPS) * (1 + t[..., 1, :]) + t[..., 0, :]


def exact_gated_residual(x, y, table, index):
    return x.double() + y.double() * table.double()[index][..., 2, :]


CASES = [pytest.param(dtype, per_token, dim, id=f"{str(dtype)[6:]}-{'token' if per_token else 'row'}-{dim}")
         for dtype in (torch.float32, torch.bfloat16) for per_token in (True, False) for dim in (96, 3072)]


@pytest.mark.parametrize("dtype,per_token,dim", CASES)
def test_reference_matches_float64(dtype, per_token, dim):
    x, y, table, index = make_case(1, dim=dim, per_token=per_token, dtype=dtype)
    got = _modulated_layer_norm_ref(x, table[:, 0], table[:, 1], index, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    assert excess(got, exact_modulated_layer_norm(x, table, index), EXACT_RTOL[dtype]) <= 1
    got = _gated_residual_ref(x, y, table[:, 2], index)
    assert got.dtype == dtype and got.shape == x.shape
    assert excess(got, exact_gated_residual(x, y, table, index), EXACT_RTOL[dtype]) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_the_separate_steps(dtype):
    """The ops are the composition they replace in the Wan block: the float32 LayerNorm op with unit
    weights, the gathered vectors, the float32 residual, bit for bit."""
    x, y, table, index = make_case(2, S=7, dim=40, dtype=dtype)
    unit = torch.ones(40), torch.zeros(40)
    rows = [table[:, i][index] for i in range(3)]
    norm = (ops.layer_norm(x.float(), *unit, EPS) * (1 + rows[1]) + rows[0]).to(dtype)
    assert torch.equal(ops.modulated_layer_norm(x, table[:, 0], table[:, 1], index, EPS), norm)
    assert torch.equal(ops.gated_residual(x, y, table[:, 2], index), (x.float() + y * rows[2]).to(dtype))


def test_shape_errors_name_the_op():
    x, y, table, index = make_case(3)
    with pytest.raises(ValueError, match="modulated_layer_norm"):
        _modulated_layer_norm_ref(x, table[:, 0], table[:, 1, :8], index, EPS)
    with pytest.raises(ValueError, match="modulated_layer_norm"):
        _modulated_layer_norm_ref(x, table[:, 0], table[:, 1], index[:, :2], EPS)
    with pytest.raises(ValueError, match="gated_residual"):
        _gated_residual_ref(x, y, table[:, 2].double(), index)
    with pytest.raises(ValueError, match="gated_residual"):
        _gated_residual_ref(x, y[:, :2], table[:, 2], index)


def test_fake_gives_the_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode
    x, y, table, index = make_case(4, dtype=torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.mstar.modulated_layer_norm(x, table[:, 0], table[:, 1], index, EPS)
        res = torch.ops.mstar.gated_residual(x, y, table[:, 2], index)
    assert out.shape == res.shape == x.shape and out.dtype == res.dtype == torch.bfloat16


_SCRIPT = r"""
import json
import torch
from test_ops_modulate import BACKEND_RTOL, EPS, excess, make_case
from mstar.ops.modulate import _gated_residual_ref, _modulated_layer_norm_ref
from mstar.ops.backends import triton_modulate as tm
out = []
for seed, kw in ((11, dict(dim=96)), (12, dict(dim=96, per_token=False, dtype=torch.bfloat16)),
                 (13, dict(dim=100, dtype=torch.bfloat16)), (14, dict(B=1, S=3, dim=3072, per_token=False)),
                 (15, dict(B=1, S=2, dim=1100, U=1, dtype=torch.bfloat16))):
    x, y, table, index = make_case(seed, **kw)
    rtol = BACKEND_RTOL[x.dtype]
    norm = excess(tm.modulated_layer_norm(x, table[:, 3], table[:, 4], index, EPS),
                  _modulated_layer_norm_ref(x, table[:, 3], table[:, 4], index, EPS), rtol)
    res = excess(tm.gated_residual(x, y, table[:, 5], index), _gated_residual_ref(x, y, table[:, 5], index), rtol)
    out.append([seed, norm, res])
print(json.dumps(out))
"""


def test_triton_kernels_in_the_interpreter():
    for seed, norm, res in run_interpreted(_SCRIPT):
        assert norm <= 1 and res <= 1, (seed, norm, res)


@pytest.mark.gpu
@pytest.mark.parametrize("per_token", [True, False])
def test_triton_kernels_on_gpu(per_token):
    """Wan2.2 TI2V-5B's width 3072 at 3510 tokens (832x480, 33 frames), a batch of two."""
    from mstar.ops.backends import triton_modulate as tm
    x, y, table, index = make_case(21, B=2, S=3510, dim=3072, U=2, per_token=per_token, dtype=torch.bfloat16,
                                   device="cuda")
    rtol = BACKEND_RTOL[torch.bfloat16]
    got = tm.modulated_layer_norm(x, table[:, 0], table[:, 1], index, EPS)
    assert excess(got, _modulated_layer_norm_ref(x, table[:, 0], table[:, 1], index, EPS), rtol) <= 1
    got = tm.gated_residual(x, y, table[:, 2], index)
    assert excess(got, _gated_residual_ref(x, y, table[:, 2], index), rtol) <= 1
    assert ops.modulated_layer_norm.selected("cuda") == "triton" == ops.gated_residual.selected("cuda")
