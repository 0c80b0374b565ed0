"""Cross-attention reads each request's cross slot [S, H, D] as pages of cross_page_size(S)
positions (a view of the same memory), so FlashInfer can split a row's keys across thread
blocks. Checked here against dense attention in float64 (the reference op computes in fp32)
over fresh random slots: whole slots and partial ones (a last page not full), several tokens
per row, rows in any slot order."""

from __future__ import annotations

import random

import pytest
import torch

from mstar import ops
from mstar.models.context import AttentionLayerSpec, CrossAttentionMetadata, CrossAttentionSpec, cross_page_size


def test_cross_page_size_divides_the_source():
    assert cross_page_size(1500) == 60  # Whisper: 25 pages of 60 positions
    assert cross_page_size(64) == 64 and cross_page_size(7) == 7 and cross_page_size(131) == 1
    for s in random.Random().sample(range(1, 5000), 40):
        p = cross_page_size(s)
        assert s % p == 0 and p <= 64
        assert not any(s % d == 0 for d in range(p + 1, min(64, s) + 1))
    spec = CrossAttentionSpec(layers=(AttentionLayerSpec(num_kv_heads=2, head_dim=8),), max_source_len=1500)
    assert (spec.page_size, spec.pages_per_slot) == (60, 25)


@pytest.mark.parametrize("source_len", [1500, 300, 48])
def test_paged_cross_attention_matches_dense(source_len):
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    slots, h, d = 5, 3, 16
    k = torch.randn(slots, source_len, h, d, generator=gen, dtype=torch.float64)
    v = torch.randn(slots, source_len, h, d, generator=gen, dtype=torch.float64)
    page = cross_page_size(source_len)
    n = source_len // page
    rng = random.Random(int(torch.randint(1 << 30, (1,), generator=gen)))
    rows = [rng.randrange(slots) for _ in range(4)]
    lens = [source_len, rng.randint(1, source_len), source_len, rng.randint(1, source_len)]
    reps = [1, 3, 2, 1]
    md = CrossAttentionMetadata.for_rows(rows, lens, reps, page_size=page, pages_per_slot=n)
    t = sum(reps)
    q = torch.randn(t, h, d, generator=gen, dtype=torch.float64)
    scale = d ** -0.5
    out = ops.paged_attention_decode(q, k.view(-1, page, h, d), v.view(-1, page, h, d), md.kv_indptr, md.kv_indices,
                                     md.kv_last_page_len, scale)
    tok = 0
    for slot, n_pos, r in zip(rows, lens, reps):
        for _ in range(r):
            kk, vv = k[slot, :n_pos], v[slot, :n_pos]  # [n_pos, h, d]
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[tok], kk) * scale, dim=-1)
            want = torch.einsum("hn,nhd->hd", w, vv)
            torch.testing.assert_close(out[tok], want, rtol=1e-5, atol=1e-5)  # the reference runs in fp32
            tok += 1
    with pytest.raises(ValueError, match="cross-attention over"):
        CrossAttentionMetadata.for_rows([0], [source_len + 1], [1], page_size=page, pages_per_slot=n)
