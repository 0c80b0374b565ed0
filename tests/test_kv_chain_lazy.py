"""MSTAR_KV_CHAIN_LAZY_STEPS (runtime/caches/cache_manager.py): decode-filled pages enter the prefix
cache only on every N-th commit of their request; the length always moves at once; pending
registrations are done before the request's chain is read or its pages released (free,
offload, fork, rollback, snapshot_slots, reset_prefix_cache, commit_pending).

Unit level: N = 1 registers every full page at the commit that fills it (as always); N = 3 / 7
defer exactly to the N-th commits, and at every point where something reads or releases the
chain the whole bookkeeping (pages, refcounts, free list, prefix entries, LRU order, keys,
snapshots, stats) equals N = 1's. Engine level: identical tokens, identical prefix-cache hits
for a follow-up request after the first finished, and every full page of a preempted or
finished request registered the moment it is released.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_no_leaks, engine, greedy_requests, hf_greedy, prompts
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar import knobs
from mstar.models.context import AttentionLayerSpec, CacheSpec, StateLayerSpec
from mstar.runtime.caches.cache_manager import CacheManager
from mstar.runtime.caches.prefix_cache import extend_keys, root_key
from mstar.runtime.engine.request import EngineRequest, SamplingParams

PS = 4
KV_SPEC = CacheSpec(attention=(AttentionLayerSpec(2, 4),))
HYBRID_SPEC = CacheSpec(attention=(AttentionLayerSpec(2, 4),),
                        state=(StateLayerSpec(conv_dim=6, conv_kernel=4, num_heads=2, key_dim=3, value_dim=3),))


def make(n, spec=KV_SPEC, **kw):
    with knobs.override(MSTAR_KV_CHAIN_LAZY_STEPS=n):
        return CacheManager(spec, num_pages=kw.pop("num_pages", 48), page_size=PS, num_slots=4,
                            dtype=torch.float32, device="cpu", **kw)


def dump(cm):
    """Every piece of bookkeeping that registration can touch."""
    pf = cm._prefix
    reqs = {rid: (list(r.pages), r.length, r.slot, list(r.keys), r.num_registered, dict(r.snaps), r.host is not None)
            for rid, r in cm._reqs.items()}
    return (reqs, dict(pf._by_key), list(pf._idle), list(pf._idle_snaps), list(pf._busy_snaps), list(pf._snap),
            cm._pool.free_list(), [cm._pool.refcount(p) for p in range(cm.num_pages)],
            cm._snap_slots.free_list(), cm.stats())


TOKS = [(7 * i + 3) % 97 for i in range(200)]
OTHER = [(5 * i + 1) % 89 for i in range(200)]


def prefill(cm, rid, toks, n):
    assert cm.admit(rid, toks[:n]) is not None
    start = cm.length(rid)
    assert cm.ensure_capacity(rid, n)
    snaps = cm.snapshot_slots(rid, start, n, toks)
    cm.commit(rid, toks, n)
    return snaps


def decode(cm, rid, toks, steps, lazy_log=None):
    for _ in range(steps):
        n = cm.length(rid) + 1
        assert cm.ensure_capacity(rid, n)
        cm.commit(rid, toks, n)
        assert cm.length(rid) == n  # the length always moves at once
        if lazy_log is not None:
            lazy_log.append(cm._reqs[rid].num_registered)


def script(n):
    """A fixed sequence of operations; the dumps at every point that reads or releases a chain."""
    cm = make(n)
    out = []
    prefill(cm, "a", TOKS, 10)
    decode(cm, "a", TOKS, 23)
    assert cm.fork("a", "a2")  # fork reads a's chain
    out.append(("fork", dump(cm)))
    decode(cm, "a2", TOKS, 11)  # its page 10 fills at its commit 11: pending for N = 3 and 7
    assert n == 1 or cm._reqs["a2"].pending is not None
    cm.rollback("a2", 3)
    out.append(("rollback", dump(cm)))
    cm.offload("a")
    out.append(("offload", dump(cm)))
    assert cm.reload("a")
    out.append(("reload", dump(cm)))
    decode(cm, "a", TOKS, 6)
    cm.free("a")
    out.append(("free", dump(cm)))
    hit = cm.admit("b", TOKS[:30] + OTHER[:5])  # a follow-up sharing a's prompt and decoded tokens
    out.append(("admit", hit, dump(cm)))
    cm.ensure_capacity("b", 35)
    cm.commit("b", TOKS[:30] + OTHER[:5], 35)
    decode(cm, "a2", TOKS, 11)
    cm.reset_prefix_cache()
    out.append(("reset", dump(cm)))
    decode(cm, "a2", TOKS, 5)
    cm.commit_pending()
    out.append(("commit_pending", dump(cm)))
    for rid in ("a2", "b"):
        cm.free(rid)
    cm.check()
    out.append(("end", dump(cm)))
    return out, cm


def test_n1_registers_every_full_page_at_once():
    cm = make(1)
    assert cm.chain_lazy_steps == 1
    prefill(cm, "a", TOKS, 10)
    log = []
    decode(cm, "a", TOKS, 30, log)
    assert log == [(10 + i) // PS for i in range(1, 31)]  # the commit that fills a page registers it
    assert cm._reqs["a"].pending is None
    keys = []
    extend_keys(keys, root_key(), TOKS, 40 // PS, PS)
    assert [cm._prefix.get(k) for k in keys] == cm.pages("a")[:10]
    assert cm.stats().cached_pages == 10


@pytest.mark.parametrize("n", [3, 7])
def test_lazy_registers_on_every_nth_commit_and_matches_n1_where_read(n):
    cm = make(n)
    assert cm.chain_lazy_steps == n
    prefill(cm, "a", TOKS, 10)
    assert cm._reqs["a"].num_registered == 2  # prompt pages: at once
    log = []
    decode(cm, "a", TOKS, 30, log)
    for i, reg in enumerate(log):  # commit c = i + 2 (commit 1 was the prefill), length 10 + i + 1
        last_nth = (i + 2) // n * n  # the last N-th commit so far
        want = max(2, (10 + last_nth - 1) // PS) if last_nth >= 2 else 2
        assert reg == want, (i, reg, want)
    assert any(reg < (10 + i + 1) // PS for i, reg in enumerate(log))  # it did defer
    ref, _ = script(1)
    got, cm = script(n)
    assert [x[0] for x in got] == [x[0] for x in ref]
    for g, r in zip(got, ref):
        assert g == r, g[0]
    assert ref[5][1] == 28  # the follow-up hit a's decode-filled pages (7 of them)


def test_pending_registered_before_free_and_offload():
    for op in ("free", "offload"):
        cm = make(7)
        prefill(cm, "a", TOKS, 10)
        decode(cm, "a", TOKS, 10)
        r = cm._reqs["a"]
        assert r.pending is not None and r.num_registered < r.length // PS
        pages = cm.pages("a")[:r.length // PS]
        getattr(cm, op)("a")
        keys = []
        extend_keys(keys, root_key(), TOKS, 20 // PS, PS)
        assert [cm._prefix.get(k) for k in keys] == pages, op
        cm.check()


def test_hybrid_snapshots_are_handed_over_at_once():
    """A commit with snapshot slots to hand over registers at once: no snapshot slot is held
    longer than with N = 1 (decode rows take none)."""
    for n in (1, 5):
        cm = make(n, HYBRID_SPEC, num_snapshot_slots=6)
        snaps = prefill(cm, "a", TOKS, 6)
        assert snaps  # boundary 3
        assert cm.ensure_capacity("a", 13)
        snaps = cm.snapshot_slots("a", 6, 13, TOKS)
        assert [p for p, _ in snaps] == [7, 11]
        cm.commit("a", TOKS, 13)  # a 7-token chunk (commit 2: not an N-th) with two snapshots
        r = cm._reqs["a"]
        assert r.num_registered == 3 and not r.snaps and cm.stats().cached_snapshots == 3, n
        decode(cm, "a", TOKS, 4)
        cm.free("a")
        cm.check()
        assert cm.stats().cached_pages == 4 and cm.stats().cached_snapshots == 3


def test_knob_validated():
    k = {x.name: x for x in knobs.KNOBS}["MSTAR_KV_CHAIN_LAZY_STEPS"]
    assert k.parse("7") == 7
    with pytest.raises(knobs.KnobError):
        k.parse("0")


# --- the engine -------------------------------------------------------------------------------------
def _engine(kind, n, **opts):
    with knobs.override(MSTAR_KV_CHAIN_LAZY_STEPS=n):
        core = engine(kind, page_size=4, **opts)
    assert core.cm.chain_lazy_steps == n
    return core


def _spy_releases(core, seen):
    """After every free / offload of a request: each of its full pages (by the tokens its
    sequence holds) is in the prefix cache. seen: [(op, had pending)]."""
    cm = core.cm

    def wrap(name):
        orig = getattr(cm, name)

        def f(rid):
            r = cm._reqs.get(rid)
            seq = core._seqs.get(rid) or next((s for s in core.scheduler.running if s.request_id == rid), None)
            if r is None or r.host is not None:
                return orig(rid)
            full, pending, pages = r.length // PS, r.pending is not None, list(r.pages)
            toks = list(seq.token_ids) if seq is not None else None
            orig(rid)
            if toks is not None and cm._uses_prefix():
                keys = []
                extend_keys(keys, r.root, toks, full, PS)
                got = [cm._prefix.get(k) for k in keys]
                # (a page registered under a key another request had cached first is not cached twice)
                assert all(g is not None for g in got), (name, rid, got, pages[:full])
            seen.append((name, pending))
        setattr(cm, name, f)
    wrap("free")
    wrap("offload")


@pytest.mark.parametrize("kind", ["qwen3", "qwen3.5"])
def test_engine_tokens_and_follow_up_hits_equal_n1(kind):
    p = prompts(1, 13, 13, seed=40)[0]
    results = {}
    for n in (1, 3, 7):
        core = _engine(kind, n, max_num_seqs=4, decode_graphs="static")
        seen = []
        _spy_releases(core, seen)
        deferred = 0
        core.add_request(EngineRequest("a", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))
        out_a = []
        while core.has_unfinished():
            for o in core.step():
                out_a += o.new_token_ids
            r = core.cm._reqs.get("a")
            deferred += r is not None and r.pending is not None
        follow = p + out_a[:21] + [5, 6, 7]
        core.add_request(EngineRequest("b", follow, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
        out_b, cached = [], None
        while core.has_unfinished():
            for o in core.step():
                out_b += o.new_token_ids
                cached = o.num_cached_tokens
        results[n] = (out_a, out_b, cached, core.cm.stats().prefix_hit_tokens, core.cm.stats().cached_pages)
        assert (deferred > 0) == (n > 1), (n, deferred)
        assert seen and (any(pend for _, pend in seen) == (n > 1))
        assert_no_leaks(core)
    assert results[3] == results[1] and results[7] == results[1]
    out_a, out_b, cached, _, _ = results[1]
    assert out_a == hf_greedy(kind, p, 40)
    if kind == "qwen3":
        assert cached == 32  # 8 pages: the prompt's 3 and 5 that decode filled
    else:
        assert cached > 0  # a hybrid resumes only at a boundary with a GDN snapshot (prefill's)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3.5"])
@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_engine_preempted_requests_have_their_pages_registered(kind, mode):
    ps_ = prompts(6, 5, 14, seed=41)
    reqs = lambda: greedy_requests(ps_, lambda i: 30 + 3 * i)  # noqa: E731
    results = {}
    for n in (1, 3, 7):
        core = _engine(kind, n, max_num_seqs=6, num_pages=36, preemption_mode=mode, decode_graphs="static",
                       admit_min_free=0)
        seen = []
        _spy_releases(core, seen)
        for r in reqs():
            core.add_request(r)
        toks: dict[str, list[int]] = {}
        while core.has_unfinished():
            for o in core.step():
                toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        st = core.cm.stats()
        results[n] = (toks, st.prefix_hit_tokens)
        assert core.scheduler.num_preemptions > 0
        preempt_op = "offload" if mode == "offload" else "free"
        if n > 1:
            assert any(op == preempt_op and pend for op, pend in seen), seen  # a pending chain was released
        assert_no_leaks(core)
    assert results[3] == results[1] and results[7] == results[1]
    for i, p in enumerate(ps_):
        assert results[1][0][str(i)] == hf_greedy(kind, p, 30 + 3 * i)
