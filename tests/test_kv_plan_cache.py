"""MSTAR_KV_PLAN_CACHE (runtime/graphs/decode_plan_cache.py): decode page-table arrays advanced from
the previous step's instead of rebuilt.

Unit level: the advance equals a fresh decode_arrays call at and across page boundaries (page
sizes 1..16, with and without attention); anything that is not "the same rows, one token
longer, same stream generation" rebuilds; every cache-manager operation that touches a
stream other than by decode growth bumps the generation; mode 2 reports a corrupted array,
each of the five, by name. Engine level (decode_graphs="static" on CPU, and eager): long
decode runs with page-boundary crossings, preemption (recompute and offload), aborts and
prefix-cache hits give the tokens of knob 0 with knob 1 and 2, and mode 2 logs nothing.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from engine_helpers import assert_no_leaks, engine, hf_greedy, prompts
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar import knobs
from mstar.models.context import AttentionLayerSpec, CacheSpec
from mstar.runtime.caches.cache_manager import CacheManager, stream_generation
from mstar.runtime.graphs.decode_plan_cache import ARRAY_NAMES, DecodeArrayCache
from mstar.runtime.engine.request import EngineRequest, SamplingParams
from mstar.runtime.engine.step_inputs import StepRows, decode_arrays

KINDS = ["qwen3.5", "qwen3"]


def rows_of(lens, pages, slots=(), generation=0) -> StepRows:
    return StepRows(decode_tokens=[0] * len(lens), decode_lens=list(lens), decode_pages=[list(p) for p in pages],
                    decode_slots=list(slots), prefill_tokens=[], prefill_starts=[], prefill_ends=[],
                    prefill_pages=[], prefill_slots=[], prefill_samples=[], snapshots=[], generation=generation)


def same(got, ref) -> None:
    for name, a, b in zip(ARRAY_NAMES, got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (name, a, b)


class _Streams:
    """Decode rows growing one token a step, with fresh pages taken at page boundaries."""

    def __init__(self, n, ps, seed):
        self.rng = random.Random(seed)
        self.ps = ps
        self.next_page = 7
        self.lens = [self.rng.randint(1, 3 * ps + 2) for _ in range(n)]
        self.pages = [[self._page() for _ in range(-(-n_ // ps))] for n_ in self.lens]

    def _page(self):
        self.next_page += self.rng.randint(1, 5)  # page ids out of order with the rows
        return self.next_page

    def step(self):
        for i in range(len(self.lens)):
            self.lens[i] += 1
            while len(self.pages[i]) * self.ps < self.lens[i]:
                self.pages[i].append(self._page())


@pytest.mark.parametrize("ps", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("attn", [True, False])
def test_advance_matches_decode_arrays_across_page_boundaries(ps, attn):
    s = _Streams(9, ps, seed=ps)
    cache = DecodeArrayCache(ps, attn, mode=1)
    crossings = 0
    for _ in range(3 * ps + 5):
        s.step()
        rows = rows_of(s.lens, s.pages if attn else [], generation=3)
        crossings += sum(1 for n in s.lens if (n - 1) % ps == 0)
        same(cache.arrays(rows), decode_arrays(rows, ps, attn))
    assert crossings > 9  # every row crossed at least one boundary
    assert cache.num_rebuilt == 1 and cache.num_advanced == 3 * ps + 4


def test_advance_single_boundary_by_hand():
    """ps 4: row 0 at 4 tokens (page full) -> 5 opens page 30; row 1 at 2 -> 3 stays."""
    cache = DecodeArrayCache(4, True, mode=1)
    r1 = rows_of([4, 2], [[10], [20]])
    same(cache.arrays(r1), decode_arrays(r1, 4, True))
    r2 = rows_of([5, 3], [[10, 30], [20]])
    pos, indptr, indices, last, slot = cache.arrays(r2)
    assert cache.num_advanced == 1
    assert pos.tolist() == [4, 2] and indptr.tolist() == [0, 2, 3] and indices.tolist() == [10, 30, 20]
    assert last.tolist() == [1, 3] and slot.tolist() == [30 * 4 + 0, 20 * 4 + 2]
    same((pos, indptr, indices, last, slot), decode_arrays(r2, 4, True))


def test_rebuilds_when_the_rows_are_not_the_previous_rows_one_longer():
    ps = 4
    cache = DecodeArrayCache(ps, True, mode=1)
    pages = [[1, 2], [3], [4, 5, 6]]
    base = [6, 3, 10]
    cache.arrays(rows_of(base, pages, slots=[0, 1, 2]))
    cases = [
        rows_of([7, 4, 11], pages, slots=[0, 1, 2], generation=1),  # another generation
        rows_of([8, 4, 11], pages, slots=[0, 1, 2]),  # one row two tokens further
        rows_of([7, 4], pages[:2], slots=[0, 1]),  # a row left
        rows_of([7, 11, 4], [pages[0], pages[2], pages[1]], slots=[0, 2, 1]),  # rows reordered
        rows_of([7, 4, 11], pages, slots=[0, 1, 3]),  # another state slot
    ]
    for rows in cases:
        cache.arrays(rows_of(base, pages, slots=[0, 1, 2]))  # (rebuilds: each case changed the last step)
        n = cache.num_rebuilt
        same(cache.arrays(rows), decode_arrays(rows, ps, True))
        assert cache.num_rebuilt == n + 1, rows
    cache.arrays(rows_of(base, pages, slots=[0, 1, 2]))
    n = cache.num_advanced
    cache.arrays(rows_of([7, 4, 11], pages, slots=[0, 1, 2]))
    assert cache.num_advanced == n + 1
    cache.invalidate()
    cache.arrays(rows_of([8, 5, 12], [[1, 2], [3, 9], [4, 5, 6]], slots=[0, 1, 2]))
    assert cache.num_advanced == n + 1


@pytest.mark.parametrize("name", ARRAY_NAMES)
def test_mode2_reports_a_corrupted_advanced_array(name, caplog, monkeypatch):
    s = _Streams(5, 4, seed=3)
    cache = DecodeArrayCache(4, True, mode=2)
    s.step()
    cache.arrays(rows_of(s.lens, s.pages))
    advance = cache._advance
    k = ARRAY_NAMES.index(name)

    def corrupt(prev, rows):
        out = list(advance(prev, rows))
        out[k] = out[k].copy()
        out[k][-1] += 1  # the last entry: the offsets' (indptr) end, a page, a position ...
        return tuple(out)
    monkeypatch.setattr(cache, "_advance", corrupt)
    s.step()
    rows = rows_of(s.lens, s.pages)
    with caplog.at_level(logging.WARNING, logger="mstar.runtime"):
        got = cache.arrays(rows)
    same(got, decode_arrays(rows, 4, True))  # mode 2 uses the rebuilt arrays
    msgs = [r for r in caplog.records if "MSTAR_KV_PLAN_CACHE" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].name == "mstar.runtime" and msgs[0].levelno == logging.WARNING
    assert f"advanced {name} differs" in msgs[0].getMessage()
    assert cache.num_differences == 1


def test_mode2_reports_shape_differences_and_a_missed_page(caplog):
    """A stale page list (a page replaced without a generation bump) is seen by mode 2."""
    cache = DecodeArrayCache(4, True, mode=2)
    cache.arrays(rows_of([5, 2], [[1, 2], [3]]))
    with caplog.at_level(logging.WARNING, logger="mstar.runtime"):
        got = cache.arrays(rows_of([6, 3], [[1, 9], [3]]))  # page 2 became 9: same generation
    assert got[2].tolist() == [1, 9, 3]
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "advanced kv_indices differs" in text and "advanced kv_slot differs" in text
    caplog.clear()
    monkey = DecodeArrayCache(4, True, mode=2)
    monkey.arrays(rows_of([5, 2], [[1, 2], [3]]))
    monkey._prev = (monkey._prev[0], monkey._prev[1], monkey._prev[2][:-1], *monkey._prev[3:])
    with caplog.at_level(logging.WARNING, logger="mstar.runtime"):
        monkey.arrays(rows_of([6, 3], [[1, 2], [3]]))
    assert any("kv_indices differs from the rebuilt one (shape" in r.getMessage() for r in caplog.records)


def test_from_knobs():
    assert DecodeArrayCache.from_knobs(4, True) is None
    for mode in (1, 2):
        with knobs.override(MSTAR_KV_PLAN_CACHE=mode):
            assert DecodeArrayCache.from_knobs(4, True).mode == mode
    with pytest.raises(knobs.KnobError):
        knobs.KNOBS[[k.name for k in knobs.KNOBS].index("MSTAR_KV_PLAN_CACHE")].parse("3")


# --- the cache manager's stream generation ----------------------------------------------------------
KV_SPEC = CacheSpec(attention=(AttentionLayerSpec(2, 4),))


def _cm(**kw):
    return CacheManager(KV_SPEC, num_pages=32, page_size=4, num_slots=4, dtype=torch.float32, device="cpu", **kw)


def _decode(cm, rid, toks):
    """One decode step of rid: its newest token's KV."""
    n = cm.length(rid) + 1
    assert cm.ensure_capacity(rid, n)
    cm.commit(rid, toks, n)


