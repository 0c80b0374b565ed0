"""dense_attention's "sdpa" backend (registered for CUDA; the function runs on CPU too) against
the reference on ragged rows: equal rows in one call, rows of other lengths in runs whose outputs
are concatenated, empty rows, rows that do not cover q (zeros there), grouped heads, causal."""

from __future__ import annotations

import importlib

import pytest
import torch

D = importlib.import_module("mstar.ops.dense_attention")  # the module (mstar.ops.dense_attention is the op)

CASES = [  # (q lengths, kv lengths, causal)
    ([4, 4, 4], [6, 6, 6], False),      # one run
    ([4, 4, 3], [9, 6, 3], False),      # a run of two, then one: the cosmos3 step's cond / uncond rows
    ([5, 0, 2], [5, 3, 7], False),      # an empty row
    ([3, 3], [5, 7], True),             # causal, queries the last positions
    ([4, 4], [4, 4], True),             # causal over the whole row
]


@pytest.mark.parametrize("qlens,kvlens,causal", CASES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_sdpa_backend_equals_reference(qlens, kvlens, causal, hq, hkv):
    g = torch.Generator().manual_seed(sum(qlens) * 31 + hkv)
    q = torch.randn(sum(qlens), hq, 16, generator=g)
    k, v = torch.randn(2, sum(kvlens), hkv, 16, generator=g)
    qi = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    ki = torch.tensor([0, *torch.tensor(kvlens).cumsum(0).tolist()], dtype=torch.int32)
    want = D.dense_attention.backends["reference"].fn(q, k, v, qi, ki, 0.25, causal)
    got = D.dense_attention_sdpa(q, k, v, qi, ki, 0.25, causal)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rows_not_covering_q_leave_zeros():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(8, 2, 16, generator=g)
    k, v = torch.randn(2, 10, 2, 16, generator=g)
    qi = torch.tensor([2, 5, 7], dtype=torch.int32)  # q rows 0-1 and 7 belong to no row
    ki = torch.tensor([0, 4, 10], dtype=torch.int32)
    want = D.dense_attention.backends["reference"].fn(q, k, v, qi, ki, 0.25, False)
    got = D.dense_attention_sdpa(q, k, v, qi, ki, 0.25, False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[:2].abs().max() == 0 and got[7].abs().max() == 0
