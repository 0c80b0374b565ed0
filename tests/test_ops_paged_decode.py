"""The small-batch paged decode attention kernels (mstar/ops/backends/triton_paged_decode.py) in
Triton's CPU interpreter (tests/triton_interpreter.py), against a float64 computation of the
same attention: rows of different lengths (one key, a part page, several hundred keys) over
shuffled pages, each row's keys cut into more slices than some rows can fill. The scratch starts
as NaN, so a slice the merge should not read would show."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_interpreted

# (q heads, kv heads, head_dim, page size, rows' key counts, slices, fewest keys a slice)
CASES = [
    (8, 2, 256, 16, [300, 1, 37], 8, 32),  # Qwen3.5-0.8B's attention
    (16, 4, 256, 16, [129], 2, 32),  # Qwen3.5-4B's
    (4, 4, 64, 5, [23, 64, 2], 4, 64),  # one query head per kv head, a page size that is no power of two
    (8, 2, 256, 16, [300, 70, 1], 16, 96),  # slices of whole blocks, a row filling 4 of 16, one filling 1
    (32, 2, 64, 16, [90, 5], 4, 64),  # a group of 16: the padded product has no padding rows
]


def paged_case(hq, hkv, d, page, lens, seed):
    """Random q [B, Hq, D] and K / V caches (bf16), the rows' pages shuffled through the cache."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // page) for n in lens]
    num_pages = sum(per_row) + 3
    k = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(num_pages, page, hkv, d, generator=g).to(torch.bfloat16)
    q = torch.randn(len(lens), hq, d, generator=g).to(torch.bfloat16)
    indices = torch.randperm(num_pages, generator=g)[:sum(per_row)].to(torch.int32)
    indptr = torch.tensor([0] + per_row, dtype=torch.int32).cumsum(0).to(torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, per_row)], dtype=torch.int32)
    return q, k, v, indptr, indices, last


