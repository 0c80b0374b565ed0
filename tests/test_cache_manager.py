"""CacheManager: pages, slots, copy-on-write, rollback, offload, and a randomized stress run.

A tiny "model" stands in for the forward pass: it writes K = token * 1024 + position (and
V = -K) at every new position, and keeps in each state slot a summary of the tokens seen
(count, sum, position-weighted sum), snapshotting it where the manager asks. Both are
functions of the token prefix only, so any sharing bug shows up as a mismatch.
"""

from __future__ import annotations

import random

import pytest
import torch

from mstar.models.context import AttentionLayerSpec, CacheSpec, StateLayerSpec
from mstar.runtime.caches.cache_manager import CacheManager, CacheStats, StateRollbackError

PS = 4
KV_SPEC = CacheSpec(attention=(AttentionLayerSpec(2, 4), AttentionLayerSpec(1, 8)))
HYBRID_SPEC = CacheSpec(attention=(AttentionLayerSpec(2, 4),),
                        state=(StateLayerSpec(conv_dim=6, conv_kernel=4, num_heads=2, key_dim=3, value_dim=3),
                               StateLayerSpec(conv_dim=4, conv_kernel=3, num_heads=1, key_dim=2, value_dim=2)))
STATE_ONLY_SPEC = CacheSpec(state=HYBRID_SPEC.state)


def make(spec=KV_SPEC, num_pages=16, num_slots=4, snaps=0, prefix=True, page_size=PS, device="cpu"):
    return CacheManager(spec, num_pages=num_pages, page_size=page_size, num_slots=num_slots,
                        dtype=torch.float32, device=device, enable_prefix_cache=prefix,
                        num_snapshot_slots=snaps)


# --- the fake model ------------------------------------------------------------------------
def kv_value(tokens, positions):
    return torch.tensor([t * 1024 + p for t, p in zip(tokens, positions)], dtype=torch.float32)


