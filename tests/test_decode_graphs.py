"""The graph-replayed decode path (runtime/graphs/cuda_graphs.py) on CPU: mode "static" runs the
graphs' fixed buffers, padding rows and page-table refresh without capturing. Its tokens
must equal the eager path's and HF's, for batches that fill a captured size exactly, need
padding, cross page boundaries and shrink as requests finish; the padding rows must not
touch any request's pages or state slots.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import NoHostSync, assert_no_leaks, engine, greedy_requests, hf_greedy, prompts, run_all
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar.models.shape_graphs import padded_sizes as capture_sizes
from mstar.runtime.engine.request import EngineRequest, SamplingParams

KINDS = ["qwen3.5", "qwen3"]


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256]
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16]


def test_padded_batch_is_the_smallest_padded_size_that_fits():
    from mstar.models.shape_graphs import padded_batch
    for top in (1, 2, 5, 20, 33, 64):
        sizes = capture_sizes(top)
        assert [padded_batch(r, top) for r in range(1, top + 1)] == [min(s for s in sizes if s >= r)
                                                                     for r in range(1, top + 1)]
    assert padded_batch(3) == 4 and padded_batch(9) == 16 and padded_batch(2) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_static_graph_decode_matches_eager_and_hf(kind):
    ps = prompts(11, 3, 40, seed=31)
    # different max_tokens: the batch shrinks through several captured sizes
    reqs = lambda: greedy_requests(ps, lambda i: 12 + 2 * i)  # noqa: E731
    core = engine(kind, page_size=4, max_num_seqs=16, max_graph_batch=16, decode_graphs="static")
    assert core.graphs is not None and core.graphs.sizes == [1, 2, 4, 8, 16]
    calls = []
    run = core.graphs.run
    core.graphs.run = lambda rows: calls.append(len(rows.decode_tokens)) or run(rows)
    got = run_all(core, reqs())
    assert calls and max(calls) == 11 and min(calls) == 1  # padded 11 -> 16, ..., down to 1
    eager = run_all(engine(kind, page_size=4, max_num_seqs=16, decode_graphs="off"), reqs())
    assert got == eager
    for i, p in enumerate(ps):
        assert got[str(i)][0] == hf_greedy(kind, p, 12 + 2 * i)
    assert_no_leaks(core)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_rows_touch_only_the_padding_page_and_slot(kind):
    core = engine(kind, page_size=4, max_num_seqs=8, decode_graphs="static")
    cm = core.cm
    assert cm.pad_page == cm.num_pages
    caches = cm.caches
    # 3 rows run at batch 4: one padding row per decode step
    for i, p in enumerate(prompts(3, 5, 9, seed=2)):
        core.add_request(EngineRequest(str(i), p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    core.step()  # prefill (eager)
    before = [t.clone() for t in (*caches.k_caches, *caches.v_caches, *caches.conv_states, *caches.recurrent_states)]
    core.step()  # one decode step through the graph path, padded 3 -> 4
    used_pages = {pg for r in ("0", "1", "2") for pg in cm.pages(r)}  # (with the pages this step took)
    used_slots = {cm.slot(r) for r in ("0", "1", "2")} if core.has_state else set()
    after = (*caches.k_caches, *caches.v_caches, *caches.conv_states, *caches.recurrent_states)
    n_kv = 2 * len(caches.k_caches)
    for j, (b, a) in enumerate(zip(before, after)):
        changed = (b != a).flatten(1).any(1).nonzero().flatten().tolist()
        if j < n_kv:
            assert set(changed) <= used_pages | {cm.pad_page}, changed
            assert cm.pad_page in changed  # the padding row wrote its K/V there
        else:
            assert set(changed) <= used_slots | {cm.pad_slot}, changed
    while core.has_unfinished():
        core.step()
    assert_no_leaks(core)


def test_graphs_off_on_cpu_by_default_and_config_checked():
    core = engine("qwen3.5", max_num_seqs=4)
    assert core.graphs is None and core.cm.pad_page is None and core.overlap is None
    # async_output "auto" (the default) overlaps only captured graphs: not "static" ones
    assert engine("qwen3.5", max_num_seqs=4, decode_graphs="static").overlap is None
    assert engine("qwen3.5", max_num_seqs=4, decode_graphs="static", async_output="on").overlap is not None
    from mstar.runtime.engine.config import EngineConfig
    assert EngineConfig(async_output=True).async_output == "on"
    assert EngineConfig(async_output=False).async_output == "off"
    with pytest.raises(ValueError, match="async_output"):
        EngineConfig(async_output="sometimes")
    with pytest.raises(ValueError, match="decode_graphs"):
        EngineConfig(decode_graphs="sometimes")
    with pytest.raises(ValueError, match="max_graph_batch"):
        EngineConfig(max_graph_batch=0)


def test_larger_batches_than_captured_run_eagerly():
    core = engine("qwen3", page_size=4, max_num_seqs=8, max_graph_batch=2, decode_graphs="static")
    assert core.graphs.sizes == [1, 2]
    ps = prompts(5, 3, 12, seed=5)
    got = run_all(core, greedy_requests(ps, 5))
    for i, p in enumerate(ps):
        assert got[str(i)][0] == hf_greedy("qwen3", p, 5)
    assert_no_leaks(core)


@pytest.mark.parametrize("mode", ["on", "decode"])
@pytest.mark.filterwarnings("error:.*must not also be an input to this custom operator")  # an op returned a view
def test_compiled_forward_with_static_graph_path_matches_hf(mode):
    """torch.compile (Inductor on CPU here) over the mstar ops: decode steps through the
    graph runner's fixed buffers; prefill and mixed steps through the compiled forward
    ("on") or the eager one ("decode")."""
    ps = prompts(5, 3, 30, seed=8)
    core = engine("qwen3.5", page_size=4, max_num_seqs=8, decode_graphs="static", compile=mode, admit_min_free=0)
    got = run_all(core, greedy_requests(ps, lambda i: 8 + i))
    for i, p in enumerate(ps):
        assert got[str(i)][0] == hf_greedy("qwen3.5", p, 8 + i)
    compiled = core._graph_forward
    assert compiled.compile_s > 0
    if mode == "on":
        assert core.forward is compiled and len(compiled._kinds) >= 2
    else:
        assert core.forward == core.model.forward and compiled._kinds == {(True, False)}  # decode only
    assert_no_leaks(core)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("kind", ["qwen3.5-gpu", "qwen3-gpu"])  # the presets' head shapes: cached kernels
@pytest.mark.parametrize("compile", ["off", "decode", "on"])
def test_cuda_graph_decode_matches_eager(kind, compile):
    from engine_helpers import model_dir
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    ps = prompts(13, 3, 60, seed=3)
    reqs = lambda: greedy_requests(ps, 24)  # noqa: E731
    opts = dict(model=model_dir(kind), device="cuda", dtype="bfloat16", page_size=16, max_num_seqs=16,
                max_model_len=256)
    g = EngineCore(EngineConfig(compile=compile, **opts))
    assert g.graphs is not None and g.graphs.graphs, "graphs were not captured"
    got = run_all(g, reqs())
    ref = run_all(EngineCore(EngineConfig(decode_graphs="off", compile=compile, **opts)), reqs())
    # the same kernels on the same inputs, replayed: equal tokens
    assert got == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("knob_set", [dict(MSTAR_INGRAPH_DECODE_TOKENS=True),
                                      dict(MSTAR_INGRAPH_DECODE_TOKENS=True, MSTAR_INGRAPH_DECODE_ROPE=True),
                                      dict(MSTAR_KV_PLAN_CACHE=2), dict(MSTAR_KV_PINNED_INDPTRS=True),
                                      dict(MSTAR_KV_CHAIN_LAZY_STEPS=4)], ids=lambda k: "+".join(k))
def test_cuda_graph_decode_knobs_match_eager(knob_set, caplog):
    """The decode-step knobs (notes/decode-knobs.md) under real capture (overlapped decode on: the default with
    graphs): tokens equal the eager knobs-off engine's; plan cache mode 2 logs no difference."""
    from engine_helpers import model_dir
    from mstar import knobs
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    ps = prompts(13, 3, 60, seed=5)
    reqs = lambda: greedy_requests(ps, 40)  # noqa: E731
    opts = dict(model=model_dir("qwen3.5-gpu"), device="cuda", dtype="bfloat16", page_size=16, max_num_seqs=8,
                max_model_len=256)
    ref = run_all(EngineCore(EngineConfig(decode_graphs="off", **opts)), reqs())
    with knobs.override(**knob_set):
        g = EngineCore(EngineConfig(**opts))
        assert g.graphs is not None and g.graphs.graphs and g.overlap is not None
        got = run_all(g, reqs())
    assert got == ref
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "plan" in r.getMessage().lower()]


