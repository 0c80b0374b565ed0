"""The rms_norm_rotary op (mstar/ops/rms_norm_rotary.py): the reference against a float64 computation
of the definition and against the two steps it replaces in Wan's self-attention (ops.rms_norm, then
the interleaved rotary in float32; bit for bit), its Triton kernel (Triton's CPU interpreter; on a GPU with
-m gpu, at the Wan2.2 TI2V-5B shape) against the reference, float32 and bfloat16, widths heads *
head_dim of 3 * 16, 4 * 32 and 24 * 128 (Wan2.2 TI2V-5B's 3072).

Tolerances: a rotation mixes the two elements of a pair, so an error in one lands on both and
cancellation can make an output element far smaller than its inputs; errors are measured against
the pair's magnitude r = |(y[2i], y[2i+1])| (a rotation keeps it), |got - want| <= ATOL + rtol * r.
With u = 2^-7 (a bfloat16 ulp relative to the value, at most):
  reference vs float64   float32: rtol 1e-5 (float32 sums over a row in another order);
                         bfloat16: rtol 1.5 u + 1e-5 (three roundings to nearest, half an ulp
                         each: the normalised x, the weighted product, the rotated output)
  Triton vs reference    float32: rtol 1e-5; bfloat16: rtol 4.5 u (one ulp at each of the three
                         roundings plus the reference's half: the interpreter casts to bfloat16 by
                         truncation, a GPU rounds to nearest as the reference does); seen 2.9 u
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_interpreted

from mstar import ops
from mstar.ops.rms_norm_rotary import _rms_norm_rotary_ref

EPS = 1e-6
ATOL = 1e-5


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary as its own step: interleaved pairs (x0, x1) -> (x0 c - x1 s, x0 s + x1 c), float32
    math, x's dtype out; x [..., S, H, D], cos / sin [S, 1, D // 2]."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)
U = 2 ** -7
EXACT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.5 * U + 1e-5}
BACKEND_RTOL = {torch.float32: 1e-5, torch.bfloat16: 4.5 * U}


def make_case(seed: int, B: int = 2, S: int = 5, heads: int = 3, head_dim: int = 16, dtype=torch.float32,
              weight_dtype=None, device="cpu"):
    """(x [B, S, heads * head_dim], weight, cos, sin [S, head_dim // 2] float32)."""
    g = torch.Generator().manual_seed(seed)
    width = heads * head_dim
    x = (torch.randn(B, S, width, generator=g) * 2 + 0.3).to(dtype)
    weight = (1 + 0.3 * torch.randn(width, generator=g)).to(weight_dtype or dtype)
    ang = torch.rand(S, head_dim // 2, generator=g, dtype=torch.float64) * 20
    return tuple(t.to(device) for t in (x, weight, ang.cos().float(), ang.sin().float()))


def excess(got: torch.Tensor, want: torch.Tensor, rtol: float) -> float:
    """max |got - want| / (ATOL + rtol r), r the magnitude of want's pair: at most 1 passes."""
    got, want = got.double(), want.double()
    r = want.unflatten(-1, (-1, 2)).norm(dim=-1).repeat_interleave(2, -1)
    return ((got - want).abs() / (ATOL + rtol * r)).max().item()


def exact(x, weight, cos, sin, heads):
    x64 = x.double()
    n = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    x0, x1 = n.unflatten(-1, (heads, -1, 2)).unbind(-1)  # [B, S, H, D // 2]
    c, s = cos.double()[:, None], sin.double()[:, None]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-3)


SHAPES = [(3, 16), (4, 32), (24, 128)]
CASES = [pytest.param(dtype, h, d, id=f"{str(dtype)[6:]}-{h}x{d}") for dtype in (torch.float32, torch.bfloat16)
         for h, d in SHAPES]


@pytest.mark.parametrize("dtype,heads,head_dim", CASES)
def test_reference_matches_float64(dtype, heads, head_dim):
    x, w, cos, sin = make_case(1, heads=heads, head_dim=head_dim, dtype=dtype)
    got = _rms_norm_rotary_ref(x, w, cos, sin, heads, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    assert excess(got, exact(x, w, cos, sin, heads), EXACT_RTOL[dtype]) <= 1


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.bfloat16, torch.float32)])
def test_reference_equals_the_separate_steps(dtype, weight_dtype):
    """The op is what Wan's self-attention computed in two steps: ops.rms_norm over the full width
    (rounded to x's dtype), the head split, apply_rotary with cos / sin [S, 1, D // 2], bit for bit."""
    heads, head_dim = 4, 32
    x, w, cos, sin = make_case(2, S=7, heads=heads, head_dim=head_dim, dtype=dtype, weight_dtype=weight_dtype)
    B, S, width = x.shape
    n = ops.rms_norm(x, w, EPS, False).view(B, S, heads, head_dim)
    want = apply_rotary(n, cos[:, None], sin[:, None]).view(B, S, width)
    assert torch.equal(ops.rms_norm_rotary(x, w, cos, sin, heads, EPS), want)


