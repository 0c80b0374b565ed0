"""The engine gate: CPU, fp32, tiny random Qwen3.5 (hybrid GDN) and Qwen3 (dense)
written by transformers with save_pretrained and loaded by path.

HF references run per prompt alone (no padding), greedy, 32 new tokens, eos ignored.
"""

from __future__ import annotations

import random

import pytest

from mstar import knobs

from engine_helpers import EOS, assert_no_leaks, engine, hf_greedy, llm, prompts, run_all
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar.runtime.engine.request import EngineRequest, SamplingParams

KINDS = ["qwen3.5", "qwen3"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

# one pool of prompts of different lengths (2..60 tokens); N=8 and N=1 use its head, so each
# HF reference is computed once
POOL = prompts(32, 2, 60, seed=7)


def _greedy_reqs(ps, tag=""):
    return [EngineRequest(f"{tag}{i}", p, GREEDY) for i, p in enumerate(ps)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 8, 32])
def test_greedy_matches_hf(kind, n):
    core = engine(kind, page_size=16, max_num_batched_tokens=96, max_num_seqs=32)
    got = run_all(core, _greedy_reqs(POOL[:n]))
    for i, p in enumerate(POOL[:n]):
        toks, fin = got[str(i)]
        assert fin == "length"
        assert toks == hf_greedy(kind, p), f"prompt {i} (len {len(p)}) differs from HF at N={n}"
    assert_no_leaks(core)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_composition_does_not_change_tokens(kind):
    """The same request alone, in a small batch, and among many others with tiny budgets."""
    target = POOL[5]
    ref = hf_greedy(kind, target)
    for n_others, budget, ps in ((0, 2048, 16), (3, 7, 4), (20, 33, 8)):
        core = engine(kind, page_size=ps, max_num_batched_tokens=budget, max_num_seqs=32)
        others = POOL[6:6 + n_others]
        reqs = _greedy_reqs(others, "o") + [EngineRequest("t", target, GREEDY)]
        random.Random(n_others).shuffle(reqs)
        got = run_all(core, reqs)
        assert got["t"][0] == ref, (n_others, budget, ps)


@pytest.mark.parametrize("kind", KINDS)
def test_fixed_8(kind):
    core = engine(kind, page_size=16, max_num_seqs=16)
    ps = prompts(24, 1, 40, seed=11)
    got = run_all(core, [EngineRequest(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True, seed=i))
                         for i, p in enumerate(ps)])
    for i in range(len(ps)):
        toks, fin = got[str(i)]
        assert len(toks) == 8 and fin == "length"
    assert_no_leaks(core)


def test_stop_string_spanning_tokens():
    """Byte tokenizer: every character is its own token, so any stop string of 2+ characters
    spans tokens. The output ends exactly before the first occurrence."""
    m = llm("qwen3.5", page_size=16)
    outs = m.generate(POOL[:16], GREEDY)
    # a run of printable ASCII tokens in some output, used as the stop string
    for o in outs:
        ids = o.token_ids
        for s in range(2, len(ids) - 3):
            if all(32 <= t < 127 for t in ids[s:s + 3]):
                stop = bytes(ids[s:s + 3]).decode()
                break
        else:
            continue
        break
    else:
        pytest.fail("no 3-token printable run in the greedy outputs: pick other prompts")
    full = o.text
    assert stop in full
    cut = full.index(stop)
    idx = outs.index(o)
    for include in (False, True):
        p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop, "\x00never\x00"],
                           include_stop_str_in_output=include)
        (r,) = m.generate([POOL[idx]], p)
        assert r.finish_reason == "stop" and r.stop_reason == stop
        assert r.text == (full[:cut + len(stop)] if include else full[:cut])
        # generation stopped right after the token that completed the stop string
        assert r.token_ids == o.token_ids[:len(r.token_ids)]
        assert len(r.token_ids) <= s + 3
    assert_no_leaks(m.engine)