def write_kv(cm, rid, tokens, start, end):
    if end <= start or not cm.has_attention:
        return
    pages = cm.pages(rid)
    pos = list(range(start, end))
    flat = torch.tensor([pages[p // cm.page_size] * cm.page_size + p % cm.page_size for p in pos])
    val = kv_value(tokens[start:end], pos)
    flat, val = flat.to(cm.device), val.to(cm.device)
    for k, v in zip(cm.caches.k_caches, cm.caches.v_caches):
        kf, vf = k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])
        kf[flat] = val[:, None, None]
        vf[flat] = -val[:, None, None]


def read_kv(cm, rid, n):
    """[n] values of position 0..n-1 from every layer (asserting the layers agree)."""
    pages = cm.pages(rid)
    flat = torch.tensor([pages[p // cm.page_size] * cm.page_size + p % cm.page_size for p in range(n)],
                        dtype=torch.long, device=cm.device)
    out = None
    for k, v in zip(cm.caches.k_caches, cm.caches.v_caches):
        kv = k.view(-1, *k.shape[2:])[flat]
        vv = v.view(-1, *v.shape[2:])[flat]
        assert torch.equal(kv, -vv)
        col = kv.reshape(n, -1)
        assert torch.equal(col, col[:, :1].expand_as(col))
        if out is None:
            out = col[:, 0]
        else:
            assert torch.equal(out, col[:, 0])
    return out.cpu() if out is not None else torch.empty(0)


def check_kv(cm, rid, tokens):
    n = cm.length(rid)
    if cm.has_attention and n:
        assert torch.equal(read_kv(cm, rid, n), kv_value(tokens[:n], range(n))), rid


def state_of(tokens):
    """The fake recurrent summary after `tokens` (a function of the prefix)."""
    n = len(tokens)
    return (float(n), float(sum(tokens)), float(sum((i + 1) * t for i, t in enumerate(tokens))))


def set_state(cm, slot, summary):
    for c in cm.caches.conv_states:
        c[slot].zero_()
        c[slot].view(-1)[:3] = torch.tensor(summary)
    for r in cm.caches.recurrent_states:
        r[slot].zero_()
        r[slot].view(-1)[:3] = torch.tensor(summary)


def get_state(cm, slot):
    vals = {tuple(c[slot].view(-1)[:3].tolist()) for c in (*cm.caches.conv_states, *cm.caches.recurrent_states)}
    assert len(vals) == 1, vals
    return vals.pop()


def step(cm, rid, tokens, end):
    """Compute positions [length, end) of `tokens` like a forward pass would: True if done."""
    start = cm.length(rid)
    if not cm.ensure_capacity(rid, end):
        return False
    snaps = dict(cm.snapshot_slots(rid, start, end, tokens))
    write_kv(cm, rid, tokens, start, end)
    if cm.has_state:
        assert get_state(cm, cm.slot(rid)) == state_of(tokens[:start])
        for p, s in snaps.items():
            set_state(cm, s, state_of(tokens[:p + 1]))
        set_state(cm, cm.slot(rid), state_of(tokens[:end]))
    cm.commit(rid, tokens, end)
    return True


def assert_all_free(cm):
    st = cm.stats()
    assert st.free_pages == st.total_pages
    assert st.used_pages == 0 and st.cached_pages == 0
    assert st.free_slots == st.total_slots
    assert st.snapshot_slots_free == st.snapshot_slots_total
    cm.check()


# --- tests -----------------------------------------------------------------------------------
def test_layout():
    cm = make(HYBRID_SPEC, num_pages=10, num_slots=3, snaps=5)
    c = cm.caches
    assert cm.has_state and cm.has_attention and cm.page_size == PS
    assert [tuple(k.shape) for k in c.k_caches] == [(10, PS, 2, 4)]
    assert [tuple(x.shape) for x in c.conv_states] == [(8, 6, 3), (8, 4, 2)]
    assert [tuple(x.shape) for x in c.recurrent_states] == [(8, 2, 3, 3), (8, 1, 2, 2)]
    assert all(x.dtype == torch.float32 for x in c.recurrent_states)
    cm2 = make(KV_SPEC)
    assert not cm2.has_state and cm2.caches.conv_states == []
    st = cm.stats()
    assert isinstance(st, CacheStats)
    assert (st.total_pages, st.free_pages, st.total_slots, st.free_slots, st.snapshot_slots_total,
            st.snapshot_slots_free) == (10, 10, 3, 3, 5, 5)
    assert st.hit_rate == 0.0


@pytest.mark.parametrize("spec", [KV_SPEC, HYBRID_SPEC, STATE_ONLY_SPEC])
def test_allocate_free_round_trip(spec):
    cm = make(spec, num_pages=12, num_slots=3, snaps=4)
    for rnd in range(3):
        ids = [f"r{rnd}-{i}" for i in range(3)]
        toks = {}
        for i, rid in enumerate(ids):
            toks[rid] = [100 * rnd + 10 * i + j for j in range(5 + 3 * i)]
            assert cm.admit(rid, toks[rid]) == 0
            assert cm.length(rid) == 0 and cm.pages(rid) == []
            if cm.has_state:
                assert cm.slot(rid) >= 0 and get_state(cm, cm.slot(rid)) == (0.0, 0.0, 0.0)
            else:
                assert cm.slot(rid) == -1
            assert step(cm, rid, toks[rid], len(toks[rid]))
            assert cm.length(rid) == len(toks[rid])
            assert len(cm.pages(rid)) == -(-len(toks[rid]) // PS)
        cm.check()
        st = cm.stats()
        assert st.used_pages == sum(-(-len(t) // PS) for t in toks.values())
        assert st.free_slots == (0 if cm.has_state else st.total_slots)
        for rid in ids:
            check_kv(cm, rid, toks[rid])
            cm.free(rid)
        cm.free("never-admitted")  # ignored
        cm.check()
        cm.reset_prefix_cache()
        assert_all_free(cm)


def test_slot_zeroed_on_miss():
    cm = make(HYBRID_SPEC, snaps=0)
    cm.admit("a", [1, 2, 3])
    set_state(cm, cm.slot("a"), (5.0, 6.0, 7.0))
    s = cm.slot("a")
    cm.free("a")
    cm.admit("b", [9, 9])
    assert cm.slot("b") == s
    assert all(float(x.abs().sum()) == 0 for x in (cm.caches.conv_states[0][s], cm.caches.recurrent_states[1][s]))


def test_ensure_capacity_out_of_pages_changes_nothing():
    cm = make(KV_SPEC, num_pages=4, prefix=False)
    cm.admit("a", list(range(10)))
    assert cm.ensure_capacity("a", 12)  # 3 pages
    assert not cm.ensure_capacity("a", 17)  # would need 5
    assert len(cm.pages("a")) == 3 and cm.stats().free_pages == 1
    assert cm.ensure_capacity("a", 16)
    assert cm.stats().free_pages == 0
    assert not cm.can_admit(1)
    assert cm.admit("b", [1, 2]) is None  # no page for it: nothing held
    assert not cm.has_request("b")
    cm.check()
    cm.free("a")
    assert_all_free(cm)


def test_out_of_slots_returns_none_without_side_effects():
    cm = make(HYBRID_SPEC, num_pages=8, num_slots=2, snaps=2)
    toks = list(range(1, 10))
    cm.admit("a", toks)
    assert step(cm, "a", toks, 9)
    cm.admit("b", [5, 6])
    before = cm.stats()
    assert not cm.can_admit(1)
    assert cm.admit("c", toks) is None  # would hit, but no slot
    assert cm.stats() == before
    assert not cm.fork("a", "d")
    assert cm.stats() == before and not cm.has_request("d")
    cm.check()
    cm.offload("b")
    assert cm.admit("c", toks) == 8
    assert not cm.reload("b")
    assert cm.is_offloaded("b")
    for r in "abc":
        cm.free(r)
    cm.reset_prefix_cache()
    assert_all_free(cm)


def test_refcounts_with_many_sharers():
    cm = make(KV_SPEC, num_pages=16, num_slots=8)
    base = list(range(1, 13))  # 3 full pages
    cm.admit("src", base + [99])
    assert step(cm, "src", base + [99], 13)
    readers = []
    for i in range(4):
        t = base + [200 + i, 201]
        assert cm.admit(f"r{i}", t) == 12
        readers.append((f"r{i}", t))
        assert cm.pages(f"r{i}") == cm.pages("src")[:3]
    shared = cm.pages("src")[:3]
    assert all(cm._pool.refcount(p) == 5 for p in shared)
    for rid, t in readers:
        assert step(cm, rid, t, len(t))
        check_kv(cm, rid, t)
    cm.check()
    cm.free("src")
    assert all(cm._pool.refcount(p) == 4 for p in shared)
    for rid, _ in readers:
        cm.free(rid)
    st = cm.stats()
    assert st.used_pages == 0 and st.cached_pages == 3
    assert st.free_pages == st.total_pages  # cached pages count as free (evictable)
    cm.reset_prefix_cache()
    assert_all_free(cm)


def test_fork_copy_on_write():
    cm = make(KV_SPEC, num_pages=16)
    toks = list(range(1, 11))  # 10 tokens: pages 0,1 full, page 2 holds 2
    cm.admit("a", toks)
    assert step(cm, "a", toks, 10)
    # fill the rest of every page with random data so a full-page copy is observable
    a_pages = list(cm.pages("a"))
    assert cm.fork("a", "b")
    assert cm.pages("b") == a_pages and cm.length("b") == 10
    last = a_pages[2]
    for k in cm.caches.k_caches:
        k[last, 2:] = torch.randn_like(k[last, 2:])
    before = [k[last].clone() for k in cm.caches.k_caches]
    # b writes its own continuation into the shared last page: copied first
    tb = toks + [77, 78, 79]
    assert step(cm, "b", tb, 13)
    assert cm.pages("b")[:2] == a_pages[:2] and cm.pages("b")[2] != last
    for k, b in zip(cm.caches.k_caches, before):
        assert torch.equal(k[last], b)  # source page unchanged
        assert torch.equal(k[cm.pages("b")[2], :2], b[:2])  # copied prefix
    check_kv(cm, "a", toks)
    check_kv(cm, "b", tb)
    # a is now the only holder of its last page: writes in place
    ta = toks + [55]
    assert step(cm, "a", ta, 11)
    assert cm.pages("a") == a_pages
    check_kv(cm, "a", ta)
    check_kv(cm, "b", tb)
    cm.check()
    cm.free("a")
    cm.free("b")
    cm.reset_prefix_cache()
    assert_all_free(cm)


def test_fork_copies_state():
    cm = make(HYBRID_SPEC, num_pages=16, num_slots=3, snaps=4)
    toks = list(range(1, 8))
    cm.admit("a", toks)
    assert step(cm, "a", toks, 7)
    assert cm.fork("a", "b")
    assert cm.slot("b") != cm.slot("a")
    assert get_state(cm, cm.slot("b")) == state_of(toks)
    for c in (*cm.caches.conv_states, *cm.caches.recurrent_states):
        assert torch.equal(c[cm.slot("a")], c[cm.slot("b")])
    tb = toks + [40, 41]
    assert step(cm, "b", tb, 9)
    assert get_state(cm, cm.slot("a")) == state_of(toks)
    check_kv(cm, "a", toks)
    check_kv(cm, "b", tb)
    cm.free("a")
    cm.free("b")
    cm.reset_prefix_cache()
    assert_all_free(cm)


def test_rollback():
    cm = make(KV_SPEC, num_pages=16)
    toks = list(range(1, 15))  # 14 tokens
    cm.admit("a", toks)
    assert step(cm, "a", toks, 14)
    pages = list(cm.pages("a"))
    assert cm.stats().cached_pages == 3
    cm.rollback("a", 7)  # length 7: pages 0, 1 (1 holds 3 tokens); 2, 3 released
    assert cm.length("a") == 7 and cm.pages("a") == pages[:2]
    st = cm.stats()
    assert st.used_pages == 2 and st.cached_pages == 3  # cached page 2 idle, still cached
    cached_page1 = [k[pages[1]].clone() for k in cm.caches.k_caches]
    # new tokens after the rollback go to a copy of cached page 1, which stays intact
    t2 = toks[:7] + [90, 91, 92, 93, 94]
    assert step(cm, "a", t2, 12)
    assert cm.pages("a")[0] == pages[0] and cm.pages("a")[1] != pages[1]
    for k, b in zip(cm.caches.k_caches, cached_page1):
        assert torch.equal(k[pages[1]], b)
    check_kv(cm, "a", t2)
    # the original prefix still hits, the rolled-back one too
    assert cm.admit("b", toks) == 12
    check_kv(cm, "b", toks)
    assert cm.admit("c", t2 + [1]) == 12
    check_kv(cm, "c", t2)
    cm.rollback("c", 0)
    cm.rollback("c", 12)
    assert cm.length("c") == 0 and cm.pages("c") == []
    with pytest.raises(ValueError):
        cm.rollback("b", 13)
    cm.check()
    for r in "abc":
        cm.free(r)
    cm.reset_prefix_cache()
    assert_all_free(cm)


def test_rollback_with_state_needs_restore():
    cm = make(HYBRID_SPEC, num_pages=16, snaps=4)
    toks = list(range(1, 11))
    cm.admit("a", toks)
    assert step(cm, "a", toks, 10)
    with pytest.raises(StateRollbackError):
        cm.rollback("a", 2)
    assert cm.length("a") == 10
    set_state(cm, cm.slot("a"), state_of(toks[:8]))  # the caller restores a checkpoint
    cm.rollback("a", 2, state_restored=True)
    assert cm.length("a") == 8
    t2 = toks[:8] + [3, 3, 3]
    assert step(cm, "a", t2, 11)
    check_kv(cm, "a", t2)
    cm.free("a")
    cm.reset_prefix_cache()
    assert_all_free(cm)


@pytest.mark.parametrize("spec", [KV_SPEC, HYBRID_SPEC, STATE_ONLY_SPEC])
def test_offload_reload_restores_contents(spec):
    torch.manual_seed(0)
    cm = make(spec, num_pages=10, num_slots=2, snaps=2, prefix=False)
    toks = list(range(1, 11))
    cm.admit("a", toks)
    assert cm.ensure_capacity("a", 10)
    cm.commit("a", toks, 10)
    pages = cm.pages("a")
    for k in (*cm.caches.k_caches, *cm.caches.v_caches):
        k[pages] = torch.randn_like(k[pages])
    kv_before = [k[pages].clone() for k in (*cm.caches.k_caches, *cm.caches.v_caches)]
    st_before = []
    if cm.has_state:
        for c in (*cm.caches.conv_states, *cm.caches.recurrent_states):
            c[cm.slot("a")] = torch.randn_like(c[cm.slot("a")])
        st_before = [c[cm.slot("a")].clone() for c in (*cm.caches.conv_states, *cm.caches.recurrent_states)]
    cm.offload("a")
    assert cm.is_offloaded("a") and cm.pages("a") == [] and cm.slot("a") == -1
    assert cm.length("a") == 10
    assert_all_free(cm)
    # someone else scribbles over the memory meanwhile
    cm.admit("x", list(range(40)))
    assert cm.ensure_capacity("x", 40)
    for k in (*cm.caches.k_caches, *cm.caches.v_caches):
        k.fill_(-1)
    for c in (*cm.caches.conv_states, *cm.caches.recurrent_states):
        c.fill_(-1)
    assert not cm.reload("a")  # no room: nothing changes
    assert cm.is_offloaded("a")
    cm.check()
    cm.free("x")
    assert cm.reload("a")
    assert not cm.is_offloaded("a")
    new_pages = cm.pages("a")
    assert len(new_pages) == 3
    for k, b in zip((*cm.caches.k_caches, *cm.caches.v_caches), kv_before):
        assert torch.equal(k[new_pages], b)
    for c, b in zip((*cm.caches.conv_states, *cm.caches.recurrent_states), st_before):
        assert torch.equal(c[cm.slot("a")], b)
    cm.check()
    cm.free("a")
    assert_all_free(cm)


def test_reload_shares_pages_still_cached():
    cm = make(KV_SPEC, num_pages=12)
    toks = list(range(1, 11))
    cm.admit("a", toks)
    assert step(cm, "a", toks, 10)
    pages = list(cm.pages("a"))
    cm.offload("a")
    assert cm.stats().cached_pages == 2
    assert cm.reload("a")
    assert cm.pages("a")[:2] == pages[:2]  # the two full pages came back from the cache
    check_kv(cm, "a", toks)
    cm.free("a")
    cm.reset_prefix_cache()
    assert_all_free(cm)


def test_offload_free_while_offloaded():
    cm = make(HYBRID_SPEC, num_pages=8, num_slots=1, snaps=2)
    toks = list(range(1, 9))
    cm.admit("a", toks)
    assert step(cm, "a", toks[:6], 6)
    cm.snapshot_slots("a", 6, 8, toks)  # a pending reservation is released by offload
    cm.offload("a")
    cm.check()
    cm.free("a")
    cm.reset_prefix_cache()
    assert_all_free(cm)


# --- randomized stress ------------------------------------------------------------------------
def _stress(spec, seed, n_ops, num_pages, num_slots, snaps, prefix, device="cpu"):
    rng = random.Random(seed)
    cm = make(spec, num_pages=num_pages, num_slots=num_slots, snaps=snaps, prefix=prefix, device=device)
    stem = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 14))] for _ in range(4)]
    toks: dict[str, list[int]] = {}
    target: dict[str, int] = {}
    next_id = 0
    counts = dict.fromkeys(["admit", "hit", "step", "fork", "rollback", "free", "offload", "reload", "fail"], 0)
    for it in range(n_ops):
        live = [r for r in toks if not cm.is_offloaded(r)]
        off = [r for r in toks if cm.is_offloaded(r)]
        op = rng.random()
        if op < 0.18 or not toks:
            t = list(rng.choice(stem)) if rng.random() < 0.8 else []
            t = t[:rng.randrange(0, len(t) + 1)] if rng.random() < 0.3 else t
            t += [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
            rid = f"q{next_id}"
            next_id += 1
            n = cm.admit(rid, t)
            if n is None:
                counts["fail"] += 1
                assert not cm.has_request(rid)
            else:
                counts["admit"] += 1
                counts["hit"] += n > 0
                assert n % PS == 0 and n <= len(t) - 1
                toks[rid], target[rid] = t, len(t) + rng.randrange(0, 10)
                check_kv(cm, rid, t)
                if cm.has_state:
                    assert get_state(cm, cm.slot(rid)) == state_of(t[:n])
        elif op < 0.60 and live:
            rid = rng.choice(live)
            t = toks[rid]
            n = cm.length(rid)
            if n < len(t):  # prefill chunk
                end = min(len(t), n + rng.randrange(1, 9))
            else:  # decode (maybe several tokens, as in speculative decoding)
                if len(t) >= target[rid]:
                    cm.free(rid)
                    del toks[rid]
                    counts["free"] += 1
                    continue
                t.append(rng.randrange(1, 50))
                end = len(t)
            before = cm.stats()
            if step(cm, rid, t, end):
                counts["step"] += 1
            else:
                counts["fail"] += 1
                assert cm.length(rid) == n
                assert cm.stats() == before
        elif op < 0.66 and live:
            rid = rng.choice(live)
            dst = f"q{next_id}"
            next_id += 1
            if cm.fork(rid, dst):
                counts["fork"] += 1
                toks[dst] = list(toks[rid][:cm.length(rid)])
                target[dst] = target[rid]
            else:
                counts["fail"] += 1
        elif op < 0.74 and live:
            rid = rng.choice(live)
            k = rng.randrange(0, cm.length(rid) + 1)
            new_len = cm.length(rid) - k
            if cm.has_state:
                set_state(cm, cm.slot(rid), state_of(toks[rid][:new_len]))
            cm.rollback(rid, k, state_restored=cm.has_state)
            del toks[rid][new_len:]
            counts["rollback"] += 1
        elif op < 0.84 and toks:
            rid = rng.choice(list(toks))
            cm.free(rid)
            del toks[rid]
            counts["free"] += 1
        elif op < 0.92 and live:
            rid = rng.choice(live)
            cm.offload(rid)
            counts["offload"] += 1
        elif off:
            rid = rng.choice(off)
            if cm.reload(rid):
                counts["reload"] += 1
                check_kv(cm, rid, toks[rid])
                if cm.has_state:
                    assert get_state(cm, cm.slot(rid)) == state_of(toks[rid][:cm.length(rid)])
            else:
                counts["fail"] += 1
        elif rng.random() < 0.05:
            cm.reset_prefix_cache()
        cm.check()
        if it % 25 == 0:
            for rid, t in toks.items():
                if not cm.is_offloaded(rid):
                    check_kv(cm, rid, t)
    for rid in list(toks):
        cm.free(rid)
    cm.check()
    st = cm.stats()
    assert st.used_pages == 0 and st.free_pages == st.total_pages
    cm.reset_prefix_cache()
    assert_all_free(cm)
    return counts, st


@pytest.mark.parametrize("spec,seed,snaps", [(KV_SPEC, 1, 0), (KV_SPEC, 2, 0), (HYBRID_SPEC, 3, 6),
                                             (HYBRID_SPEC, 4, 2), (STATE_ONLY_SPEC, 5, 4)])
def test_stress(spec, seed, snaps):
    counts, st = _stress(spec, seed, n_ops=5000, num_pages=24, num_slots=5, snaps=snaps, prefix=True)
    for name in ("admit", "hit", "step", "fork", "free", "offload", "reload", "fail"):
        assert counts[name] > 0, counts
    assert st.prefix_hit_tokens > 0 and 0 < st.hit_rate < 1


def test_stress_no_prefix_cache():
    counts, st = _stress(HYBRID_SPEC, 7, n_ops=1500, num_pages=24, num_slots=5, snaps=4, prefix=False)
    assert counts["hit"] == 0 and st.prefix_queries == 0 and st.cached_pages == 0


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [KV_SPEC, HYBRID_SPEC])
def test_stress_cuda(spec):
    """The same bookkeeping on CUDA tensors: pinned, asynchronous offload copies included."""
    counts, _ = _stress(spec, 11, n_ops=800, num_pages=24, num_slots=5, snaps=4, prefix=True, device="cuda")
    assert counts["offload"] > 0 and counts["reload"] > 0


UNIFORM_STATE_SPEC = CacheSpec(state=(StateLayerSpec(conv_dim=6, conv_kernel=4, num_heads=2, key_dim=3, value_dim=3),) * 3)


@pytest.mark.parametrize("spec", [UNIFORM_STATE_SPEC, STATE_ONLY_SPEC], ids=["stacked", "per-layer"])
def test_state_zero_and_copy_touch_one_slot_in_every_layer(spec):
    """Layers of one shape share a [layers, rows, ...] stack (one kernel zeroes or copies a slot
    everywhere); mixed shapes keep a tensor per layer. Either way only the slot's rows change."""
    cm = make(spec, num_slots=4, snaps=2)
    c = cm.caches
    assert bool(c.state_stacks) == (spec is UNIFORM_STATE_SPEC)
    for stack, per_layer in zip(c.state_stacks, (c.conv_states, c.recurrent_states)):
        assert all(t.data_ptr() == stack[i].data_ptr() and t.is_contiguous() for i, t in enumerate(per_layer))
    g = torch.Generator().manual_seed(7)
    for t in (*c.conv_states, *c.recurrent_states):
        t.copy_(torch.randn(t.shape, generator=g))
    before = [t.clone() for t in (*c.conv_states, *c.recurrent_states)]
    cm._zero_state(2)
    cm._copy_state(1, 4)
    for t, b in zip((*c.conv_states, *c.recurrent_states), before):
        want = b.clone()
        want[2] = 0
        want[4] = b[1]
        assert torch.equal(t, want)