def test_shape_errors_name_the_op():
    x, w, cos, sin = make_case(3, heads=3, head_dim=16)
    bad = [(x[0], w, cos, sin, 3),  # x not [B, S, width]
           (x, w[:8], cos, sin, 3),  # weight not [width]
           (x, w, cos[:4], sin[:4], 3),  # cos / sin not one row per token
           (x, w, cos, sin, 5),  # width not a multiple of heads ...
           (x, w, cos, sin, 6),  # ... head_dim (8) not cos's 2 * 8
           (x[..., :45], w[:45], cos, sin, 3),  # odd head_dim
           (x, w, cos.double(), sin, 3)]  # angles not float32
    for args in bad:
        with pytest.raises(ValueError, match="rms_norm_rotary"):
            _rms_norm_rotary_ref(*args, EPS)


def test_fake_gives_the_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode
    x, w, cos, sin = make_case(4, dtype=torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.mstar.rms_norm_rotary(x, w, cos, sin, 3, EPS)
    assert out.shape == x.shape and out.dtype == torch.bfloat16


_SCRIPT = r"""
import json
import torch
from test_ops_rms_norm_rotary import BACKEND_RTOL, EPS, excess, make_case
from mstar.ops.rms_norm_rotary import _rms_norm_rotary_ref
from mstar.ops.backends import triton_rms_norm_rotary as tr
out = []
for seed, kw in ((11, dict(heads=3, head_dim=16)), (12, dict(heads=3, head_dim=16, dtype=torch.bfloat16)),
                 (13, dict(heads=4, head_dim=32)), (14, dict(heads=4, head_dim=32, dtype=torch.bfloat16)),
                 (15, dict(B=1, S=3, heads=24, head_dim=128)),
                 (16, dict(B=1, S=3, heads=24, head_dim=128, dtype=torch.bfloat16)),
                 (17, dict(B=3, S=2, heads=4, head_dim=32, dtype=torch.bfloat16, weight_dtype=torch.float32))):
    x, w, cos, sin = make_case(seed, **kw)
    heads = kw["heads"]
    got = tr.rms_norm_rotary(x, w, cos, sin, heads, EPS)
    want = _rms_norm_rotary_ref(x, w, cos, sin, heads, EPS)
    assert got.dtype == want.dtype and got.shape == want.shape
    out.append([seed, excess(got, want, BACKEND_RTOL[x.dtype])])
print(json.dumps(out))
"""


def test_triton_kernel_in_the_interpreter():
    for seed, ex in run_interpreted(_SCRIPT):
        assert ex <= 1, (seed, ex)


@pytest.mark.gpu
def test_triton_kernel_on_gpu():
    """Wan2.2 TI2V-5B's 24 heads of 128 at 3510 tokens (832x480, 33 frames), a batch of two."""
    from mstar.ops.backends import triton_rms_norm_rotary as tr
    x, w, cos, sin = make_case(21, B=2, S=3510, heads=24, head_dim=128, dtype=torch.bfloat16, device="cuda")
    got = tr.rms_norm_rotary(x, w, cos, sin, 24, EPS)
    assert excess(got, _rms_norm_rotary_ref(x, w, cos, sin, 24, EPS), BACKEND_RTOL[torch.bfloat16]) <= 1
    assert ops.rms_norm_rotary.selected("cuda") == "triton"