def attention_float64(q, k, v, indptr, indices, last, scale):
    """Each row's query heads over its keys in float64 (GQA: head h reads kv head h // group)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[2]
    page = k.shape[1]
    for i in range(q.shape[0]):
        pages = indices[indptr[i]:indptr[i + 1]].long()
        n = (len(pages) - 1) * page + int(last[i])
        ki = k[pages].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        vi = v[pages].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), ki) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vi)
    return out


_SCRIPT = r"""
import json, torch
from mstar.ops.backends import triton_paged_decode as tpd
from test_ops_paged_decode import CASES, attention_float64, paged_case
out = []
for n, (hq, hkv, d, page, lens, splits, min_chunk) in enumerate(CASES):
    q, k, v, indptr, indices, last = paged_case(hq, hkv, d, page, lens, seed=n + int(torch.randint(1 << 20, ())))
    scale = d ** -0.5
    part_o = torch.full((len(lens), hq, splits, d), float("nan"))
    part_lse = torch.full((len(lens), hq, splits), float("nan"))
    got = tpd.decode(q, k, v, indptr, indices, last, scale, part_o, part_lse, splits, min_chunk=min_chunk)
    want = attention_float64(q, k, v, indptr, indices, last, scale)
    err = (got.double() - want).abs() / (want.abs() + 1)
    out.append({"max_err": err.max().item(), "max_ref": want.abs().max().item(),
                "one_key_exact": bool(torch.equal(got[lens.index(1)], v[indices[indptr[lens.index(1)]], 0].repeat_interleave(hq // hkv, 0))) if 1 in lens else None})
print(json.dumps(out))
"""


def test_split_and_merge_kernels_in_the_interpreter():
    """Within 8e-3 of float64 relative to |out| + 1 (the product of the softmax weights and V
    takes the weights in bf16, as FlashInfer's does, and the output is bf16: a rounding step is
    4e-3 of the value); a one-key row returns its V exactly."""
    got = run_interpreted(_SCRIPT)
    assert len(got) == len(CASES)
    for case, row in zip(CASES, got):
        assert row["max_err"] < 8e-3, (case, row)
        assert row["max_ref"] > 0.1
        if row["one_key_exact"] is not None:
            assert row["one_key_exact"], case


def test_the_float64_reference_is_the_ops_reference():
    """The test's float64 attention agrees with the op's reference backend (float32 scores)."""
    from mstar.ops import attention
    q, k, v, indptr, indices, last = paged_case(8, 2, 64, 16, [40, 3], seed=7)
    ref = attention.paged_attention_decode.backends["reference"].fn(q.float(), k.float(), v.float(), indptr, indices,
                                                                    last, 0.125)
    assert torch.allclose(ref.double(), attention_float64(q, k, v, indptr, indices, last, 0.125), atol=1e-5)


@pytest.mark.parametrize("batch,hkv,sms,waves,want", [(1, 2, 132, 1, 64), (1, 4, 132, 1, 32), (8, 2, 132, 1, 8),
                                                      (8, 4, 132, 1, 4), (8, 4, 132, 4, 16), (8, 20, 132, 1, 2),
                                                      (3, 2, 78, 1, 8), (1, 2, 132, 4, 64)])
def test_slices_per_row_fill_about_the_waves_asked(batch, hkv, sms, waves, want):
    from mstar.ops.backends import triton_paged_decode as tpd
    assert tpd.splits_for(batch, hkv, sms, waves) == want
    assert tpd.splits_for(batch, hkv, sms, waves) <= tpd.MAX_SPLITS


def test_slices_depend_on_the_batch_rounded_up_to_a_power_of_two():
    """A graph's padded batch (3 rows padded to 4, 5 to 8) slices a row as the eager batch does."""
    from mstar.ops.backends import triton_paged_decode as tpd
    for small, padded in ((3, 4), (5, 8), (6, 8), (7, 8)):
        for hkv in (1, 2, 4, 20):
            assert tpd.splits_for(small, hkv, 132) == tpd.splits_for(padded, hkv, 132)


_EAGER_SCRIPT = r"""
import json, torch
from mstar.ops.backends import triton_paged_decode as tpd
from test_ops_paged_decode import attention_float64, paged_case
hq, hkv, d, page = 8, 2, 256, 16
seed = int(torch.randint(1 << 20, ()))
out = {}
# an eager step of 3 rows (host page table), its second layer, then a step of 1 row
q, k, v, indptr, indices, last = paged_case(hq, hkv, d, page, [300, 1, 70], seed)
got = tpd._eager_decode(q, k, v, indptr, indices, last, d ** -0.5)
again = tpd._eager_decode(q, k, v, indptr, indices, last, d ** -0.5)
want = attention_float64(q, k, v, indptr, indices, last, d ** -0.5)
out["err3"] = ((got.double() - want).abs() / (want.abs() + 1)).max().item()
out["same_layer_again"] = bool(torch.equal(got, again))
# the same rows padded to 4 as a decode graph's plan holds them (a one-key padding row): equal rows
splits = tpd.splits_for(4, hkv, 132)
pad_ptr = torch.cat([indptr, indptr[-1:] + 1])
pad_idx = torch.cat([indices, indices[:1]])
pad_last = torch.cat([last, torch.ones(1, dtype=torch.int32)])
qp = torch.cat([q, q[:1]])
po = torch.empty(4, hq, splits, d)
pl = torch.empty(4, hq, splits)
padded = tpd.decode(qp, k, v, pad_ptr, pad_idx, pad_last, d ** -0.5, po, pl, splits)
out["padded_equal"] = bool(torch.equal(padded[:3], got))
# the op handed a decode graph's plan (its indptr) runs the kernels on the plan's buffers
plan = tpd.TritonDecodePlan("cpu", 3, 64, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
plan.plan(indptr, indices, last)
via_plan = tpd.paged_attention_decode(q, k, v, plan.indptr, plan.indices, plan.last_page_len, d ** -0.5)
out["plan_equal"] = bool(torch.equal(via_plan, got))
q1, k1, v1, indptr1, indices1, last1 = paged_case(hq, hkv, d, page, [45], seed + 1)
got1 = tpd._eager_decode(q1, k1, v1, indptr1, indices1, last1, d ** -0.5)
want1 = attention_float64(q1, k1, v1, indptr1, indices1, last1, d ** -0.5)
out["err1"] = ((got1.double() - want1).abs() / (want1.abs() + 1)).max().item()
print(json.dumps(out))
"""


def test_eager_steps_copy_the_table_once_and_match_the_padded_graph_rows():
    """An eager step (host page table) runs the kernels with the slices a decode graph's padded
    batch uses: the rows are bit-equal to the padded run and to the op handed a graph plan; a
    second layer of the step reuses the copied table; the next step (new tensors, fewer rows)
    reloads it."""
    got = run_interpreted(_EAGER_SCRIPT)
    assert got["err3"] < 8e-3 and got["err1"] < 8e-3, got
    assert got["same_layer_again"] and got["padded_equal"] and got["plan_equal"], got


def test_which_shapes_the_kernels_take():
    from mstar.ops.backends import triton_paged_decode as tpd
    assert tpd.takes(1, 8, 2, 256, torch.bfloat16)
    assert tpd.takes(tpd.MAX_ROWS, 16, 4, 256, torch.float16)
    assert not tpd.takes(tpd.MAX_ROWS + 1, 16, 4, 256, torch.bfloat16)  # FlashInfer's
    assert not tpd.takes(1, 8, 2, 256, torch.float32)
    assert not tpd.takes(1, 8, 2, 96, torch.bfloat16)  # the arange needs a power of two
    assert not tpd.takes(1, 64, 2, 128, torch.bfloat16)  # more query heads a kv head than the MMA's rows
    assert tpd.takes(1, 32, 8, 128, torch.bfloat16)  # Qwen3-8B's
    assert not tpd.takes(1, 20, 20, 64, torch.bfloat16)  # Whisper's: a group of one (not measured)
    assert not tpd.takes(1, 16, 8, 128, torch.bfloat16)  # Qwen3-0.6B's: a group of two


def test_batches_it_does_not_take_get_the_other_backends_plan_and_kernel():
    """Past MAX_ROWS the plan is the other backend's (here, without FlashInfer, the reference's),
    and a call whose page table is no plan of this module's runs the other backend."""
    from mstar.ops import attention
    from mstar.ops.backends import triton_paged_decode as tpd
    plan = tpd.decode_graph_plan("cpu", tpd.MAX_ROWS + 1, 64, num_q_heads=8, num_kv_heads=2, head_dim=256,
                                 page_size=16, dtype=torch.bfloat16, scale=0.0625)
    assert type(plan) is attention.StaticDecodePlan and plan.batch == tpd.MAX_ROWS + 1
    q, k, v, indptr, indices, last = paged_case(8, 2, 64, 16, [40, 3, 17], seed=int(torch.randint(1 << 20, ())))
    got = tpd.paged_attention_decode(q, k, v, indptr, indices, last, 0.125)
    want = attention.paged_attention_decode.backends["reference"].fn(q, k, v, indptr, indices, last, 0.125)
    assert torch.equal(got, want)


def test_a_backend_finds_its_graph_plan_by_the_indptr_tensor_itself():
    from mstar.ops import attention
    plan = attention.StaticDecodePlan("cpu", 2, 8)
    attention.remember_graph_plan(plan)
    assert attention.graph_plan_of(plan.indptr, attention.StaticDecodePlan) is plan
    assert attention.graph_plan_of(plan.indptr.clone(), attention.StaticDecodePlan) is None  # equal, not the same
    assert attention.graph_plan_of(plan.indptr, int) is None  # another backend's kind of plan
