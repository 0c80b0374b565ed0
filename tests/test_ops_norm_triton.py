"""The LayerNorm ops' Triton kernel (mstar/ops/backends/triton_layer_norm.py) against the
reference and a float64 computation, and the RMSNorm kernels that share its row load
(triton_norm.py) against their reference, in Triton's CPU interpreter (tests/triton_interpreter.py):
rows of widths that are and are not powers of two, inputs that are strided views, with and
without the residual add, x fp32 / bf16 with weights of x's dtype or fp32.

Tolerances: in fp32 both sides are float32 sums in another order (1e-5 of the output's
scale). In bf16 the new residual x + r must be one rounding of the exact sum (the interpreter
casts by truncation, the GPU to nearest: within one bf16 step either way). The output may be up
to four bf16 steps (2^-7 of the largest |output| each) from the reference's: the residual's step
carried through the norm, and up to two truncating casts after it (the plain RMSNorm rounds
before its weight). Seen: 4 steps at an output scale of 3.97 (RMSNorm, fused add). Wrong maths
(a missing bias, a wrong weight offset) is caught by the fp32 cases at 1e-5."""

from __future__ import annotations

import torch
from triton_interpreter import run_interpreted

CASES = [(5, 48), (3, 80), (4, 64), (1, 1280)]  # (rows, width)


def inputs(rows, width, dtype, w_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width + 7, generator=g) * 3 + 1).to(dtype)[:, :width]  # row stride width + 7
    r = (torch.randn(rows, width, generator=g) * 2).to(dtype)
    w = (1 + 0.3 * torch.randn(width, generator=g)).to(w_dtype)
    b = (0.2 * torch.randn(width, generator=g)).to(w_dtype)
    return x, r, w, b


_SCRIPT = r"""
import json, random, torch
from mstar.ops.layer_norm import fused_add_layer_norm, layer_norm
from mstar.ops.backends import triton_layer_norm as tl_ln
from mstar.ops.backends import triton_norm as tn
from mstar.ops import norm
from test_ops_norm_triton import CASES, inputs
out = []
seed = random.randrange(1 << 30)
for dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)):
    for rows, width in CASES:
        seed += 1
        x, r, w, b = inputs(rows, width, dtype, w_dtype, seed)
        ref = layer_norm.backends["reference"].fn(x, w, b, 1e-5)
        got = tl_ln.layer_norm(x, w, b, 1e-5)
        ref_y, ref_s = fused_add_layer_norm.backends["reference"].fn(x, r, w, b, 1e-5)
        got_y, got_s = tl_ln.fused_add_layer_norm(x, r, w, b, 1e-5)
        # float64: the exact sum, normalised (what both roundings approximate)
        s64 = x.double() + r.double()
        y64 = torch.nn.functional.layer_norm(got_s.double(), (width,), w.double(), b.double(), 1e-5)
        out.append(dict(dtype=str(dtype), rows=rows, width=width, seed=seed,
                        shape_ok=got.shape == ref.shape and got_y.shape == ref_y.shape and got.dtype == dtype,
                        d_plain=(got.float() - ref.float()).abs().max().item(),
                        d_fused=(got_y.float() - ref_y.float()).abs().max().item(),
                        d_f64=(got_y.double() - y64).abs().max().item(),
                        d_sum=((got_s.double() - s64).abs() / s64.abs().clamp_min(1e-30)).max().item(),
                        scale=ref_y.float().abs().max().item()))
        for zc in (True, False):  # RMSNorm, plain and fused add, through the shared row load
            ry, rs = norm.fused_add_rms_norm.backends["reference"].fn(x, r, w, 1e-6, zc)
            gy, gs = tn.fused_add_rms_norm(x, r, w, 1e-6, zc)
            rp, gp = norm.rms_norm.backends["reference"].fn(x, w, 1e-6, zc), tn.rms_norm(x, w, 1e-6, zc)
            out.append(dict(rms=True, dtype=str(dtype), seed=seed, zc=zc,
                            d_y=max((gy.float() - ry.float()).abs().max().item(), (gp.float() - rp.float()).abs().max().item()),
                            d_s=(gs.float() - rs.float()).abs().max().item(),
                            scale=max(ry.float().abs().max().item(), rp.float().abs().max().item(), 1.0),
                            s_scale=rs.float().abs().max().item()))
        # the weight in float32, one rounding (Cosmos3's Nemotron form); also over heads [rows, 2, width // 2]
        for xs in (x, x.reshape(rows, 2, width // 2)):
            ws = w if xs.dim() == 2 else w[: width // 2]
            rf = norm.rms_norm_fp32_weight.backends["reference"].fn(xs, ws, 1e-6)
            gf = tn.rms_norm_fp32_weight(xs, ws, 1e-6)
            y64 = (xs.double() * torch.rsqrt(xs.double().pow(2).mean(-1, keepdim=True) + 1e-6)) * ws.double()
            out.append(dict(fp32w=True, dtype=str(dtype), seed=seed, shape_ok=gf.shape == xs.shape and gf.dtype == dtype,
                            d_y=(gf.float() - rf.float()).abs().max().item(),
                            d_f64=(gf.double() - y64).abs().max().item(),
                            scale=max(rf.float().abs().max().item(), 1.0)))
        # the gated norm over heads, z a column slice of a wider projection (no [T * H, D] view of it)
        heads, d = 2, width // 2
        zw = (torch.randn(rows, 3 * width, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
        for z in (zw[:, width:2 * width].reshape(rows, heads, d), zw[:, :width].contiguous().reshape(rows, heads, d)):
            xs = x.reshape(rows, heads, d)
            rg = norm.gated_rms_norm.backends["reference"].fn(xs, z, w[:d], 1e-6)
            gg = tn.gated_rms_norm(xs, z, w[:d], 1e-6)
            out.append(dict(gated=True, dtype=str(dtype), seed=seed, shape_ok=gg.shape == xs.shape,
                            d_y=(gg.float() - rg.float()).abs().max().item(),
                            scale=max(rg.float().abs().max().item(), 1.0)))
        ry, rs = norm.fused_add_rms_norm_fp32_weight.backends["reference"].fn(x, r, w, 1e-6)
        gy, gs = tn.fused_add_rms_norm_fp32_weight(x, r, w, 1e-6)
        out.append(dict(rms=True, dtype=str(dtype), seed=seed, zc=None,
                        d_y=(gy.float() - ry.float()).abs().max().item(), d_s=(gs.float() - rs.float()).abs().max().item(),
                        scale=max(ry.float().abs().max().item(), 1.0), s_scale=rs.float().abs().max().item()))
print(json.dumps(out))
"""


