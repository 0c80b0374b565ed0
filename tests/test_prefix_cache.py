"""Prefix caching: chained page keys, hits and misses, LRU eviction, state snapshots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.models.context import AttentionLayerSpec, CacheSpec, StateLayerSpec
from mstar.runtime.caches.cache_manager import CacheManager
from mstar.runtime.caches.prefix_cache import PrefixCache, extend_keys, page_key, root_key

PS = 4
KV_SPEC = CacheSpec(attention=(AttentionLayerSpec(2, 4),))
HYBRID_SPEC = CacheSpec(attention=(AttentionLayerSpec(2, 4),),
                        state=(StateLayerSpec(conv_dim=6, conv_kernel=4, num_heads=2, key_dim=3, value_dim=3),
                               StateLayerSpec(conv_dim=4, conv_kernel=3, num_heads=1, key_dim=2, value_dim=2)))


def make(spec=KV_SPEC, num_pages=16, num_slots=4, snaps=0, prefix=True):
    return CacheManager(spec, num_pages=num_pages, page_size=PS, num_slots=num_slots, dtype=torch.float32,
                        device="cpu", enable_prefix_cache=prefix, num_snapshot_slots=snaps)


def run(cm, rid, toks, start=None, end=None):
    """Prefill toks[start:end] (default: from the request's length to the end): ensure,
    snapshot, 'write' KV (position-coded), commit. Returns the snapshot list."""
    start = cm.length(rid) if start is None else start
    end = len(toks) if end is None else end
    assert cm.ensure_capacity(rid, end)
    snaps = cm.snapshot_slots(rid, start, end, toks)
    pages = cm.pages(rid)
    for p in range(start, end):
        for k in cm.caches.k_caches:
            k[pages[p // PS], p % PS] = toks[p] * 1000 + p
    cm.commit(rid, toks, end)
    return snaps


def kv_ok(cm, rid, toks):
    pages = cm.pages(rid)
    return all(float(cm.caches.k_caches[0][pages[p // PS], p % PS, 0, 0]) == toks[p] * 1000 + p
               for p in range(cm.length(rid)))


def all_free(cm):
    st = cm.stats()
    return (st.free_pages == st.total_pages and st.free_slots == st.total_slots
            and st.snapshot_slots_free == st.snapshot_slots_total and st.cached_pages == 0)


# --- keys ------------------------------------------------------------------------------------
def test_page_key_is_stable_and_chained():
    r = root_key()
    assert r == root_key(None) == root_key(b"") and r != root_key("tenant-a")
    k1 = page_key(r, [1, 2, 3, 4])
    assert k1 == page_key(r, (1, 2, 3, 4)) == page_key(r, np.array([1, 2, 3, 4])) \
        == page_key(r, torch.tensor([1, 2, 3, 4]))
    assert len(k1) == 16 and k1 != page_key(r, [1, 2, 3, 5])
    # the same page content after a different prefix has a different key
    a = page_key(page_key(r, [1, 1, 1, 1]), [7, 7, 7, 7])
    b = page_key(page_key(r, [2, 2, 2, 2]), [7, 7, 7, 7])
    assert a != b
    keys: list[bytes] = []
    extend_keys(keys, r, list(range(10)), 2, PS)
    assert keys == [page_key(r, [0, 1, 2, 3]), page_key(keys[0], [4, 5, 6, 7])]
    extend_keys(keys, r, list(range(10)), 2, PS)  # idempotent
    assert len(keys) == 2


def test_prefix_cache_lru_and_snapshot_tiers():
    pc = PrefixCache(num_pages=8)
    for i in range(4):
        pc.insert(bytes([i]) * 16, page=i, snapshot=100 + i, idle=False)
    assert pc.get(bytes([2]) * 16) == 2 and pc.get(b"x" * 16) is None
    assert pc.key_of(2) == bytes([2]) * 16 and pc.snapshot_of(2) == 102 and not pc.is_idle(2)
    with pytest.raises(KeyError):
        pc.insert(bytes([0]) * 16, page=5, snapshot=None, idle=False)
    with pytest.raises(KeyError):
        pc.insert(bytes([9]) * 16, page=0, snapshot=None, idle=False)
    assert pc.num_idle == 0 and pc.evict_page() is None
    for i in (2, 0, 3):
        pc.mark_idle(i)
    assert pc.idle_pages() == [2, 0, 3]
    pc.mark_busy(0)
    pc.mark_idle(0)
    assert pc.idle_pages() == [2, 3, 0]
    pc.check()
    # snapshots: idle LRU first, then busy
    assert pc.evict_snapshot() == 102 and pc.snapshot_of(2) is None and pc.is_cached(2)
    assert pc.evict_page() == (2, None)
    assert pc.evict_page() == (3, 103)
    assert not pc.is_cached(3) and pc.get(bytes([3]) * 16) is None
    assert pc.evict_snapshot() == 100  # page 0 idle
    assert pc.evict_snapshot() == 101  # page 1 busy: second tier
    assert pc.evict_snapshot() is None
    pc.insert(b"k" * 16, page=6, snapshot=106, idle=True)
    pc.check()
    idle, snaps = pc.clear()
    assert idle == [0, 6] and snaps == [106] and pc.num_entries == 0
    pc.check()


# --- hits and misses ---------------------------------------------------------------------------
def test_hit_miss_partial_pages_and_cap():
    cm = make()
    a = list(range(1, 12))  # 11 tokens: 2 full pages + 3
    assert cm.admit("a", a) == 0
    run(cm, "a", a)
    assert cm.stats().cached_pages == 2
    # same prompt: 2 pages hit (8 <= 10)
    assert cm.admit("b", a) == 8 and cm.pages("b") == cm.pages("a")[:2] and cm.length("b") == 8
    assert kv_ok(cm, "b", a)
    # prompt of exactly 2 pages: the hit is capped so that one token is left to compute
    assert cm.admit("c", a[:8]) == 4
    # a partial first page never hits
    assert cm.admit("d", a[:3]) == 0
    # diverging inside page 2: only page 1 hits
    assert cm.admit("e", a[:6] + [99, 99, 99]) == 4
    # diverging in page 1: miss
    assert cm.admit("f", [0] + a[1:]) == 0
    st = cm.stats()
    assert (st.prefix_queries, st.prefix_hit_queries) == (6, 3)
    assert st.prefix_query_tokens == 11 + 11 + 8 + 3 + 9 + 11 and st.prefix_hit_tokens == 16
    assert st.hit_rate == pytest.approx(16 / 53)
    for r in "abcdef":
        cm.free(r)
    cm.check()
    cm.reset_prefix_cache()
    assert all_free(cm)


def test_chained_hash_same_page_after_different_prefix_misses():
    cm = make()
    x = [1, 1, 1, 1, 7, 7, 7, 7, 5]
    cm.admit("x", x)
    run(cm, "x", x)
    y = [2, 2, 2, 2, 7, 7, 7, 7, 5]  # page 2 identical, page 1 not
    assert cm.admit("y", y) == 0
    run(cm, "y", y)
    assert kv_ok(cm, "y", y) and kv_ok(cm, "x", x)
    assert cm.stats().cached_pages == 4
    assert cm.admit("z", y + [3]) == 8 and kv_ok(cm, "z", y)
    for r in "xyz":
        cm.free(r)
    cm.reset_prefix_cache()
    assert all_free(cm)


def test_cache_salt_separates_prefixes():
    cm = make()
    t = list(range(10))
    cm.admit("a", t, cache_salt="img-1")
    run(cm, "a", t)
    assert cm.admit("b", t) == 0
    assert cm.admit("c", t, cache_salt="img-2") == 0
    assert cm.admit("d", t, cache_salt="img-1") == 8
    for r in "abcd":
        cm.free(r)
    cm.reset_prefix_cache()
    assert all_free(cm)


def test_decode_pages_are_registered_for_kv_models():
    cm = make()
    t = [3, 1, 4, 1, 5, 9]
    cm.admit("a", t)
    run(cm, "a", t)
    for tok in [2, 6, 5]:  # decode one token at a time
        t = t + [tok]
        run(cm, "a", t)
    assert cm.length("a") == 9 and cm.stats().cached_pages == 2
    cm.free("a")
    assert cm.admit("b", t + [8]) == 8
    cm.free("b")
    cm.reset_prefix_cache()
    assert all_free(cm)


def test_lru_eviction_order():
    cm = make(num_pages=6)
    a, b = [1] * 9, [2] * 9  # 2 full pages + 1 each
    cm.admit("a", a)
    run(cm, "a", a)
    cm.admit("b", b)
    run(cm, "b", b)
    pa, pb = list(cm.pages("a")), list(cm.pages("b"))
    cm.free("a")  # a's pages idle first (older), its tail before its head
    cm.free("b")
    st = cm.stats()
    assert st.free_pages == 6 and st.cached_pages == 4 and st.evictable_pages == 4
    assert cm._prefix.idle_pages() == [pa[1], pa[0], pb[1], pb[0]]
    # need 4 pages: 2 from the free list, then a's tail, then a's head
    cm.admit("c", [3] * 16)
    assert cm.ensure_capacity("c", 16)
    assert sorted(cm.pages("c")[2:]) == sorted(pa[:2]) and cm.pages("c")[2] == pa[1]
    assert cm.stats().cached_pages == 2
    cm.free("c")
    assert cm.admit("a2", a) == 0  # a was evicted
    assert cm.admit("b2", b) == 8  # b survived
    cm.free("a2")
    cm.free("b2")
    cm.check()
    cm.reset_prefix_cache()
    assert all_free(cm)


def test_hit_revives_idle_pages_and_protects_them():
    cm = make(num_pages=4)
    a = [5] * 9
    cm.admit("a", a)
    run(cm, "a", a)
    cm.free("a")
    assert cm.admit("b", a) == 8  # the 2 idle pages are busy again
    assert cm.stats().evictable_pages == 0 and cm.stats().free_pages == 2
    cm.admit("c", [6] * 20)
    assert not cm.ensure_capacity("c", 12)  # would need to evict b's pages
    assert cm.ensure_capacity("c", 8)
    assert kv_ok(cm, "b", a)
    for r in "bc":
        cm.free(r)
    cm.reset_prefix_cache()
    assert all_free(cm)


def test_concurrent_identical_prefills_keep_one_entry():
    cm = make(HYBRID_SPEC, num_pages=16, snaps=8)
    t = list(range(1, 10))
    cm.admit("a", t)
    cm.admit("b", t)
    sa = run(cm, "a", t, end=8)
    assert [p for p, _ in sa] == [3, 7]
    sb = cm.snapshot_slots("b", 0, 8, t)
    assert sb == []  # a's pages are cached with snapshots now
    assert cm.ensure_capacity("b", 8)
    cm.commit("b", t, 8)  # b's identical pages stay private; the cache keeps a's
    st = cm.stats()
    assert st.cached_pages == 2 and st.cached_snapshots == 2 and st.used_pages == 4
    cm.free("a")
    cm.free("b")
    assert cm.stats().cached_pages == 2
    cm.reset_prefix_cache()
    assert all_free(cm)


# --- snapshots (hybrid models) ------------------------------------------------------------------
def test_snapshot_positions_and_state_copied_into_hit_slot():
    torch.manual_seed(0)
    cm = make(HYBRID_SPEC, num_pages=16, num_slots=3, snaps=6)
    t = list(range(1, 15))  # 14 tokens
    cm.admit("a", t)
    # chunked prefill: [0, 6) then [6, 14); boundaries 3, 7, 11
    s1 = run(cm, "a", t, 0, 6)
    assert [p for p, _ in s1] == [3]
    assert cm.stats().reserved_snapshots == 0 and cm.stats().cached_snapshots == 1
    s2 = cm.snapshot_slots("a", 6, 14, t)
    assert [p for p, _ in s2] == [7, 11]
    assert cm.snapshot_slots("a", 6, 14, t) == s2  # asking again hands out the same slots
    assert cm.stats().reserved_snapshots == 2
    slots = dict(s1 + s2)
    assert len(set(slots.values())) == 3 and all(s >= 3 for s in slots.values())
    known = {}
    for p, s in slots.items():  # the "forward" writes the state after token p
        known[p] = [torch.randn_like(c[s]) for c in (*cm.caches.conv_states, *cm.caches.recurrent_states)]
        for c, v in zip((*cm.caches.conv_states, *cm.caches.recurrent_states), known[p]):
            c[s] = v
    assert cm.ensure_capacity("a", 14)
    cm.commit("a", t, 14)
    assert cm.stats().cached_snapshots == 3 and cm.stats().reserved_snapshots == 0

    def state(slot):
        return [c[slot] for c in (*cm.caches.conv_states, *cm.caches.recurrent_states)]

    # a later prompt sharing 2 pages and a bit: resumes at 8 with the snapshot after token 7
    assert cm.admit("b", t[:10] + [50]) == 8
    assert all(torch.equal(x, y) for x, y in zip(state(cm.slot("b")), known[7]))
    # full prompt: capped at 12 (3 pages), snapshot after token 11
    assert cm.admit("c", t + [1]) == 12
    assert all(torch.equal(x, y) for x, y in zip(state(cm.slot("c")), known[11]))
    for r in "abc":
        cm.free(r)
    cm.check()
    cm.reset_prefix_cache()
    assert all_free(cm)


def test_hybrid_hit_needs_snapshot_at_boundary():
    cm = make(HYBRID_SPEC, num_pages=16, num_slots=3, snaps=1)
    t = list(range(1, 14))  # boundaries 3, 7, 11
    cm.admit("a", t)
    s = run(cm, "a", t, 0, 13)
    assert [p for p, _ in s] == [3]  # only one snapshot slot
    assert cm.stats().cached_pages == 3
    # pages 1..3 are cached but only page 1 ends with a snapshot: hit 4
    assert cm.admit("b", t) == 4
    cm.free("b")
    # no snapshot at all: miss although KV pages are cached
    cm.free("a")
    cm._prefix.evict_snapshot()
    cm._snap_slots.release(s[0][1])
    assert cm.admit("c", t) == 0
    cm.free("c")
    cm.check()
    cm.reset_prefix_cache()
    assert all_free(cm)


def test_snapshot_slots_run_out_and_evict_lru():
    cm = make(HYBRID_SPEC, num_pages=32, num_slots=3, snaps=2)
    a = [1] * 8
    cm.admit("a", a)
    assert len(run(cm, "a", a)) == 2
    cm.free("a")  # a's snapshots are now on idle pages
    b = [2] * 12
    cm.admit("b", b)
    sb = cm.snapshot_slots("b", 0, 12, b)
    # both slots come from a's idle snapshots (tail page first); none left for the third boundary
    assert [p for p, _ in sb] == [3, 7]
    assert cm.stats().cached_snapshots == 0 and cm.stats().cached_pages == 2
    assert cm.admit("a2", a + [1]) == 0  # a's pages are cached but lost their snapshots
    cm.free("a2")
    assert cm.ensure_capacity("b", 12)
    cm.commit("b", b, 12)
    # b is running: its snapshots are busy, yet a new prefill may take them (second tier)
    c = [3] * 5
    cm.admit("c", c)
    sc = cm.snapshot_slots("c", 0, 5, c)
    assert len(sc) == 1 and cm.stats().cached_snapshots == 1
    cm.free("c")  # an unused reservation is returned
    assert cm.stats().snapshot_slots_free == 1
    for r in ("b",):
        cm.free(r)
    assert cm.stats().snapshot_slots_free == 2
    cm.check()
    cm.reset_prefix_cache()
    assert all_free(cm)


def test_snapshot_slots_empty_without_state_or_prefix():
    cm = make(KV_SPEC)
    cm.admit("a", [1] * 9)
    assert cm.snapshot_slots("a", 0, 9, [1] * 9) == []
    cm2 = make(HYBRID_SPEC, snaps=4, prefix=False)
    cm2.admit("a", [1] * 9)
    assert cm2.snapshot_slots("a", 0, 9, [1] * 9) == []
    cm3 = make(HYBRID_SPEC, snaps=0)
    cm3.admit("a", [1] * 9)
    assert cm3.snapshot_slots("a", 0, 9, [1] * 9) == []


def test_prefix_cache_disabled():
    cm = make(prefix=False)
    t = list(range(12))
    cm.admit("a", t)
    run(cm, "a", t)
    assert cm.admit("b", t) == 0
    st = cm.stats()
    assert st.cached_pages == 0 and st.prefix_queries == 0 and st.hit_rate == 0.0
    cm.free("a")
    cm.free("b")
    assert all_free(cm)


def test_reset_prefix_cache_with_running_requests():
    cm = make(HYBRID_SPEC, num_pages=16, snaps=4)
    t = list(range(1, 10))
    cm.admit("a", t)
    run(cm, "a", t)
    cm.admit("b", [9] * 9)
    run(cm, "b", [9] * 9)
    cm.free("b")
    cm.reset_prefix_cache()
    st = cm.stats()
    assert st.cached_pages == 0 and st.snapshot_slots_free == 4 and st.used_pages == 3
    assert cm.admit("c", t) == 0
    assert kv_ok(cm, "a", t)
    cm.free("a")
    cm.free("c")
    cm.check()
    assert all_free(cm)


def test_state_model_without_snapshot_slots_skips_prefix_cache():
    cm = make(HYBRID_SPEC, snaps=0)
    t = list(range(1, 12))
    cm.admit("a", t)
    run(cm, "a", t)
    assert cm.admit("b", t) == 0
    st = cm.stats()
    assert st.cached_pages == 0 and st.prefix_queries == 0
    cm.free("a")
    cm.free("b")
    assert all_free(cm)