@pytest.mark.parametrize("kind", KINDS)
def test_long_prompts_many_chunks_and_pages(kind):
    long_ps = prompts(3, 150, 260, seed=3)
    core = engine(kind, page_size=8, max_num_batched_tokens=24, max_num_seqs=8)
    reqs = _greedy_reqs(long_ps, "L") + _greedy_reqs(POOL[:3], "s")
    got = run_all(core, reqs)
    for i, p in enumerate(long_ps):
        assert got[f"L{i}"][0] == hf_greedy(kind, p)
    for i, p in enumerate(POOL[:3]):
        assert got[f"s{i}"][0] == hf_greedy(kind, p)
    assert core.num_steps > sum(len(p) for p in long_ps) // 24
    assert_no_leaks(core)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("snapshots", ["page", "chunk-end"])
def test_prefix_hit_matches_miss(kind, page_size, snapshots):
    """Shared prefixes of 2-6 pages (16: boundaries 32, 48... mid-way in the 64-token GDN
    chunk; 5: every boundary unaligned); later requests hit; tokens equal HF's. With
    chunk-end snapshots the hybrid model hits only at the chunk ends that kept one."""
    with knobs.override(MSTAR_GDN_SNAPSHOTS=snapshots):
        _prefix_hit_matches_miss(kind, page_size, every_hit=snapshots == "page" or kind == "qwen3")


def _prefix_hit_matches_miss(kind, page_size, every_hit):
    rng = random.Random(page_size)
    base = [rng.randrange(320) for _ in range(100)]
    ps = [base[:70] + [rng.randrange(320) for _ in range(k)] for k in (1, 9, 30)]
    ps += [base[:37] + [rng.randrange(320) for _ in range(5)], base[:70]]
    ps += [base[:3 * page_size + 1]]  # all but the last token cached: it runs as a decode row
    core = engine(kind, page_size=page_size, max_num_batched_tokens=40, max_num_seqs=8)
    first = run_all(core, [EngineRequest("first", base, GREEDY)])
    assert first["first"][0] == hf_greedy(kind, base)
    s0 = core.cm.stats()
    got = run_all(core, _greedy_reqs(ps, "h"))
    s1 = core.cm.stats()
    assert s1.prefix_hit_tokens > s0.prefix_hit_tokens
    for i, p in enumerate(ps):
        assert got[f"h{i}"][0] == hf_greedy(kind, p), f"prompt {i} after a prefix hit"
    # every later request hit at least one page
    if every_hit:
        assert s1.prefix_hit_queries - s0.prefix_hit_queries == len(ps)
    assert core.stats()["prefix_hit_rate"] > 0
    assert_no_leaks(core)


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_hit_reported_in_outputs(kind):
    m = llm(kind, page_size=16)
    p = POOL[10] + POOL[11] + POOL[12]
    (a,) = m.generate([p], GREEDY)
    (b,) = m.generate([p], GREEDY)
    assert a.token_ids == b.token_ids
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == ((len(p) - 1) // 16) * 16 > 0


@pytest.mark.parametrize("mode, num_pages, total", [("recompute", 300, 300), ("offload", 70, 150)])
def test_abort_storm(mode, num_pages, total):
    """Hundreds of requests, random aborts at random moments while the others run (and, with
    a small pool, are preempted); survivors are correct and nothing leaks."""
    kind = "qwen3.5"
    rng = random.Random(0)
    core = engine(kind, page_size=4, max_num_batched_tokens=64, max_num_seqs=24, num_pages=num_pages,
                  preemption_mode=mode)
    start = core.cm.stats()
    ps = prompts(total, 1, 30, seed=99)
    survivors = set(rng.sample(range(total), 12))
    params = {}
    for i in range(total):
        params[i] = GREEDY if i in survivors else SamplingParams(
            max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 1.0]), seed=i, ignore_eos=True)
    pending = list(range(total))
    live: set[int] = set()
    toks: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    aborted_ids: set[str] = set()
    steps = 0
    while pending or core.has_unfinished():
        for _ in range(rng.randint(0, 12)):
            if pending:
                i = pending.pop(0)
                core.add_request(EngineRequest(str(i), ps[i], params[i]))
                live.add(i)
        if steps % 2 == 0:
            cands = [i for i in live if i not in survivors]
            k = min(len(cands), rng.randint(0, 6))
            ab = [str(i) for i in rng.sample(cands, k)]
            core.abort(ab + ["no-such-request"])
            aborted_ids.update(ab)
            live.difference_update(int(a) for a in ab)
        for o in core.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.request_id not in finished, "two final outputs"
                finished[o.request_id] = o.finish_reason
                live.discard(int(o.request_id))
        steps += 1
        assert steps < 5000
    assert len(finished) == total
    for a in aborted_ids:
        assert finished[a] in ("abort", "length", "stop")
    assert sum(1 for v in finished.values() if v == "abort") > total // 3
    if mode == "offload":
        assert core.scheduler.num_preemptions > 0
    for i in survivors:
        assert toks[str(i)] == hf_greedy(kind, ps[i]), f"survivor {i}"
    assert core.cm.stats().total_pages == start.total_pages
    assert_no_leaks(core)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode,graphs", [("recompute", {}), ("offload", {}),
                                         ("recompute", {"decode_graphs": "static", "async_output": True}),
                                         ("offload", {"decode_graphs": "static", "async_output": True})])
