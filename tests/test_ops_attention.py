"""Paged-KV ops (kv_append, paged_attention_prefill/decode) vs dense causal attention in
float64 on the unpaged K/V, plus opcheck and a torch.compile(fullgraph=True) smoke test
over every op of norm / activation / rotary / attention.

Every case scatters each row's K/V over pages of a random permutation of the pool, fills
all unused cache slots (including the tail of each last page) with NaN so any read of them
shows, and mixes fresh prefills, chunks continuing a history, single-token and multi-page
rows, and last pages that are exactly full.

Tolerances: float32 inputs vs float64 on the same values: rtol 1e-5, atol 1e-5.
bfloat16 q / cache: the float64 result from the same bf16 values, rounded once to bf16
by the op: ~1 bf16 ulp, rtol 1.6e-2, atol 1e-2.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from mstar import ops

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
I32 = torch.int32


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)


class Paged:
    """Rows of dense K/V scattered into a NaN-poisoned page pool, with the index tensors."""

    def __init__(self, kv_lens, hkv, d, page_size, dtype, spare_pages=3):
        self.kv_lens = list(kv_lens)
        self.page_size = page_size
        npages = [max(1, -(-n // page_size)) for n in self.kv_lens]
        total = sum(npages) + spare_pages
        perm = torch.randperm(total).tolist()
        self.k_cache = torch.full((total, page_size, hkv, d), float("nan"), dtype=dtype)
        self.v_cache = torch.full((total, page_size, hkv, d), float("nan"), dtype=dtype)
        self.k, self.v, self.pages = [], [], []
        for n, np_ in zip(self.kv_lens, npages):
            pages = [perm.pop() for _ in range(np_)]
            k = _rand(n, hkv, d, dtype=dtype, scale=1.5)
            v = _rand(n, hkv, d, dtype=dtype, scale=1.5)
            for j in range(n):
                self.k_cache[pages[j // page_size], j % page_size] = k[j]
                self.v_cache[pages[j // page_size], j % page_size] = v[j]
            self.k.append(k)
            self.v.append(v)
            self.pages.append(pages)
        self.kv_indptr = torch.tensor([0] + list(_cumsum(npages)), dtype=I32)
        self.kv_indices = torch.tensor([p for ps in self.pages for p in ps], dtype=I32)
        self.kv_last_page_len = torch.tensor([n - (len(ps) - 1) * page_size
                                              for n, ps in zip(self.kv_lens, self.pages)], dtype=I32)


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _dense_attention64(q, k, v, scale):
    """q [n, Hq, D], k/v [L, Hkv, D]; queries are the last n positions; float64 -> [n, Hq, D]."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    q64 = q.double().transpose(0, 1)  # [Hq, n, D]
    k64 = k.double().repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, L, D]
    v64 = v.double().repeat_interleave(g, dim=1).transpose(0, 1)
    s = q64 @ k64.transpose(1, 2) * scale
    qpos = torch.arange(L - n, L)[:, None]
    s = s.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
    return (torch.softmax(s, dim=-1) @ v64).transpose(0, 1)


