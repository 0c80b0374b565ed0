"""causal_conv1d_prefill's Triton kernel against the reference: ragged rows (lengths 0, 1, 2,
< K-1 and long), pooled history, bias or not, SiLU or not, snapshots (global token 0, row
starts and ends, mid-row, the last token), x bf16 / fp16 / fp32 with a pool of another dtype.
The kernel runs here in Triton's CPU interpreter (TRITON_INTERPRET=1, in a subprocess: the
variable is read when kernels are defined), with small blocks so that channel, token and
state blocks are partial; a `gpu` test checks the 0.8B shape on CUDA.

Tolerances: the pool is pure data movement (inputs cast to the pool dtype), so it must equal
the reference's bit for bit, untouched slots included (in the interpreter, which casts float32
to bf16 by truncation, within one bf16 step where x is rounded into a narrower pool dtype).
Outputs: |got - ref| <= 1e-5 + rtol |ref|, rtol 1e-5 for fp32; bf16 / fp16 outputs are both
roundings of float32 sums that differ only in summation order / FMA (within 1e-5), so they
may sit one rounding step apart: rtol 2^-7 (bf16), 2^-10 (fp16)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_interpreted

NUM_SLOTS = 24
ROW_SLOTS = [3, 7, 0, 5, 9, 2, 15, 17, 19, 21]  # rows' own slots
SNAP_SLOTS = [1, 4, 6, 8, 10, 11, 12, 13, 14]  # distinct from the rows' slots; 16, 18, 20, 22, 23 never written


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def make_case(lens, C, K, x_dtype, pool_dtype, with_bias, snap_tok, seed, x_pad=0, strided_pool=False):
    """Inputs for one prefill call. snap_tok: global token indices; x_pad > 0 makes x a view
    whose row stride is C + x_pad; strided_pool makes the pool a non-contiguous view (the
    backend then falls back to the reference)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = torch.randn(T, C + x_pad, generator=g).to(x_dtype)[:, :C]
    weight = (torch.randn(C, K, generator=g) * 0.5).to(x_dtype)
    bias = torch.randn(C, generator=g).to(x_dtype) if with_bias else None
    pool = torch.randn(NUM_SLOTS, C, K - 1, generator=g).to(pool_dtype)  # nonzero history everywhere
    if strided_pool:
        pool = pool.transpose(1, 2).contiguous().transpose(1, 2)  # clone() keeps these strides
    slots = torch.tensor(ROW_SLOTS[:len(lens)])
    snap_t = torch.tensor(snap_tok, dtype=torch.long)
    snap_s = torch.tensor(SNAP_SLOTS[:len(snap_tok)], dtype=torch.long)
    return x, weight, bias, pool, _cu(lens), slots, snap_t, snap_s


def _lossy(src, dst):
    return src != dst and (src == torch.float32 or {src, dst} == {torch.float16, torch.bfloat16})


def compare(fn_ref, fn_got, args, silu, interpreted=False):
    """Run both on clones of args; returns a dict of findings (checked by the caller).
    Triton's interpreter casts float32 -> bf16 by truncation (the GPU rounds to nearest even),
    so there a pool that gets x rounded to a narrower dtype may be one rounding step off."""
    x, weight, bias, pool, cu, slots, snap_t, snap_s = args
    p_ref, p_got = pool.clone(), pool.clone()
    ref = fn_ref(x, weight, bias, p_ref, cu, slots, snap_t, snap_s, silu)
    got = fn_got(x, weight, bias, p_got, cu, slots, snap_t, snap_s, silu)
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[x.dtype]
    atol = 1e-5  # float32 accumulation: a few terms of magnitude < 10 summed in another order
    d = (got.double() - ref.double()).abs()
    bound = atol + rtol * ref.double().abs()
    touched = set(slots.tolist()) | set(snap_s.tolist())
    untouched = [s for s in range(pool.shape[0]) if s not in touched]
    return {
        "shape_dtype_ok": got.shape == ref.shape and got.dtype == ref.dtype,
        "out_ok": bool((d <= bound).all()),
        "out_err": d.max().item() if d.numel() else 0.0,
        "out_exact_frac": (got == ref).float().mean().item() if d.numel() else 1.0,
        "pool_equal": torch.equal(p_got, p_ref) if not (interpreted and _lossy(x.dtype, pool.dtype)) else
        bool(((p_got.double() - p_ref.double()).abs() <= 2.0 ** -7 * p_ref.double().abs()).all()),
        "pool_err": (p_got.double() - p_ref.double()).abs().max().item(),
        "untouched_equal": torch.equal(p_got[untouched], pool[untouched]),
        "rows_written": not torch.equal(p_got[slots.long()], pool[slots.long()]) if x.shape[0] else True,
    }


def _case(name, silu, **kw):
    return name, kw, silu


