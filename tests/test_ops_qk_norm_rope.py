"""qk_norm_rope: the per-head q/k RMSNorm and rotary of an attention layer, from the fused
qkv projection, as one op. The reference is the composed path (bit for bit); the Triton
kernel runs in Triton's CPU interpreter (tests/triton_interpreter.py)."""

from __future__ import annotations

import pytest
import torch

from mstar.ops import rotary
from mstar.ops.norm import _rms_norm_ref
from triton_interpreter import run_interpreted

SHAPES = [(4, 2, 32, 16, True, True), (4, 2, 16, 16, False, False), (2, 1, 64, 16, True, False)]


def _inputs(hq, hk, d, rd, gated, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    width = hq * d * (2 if gated else 1) + 2 * hk * d
    qkv = torch.randn(6, width + 3, generator=g).to(dtype)[:, :width]  # a view with row stride > width
    pos = torch.tensor([0, 7, 3, 100, 31, 64])
    cache = rotary.build_cos_sin_cache(128, rd, 10000.0)
    qw, kw = (torch.randn(d, generator=g) * 0.1).to(dtype), (torch.randn(d, generator=g) * 0.1).to(dtype)
    return qkv, pos, qw, kw, cache


@pytest.mark.parametrize("hq,hk,d,rd,zc,gated", SHAPES)
def test_reference_is_the_composed_path(hq, hk, d, rd, zc, gated):
    qkv, pos, qw, kw, cache = _inputs(hq, hk, d, rd, gated, torch.float32, seed=d)
    q, k, v = rotary.qk_norm_rope.backends["reference"].fn(qkv, pos, qw, kw, cache, hq, hk, d, rd, 1e-6, zc, gated)
    q0, k0, v0, gate = rotary.split_qkv_heads(qkv, hq, hk, d, gated)
    q1 = _rms_norm_ref(q0.contiguous(), qw, 1e-6, zc)
    k1 = _rms_norm_ref(k0.contiguous(), kw, 1e-6, zc)
    q1, k1 = rotary.rotary_embedding.backends["reference"].fn(pos, q1, k1, cache, rd)
    assert torch.equal(q, q1) and torch.equal(k, k1) and torch.equal(v, v0)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert (gate is not None) == gated
    # float64 check of one head: normalise, weight, rotate the first rd dims
    x = q0[2, 1].double()
    y = x / (x.pow(2).mean() + 1e-6).sqrt() * ((1 + qw.double()) if zc else qw.double())
    ang = pos[2].double() * (1.0 / 10000.0 ** (torch.arange(0, rd, 2).double() / rd))
    r = rd // 2
    want = torch.cat([y[:r] * ang.cos() - y[r:rd] * ang.sin(), y[r:rd] * ang.cos() + y[:r] * ang.sin(), y[rd:]])
    assert (q[2, 1].double() - want).abs().max().item() < 1e-5


def test_fp32_weight_form_is_the_composed_path():
    """qk_norm_rope_fp32_weight: split, rms_norm_fp32_weight of each q / k head, rotary (bit for bit)."""
    from mstar.ops.norm import _rms_norm_fp32_weight_ref
    for dtype in (torch.float32, torch.bfloat16):
        qkv, pos, qw, kw, cache = _inputs(4, 2, 32, 32, False, dtype, seed=11)
        q, k, v = rotary.qk_norm_rope_fp32_weight.backends["reference"].fn(qkv, pos, qw, kw, cache, 4, 2, 32, 32,
                                                                           1e-6)
        q0, k0, v0, _ = rotary.split_qkv_heads(qkv, 4, 2, 32, False)
        q1, k1 = rotary.rotary_embedding.backends["reference"].fn(
            pos, _rms_norm_fp32_weight_ref(q0.contiguous(), qw, 1e-6), _rms_norm_fp32_weight_ref(k0.contiguous(), kw,
                                                                                                 1e-6), cache, 32)
        assert torch.equal(q, q1) and torch.equal(k, k1) and torch.equal(v, v0)
        torch.library.opcheck(rotary.qk_norm_rope_fp32_weight.overload, (qkv, pos, qw, kw, cache, 4, 2, 32, 32, 1e-6))


_SCRIPT = r"""
import json, torch
from mstar.ops import rotary
from mstar.ops.backends import triton_elementwise as te
from test_ops_qk_norm_rope import SHAPES, _inputs
out = []
for dtype in (torch.float32, torch.bfloat16):
    for hq, hk, d, rd, zc, gated in SHAPES:
        args = _inputs(hq, hk, d, rd, gated, dtype, seed=d)
        ref = rotary.qk_norm_rope.backends["reference"].fn(*args, hq, hk, d, rd, 1e-6, zc, gated)
        got = te.qk_norm_rope(*args, hq, hk, d, rd, 1e-6, zc, gated)
        out.append([str(dtype)] + [(a.float() - b.float()).abs().max().item() for a, b in zip(ref, got)]
                   + [a.float().abs().max().item() for a in ref[:2]])
        if not gated:  # the fp32-weight form (Cosmos3's heads)
            ref = rotary.qk_norm_rope_fp32_weight.backends["reference"].fn(*args, hq, hk, d, rd, 1e-6)
            got = te.qk_norm_rope_fp32_weight(*args, hq, hk, d, rd, 1e-6)
            out.append([str(dtype)] + [(a.float() - b.float()).abs().max().item() for a, b in zip(ref, got)]
                       + [a.float().abs().max().item() for a in ref[:2]])
print(json.dumps(out))
"""


def test_triton_kernel_in_the_interpreter():
    got = run_interpreted(_SCRIPT)
    assert len(got) == 2 * (len(SHAPES) + sum(not s[5] for s in SHAPES))
    for dtype, dq, dk, dv, mq, mk in got:
        assert dv == 0.0
        if dtype == "torch.float32":
            assert dq < 1e-5 and dk < 1e-5, (dq, dk)
        else:  # a bf16 rounding step in the norm (rsqrt vs 1 / sqrt, sum order), carried by the rotation
            assert dq <= mq * 2 ** -6 and dk <= mk * 2 ** -6, (dq, dk, mq, mk)


def _joint(hk, d, dtype, t, seed):
    """Joint key / value buffers of 3 * t rows (random: the rows not written must stay) and the
    distinct rows the t tokens go to."""
    g = torch.Generator().manual_seed(seed)
    k_out, v_out = torch.randn(3 * t, hk, d, generator=g).to(dtype), torch.randn(3 * t, hk, d, generator=g).to(dtype)
    return k_out, v_out, torch.randperm(3 * t, generator=g)[:t]


def test_kv_form_writes_k_and_v_into_their_rows():
    """qk_norm_rope_kv_fp32_weight: q as qk_norm_rope_fp32_weight's; its k and v in rows kv_rows of the
    joint buffers, every other row as it was."""
    for dtype in (torch.float32, torch.bfloat16):
        qkv, pos, qw, kw, cache = _inputs(4, 2, 32, 32, False, dtype, seed=5)
        k_out, v_out, rows = _joint(2, 32, dtype, qkv.shape[0], seed=6)
        k0, v0 = k_out.clone(), v_out.clone()
        q = rotary.qk_norm_rope_kv_fp32_weight.backends["reference"].fn(qkv, pos, qw, kw, cache, 4, 2, 32, 32, 1e-6,
                                                                        k_out, v_out, rows)
        q1, k1, v1 = rotary.qk_norm_rope_fp32_weight.backends["reference"].fn(qkv, pos, qw, kw, cache, 4, 2, 32, 32,
                                                                              1e-6)
        assert torch.equal(q, q1) and torch.equal(k_out[rows], k1) and torch.equal(v_out[rows], v1)
        rest = torch.ones(k_out.shape[0], dtype=torch.bool)
        rest[rows] = False
        assert torch.equal(k_out[rest], k0[rest]) and torch.equal(v_out[rest], v0[rest])
        torch.library.opcheck(rotary.qk_norm_rope_kv_fp32_weight.overload,
                              (qkv, pos, qw, kw, cache, 4, 2, 32, 32, 1e-6, k_out, v_out, rows))


def _diffs(dtype, q_ref, q_got, k_ref, k_got, v_ref, v_got) -> list:
    """[dtype, largest q / k / v differences, largest |q| / |k| of the reference] (the caches whole)."""
    return [str(dtype)] + [(a.float() - b.float()).abs().max().item() for a, b in
                           ((q_ref, q_got), (k_ref, k_got), (v_ref, v_got))] + [q_ref.float().abs().max().item(),
                                                                               k_ref.float().abs().max().item()]


def _assert_rows_close(got) -> None:
    """v exact; q, k within 1e-5 in float32, within a bf16 rounding step of their largest values."""
    for dtype, dq, dk, dv, mq, mk in got:
        assert dv == 0.0  # v copied, and no other row touched
        if dtype == "torch.float32":
            assert dq < 1e-5 and dk < 1e-5, (dq, dk)
        else:
            assert dq <= mq * 2 ** -6 and dk <= mk * 2 ** -6, (dq, dk, mq, mk)


_KV_SCRIPT = r"""
import json, torch
from mstar.ops import rotary
from mstar.ops.backends import triton_elementwise as te
from test_ops_qk_norm_rope import _diffs, _inputs, _joint
out = []
for dtype in (torch.float32, torch.bfloat16):
    for hq, hk, d, rd in ((4, 2, 32, 32), (2, 1, 64, 16), (4, 4, 16, 16)):
        qkv, pos, qw, kw, cache = _inputs(hq, hk, d, rd, False, dtype, seed=d + hq)
        k_ref, v_ref, rows = _joint(hk, d, dtype, qkv.shape[0], seed=d)
        k_got, v_got = k_ref.clone(), v_ref.clone()
        q_ref = rotary.qk_norm_rope_kv_fp32_weight.backends["reference"].fn(qkv, pos, qw, kw, cache, hq, hk, d, rd,
                                                                            1e-6, k_ref, v_ref, rows)
        q_got = te.qk_norm_rope_kv_fp32_weight(qkv, pos, qw, kw, cache, hq, hk, d, rd, 1e-6, k_got, v_got, rows)
        out.append(_diffs(dtype, q_ref, q_got, k_ref, k_got, v_ref, v_got))
print(json.dumps(out))
"""


def test_kv_form_triton_kernel_in_the_interpreter():
    got = run_interpreted(_KV_SCRIPT)
    assert len(got) == 6
    _assert_rows_close(got)


def _paged(hk, d, dtype, t, seed, page_size=4):
    """A paged cache [pages, page_size, Hkv, D] of random contents and t slots for t tokens: distinct
    slots in shuffled pages, the second token a padding token (slot -1: nothing written)."""
    g = torch.Generator().manual_seed(seed)
    pages = 3 * t // page_size + 2
    k_cache = torch.randn(pages, page_size, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(pages, page_size, hk, d, generator=g).to(dtype)
    slots = torch.randperm(pages * page_size, generator=g)[:t]
    slots[1] = -1
    return k_cache, v_cache, slots


@pytest.mark.parametrize("hq,hk,d,rd,zc,gated", SHAPES)
def test_append_form_is_qk_norm_rope_then_kv_append(hq, hk, d, rd, zc, gated):
    """qk_norm_rope_append: q as qk_norm_rope's; its k and v written into the paged cache as
    kv_append writes them (bit for bit), the padding token's slot and every other slot untouched."""
    from mstar.ops import attention
    for dtype in (torch.float32, torch.bfloat16):
        qkv, pos, qw, kw, cache = _inputs(hq, hk, d, rd, gated, dtype, seed=d + 1)
        k_cache, v_cache, slots = _paged(hk, d, dtype, qkv.shape[0], seed=d + 2)
        k_want, v_want = k_cache.clone(), v_cache.clone()
        q1, k1, v1 = rotary.qk_norm_rope.backends["reference"].fn(qkv, pos, qw, kw, cache, hq, hk, d, rd, 1e-6, zc,
                                                                  gated)
        attention.kv_append.backends["reference"].fn(k1, v1, k_want, v_want, slots)
        args = (qkv, pos, qw, kw, cache, hq, hk, d, rd, 1e-6, zc, gated, k_cache, v_cache, slots)
        q = rotary.qk_norm_rope_append.backends["reference"].fn(*args)
        assert torch.equal(q, q1) and torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
        torch.library.opcheck(rotary.qk_norm_rope_append.overload, args)


_APPEND_SCRIPT = r"""
import json, torch
from mstar.ops import rotary
from mstar.ops.backends import triton_elementwise as te
from test_ops_qk_norm_rope import SHAPES, _diffs, _inputs, _paged
out = []
for dtype in (torch.float32, torch.bfloat16):
    for hq, hk, d, rd, zc, gated in SHAPES:
        qkv, pos, qw, kw, cache = _inputs(hq, hk, d, rd, gated, dtype, seed=d + 3)
        k_ref, v_ref, slots = _paged(hk, d, dtype, qkv.shape[0], seed=d + 4)
        k_got, v_got = k_ref.clone(), v_ref.clone()
        q_ref = rotary.qk_norm_rope_append.backends["reference"].fn(qkv, pos, qw, kw, cache, hq, hk, d, rd, 1e-6, zc,
                                                                    gated, k_ref, v_ref, slots)
        q_got = te.qk_norm_rope_append(qkv, pos, qw, kw, cache, hq, hk, d, rd, 1e-6, zc, gated, k_got, v_got, slots)
        out.append(_diffs(dtype, q_ref, q_got, k_ref, k_got, v_ref, v_got))
print(json.dumps(out))
"""


def test_append_form_triton_kernel_in_the_interpreter():
    """The one-kernel form against the reference: the whole caches compared (the slots written, the
    padding token's and the others); q and k within a bf16 rounding step, v exact."""
    got = run_interpreted(_APPEND_SCRIPT)
    assert len(got) == 2 * len(SHAPES)
    _assert_rows_close(got)