def test_admission_batching_groups_prefills_and_keeps_tokens():
    """admit_min_free: while decodes run, waiting requests are admitted once enough rows are
    free (or after admit_max_wait held steps); tokens equal those of admitting at once."""
    ps = prompts(12, 3, 20, seed=4)
    reqs = lambda: greedy_requests(ps, lambda i: 4 + (i % 4) * 3)  # noqa: E731

    def run(**kw):
        core = engine("qwen3.5", page_size=4, max_num_seqs=4, decode_graphs="static", **kw)
        admitted, mixed = [], 0
        sched = core.scheduler.schedule

        def spy():
            nonlocal mixed
            out = sched()
            if out.admitted:
                admitted.append(len(out.admitted))
            mixed += bool(out.decode and out.prefill)
            return out
        core.scheduler.schedule = spy
        got = run_all(core, reqs())
        assert_no_leaks(core)
        return got, admitted, mixed

    eager, adm0, mixed0 = run(admit_min_free=0)
    batched, adm2, mixed2 = run(admit_min_free=3)
    assert batched == eager
    assert max(adm2[1:]) >= 3 and mixed2 < mixed0, (adm0, adm2, mixed0, mixed2)
    core = engine("qwen3.5", page_size=4, max_num_seqs=4, decode_graphs="static")
    assert core.scheduler.admit_min_free == 1  # default: max_num_seqs // 4 with decode graphs
    assert engine("qwen3.5", max_num_seqs=8).scheduler.admit_min_free == 0  # eager engines admit at once


