"""Activation and rotary ops vs float64 math, rotary vs transformers' Qwen3 / Qwen3.5 rope,
and torch.library.opcheck.

Tolerances: float32 inputs vs float64 on the same values (for rotary: the same cos/sin
table, widened to float64): rtol 1e-5, atol 1e-5. bfloat16 inputs: ~1 bf16 ulp, rtol
1.6e-2, atol 1e-2. The float32 table itself vs float64 trigonometry: its angle
pos * inv_freq is a float32 product, off by up to ~pos * 2^-23 rad, so atol 4 * max_pos * 2^-24.
Versus transformers in float32: rtol 1e-5, atol 1e-5 (same cos/sin table, same products);
in bfloat16 transformers rounds cos/sin and each product to bf16, so rtol/atol 3e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from mstar import ops

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype=torch.float32, scale=1.0, offset=0.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale + offset).to(dtype)


# --- silu_and_mul / gelu ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("shape", [(9, 2 * 96), (3, 5, 2 * 256), (1, 2 * 17)])
def test_silu_and_mul_vs_float64(dtype, shape):
    x = _rand(*shape, dtype=dtype, scale=3.0)
    out = ops.silu_and_mul(x)
    d = shape[-1] // 2
    x64 = x.double()
    ref = x64[..., :d] * torch.sigmoid(x64[..., :d]) * x64[..., d:]
    assert out.dtype == dtype and out.shape == (*shape[:-1], d) and out.is_contiguous()
    tol = TOL.get(dtype, dict(rtol=2e-3, atol=2e-3))  # float16: ~1 ulp (2^-11 relative)
    torch.testing.assert_close(out.double(), ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_relu_square_vs_float64_and_in_the_triton_interpreter(dtype):
    """relu(x)^2 is one rounding of the exact square (the square of a 16-bit float is exact in
    float32, the Triton kernel's arithmetic): equal to the float64 value rounded once (in the
    interpreter, within its truncating cast)."""
    x = _rand(7, 5, 131, dtype=dtype, scale=3.0)
    out = ops.relu_square(x)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, x.double().clamp_min(0).square().to(dtype))
    from triton_interpreter import run_interpreted
    got = run_interpreted(f"""
import json, torch
from mstar.ops.backends import triton_elementwise as te
x = (torch.randn(3, 4099, generator=torch.Generator().manual_seed(5)) * 3).to(torch.{str(dtype).split('.')[-1]})
y = te.relu_square(x[:, 1:])  # a strided view
want = x[:, 1:].double().clamp_min(0).square().to(x.dtype)
d = (y.double() - want.double()).abs() / want.double().abs().clamp_min(1e-30)
print(json.dumps([d.max().item(), list(y.shape), y.is_contiguous(), bool((y >= 0).all())]))
""")
    # the interpreter casts to 16-bit floats by truncation (the GPU rounds to nearest): one step
    step = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    assert got[0] <= step and got[1:] == [[3, 4098], True, True], got


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul_vs_float64_and_in_the_triton_interpreter(dtype):
    """x * sigmoid(gate) with the gate a strided view of a wider projection (an attention's output
    gate): the reference within two roundings of float64; the Triton kernel, in the interpreter,
    within one rounding step of the reference."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x = (torch.randn(5, 3, 64, generator=g) * 2).to(dtype)
    proj = (torch.randn(5, 3, 128, generator=g) * 3).to(dtype)
    gate = proj[..., 64:]
    out = ops.sigmoid_mul(x, gate)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    ref = x.double() * torch.sigmoid(gate.double())
    step = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -7}[dtype]
    assert ((out.double() - ref).abs() <= 2 * step * ref.abs() + 1e-30).all()
    torch.library.opcheck(ops.sigmoid_mul.overload, (x, gate))
    from triton_interpreter import run_interpreted
    got = run_interpreted(f"""
import json, torch
from mstar.ops import activation
from mstar.ops.backends import triton_elementwise as te
g = torch.Generator().manual_seed(3)
x = (torch.randn(5, 3, 64, generator=g) * 2).to(torch.{str(dtype).split('.')[-1]})
proj = (torch.randn(5, 3, 128, generator=g) * 3).to(x.dtype)
y = te.sigmoid_mul(x, proj[..., 64:])
want = activation.sigmoid_mul.backends["reference"].fn(x, proj[..., 64:])
d = (y.double() - want.double()).abs() / want.double().abs().clamp_min(1e-30)
print(json.dumps([d.max().item(), list(y.shape), y.is_contiguous()]))
""")
    # the interpreter casts to 16-bit floats by truncation (the GPU rounds to nearest): two steps
    assert got[0] <= {torch.float32: 1e-6, torch.bfloat16: 2 * 2.0 ** -7}[dtype] and got[1:] == [[5, 3, 64], True], got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(13, 320), (2, 7, 64)])