def test_preemption_same_tokens(kind, mode, graphs):
    """A pool far too small for the batch: sequences are preempted (recomputed or offloaded
    and reloaded) and still produce HF's tokens; also through the decode-graph path with
    overlapped decode (a step in flight is read back before any preemption)."""
    ps = POOL[:10]
    core = engine(kind, page_size=4, num_pages=60, max_num_batched_tokens=64, max_num_seqs=10,
                  preemption_mode=mode, **graphs)
    got = run_all(core, _greedy_reqs(ps))
    assert core.scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        assert got[str(i)][0] == hf_greedy(kind, p), f"prompt {i} ({mode})"
    assert_no_leaks(core)


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_sampling_alone_vs_batch(kind):
    p = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=4242,
                       ignore_eos=True)
    target = POOL[3]
    alone = run_all(engine(kind, page_size=16), [EngineRequest("t", target, p)])["t"][0]
    rng = random.Random(5)
    others = [EngineRequest(f"o{i}", q, SamplingParams(max_tokens=rng.randint(1, 30), temperature=1.2,
                                                         top_p=0.7, ignore_eos=True))
              for i, q in enumerate(POOL[6:20])]
    core = engine(kind, page_size=4, max_num_batched_tokens=20, max_num_seqs=8)
    batch = run_all(core, others[:7] + [EngineRequest("t", target, p)] + others[7:])
    assert batch["t"][0] == alone
    # same seed twice in one batch: the same tokens; another seed: different ones
    core2 = engine(kind, page_size=16)
    q = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    r = run_all(core2, [EngineRequest("a", target, q), EngineRequest("b", target, q),
                        EngineRequest("c", target, SamplingParams(max_tokens=24, temperature=1.0, seed=8,
                                                                  ignore_eos=True))])
    assert r["a"][0] == r["b"][0] != r["c"][0]


def test_eos_stops_unless_ignored():
    """Force an eos as the greedy token through a stop id: the same path eos takes."""
    kind = "qwen3"
    p = POOL[0]
    ref = hf_greedy(kind, p)
    core = engine(kind, page_size=16)
    r = run_all(core, [EngineRequest("e", p, SamplingParams(max_tokens=32, temperature=0.0),
                                     eos_token_ids=(ref[3],))])
    assert r["e"] == (ref[:4], "stop")
    r = run_all(core, [EngineRequest("f", p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                                     eos_token_ids=(ref[3],))])
    assert r["f"] == (ref, "length")
    assert EOS in core.eos_token_ids


@pytest.mark.parametrize("kind", KINDS)
def test_without_prefix_caching(kind):
    core = engine(kind, page_size=16, enable_prefix_caching=False, max_num_batched_tokens=32)
    ps = [POOL[4], POOL[4], POOL[4] + POOL[5]]
    got = run_all(core, _greedy_reqs(ps))
    for i, p in enumerate(ps):
        assert got[str(i)][0] == hf_greedy(kind, p)
    assert core.cm.stats().prefix_hit_tokens == 0 and core.cm.stats().cached_pages == 0
    assert_no_leaks(core)