def test_admission_batching_waits_at_most_admit_max_wait_steps():
    core = engine("qwen3", page_size=4, max_num_seqs=8, decode_graphs="static", admit_min_free=8, admit_max_wait=3)
    assert core.scheduler.admit_max_wait == 3
    for i, p in enumerate(prompts(8, 3, 6, seed=9)):
        core.add_request(EngineRequest(str(i), p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
    core.step()
    core.add_request(EngineRequest("late", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0,
                                                                    ignore_eos=True)))
    core.abort(["0"])  # one row frees: 1 < the batch (min(8, 8 requests / 4) = 2), so "late" is held back...
    waits = 0
    while core.scheduler.waiting:
        core.step()
        waits += 1
    assert waits == 4  # ...for admit_max_wait (3) held steps, admitted on the 4th
    while core.has_unfinished():
        core.step()
    assert_no_leaks(core)


def test_admission_batch_is_a_quarter_of_the_requests_at_most():
    """A burst at low concurrency is admitted at once: the batch waited for is admit_min_free
    or a quarter of the requests in the engine, whichever is smaller."""
    core = engine("qwen3", page_size=4, max_num_seqs=16, decode_graphs="static", admit_min_free=8)
    for i, p in enumerate(prompts(4, 3, 6, seed=9)):
        core.add_request(EngineRequest(str(i), p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
    core.step()
    for i, p in enumerate(prompts(2, 3, 6, seed=10)):  # 2 waiting of 6 requests: the batch is min(8, 2) = 2
        core.add_request(EngineRequest(f"late{i}", p, SamplingParams(max_tokens=3, temperature=0.0,
                                                                    ignore_eos=True)))
    sched, seen = core.scheduler.schedule, []
    core.scheduler.schedule = lambda: seen.append(sched()) or seen[-1]
    core.step()
    core.scheduler.schedule = sched
    assert [s.request_id for s in seen[0].admitted] == ["late0", "late1"] and len(seen[0].decode) == 4
    core.add_request(EngineRequest("late2", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0,
                                                                     ignore_eos=True)))
    out = core.scheduler.schedule()  # 1 waiting < min(8, 7 / 4 -> 2): held
    assert not out.admitted and core.scheduler.waiting


@pytest.mark.parametrize("kind", KINDS)
def test_overlapped_decode_matches_synchronous(kind):
    """async_output: decode step k is launched before step k-1 is read back (device
    loop-back of the tokens); outputs arrive a step later with the same tokens, stop
    tokens found late drop the chained step's token, aborts in flight leak nothing."""
    ps = prompts(10, 3, 30, seed=12)
    ref_core = engine(kind, page_size=4, max_num_seqs=6, decode_graphs="static")
    ref = run_all(ref_core, greedy_requests(ps, lambda i: 10 + i))
    # stop on a token the reference produced mid-way (found only after the next step launched)
    stop_tok = ref["3"][0][4]
    params = lambda i: SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True,  # noqa: E731
                                      stop_token_ids=[stop_tok] if i == 3 else [])
    want = run_all(engine(kind, page_size=4, max_num_seqs=6, decode_graphs="static"),
                   [EngineRequest(str(i), p, params(i)) for i, p in enumerate(ps)])
    core = engine(kind, page_size=4, max_num_seqs=6, decode_graphs="static", async_output=True, admit_min_free=2)
    assert core.overlap is not None
    got = run_all(core, [EngineRequest(str(i), p, params(i)) for i, p in enumerate(ps)])
    assert got == want
    assert got["3"][1] == "stop" and got["3"][0][-1] == stop_tok
    assert core.overlap.num_chained >= core.num_steps // 3, (core.overlap.num_chained, core.num_steps)
    assert_no_leaks(core)
    # abort while a step is in flight; then a prefix-cache hit on pages committed late
    core.add_request(EngineRequest("a", ps[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
    core.add_request(EngineRequest("b", ps[1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    for _ in range(4):
        core.step()
    assert core.overlap.inflight is not None
    core.abort(["a"])
    rest = {}
    while core.has_unfinished():
        for o in core.step():
            rest.setdefault(o.request_id, []).append(o.finish_reason)
    assert rest["a"][-1] == "abort" and rest["b"][-1] == "length"
    # "a"'s pages were committed after their tokens were read back: a later request hits them
    hits = core.cm.stats().prefix_hit_tokens
    c = ps[0] + ref["0"][0][:8]
    again = run_all(core, [EngineRequest("c", c, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))])
    assert again["c"][0] == hf_greedy(kind, c, 6)
    assert core.cm.stats().prefix_hit_tokens > hits
    assert_no_leaks(core)


def _sampled_params(i: int, **kw) -> SamplingParams:
    """A mix of sampled (and greedy-with-penalty) requests, one kind per i % 8, seed per i."""
    kinds = [dict(temperature=0.9),
             dict(temperature=1.1, top_p=0.8),
             dict(temperature=0.8, top_k=5),
             dict(temperature=1.0, min_p=0.2),
             dict(temperature=0.0, repetition_penalty=1.8),
             dict(temperature=1.2, top_k=40, top_p=0.9, presence_penalty=1.5),
             dict(temperature=0.7, frequency_penalty=0.9, repetition_penalty=1.3),
             dict(temperature=1.0, top_p=0.95, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.5)]
    return SamplingParams(max_tokens=kw.pop("max_tokens", 14 + i % 5), seed=1000 + 7 * i, ignore_eos=True,
                          **kinds[i % len(kinds)], **kw)


def _guard_launch(core) -> list[int]:
    """Run the overlap's device sampling of non-greedy steps under NoHostSync; returns a counter."""
    ov, calls = core.overlap, [0]
    sample = ov._sample

    def guarded(*a):
        calls[0] += 1
        with NoHostSync("a host read of a tensor during the overlapped launch"):
            return sample(*a)
    ov._sample = guarded
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_overlapped_decode_sampled_rows_match_synchronous(kind):
    """Sampled rows (temperature, top-k, top-p, min-p, the three penalties, each its own seed)
    take overlapped decode too: the tokens equal the synchronous engine's, steps are chained, the
    launch reads nothing back; a stop token found late and an abort in flight as for greedy rows."""
    ps = prompts(9, 3, 24, seed=17)
    mk = lambda: [EngineRequest(str(i), p, _sampled_params(i)) for i, p in enumerate(ps)]  # noqa: E731
    opts = dict(page_size=4, max_num_seqs=6, decode_graphs="static", admit_min_free=2)
    sync = engine(kind, async_output=False, **opts)
    want = run_all(sync, mk())
    assert sync.overlap is None
    core = engine(kind, async_output=True, **opts)
    calls = _guard_launch(core)
    got = run_all(core, mk())
    assert got == want
    assert core.overlap.num_chained > 0 and calls[0] > core.overlap.num_chained // 2, (core.overlap.num_chained,
                                                                                       calls)
    assert_no_leaks(core)
    # a stop token drawn mid-way (found after the next step launched), and a row aborted in flight
    stop_tok = want["5"][0][6]
    mk2 = lambda: [EngineRequest(str(i), p, _sampled_params(i, stop_token_ids=[stop_tok] if i == 5 else []))  # noqa: E731
                   for i, p in enumerate(ps[:6])]
    want2 = run_all(sync, mk2())
    assert want2["5"][1] == "stop"
    chained = core.overlap.num_chained
    got2 = run_all(core, mk2())
    assert got2 == want2 and core.overlap.num_chained > chained
    core.add_request(EngineRequest("a", ps[0], _sampled_params(1, max_tokens=40)))
    core.add_request(EngineRequest("b", ps[1], _sampled_params(6, max_tokens=12)))
    for _ in range(4):
        core.step()
    assert core.overlap.inflight is not None
    core.abort(["a"])
    while core.has_unfinished():
        core.step()
    # a penalty request after the aborted one took its row: its counts start from zero
    again = run_all(core, [EngineRequest("c", ps[2], _sampled_params(6))])
    assert again["c"] == run_all(sync, [EngineRequest("c", ps[2], _sampled_params(6))])["c"]
    assert_no_leaks(core)


def test_overlapped_decode_sampled_rows_tokens_depend_on_the_bookkeeping():
    """The comparison above can fail: with the device steps counting each token twice for the
    penalties, or drawing with the next step's noise, the tokens differ from the synchronous ones."""
    ps = prompts(4, 3, 12, seed=23)
    kinds = [dict(temperature=0.0, frequency_penalty=0.4), dict(temperature=0.8, frequency_penalty=0.4, seed=3),
             dict(temperature=0.0, presence_penalty=0.8), dict(temperature=1.0, top_p=0.9, seed=4)]
    mk = lambda: [EngineRequest(str(i), p, SamplingParams(max_tokens=24, ignore_eos=True, **kinds[i]))  # noqa: E731
                  for i, p in enumerate(ps)]
    opts = dict(page_size=4, max_num_seqs=4, decode_graphs="static")
    want = run_all(engine("qwen3", async_output=False, **opts), mk())
    core = engine("qwen3", async_output=True, **opts)
    s = core.sampler
    dev = s.sample_device

    def count_twice(logits, rows, steps, max_finite=None, col_ids=None):
        tokens = dev(logits, rows, steps, max_finite, col_ids)
        s._count(s._gather(rows, steps), tokens)
        return tokens
    s.sample_device = count_twice
    assert run_all(core, mk()) != want
    s.sample_device = lambda logits, rows, steps, max_finite=None, col_ids=None: dev(
        logits, rows, [t + 1 for t in steps], max_finite, col_ids)
    assert run_all(core, mk()) != want
    del s.sample_device
    assert run_all(core, mk()) == want and core.overlap.num_chained > 0


def test_overlapped_decode_falls_back_for_logprobs_and_min_tokens():
    """Rows asking for logprobs, or whose stop ids are masked until min_tokens, run synchronously."""
    ps = prompts(3, 3, 10, seed=13)
    opts = dict(page_size=4, max_num_seqs=4, decode_graphs="static")
    for extra in (dict(logprobs=2), dict(min_tokens=8, stop_token_ids=[7])):
        mk = lambda: [EngineRequest(str(i), p, _sampled_params(i, max_tokens=8, **extra))  # noqa: E731
                      for i, p in enumerate(ps)]
        core = engine("qwen3.5", async_output=True, **opts)
        got = run_all(core, mk())
        assert core.overlap.num_chained == 0 and core.overlap.inflight is None, extra
        assert got == run_all(engine("qwen3.5", async_output=False, **opts), mk())
    # one logprob row among sampled ones keeps the whole step synchronous
    mk = lambda: [EngineRequest(str(i), p, _sampled_params(i, max_tokens=8, logprobs=1 if i == 1 else None))  # noqa: E731
                  for i, p in enumerate(ps)]
    core = engine("qwen3.5", async_output=True, **opts)
    run_all(core, mk())
    assert core.overlap.num_chained == 0


def test_overlapped_decode_constrained_family_matches_synchronous():
    """A family whose hooks constrain the logits (Orpheus: a mask per frame position) with its
    default sampling (temperature, top-p, repetition penalty) over a 156940-id vocabulary: the
    overlapped engine's tokens equal the synchronous one's, with chained steps."""
    pytest.importorskip("snac")
    from mstar.models import interfaces as I
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore

    def speech(rid, text, seed, n):
        return EngineRequest(rid, [], None, media=I.MediaRequest(rid, {"text": text, "voice": "tara",
                                                                        "max_new_tokens": n}, seed))
    mk = lambda: [speech("a", "One.", 5, 30), speech("b", "Two, and more.", 6, 23),  # noqa: E731
                  speech("c", "Three.", 7, 26)]
    opts = dict(model="tiny-orpheus", dtype="float32", device="cpu", max_num_seqs=4, decode_graphs="static")
    sync = EngineCore(EngineConfig(async_output=False, **opts))
    assert sync.overlap is None and sync._constrain
    want = run_all(sync, mk())
    core = EngineCore(EngineConfig(async_output=True, **opts))
    calls = _guard_launch(core)
    got = run_all(core, mk())
    assert got == want and [len(want[r][0]) for r in "abc"] == [30, 23, 26]
    assert core.overlap.num_chained > 0 and calls[0] > 0
    assert len(core.output_stage) == 0
    assert_no_leaks(core)
    # the head over the family's logit_ids alone (audio codes, end of speech): the same tokens as
    # the whole head (and so the whole-vocabulary sampling, not the candidate columns), synchronous
    # and overlapped
    ids = sync.hooks.logit_ids
    assert ids is not None and len(ids) == 7 * 4096 + 1 and bool((ids[1:] > ids[:-1]).all())
    for eng in (EngineCore(EngineConfig(async_output=False, **opts)), EngineCore(EngineConfig(async_output=True,
                                                                                             **opts))):
        eng._logit_ids, eng._candidates = None, False
        assert run_all(eng, mk()) == want


def test_compute_logits_of_keeps_the_ids_columns():
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    core = EngineCore(EngineConfig(model="tiny-qwen3", dtype="float32", device="cpu", max_num_seqs=2))
    m = core.model
    g = torch.Generator().manual_seed(3)
    h = torch.randn(3, m.config.hidden_size, generator=g)
    ids = torch.randperm(m.config.vocab_size, generator=g)[:37].sort().values
    full, sub = m.compute_logits(h), m.compute_logits_of(h, ids)
    assert sub.dtype == torch.float32 and sub.shape == full.shape
    assert torch.allclose(sub[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    rest = torch.ones(full.shape[1], dtype=torch.bool)
    rest[ids] = False
    assert bool(torch.isneginf(sub[:, rest]).all())
    assert m.compute_logits_of(h, ids) is not sub and m._head_rows[0] is ids  # rows copied once per ids


def test_overlap_takes_incomplete_plans_up_to_the_reference_row_limit():
    """Rows decided on the candidate stage (top-p, top-k: a plan the host cannot call complete,
    ties or mass may lie beyond the candidates) overlap while at most MAX_DEVICE_REFERENCE_ROWS of
    them share a step; greedy rows do not count; a larger batch samples synchronously."""
    from mstar.runtime.engine import sampler as S
    sm = S.Sampler(16, 50000, "cpu")  # a vocabulary beyond the candidate stage: top-p plans are incomplete
    topp = [sm.add(SamplingParams(temperature=0.8, top_p=0.9), i, [], []) for i in range(S.MAX_DEVICE_REFERENCE_ROWS + 1)]
    greedy = sm.add(SamplingParams(temperature=0.0), 99, [], [])
    topk = sm.add(SamplingParams(temperature=0.8, top_k=5), 98, [], [])
    n = S.MAX_DEVICE_REFERENCE_ROWS
    assert sm.on_device(topp[:n - 1] + [greedy, topk]) and sm.on_device([greedy] * 12)
    assert not sm.on_device(topp) and not sm.on_device(topp[:n] + [topk])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_cuda_graph_decode_whisper_matches_eager():
    """Whisper: self-attention and cross-attention plans per captured batch size."""
    from mstar.models.whisper.tokens import WhisperTokens
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    from whisper_helpers import clip
    tok = WhisperTokens.from_vocab_size(51865)
    prompt = tok.decoder_prompt("en", "transcribe")
    reqs = lambda: [EngineRequest(str(i), prompt, SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0),  # noqa: E731
                                  encoder_input=clip(2.0 + 3 * i, 200.0 + 50 * i, seed=i)) for i in range(5)]
    opts = dict(model="whisper-tiny", random_weights=True, device="cuda", dtype="bfloat16", max_num_seqs=8)
    g = EngineCore(EngineConfig(**opts))
    assert g.graphs is not None and g.graphs.graphs and g.graphs.cross_plans
    assert run_all(g, reqs()) == run_all(EngineCore(EngineConfig(decode_graphs="off", **opts)), reqs())