def _row_lengths(page_size, rng):
    """(kv_len, qo_len) rows: single-token, fresh prefill, history + chunk, multi-page, full page."""
    ps = page_size
    rows = [
        (1, 1),                                 # first token of a sequence
        (rng.randint(2, 40), 1),                # decode-like row inside a prefill batch
        (n := rng.randint(20, 70), n),          # fresh prompt
        (rng.randint(50, 90), rng.randint(2, 9)),  # chunk continuing a history
        (3 * ps if ps > 1 else 33, 5),          # last page exactly full
        (2 * ps + 1 if ps > 1 else 17, 4),      # last page holds one token
    ]
    rng.shuffle(rows)
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_prefill_vs_dense_float64(dtype, page_size, head_dim, group):
    rng = random.Random(hash((str(dtype), page_size, head_dim, group)) & 0xFFFF)
    hkv = 2
    hq = hkv * group
    rows = _row_lengths(page_size, rng)
    paged = Paged([kv for kv, _ in rows], hkv, head_dim, page_size, dtype)
    qo_lens = [qo for _, qo in rows]
    qo_indptr = torch.tensor([0] + list(_cumsum(qo_lens)), dtype=I32)
    q = _rand(sum(qo_lens), hq, head_dim, dtype=dtype, scale=1.5)
    scale = head_dim ** -0.5
    out = ops.paged_attention_prefill(q, paged.k_cache, paged.v_cache, qo_indptr, paged.kv_indptr,
                                      paged.kv_indices, paged.kv_last_page_len, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = torch.cat([_dense_attention64(q[qo_indptr[i]:qo_indptr[i + 1]], paged.k[i], paged.v[i], scale)
                     for i in range(len(rows))])
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_vs_dense_float64(dtype, page_size, head_dim, group):
    rng = random.Random(hash(("d", str(dtype), page_size, head_dim, group)) & 0xFFFF)
    hkv = 2
    hq = hkv * group
    kv_lens = [1, page_size, page_size + 1, rng.randint(2, 30), rng.randint(40, 100), 3 * page_size]
    rng.shuffle(kv_lens)
    paged = Paged(kv_lens, hkv, head_dim, page_size, dtype)
    q = _rand(len(kv_lens), hq, head_dim, dtype=dtype, scale=1.5)
    scale = 1.0 / math.sqrt(head_dim)
    out = ops.paged_attention_decode(q, paged.k_cache, paged.v_cache, paged.kv_indptr, paged.kv_indices,
                                     paged.kv_last_page_len, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = torch.cat([_dense_attention64(q[i:i + 1], paged.k[i], paged.v[i], scale) for i in range(len(kv_lens))])
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_last_row_of_prefill(dtype):
    """A decode over a row's kv equals the last query of a prefill over the same kv."""
    page_size, hkv, hq, d = 16, 2, 8, 128
    kv_lens = [1, 16, 17, 45, 120]
    qo_lens = [1, 3, 17, 9, 120]
    paged = Paged(kv_lens, hkv, d, page_size, dtype)
    qo_indptr = torch.tensor([0] + list(_cumsum(qo_lens)), dtype=I32)
    q = _rand(sum(qo_lens), hq, d, dtype=dtype)
    pre = ops.paged_attention_prefill(q, paged.k_cache, paged.v_cache, qo_indptr, paged.kv_indptr,
                                      paged.kv_indices, paged.kv_last_page_len, 0.1)
    last = (qo_indptr[1:] - 1).long()
    dec = ops.paged_attention_decode(q[last].contiguous(), paged.k_cache, paged.v_cache, paged.kv_indptr,
                                     paged.kv_indices, paged.kv_last_page_len, 0.1)
    # float32: both are fp32 softmax over the same scores, summed in other orders (up to ~2e-6
    # apart over 120 keys on fresh inputs), so 1e-5; bf16: 1 ulp
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(dec, pre[last], **tol)


def test_attention_empty_inputs():
    kc = _rand(4, 16, 2, 64)
    vc = _rand(4, 16, 2, 64)
    z1 = torch.zeros(1, dtype=I32)
    e = torch.zeros(0, dtype=I32)
    out = ops.paged_attention_prefill(_rand(0, 4, 64), kc, vc, z1, z1, e, e, 0.125)
    assert out.shape == (0, 4, 64)
    out = ops.paged_attention_decode(_rand(0, 4, 64), kc, vc, z1, e, e, 0.125)
    assert out.shape == (0, 4, 64)
    before = kc.clone()
    ops.kv_append(_rand(0, 2, 64), _rand(0, 2, 64), kc, vc, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(kc, before)


# --- kv_append --------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.bfloat16)])
def test_kv_append_writes_exactly_the_given_slots(page_size, src_dtype, cache_dtype):
    hkv, d, t = 2, 64, 23
    num_pages = 9 if page_size == 16 else 50  # room for the tokens and untouched slots
    poison = 1234.5
    kc = torch.full((num_pages, page_size, hkv, d), poison, dtype=cache_dtype)
    vc = torch.full((num_pages, page_size, hkv, d), -poison, dtype=cache_dtype)
    nslots = num_pages * page_size
    slots = torch.randperm(nslots)[:t].to(torch.int64)
    pad = torch.rand(t) < 0.25  # padding tokens: negative slots, skipped
    slots[pad] = -1
    # k, v as views of one fused projection, like a model passes them
    kv = _rand(t, 2 * hkv * d, dtype=src_dtype, scale=2.0)
    k = kv[:, : hkv * d].view(t, hkv, d)
    v = kv[:, hkv * d:].view(t, hkv, d)
    ops.kv_append(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(nslots, hkv, d), vc.view(nslots, hkv, d)
    live = slots >= 0
    assert torch.equal(flat_k[slots[live]], k[live].to(cache_dtype))
    assert torch.equal(flat_v[slots[live]], v[live].to(cache_dtype))
    untouched = torch.ones(nslots, dtype=torch.bool)
    untouched[slots[live]] = False
    assert untouched.sum() == nslots - int(live.sum())
    assert (flat_k[untouched] == poison).all() and (flat_v[untouched] == -poison).all()


def test_kv_append_then_attention_matches_dense():
    """The step's flow: append new tokens at their slots, then prefill over the pages."""
    page_size, hkv, hq, d = 16, 2, 4, 64
    hist, new = 21, 12
    paged = Paged([hist + new], hkv, d, page_size, torch.float32)
    k_all, v_all = paged.k[0], paged.v[0]
    pages = paged.pages[0]
    pos = torch.arange(hist, hist + new)
    slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in pos.tolist()])
    flat = paged.k_cache.view(-1, hkv, d)
    flat[slots] = float("nan")  # the new tokens are not there yet
    paged.v_cache.view(-1, hkv, d)[slots] = float("nan")
    ops.kv_append(k_all[hist:], v_all[hist:], paged.k_cache, paged.v_cache, slots)
    q = _rand(new, hq, d)
    out = ops.paged_attention_prefill(q, paged.k_cache, paged.v_cache, torch.tensor([0, new], dtype=I32),
                                      paged.kv_indptr, paged.kv_indices, paged.kv_last_page_len, 0.125)
    torch.testing.assert_close(out.double(), _dense_attention64(q, k_all, v_all, 0.125), **TOL[torch.float32])


# --- opcheck / compile --------------------------------------------------------------------------
def _attention_case(dtype):
    page_size, hkv, hq, d = 16, 2, 4, 64
    paged = Paged([5, 16, 40], hkv, d, page_size, dtype)
    paged.k_cache.nan_to_num_(0.5)  # opcheck compares outputs with NaN-unfriendly checks
    paged.v_cache.nan_to_num_(0.5)
    qo_lens = [2, 16, 7]
    qo_indptr = torch.tensor([0] + list(_cumsum(qo_lens)), dtype=I32)
    return paged, qo_indptr, _rand(sum(qo_lens), hq, d, dtype=dtype), _rand(3, hq, d, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_attention_ops(dtype):
    paged, qo_indptr, q, qd = _attention_case(dtype)
    torch.library.opcheck(ops.paged_attention_prefill.overload,
                          (q, paged.k_cache, paged.v_cache, qo_indptr, paged.kv_indptr, paged.kv_indices,
                           paged.kv_last_page_len, 0.125))
    torch.library.opcheck(ops.paged_attention_decode.overload,
                          (qd, paged.k_cache, paged.v_cache, paged.kv_indptr, paged.kv_indices,
                           paged.kv_last_page_len, 0.125))
    t = 6
    slots = torch.tensor([3, 70, -1, 17, 0, 45], dtype=torch.int64)
    torch.library.opcheck(ops.kv_append.overload,
                          (_rand(t, 2, 64, dtype=dtype), _rand(t, 2, 64, dtype=dtype),
                           paged.k_cache.clone(), paged.v_cache.clone(), slots))


def test_torch_compile_fullgraph_all_ops():
    """One compiled function calling every op; matches eager and mutates the caches."""
    torch._dynamo.reset()
    paged, qo_indptr, q, qd = _attention_case(torch.float32)
    hq, d = q.shape[1:]
    t = q.shape[0]
    cache = ops.build_cos_sin_cache(256, 32, 10000.0)
    pos = torch.randint(0, 256, (t,))
    slots = torch.randperm(paged.k_cache.shape[0] * paged.k_cache.shape[1])[:t]
    x = _rand(t, hq * d)
    w = _rand(hq * d, scale=0.2)
    wd = _rand(d, scale=0.2)

    def step(x, residual, k_cache, v_cache):
        h, residual = ops.fused_add_rms_norm(x, residual, w, 1e-6, True)
        h = ops.rms_norm(h, w, 1e-6, False)
        h = ops.gelu(h, "tanh") + ops.silu_and_mul(torch.cat([h, h], -1))
        h = ops.l2_norm(h, 1e-6) * 4.0
        qq = h.view(t, hq, d)
        kk = ops.gated_rms_norm(qq[:, :2], qq[:, 2:], wd, 1e-6)
        qq, kk = ops.rotary_embedding(pos, qq, kk, cache, 32)
        ops.kv_append(kk, kk * 0.5, k_cache, v_cache, slots)
        o = ops.paged_attention_prefill(qq, k_cache, v_cache, qo_indptr, paged.kv_indptr, paged.kv_indices,
                                        paged.kv_last_page_len, 0.125)
        od = ops.paged_attention_decode(qq[:3], k_cache, v_cache, paged.kv_indptr, paged.kv_indices,
                                        paged.kv_last_page_len, 0.125)
        return o, od, residual

    res = _rand(t, hq * d)
    kc_e, vc_e = paged.k_cache.clone(), paged.v_cache.clone()
    kc_c, vc_c = paged.k_cache.clone(), paged.v_cache.clone()
    eager = step(x, res, kc_e, vc_e)
    compiled = torch.compile(step, fullgraph=True)(x, res, kc_c, vc_c)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(kc_e, kc_c) and torch.equal(vc_e, vc_c)
    assert not torch.equal(kc_c, paged.k_cache)  # the appended tokens landed in the compiled caches


def test_step_memo_is_stale_for_a_new_step_an_edit_or_another_key():
    """The once-a-step state of the decode backends (a FlashInfer plan, the Triton backend's device
    copy of the page table) is remade for new tensors, an in-place edit of the same tensor, or
    other companion arrays, and kept for the step's next layer."""
    from mstar.ops.attention import StepMemo
    memo = StepMemo()
    indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert memo.stale(indptr, "k")
    memo.mark(indptr, "k")
    assert not memo.stale(indptr, "k")
    assert memo.stale(indptr, "other arrays")
    assert memo.stale(indptr.clone(), "k")  # equal values, a new step's tensor
    indptr[2] = 6  # the same tensor edited in place
    assert memo.stale(indptr, "k")
    with torch.inference_mode():  # the engine's tensors keep no version: identity alone decides
        t = torch.tensor([0, 1], dtype=torch.int32)
        memo.mark(t, "k")
        assert not memo.stale(t, "k") and memo.stale(torch.tensor([0, 1], dtype=torch.int32), "k")
