"""Scheduler (with the real CacheManager, no model) and the step-input builder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.models.context import AttentionLayerSpec, CacheSpec, StateLayerSpec
from mstar.runtime.caches.cache_manager import CacheManager
from mstar.runtime.engine.request import SamplingParams
from mstar.runtime.scheduling.scheduler import Scheduler, Sequence, SeqStatus
from mstar.runtime.engine.step_inputs import StepInputBuilder, StepRows

ATTN = CacheSpec(attention=(AttentionLayerSpec(1, 2),))
HYBRID = CacheSpec(attention=(AttentionLayerSpec(1, 2),), state=(StateLayerSpec(4, 2, 1, 2, 2),))


def make(spec=ATTN, *, num_pages=100, page_size=4, max_num_seqs=8, budget=8, mode="recompute", slots=None):
    cm = CacheManager(spec, num_pages=num_pages, page_size=page_size, num_slots=slots or max_num_seqs,
                      dtype=torch.float32, device="cpu", enable_prefix_cache=True, num_snapshot_slots=4)
    return cm, Scheduler(cm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, preemption_mode=mode)


def seq(rid, n, max_tokens=100, base=0):
    return Sequence(rid, [base + i for i in range(n)], n, SamplingParams(max_tokens=max_tokens), frozenset(), 0,
                    10_000)


def advance(cm, sched, out, token=7):
    """What the engine does after the forward: lengths, commits, one token per sampling row."""
    for s in out.decode:
        s.num_computed += 1
        cm.commit(s.request_id, s.token_ids, s.num_computed)
        s.token_ids.append(token)
    for r in out.prefill:
        r.seq.num_computed = r.end
        cm.commit(r.seq.request_id, r.seq.token_ids, r.end)
        if r.end == len(r.seq.token_ids):
            r.seq.token_ids.append(token)
    cm.check()


def test_chunked_prefill_budget_and_decode_first():
    cm, sched = make(budget=8)
    a, b, c = seq("a", 10), seq("b", 6, base=100), seq("c", 3, base=200)
    for s in (a, b, c):
        sched.add(s)
    o = sched.schedule()
    assert [(r.seq.request_id, r.start, r.end) for r in o.prefill] == [("a", 0, 8)]
    assert [s.request_id for s in o.admitted] == ["a"]
    advance(cm, sched, o)
    o = sched.schedule()
    assert [(r.seq.request_id, r.start, r.end, r.samples) for r in o.prefill] == [("a", 8, 10, True),
                                                                                 ("b", 0, 6, True)]
    advance(cm, sched, o)
    o = sched.schedule()
    # a and b decode (first, no budget used); c admitted with the whole budget
    assert [s.request_id for s in o.decode] == ["a", "b"]
    assert [(r.seq.request_id, r.start, r.end) for r in o.prefill] == [("c", 0, 3)]
    assert o.num_tokens == 5
    advance(cm, sched, o)
    for s in (a, b, c):
        sched.remove(s)
    cm.check()
    assert cm.stats().used_pages == 0


def test_max_num_seqs_bounds_running():
    cm, sched = make(max_num_seqs=2, budget=100)
    seqs = [seq(str(i), 3, base=10 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    o = sched.schedule()
    assert len(o.prefill) == 2 and len(sched.waiting) == 2
    advance(cm, sched, o)
    sched.remove(seqs[0])
    o = sched.schedule()
    assert [s.request_id for s in o.decode] == ["1"] and [r.seq.request_id for r in o.prefill] == ["2"]


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_preemption_takes_the_newest(mode):
    cm, sched = make(num_pages=6, page_size=4, budget=100, mode=mode)
    a, b = seq("a", 8), seq("b", 8, base=50)
    sched.add(a)
    sched.add(b)
    o = sched.schedule()
    assert len(o.prefill) == 2  # 4 pages of 6
    advance(cm, sched, o)
    for _ in range(8):  # both decode until the pool is dry
        o = sched.schedule()
        if o.preempted:
            break
        advance(cm, sched, o)
    assert o.preempted == [b] and sched.waiting[0] is b and b.status is SeqStatus.WAITING
    assert [s.request_id for s in o.decode] == ["a"]
    assert o.admitted == []  # no admissions in a step that preempted
    if mode == "offload":
        assert b.offloaded and cm.is_offloaded("b") and b.num_computed > 0
    else:
        assert not b.in_cache and b.num_computed == 0 and not cm.has_request("b")
    advance(cm, sched, o)
    sched.remove(a)
    o = sched.schedule()  # b comes back: recompute = prefill of everything; offload = decode row
    assert o.admitted == [b]
    if mode == "offload":
        assert o.decode == [b] and not b.offloaded
    else:
        assert o.prefill[0].seq is b and o.prefill[0].end == len(b.token_ids)
    advance(cm, sched, o)
    sched.remove(b)
    cm.check()
    assert cm.stats().used_pages == 0


def test_preempt_self_when_alone_is_last():
    cm, sched = make(num_pages=3, page_size=4, budget=100)
    a = seq("a", 8)
    sched.add(a)
    o = sched.schedule()
    advance(cm, sched, o)
    for _ in range(4):
        o = sched.schedule()
        advance(cm, sched, o)
    # 12 tokens fill 3 pages; the 13th needs a 4th: a preempts itself, then can never fit
    o = sched.schedule()
    assert o.preempted == [a]
    o = sched.schedule()
    assert o.failed == [a] and not sched.waiting
    sched.remove(a)
    cm.check()


def test_hybrid_admission_needs_a_slot():
    cm, sched = make(HYBRID, max_num_seqs=4, slots=1, budget=100)
    a, b = seq("a", 5), seq("b", 5, base=9)
    sched.add(a)
    sched.add(b)
    o = sched.schedule()
    assert o.admitted == [a] and list(sched.waiting) == [b]
    advance(cm, sched, o)
    sched.remove(a)
    o = sched.schedule()
    assert o.admitted == [b]
    assert cm.slot("b") == 0


def test_prefix_hit_skips_computed_tokens():
    cm, sched = make(budget=100)
    a = seq("a", 13)
    sched.add(a)
    advance(cm, sched, sched.schedule())
    sched.remove(a)
    b = seq("b", 13)
    sched.add(b)
    o = sched.schedule()
    # 12 of 13 tokens cached: the last prompt token runs as a decode row
    assert o.decode == [b] and not o.prefill and b.num_cached_tokens == 12 == b.num_computed
    c = seq("c", 14)
    sched.add(c)
    o = sched.schedule()
    assert (o.prefill[0].start, o.prefill[0].end) == (12, 14) and c.num_cached_tokens == 12


def _naive(rows: StepRows, ps):
    ids, pos, slots = [], [], []
    for t, n, pages in zip(rows.decode_tokens, rows.decode_lens, rows.decode_pages):
        ids.append(t)
        pos.append(n - 1)
        slots.append(pages[(n - 1) // ps] * ps + (n - 1) % ps)
    off = 0
    for s, e, pages in zip(rows.prefill_starts, rows.prefill_ends, rows.prefill_pages):
        ids += rows.prefill_tokens[off:off + e - s]
        off += e - s
        for p in range(s, e):
            pos.append(p)
            slots.append(pages[p // ps] * ps + p % ps)
    return ids, pos, slots


def test_step_inputs_match_naive():
    ps = 4
    rng = np.random.default_rng(0)
    pages = [list(rng.permutation(200)[:20]) for _ in range(5)]
    rows = StepRows(decode_tokens=[5, 6], decode_lens=[9, 4], decode_pages=pages[:2], decode_slots=[3, 1],
                    prefill_tokens=list(range(7 + 3 + 1)), prefill_starts=[0, 5, 12], prefill_ends=[7, 8, 13],
                    prefill_pages=pages[2:], prefill_slots=[0, 2, 4], prefill_samples=[True, False, True],
                    snapshots=[(3, 9), (9, 8)])
    b = StepInputBuilder(page_size=ps, device="cpu", has_attention=True, has_state=True)
    ctx, n_sample = b.build(rows)
    ids, pos, slots = _naive(rows, ps)
    assert ctx.input_ids.tolist() == ids and ctx.positions.tolist() == pos
    assert ctx.attn.slot_mapping.tolist() == slots
    assert ctx.num_decode_tokens == 2 and n_sample == 4
    assert ctx.logits_indices.tolist() == [0, 1, 2 + 6, 2 + 7 + 3 + 0]
    a = ctx.attn
    assert a.decode_kv_indptr.tolist() == [0, 3, 4]
    assert a.decode_kv_indices.tolist() == [int(x) for x in pages[0][:3] + pages[1][:1]]
    assert a.decode_kv_last_page_len.tolist() == [1, 4]
    assert a.prefill_qo_indptr.tolist() == [0, 7, 10, 11]
    assert a.prefill_kv_indptr.tolist() == [0, 2, 4, 8]
    assert a.prefill_kv_last_page_len.tolist() == [3, 4, 1]
    assert a.decode_kv_indptr.dtype == torch.int32 and a.slot_mapping.dtype == torch.int64
    st = ctx.state
    assert st.decode_slots.tolist() == [3, 1] and st.prefill_slots.tolist() == [0, 2, 4]
    assert st.prefill_cu_seqlens.tolist() == [0, 7, 10, 11]
    assert st.snap_token_idx.tolist() == [3, 9] and st.snap_slots.tolist() == [9, 8]
    assert st.prefill_cu_seqlens.dtype == torch.int32 and st.decode_slots.dtype == torch.int64


def test_step_inputs_device_views_start_16_byte_aligned():
    """Every device tensor of the context starts at a multiple of 16 bytes of its buffer, whatever
    the row counts: Triton specialises kernels on the alignment of their pointer arguments, and
    views at odd offsets made served steps compile variants the warm-up never met."""
    import dataclasses
    rng = np.random.default_rng()
    b = StepInputBuilder(page_size=4, device="cpu", has_attention=True, has_state=True)
    for _ in range(20):
        d, p = int(rng.integers(0, 5)), int(rng.integers(1, 5))
        lens = [int(x) for x in rng.integers(1, 12, p)]
        rows = StepRows(decode_tokens=[1] * d, decode_lens=[int(x) for x in rng.integers(1, 9, d)],
                        decode_pages=[[int(x) for x in rng.permutation(50)[:3]] for _ in range(d)],
                        decode_slots=list(range(d)), prefill_tokens=[2] * sum(lens), prefill_starts=[0] * p,
                        prefill_ends=lens, prefill_pages=[[int(x) for x in rng.permutation(50)[:3]] for _ in range(p)],
                        prefill_slots=list(range(d, d + p)), prefill_samples=[True] * p,
                        snapshots=[(int(rng.integers(0, sum(lens))), 9)] * int(rng.integers(0, 2)))
        ctx, _ = b.build(rows)
        views = [ctx.input_ids, ctx.positions, ctx.logits_indices, ctx.attn.slot_mapping,
                 ctx.attn.decode_kv_indices, ctx.attn.prefill_kv_indices]
        views += [getattr(ctx.state, f.name) for f in dataclasses.fields(ctx.state)]
        for t in views:
            assert t.storage_offset() * t.element_size() % 16 == 0, (t.dtype, t.storage_offset())


def test_step_inputs_decode_only_and_prefill_only():
    b = StepInputBuilder(page_size=4, device="cpu", has_attention=True, has_state=False)
    ctx, n = b.build(StepRows([1], [1], [[7]], [], [], [], [], [], [], [], []))
    assert ctx.attn.slot_mapping.tolist() == [28] and n == 1 and ctx.state is None
    ctx, n = b.build(StepRows([], [], [], [], [1, 2], [0], [2], [[3]], [], [False], []))
    assert ctx.attn.slot_mapping.tolist() == [12, 13] and n == 0 and ctx.logits_indices.numel() == 0


@pytest.mark.parametrize("spec", [ATTN, HYBRID], ids=["attn", "hybrid"])
@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_fuzz_invariants(spec, mode):
    """Random arrivals, lengths, aborts and a tight pool: the cache bookkeeping stays
    consistent every step, every sequence finishes, and everything is returned."""
    import random
    rng = random.Random(10 * (mode == "offload") + len(spec.state))
    cm, sched = make(spec, num_pages=20, page_size=4, max_num_seqs=6, budget=10, mode=mode)
    live: dict[str, Sequence] = {}
    done = 0
    for step in range(400):
        if step < 300 and rng.random() < 0.5:
            rid = f"r{step}"
            s = seq(rid, rng.randint(1, 30), max_tokens=rng.randint(1, 20), base=rng.randrange(3) * 1000)
            live[rid] = s
            sched.add(s)
        if live and rng.random() < 0.15:
            victim = live.pop(rng.choice(sorted(live)))
            sched.remove(victim)
            done += 1
        o = sched.schedule()
        for f in o.failed:
            live.pop(f.request_id)
            sched.remove(f)
            done += 1
        advance(cm, sched, o)
        for s in list(o.decode) + [r.seq for r in o.prefill if r.end == r.seq.num_computed]:
            if s.request_id in live and s.num_output_tokens >= s.params.max_tokens:
                live.pop(s.request_id)
                sched.remove(s)
                done += 1
        assert len(sched.running) <= 6
    while live:
        o = sched.schedule()
        assert not o.is_empty or o.failed
        for f in o.failed:
            live.pop(f.request_id)
            sched.remove(f)
        advance(cm, sched, o)
        for s in list(o.decode) + [r.seq for r in o.prefill]:
            if s.request_id in live and s.num_output_tokens >= s.params.max_tokens:
                live.pop(s.request_id)
                sched.remove(s)
    assert not sched.running and not sched.waiting
    cm.reset_prefix_cache()
    st = cm.stats()
    assert st.free_pages == st.total_pages and st.free_slots == st.total_slots
    assert st.snapshot_slots_free == st.snapshot_slots_total
    assert sched.num_preemptions > 0