def test_triton_layer_norm_in_the_interpreter():
    got = run_interpreted(_SCRIPT)
    rms = [c for c in got if c.get("rms")]
    fp32w = [c for c in got if c.get("fp32w")]
    gated = [c for c in got if c.get("gated")]
    rows = [c for c in got if not c.get("rms") and not c.get("fp32w") and not c.get("gated")]
    assert len(gated) == 2 * len(rows)
    for c in gated:  # the reference's roundings: within one step of the output dtype
        step = 1e-5 if c["dtype"] == "torch.float32" else 2.0 ** -7
        assert c["shape_ok"] and c["d_y"] <= 2 * step * c["scale"], c
    assert len(rows) == 3 * len(CASES) and len(rms) == 3 * len(rows) and len(fp32w) == 2 * len(rows)
    for c in fp32w:  # one rounding: within one step of the output's dtype of the reference and of float64
        assert c["shape_ok"], c
        step = 1e-5 if c["dtype"] == "torch.float32" else 2.0 ** -7
        assert c["d_y"] <= step * c["scale"] and c["d_f64"] <= step * c["scale"], c
    for c in rms:
        if c["dtype"] == "torch.float32":
            assert c["d_y"] < 1e-5 * c["scale"] and c["d_s"] == 0.0, c
        else:  # see the module docstring: up to four bf16 steps of the output's scale here
            assert c["d_y"] <= 4 * 2.0 ** -7 * c["scale"] and c["d_s"] <= 2.0 ** -7 * c["s_scale"], c
    for c in rows:
        assert c["shape_ok"], c
        if c["dtype"] == "torch.float32":
            tol = 1e-5 * max(c["scale"], 1.0)
            assert c["d_plain"] < tol and c["d_fused"] < tol and c["d_f64"] < tol, c
            assert c["d_sum"] < 1e-6, c
        else:
            step = 2.0 ** -7 * c["scale"]
            assert c["d_plain"] <= 4 * step and c["d_fused"] <= 4 * step, c
            assert c["d_f64"] <= step, c
            assert c["d_sum"] <= 2.0 ** -7, c  # one rounding of the exact sum


def test_backend_registered_for_cuda_only():
    import mstar.ops.backends.triton_layer_norm  # noqa: F401 -- registers (imports Triton only)
    from mstar.ops.layer_norm import fused_add_layer_norm, layer_norm
    for op in (layer_norm, fused_add_layer_norm):
        b = op.backends["triton"]
        assert b.devices == ("cuda",) and b.priority > op.backends["reference"].priority
        assert op.selected("cpu") == "reference"