def test_gelu_vs_float64(dtype, approximate, shape):
    x = _rand(*shape, dtype=dtype, scale=3.0)
    out = ops.gelu(x, approximate)
    x64 = x.double()
    if approximate == "none":
        ref = 0.5 * x64 * (1.0 + torch.erf(x64 / math.sqrt(2.0)))
    else:
        ref = 0.5 * x64 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


def _gelu64(x64: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "none":
        return 0.5 * x64 * (1.0 + torch.erf(x64 / math.sqrt(2.0)))
    return 0.5 * x64 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64 ** 3)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_gelu_vs_float64(dtype, approximate):
    x, w, b = _rand(2, 9, 48, dtype=dtype), _rand(80, 48, dtype=dtype, scale=0.2), _rand(80, dtype=dtype)
    out = ops.linear_gelu(x, w, b, approximate)
    # the product rounded to the dtype first (as a separate linear would), then GELU
    ref = _gelu64(torch.nn.functional.linear(x, w, b).double(), approximate)
    assert out.dtype == dtype and out.shape == (2, 9, 80)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_gelu_cublaslt_on_gpu(approximate):
    """The epilogue's GELU against float64 math on the float64 product (it rounds once, after the
    activation): within bf16 rounding of the output."""
    from mstar.ops.activation import _linear_gelu_cublaslt
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 700, 3072, generator=g).bfloat16().cuda()
    w = (torch.randn(4096, 3072, generator=g) * 3072 ** -0.5).bfloat16().cuda()
    b = torch.randn(4096, generator=g).bfloat16().cuda()
    out = _linear_gelu_cublaslt(x, w, b, approximate)
    ref = _gelu64(torch.nn.functional.linear(x.double(), w.double(), b.double()), approximate)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 700, 4096)
    torch.testing.assert_close(out.double(), ref, rtol=1.6e-2, atol=1e-2)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(Exception):
        ops.gelu(torch.randn(3, 4), "sigmoid")


def test_activation_empty_inputs():
    assert ops.silu_and_mul(torch.randn(0, 64)).shape == (0, 32)
    assert ops.gelu(torch.randn(0, 64), "tanh").shape == (0, 64)


# --- rotary -----------------------------------------------------------------------------------
def _rotary64(positions, x, cache, rotary_dim):
    """NeoX rope in float64 from the cos|sin table: x [T, H, D]."""
    x64 = x.double()
    r = rotary_dim // 2
    cs = cache.double()[positions]
    cos, sin = cs[:, None, :r], cs[:, None, r:rotary_dim]
    x1, x2 = x64[..., :r], x64[..., r:rotary_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x64[..., rotary_dim:]], dim=-1)


def _positions(t, max_pos):
    # arbitrary, unsorted, with repeats possible: rows of a step sit anywhere
    return torch.randint(0, max_pos, (t,), dtype=torch.int64)