def cases():
    """(name, make_case kwargs, silu)."""
    lens_a = [1, 2, 3, 0, 40, 5]  # starts 0, 1, 3, 6, 6, 46; T = 51
    snaps_a = [0, 1, 2, 4, 5, 6, 25, 45, 50]  # token 0; row ends; row 2 mid (pos 1 < K-1); row 4 start/mid/end; last
    lens_b = [0, 0, 3, 1, 0, 2, 0, 7, 1, 0]  # leading/trailing empty rows; many rows for the binary search
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    return [
        _case("fp32 K4 bias silu snaps", True, lens=lens_a, C=70, K=4, x_dtype=f32, pool_dtype=f32, with_bias=True,
              snap_tok=snaps_a, seed=1),
        _case("fp32 K4 no bias no silu", False, lens=lens_a, C=40, K=4, x_dtype=f32, pool_dtype=f32, with_bias=False,
              snap_tok=[], seed=2),
        _case("fp32 K2 bias silu snaps", True, lens=lens_a, C=45, K=2, x_dtype=f32, pool_dtype=f32, with_bias=True,
              snap_tok=snaps_a, seed=3),
        _case("fp32 K5 empty rows snaps", True, lens=lens_b, C=50, K=5, x_dtype=f32, pool_dtype=f32, with_bias=False,
              snap_tok=[0, 1, 3, 4, 6, 12, 13], seed=4),
        _case("fp32 strided x", False, lens=[40, 1, 2], C=33, K=4, x_dtype=f32, pool_dtype=f32, with_bias=True,
              snap_tok=[0, 39, 40, 42], seed=5, x_pad=7),
        _case("bf16 x fp32 pool", True, lens=lens_a, C=70, K=4, x_dtype=bf16, pool_dtype=f32, with_bias=True,
              snap_tok=snaps_a, seed=6),
        _case("bf16 x bf16 pool", False, lens=lens_a, C=64, K=4, x_dtype=bf16, pool_dtype=bf16, with_bias=False,
              snap_tok=snaps_a[::2], seed=7),
        _case("fp16 x bf16 pool", True, lens=lens_b, C=40, K=4, x_dtype=f16, pool_dtype=bf16, with_bias=True,
              snap_tok=[0, 2, 3, 13], seed=8),
        _case("fp32 x bf16 pool", True, lens=[2, 40], C=40, K=4, x_dtype=f32, pool_dtype=bf16, with_bias=True,
              snap_tok=[0, 1, 2, 41], seed=9),
        _case("non-contiguous pool: fallback", True, lens=lens_a, C=40, K=4, x_dtype=f32, pool_dtype=f32,
              with_bias=True, snap_tok=snaps_a, seed=11, strided_pool=True),
        _case("T=0", True, lens=[0, 0], C=40, K=4, x_dtype=f32, pool_dtype=f32, with_bias=True, snap_tok=[], seed=10),
    ]


def check(name, r):
    assert r["shape_dtype_ok"], name
    assert r["out_ok"], (name, r)
    assert r["pool_equal"], (name, r)
    assert r["untouched_equal"], (name, r)
    assert r["rows_written"], (name, r)


_SCRIPT = r"""
import json
from test_ops_conv1d_prefill_triton import cases, make_case, compare
from mstar.ops import conv1d
from mstar.ops.backends import triton_conv1d
triton_conv1d._PREFILL_BLOCK_T = 8   # partial token and state blocks
triton_conv1d._PREFILL_BLOCK_C = 32  # several channel blocks, the last partial
ref = conv1d.causal_conv1d_prefill.backends["reference"].fn
out = []
for name, kw, silu in cases():
    out.append([name, compare(ref, triton_conv1d.causal_conv1d_prefill, make_case(**kw), silu, interpreted=True)])
print(json.dumps(out))
"""


def test_triton_prefill_in_the_interpreter():
    results = run_interpreted(_SCRIPT)
    assert [n for n, _ in results] == [c[0] for c in cases()]
    for name, r in results:
        check(name, r)


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_triton_prefill_gpu_0_8b_shape(pool_dtype):
    """Qwen3.5-0.8B's conv: C = 6144, K = 4; 8 rows of 256 tokens, bf16, snapshots; no host sync."""
    from mstar.ops import conv1d
    from mstar.ops.backends import triton_conv1d

    lens = [256] * 8
    snaps = [0, 63, 255, 256, 257, 1000, 1791, 2047]
    args = [a.cuda() if isinstance(a, torch.Tensor) else a
            for a in make_case(lens, 6144, 4, torch.bfloat16, pool_dtype, True, snaps, seed=11)]
    ref = conv1d.causal_conv1d_prefill.backends["reference"].fn

    def got(*a):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return triton_conv1d.causal_conv1d_prefill(*a)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    got(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], True)  # compile outside the check
    for silu in (True, False):
        check(f"gpu silu={silu}", compare(ref, got, args, silu))
    # ragged rows, short rows and empty rows on the GPU too
    args = [a.cuda() if isinstance(a, torch.Tensor) else a
            for a in make_case([1, 2, 0, 3, 300, 17], 6144, 4, torch.bfloat16, pool_dtype, False,
                               [0, 1, 2, 4, 5, 6, 305, 322], seed=12)]
    check("gpu ragged", compare(ref, got, args, True))