def test_stream_generation_bumps_on_every_stream_change_but_not_on_decode_growth():
    cm = _cm()
    toks = list(range(1, 40))
    g = stream_generation()
    assert cm.admit("a", toks[:9]) == 0  # reset (a new stream)
    assert stream_generation() > g
    assert cm.ensure_capacity("a", 9)
    g = stream_generation()
    cm.commit("a", toks, 9)
    for _ in range(8):  # decode growth, across page boundaries
        _decode(cm, "a", toks)
    assert stream_generation() == g

    def bumps(fn):
        g0 = stream_generation()
        fn()
        return stream_generation() > g0
    assert bumps(lambda: cm.fork("a", "b"))  # fork
    assert bumps(lambda: cm.ensure_capacity("b", cm.length("b") + 1))  # copy-on-write of the shared last page
    assert bumps(lambda: cm.rollback("a", 3))  # rollback
    assert bumps(lambda: cm.offload("a"))  # offload
    assert bumps(lambda: cm.reload("a"))  # reload
    assert bumps(lambda: cm.free("b"))  # remove / release
    assert bumps(cm.reset_prefix_cache)  # reset
    g = stream_generation()
    cm.free("nope")  # unknown ids are ignored
    assert stream_generation() == g


def test_reload_with_other_pages_rebuilds_and_would_be_caught_by_mode2(caplog):
    """offload + reload gives a request other pages with the next length one further: only the
    generation tells the cache; had it been missed, mode 2 would report the indices."""
    cm = _cm(enable_prefix_cache=False)
    toks = list(range(1, 40))
    rid = "a"
    cm.admit(rid, toks[:6])
    cm.ensure_capacity("a", 6)
    cm.commit("a", toks, 6)
    filler = "f"
    cm.admit(filler, toks[:2])

    def rows():
        return rows_of([cm.length(rid) + 1], [cm.pages(rid)], generation=stream_generation())

    cache = DecodeArrayCache(4, True, mode=2)
    cm.ensure_capacity(rid, 7)
    r = rows()
    cache.arrays(r)
    cm.commit(rid, toks, 7)
    old_pages = cm.pages(rid)
    cm.offload(rid)
    cm.ensure_capacity(filler, 12)  # takes the freed pages: the reload gets others
    assert cm.reload(rid)
    cm.ensure_capacity(rid, 8)
    assert cm.pages(rid) != old_pages
    r2 = rows()
    n = cache.num_rebuilt
    with caplog.at_level(logging.WARNING, logger="mstar.runtime"):
        same(cache.arrays(r2), decode_arrays(r2, 4, True))
        assert cache.num_rebuilt == n + 1 and cache.num_differences == 0
        # the same step claiming the old generation: mode 2 sees the stale pages
        cache.arrays(r)
        r2.generation = r.generation
        cache.arrays(r2)
    assert cache.num_differences >= 1
    assert any("advanced kv_indices differs" in x.getMessage() for x in caplog.records)


