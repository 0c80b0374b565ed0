"""The adain_act op (mstar/ops/adain.py): the reference against a float64 computation of its
definition, its Triton kernel against that float64 computation (Triton's CPU interpreter) and
against the reference (on a GPU with -m gpu), and Kokoro's blocks built on it against the separate
modules they replace (the norm, the AdaIN affine, the activation and the mask one after another)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_interpreted

from mstar import ops
from mstar.ops.adain import _adain_act_ref

TRITON_TOL = 2e-5  # float32, sums of up to a few thousand terms in another order


def make_case(seed: int, B: int = 3, C: int = 5, T: int = 300, snake: bool = True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, C, T, generator=g) * 2 + 0.5).to(dtype)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype).unsqueeze(1)
    gamma, beta = (0.3 * torch.randn(B, C, generator=g)).to(dtype), (0.3 * torch.randn(B, C, generator=g)).to(dtype)
    weight, bias = 1 + 0.2 * torch.randn(C, generator=g), 0.2 * torch.randn(C, generator=g)
    alpha = (0.3 + torch.rand(C, generator=g) * 1.5) if snake else torch.empty(0)
    return x, mask, gamma, beta, weight, bias, alpha


def exact(x, mask, gamma, beta, weight, bias, alpha, slope, eps):
    """The definition in float64, row by row over each row's own positions."""
    x64 = x.double()
    out = torch.zeros_like(x64)
    for b in range(x.shape[0]):
        n = int(mask[b, 0].sum())
        xs = x64[b, :, :n]
        mean = xs.mean(-1, keepdim=True)
        var = ((xs - mean) ** 2).mean(-1, keepdim=True)
        y = (xs - mean) / torch.sqrt(var + eps) * weight.double()[:, None] + bias.double()[:, None]
        y = (1 + gamma[b].double()[:, None]) * y + beta[b].double()[:, None]
        if alpha.numel():
            a = alpha.double()[:, None]
            y = y + torch.sin(a * y) ** 2 / (a + 1e-9)
        else:
            y = F.leaky_relu(y, slope)
        out[b, :, :n] = y
    return out


@pytest.mark.parametrize("snake", [True, False])
def test_reference_matches_float64(snake):
    case = make_case(1 + snake, snake=snake)
    got = _adain_act_ref(*case, 0.2, 1e-5)
    assert (got.double() - exact(*case, 0.2, 1e-5)).abs().max().item() < 1e-5
    assert got.dtype == torch.float32 and (got[case[1].expand_as(got) == 0] == 0).all()


def test_shape_errors_name_the_op():
    x, mask, gamma, beta, weight, bias, alpha = make_case(3)
    with pytest.raises(ValueError, match="adain_act"):
        _adain_act_ref(x, mask, gamma[:, :2], beta, weight, bias, alpha, 0.2, 1e-5)
    with pytest.raises(ValueError, match="adain_act"):
        _adain_act_ref(x, mask, gamma, beta, weight, bias, alpha[:2], 0.2, 1e-5)


def test_kokoro_blocks_equal_the_separate_modules():
    """AdaIN1d.act (the op) == act(AdaIN1d(x)) * m, bit for bit on the reference backend."""
    from mstar.models.kokoro.blocks import AdaIN1d
    torch.manual_seed(4)
    mod = AdaIN1d(8, 6)
    with torch.no_grad():
        mod.norm.weight.uniform_(0.5, 1.5)
        mod.norm.bias.normal_()
    x, mask, *_ = make_case(5, B=2, C=6, T=50)
    s = torch.randn(2, 8)
    alpha = torch.rand(6) + 0.5
    with torch.no_grad():
        assert torch.equal(mod.act(x, s, mask, alpha=alpha), ops.snake(mod(x, s, mask), alpha) * mask)
        assert torch.equal(mod.act(x, s, mask, slope=0.2), F.leaky_relu(mod(x, s, mask), 0.2) * mask)


_SCRIPT = r"""
import json
import torch
from test_ops_adain import exact, make_case
from mstar.ops.backends import triton_adain
out = []
for seed, kw in ((11, dict(snake=True)), (12, dict(snake=False)), (13, dict(B=2, C=3, T=2500)),
                 (14, dict(B=1, C=2, T=7))):
    case = make_case(seed, **kw)
    # against float64: torch's own float32 sin on the CPU varies by up to 5e-4 here between runs
    ref = exact(*case, 0.2, 1e-5)
    got = triton_adain.adain_act(*case, 0.2, 1e-5)
    zero = bool((got[case[1].expand_as(got) == 0] == 0).all())
    out.append([seed, (got.double() - ref).abs().max().item(), zero])
print(json.dumps(out))
"""


def test_triton_kernel_in_the_interpreter():
    for seed, err, padding_zero in run_interpreted(_SCRIPT):
        assert err < TRITON_TOL and padding_zero, (seed, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, TRITON_TOL), (torch.bfloat16, 0.05)])
def test_triton_kernel_on_gpu(dtype, tol):
    """Kokoro's widest AdaIN: 128 channels x 24000 positions, rows of different lengths."""
    from mstar.ops.backends import triton_adain
    case = [t.cuda() for t in make_case(21, B=4, C=128, T=24000, dtype=dtype)]
    ref = _adain_act_ref(*case, 0.2, 1e-5).float()
    got = triton_adain.adain_act(*case, 0.2, 1e-5).float()
    assert (got - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())
    assert ops.adain_act.selected("cuda") == "triton"