@pytest.mark.parametrize("rd,base,n", [(64, 10000.0, 300), (128, 1_000_000.0, 5000), (32, 500.0, 77)])
def test_build_cos_sin_cache_vs_float64(rd, base, n):
    cache = ops.build_cos_sin_cache(n, rd, base)
    assert cache.shape == (n, rd) and cache.dtype == torch.float32
    inv = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
    atol = 4 * n * 2.0 ** -24 + 1e-7
    torch.testing.assert_close(cache[:, : rd // 2].double(), ang.cos(), rtol=0, atol=atol)
    torch.testing.assert_close(cache[:, rd // 2:].double(), ang.sin(), rtol=0, atol=atol)


def test_build_cos_sin_cache_matches_transformers_inv_freq():
    cfg = Qwen3_5TextConfig(head_dim=256)
    inv_hf, _ = hf_qwen3_5.Qwen3_5TextRotaryEmbedding.compute_default_rope_parameters(cfg)
    n = 1000
    cache = ops.build_cos_sin_cache(n, 64, cfg.rope_parameters["rope_theta"])
    freqs = torch.arange(n).float()[:, None] * inv_hf[None, :]
    assert torch.equal(cache, torch.cat([freqs.cos(), freqs.sin()], dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (256, 64), (64, 32), (64, 64)])
def test_rotary_vs_float64(dtype, head_dim, rotary_dim):
    base, max_pos, t = 1_000_000.0, 4096, 37
    cache = ops.build_cos_sin_cache(max_pos, rotary_dim, base)
    pos = _positions(t, max_pos)
    q = _rand(t, 8, head_dim, dtype=dtype, scale=2.0)
    k = _rand(t, 2, head_dim, dtype=dtype, scale=2.0)
    qo, ko = ops.rotary_embedding(pos, q, k, cache, rotary_dim)
    assert qo.dtype == dtype and ko.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
    torch.testing.assert_close(qo.double(), _rotary64(pos, q, cache, rotary_dim), **TOL[dtype])
    torch.testing.assert_close(ko.double(), _rotary64(pos, k, cache, rotary_dim), **TOL[dtype])
    # the pass-through dims are copied exactly, and the inputs are left alone
    assert torch.equal(qo[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(ko[..., rotary_dim:], k[..., rotary_dim:])


def test_rotary_strided_inputs():
    """q and k as views into one fused qkv projection (the way models call it)."""
    t, hq, hk, d, rd = 11, 4, 2, 128, 128
    cache = ops.build_cos_sin_cache(2048, rd, 10000.0)
    qkv = _rand(t, (hq + 2 * hk) * d, scale=2.0)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    assert not q.is_contiguous()
    pos = _positions(t, 2048)
    qo, ko = ops.rotary_embedding(pos, q, k, cache, rd)
    q2, k2 = ops.rotary_embedding(pos, q.contiguous(), k.contiguous(), cache, rd)
    assert torch.equal(qo, q2) and torch.equal(ko, k2)
    torch.library.opcheck(ops.rotary_embedding.overload, (pos, q, k, cache, rd))


def _hf_apply(apply_fn, q, k, cos, sin):
    # HF layout [B, H, S, D] with cos/sin [B, S, rd]; ours is [T, H, D]
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    qo, ko = apply_fn(qh, kh, cos, sin)
    return qo[0].transpose(0, 1), ko[0].transpose(0, 1)


HF_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_vs_transformers_qwen3(dtype):
    cfg = Qwen3Config(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                      max_position_embeddings=40960, rope_parameters={"rope_type": "default",
                                                                       "rope_theta": 1_000_000.0})
    rope = hf_qwen3.Qwen3RotaryEmbedding(cfg)
    t = 29
    pos = _positions(t, 40960)
    q = _rand(t, 8, 128, dtype=dtype, scale=2.0)
    k = _rand(t, 2, 128, dtype=dtype, scale=2.0)
    cos, sin = rope(q, pos[None])
    ref_q, ref_k = _hf_apply(hf_qwen3.apply_rotary_pos_emb, q, k, cos, sin)
    cache = ops.build_cos_sin_cache(40960, 128, 1_000_000.0)
    qo, ko = ops.rotary_embedding(pos, q, k, cache, 128)
    torch.testing.assert_close(qo, ref_q, **HF_TOL[dtype])
    torch.testing.assert_close(ko, ref_k, **HF_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_vs_transformers_qwen3_5_partial(dtype):
    cfg = Qwen3_5TextConfig(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                            max_position_embeddings=32768)
    assert cfg.rope_parameters.get("partial_rotary_factor") == 0.25
    base = cfg.rope_parameters["rope_theta"]
    rope = hf_qwen3_5.Qwen3_5TextRotaryEmbedding(cfg)
    t = 23
    pos = _positions(t, 32768)
    q = _rand(t, 8, 256, dtype=dtype, scale=2.0)
    k = _rand(t, 2, 256, dtype=dtype, scale=2.0)
    cos, sin = rope(q, pos[None])  # text-only: the three mrope position streams are equal
    assert cos.shape[-1] == 64
    ref_q, ref_k = _hf_apply(hf_qwen3_5.apply_rotary_pos_emb, q, k, cos, sin)
    cache = ops.build_cos_sin_cache(32768, 64, base)
    qo, ko = ops.rotary_embedding(pos, q, k, cache, 64)
    torch.testing.assert_close(qo, ref_q, **HF_TOL[dtype])
    torch.testing.assert_close(ko, ref_k, **HF_TOL[dtype])


def test_rotary_empty_inputs():
    cache = ops.build_cos_sin_cache(16, 64, 10000.0)
    q, k = torch.randn(0, 4, 64), torch.randn(0, 2, 64)
    qo, ko = ops.rotary_embedding(torch.zeros(0, dtype=torch.int64), q, k, cache, 64)
    assert qo.shape == q.shape and ko.shape == k.shape


# --- opcheck ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_activation_rotary(dtype):
    x = _rand(6, 2 * 48, dtype=dtype, scale=2.0)
    torch.library.opcheck(ops.silu_and_mul.overload, (x,))
    torch.library.opcheck(ops.silu_and_mul.overload, (_rand(2, 3, 2 * 16, dtype=dtype),))
    torch.library.opcheck(ops.gelu.overload, (x, "none"))
    torch.library.opcheck(ops.gelu.overload, (x, "tanh"))
    torch.library.opcheck(ops.relu_square.overload, (x,))
    cache = ops.build_cos_sin_cache(512, 64, 10000.0)
    pos = _positions(9, 512)
    for rd in (64, 32):
        c = cache if rd == 64 else ops.build_cos_sin_cache(512, rd, 10000.0)
        q, k = _rand(9, 4, 64, dtype=dtype), _rand(9, 2, 64, dtype=dtype)
        torch.library.opcheck(ops.rotary_embedding.overload, (pos, q, k, c, rd))