def test_another_request_in_a_finished_ones_place_rebuilds(caplog):
    """Rows [a, b]; b finishes and c (reloaded, one token longer than b was) decodes in its
    place: nothing but the generation tells (no state slots: an attention-only model)."""
    cm = _cm(enable_prefix_cache=False)
    toks = list(range(1, 60))
    for rid, n in (("a", 6), ("b", 9), ("c", 9)):
        cm.admit(rid, toks[:n])
        cm.ensure_capacity(rid, n)
        cm.commit(rid, toks, n)
    cm.offload("c")
    cache = DecodeArrayCache(4, True, mode=2)
    for rid in ("a", "b"):
        cm.ensure_capacity(rid, cm.length(rid) + 1)
    r1 = rows_of([7, 10], [cm.pages("a"), cm.pages("b")], generation=stream_generation())
    cache.arrays(r1)
    cm.commit("a", toks, 7)
    cm.commit("b", toks, 10)
    cm.free("b")
    cm.admit("f", toks[:2])
    cm.ensure_capacity("f", 12)  # takes b's pages: c comes back in others
    assert cm.reload("c")
    cm.commit("c", toks, 10)
    for rid in ("a", "c"):
        cm.ensure_capacity(rid, cm.length(rid) + 1)
    r2 = rows_of([8, 11], [cm.pages("a"), cm.pages("c")], generation=stream_generation())
    assert r2.generation != r1.generation and cm.pages("c")[:3] != r1.decode_pages[1][:3]
    n = cache.num_rebuilt
    with caplog.at_level(logging.WARNING, logger="mstar.runtime"):
        same(cache.arrays(r2), decode_arrays(r2, 4, True))
        assert cache.num_rebuilt == n + 1 and cache.num_differences == 0
        cache.arrays(r1)
        r2.generation = r1.generation  # had free / reload not bumped it
        cache.arrays(r2)
    assert cache.num_differences >= 1
    assert any("advanced kv_indices differs" in x.getMessage() for x in caplog.records)


# --- the engine -------------------------------------------------------------------------------------
def _scenario(kind, mode, *, graphs="static", **opts):
    """Long decode runs: shared prompt prefixes (prefix hits), outputs of 20..70 tokens at page
    size 4 (many boundary crossings), late arrivals, an abort mid-run, and a pool small enough
    to preempt. {id: tokens}, the core."""
    rng = random.Random(7)
    prefix = prompts(1, 12, 12, seed=70)[0]
    ps_ = prompts(10, 3, 20, seed=71)
    ps_ = [(prefix + p) if i % 2 else p for i, p in enumerate(ps_)]
    # GDN snapshots at every page: the hybrid model hits the shared prefix too
    with knobs.override(MSTAR_KV_PLAN_CACHE=mode, MSTAR_GDN_SNAPSHOTS="page"):
        core = engine(kind, page_size=4, max_num_seqs=8, max_graph_batch=8, decode_graphs=graphs,
                      admit_min_free=0, **opts)
    toks: dict[str, list[int]] = {}

    def add(i):
        core.add_request(EngineRequest(str(i), ps_[i], SamplingParams(max_tokens=rng.randint(20, 70),
                                                                       temperature=0.0, ignore_eos=True)))
        toks[str(i)] = []

    def step():
        for o in core.step():
            toks[o.request_id] += o.new_token_ids

    for i in range(6):
        add(i)
    for _ in range(12):
        step()
    core.abort(["2"])
    for i in range(6, 10):
        for _ in range(5):
            step()
        add(i)
    while core.has_unfinished():
        step()
    return toks, core


def _cache(core):
    return core.graphs._plan_cache if core.graphs is not None else core.inputs._plan_cache


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preemption", ["recompute", "offload"])
def test_engine_tokens_equal_knob0_and_mode2_logs_nothing(kind, preemption, caplog):
    opts = dict(num_pages=48, preemption_mode=preemption)
    ref, core0 = _scenario(kind, 0, **opts)
    assert core0.graphs._plan_cache is None and core0.inputs._plan_cache is None  # knob 0: no cache at all
    assert core0.scheduler.num_preemptions > 0 and core0.cm.stats().prefix_hit_tokens > 0
    got1, core1 = _scenario(kind, 1, **opts)
    assert got1 == ref
    c1 = _cache(core1)
    assert c1.mode == 1 and c1.num_advanced > 50 and c1.num_rebuilt > 5
    assert core1.scheduler.num_preemptions > 0 and core1.cm.stats().prefix_hit_tokens > 0
    with caplog.at_level(logging.WARNING, logger="mstar.runtime"):
        got2, core2 = _scenario(kind, 2, **opts)
    assert got2 == ref
    c2 = _cache(core2)
    assert c2.mode == 2 and c2.num_advanced > 50 and c2.num_differences == 0
    assert not [r for r in caplog.records if "MSTAR_KV_PLAN_CACHE" in r.getMessage()]
    for c in (core0, core1, core2):
        assert_no_leaks(c)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_eager_decode_and_overlap_with_plan_cache(kind, caplog):
    """The eager step builder uses the cache too (decode rows of decode-only and mixed steps);
    overlapped decode chains graph steps through it. Tokens equal knob 0's and HF's."""
    ref, _ = _scenario(kind, 0, graphs="off")
    # (overlapped outputs come a step later: the abort mid-run cuts "2" elsewhere)
    ref_ov, _ = _scenario(kind, 0, async_output=True)
    with caplog.at_level(logging.WARNING, logger="mstar.runtime"):
        for mode in (1, 2):
            got, core = _scenario(kind, mode, graphs="off")
            assert got == ref
            c = core.inputs._plan_cache
            assert core.graphs is None and c.num_advanced > 50 and c.num_differences == 0
            assert_no_leaks(core)
            got, core = _scenario(kind, mode, async_output=True)
            assert core.overlap is not None and core.overlap.num_chained > 0
            assert got == ref_ov and _cache(core).num_advanced > 50 and _cache(core).num_differences == 0
            assert_no_leaks(core)
    assert not [r for r in caplog.records if "MSTAR_KV_PLAN_CACHE" in r.getMessage()]
    p = prompts(1, 9, 9, seed=5)[0]
    with knobs.override(MSTAR_KV_PLAN_CACHE=1):
        core = engine(kind, page_size=4, max_num_seqs=4, decode_graphs="static")
    core.add_request(EngineRequest("x", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))
    out = []
    while core.has_unfinished():
        for o in core.step():
            out += o.new_token_ids
    assert out == hf_greedy(kind, p, 40)
    assert core.graphs._plan_cache.num_advanced == 38  # every decode step after the first
