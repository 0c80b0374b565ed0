"""In-graph decode inputs (MSTAR_INGRAPH_DECODE_TOKENS, MSTAR_INGRAPH_DECODE_ROPE;
runtime/graphs/decode_masters.py) on CPU through the static decode-graph path: the graphs gather
each row's input token (and position) from per-request device masters that the sampler
(or overlapped decode's launch) writes, instead of the host staging them.

Tokens must equal the knobs-off engine's and HF's, through overlapped decode, preemption
(recompute and offload), aborts, prefix-cache hits and mixed greedy / sampled batches; what
the graph gathered must be what the host would have staged; master slots never leak; a
request past the masters' capacity fails naming it; off, nothing new runs.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_no_leaks, engine, hf_greedy, prompts, run_all
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar import knobs
from mstar.runtime.graphs.decode_masters import DecodeMasters, MasterCapacityError
from mstar.runtime.graphs.decode_overlap import PLACEHOLDER
from mstar.runtime.engine.request import EngineRequest, SamplingParams

KINDS = ["qwen3.5", "qwen3"]


def on_engine(kind, rope=True, **opts):
    """An engine built with the knobs on (they are read once, at build)."""
    with knobs.override(MSTAR_INGRAPH_DECODE_TOKENS=True, MSTAR_INGRAPH_DECODE_ROPE=rope):
        core = engine(kind, **opts)
    assert core.masters is not None and core.graphs.masters is core.masters
    assert core.sampler.masters is core.masters
    assert (core.masters.positions is not None) == rope
    return core


def assert_masters_free(core) -> None:
    m = core.masters
    m.check()
    assert m.num_free == m.capacity and m.num_assigned == 0


class GraphInputSpy:
    """Wraps graphs.run: after each graph step, what the graph read (gathered ids and, with
    ROPE, positions) must be what the host would have staged; row 0 of the staged buffer
    holds the rows' master slots."""

    def __init__(self, core):
        self.core = core
        self.graphs = g = core.graphs
        self.steps = self.checked_tokens = 0
        self.deferred: list[tuple[str, int, int]] = []  # (request id, token index, gathered id)
        run = g.run

        def spy(rows, loopback=None, slots=None):
            assert loopback is None and slots is not None  # no loop-back copy with the masters
            out = run(rows, loopback=loopback, slots=slots)
            d = len(rows.decode_tokens)
            assert g._dev[0, :d].tolist() == slots
            ids = g._ids[:d].tolist()
            rid_of = {v: k for k, v in core.masters._slot_of.items()}
            for want, got, slot, n in zip(rows.decode_tokens, ids, slots, rows.decode_lens):
                if want != PLACEHOLDER:
                    assert got == want
                    self.checked_tokens += 1
                else:  # a chained step's input: known once read back (verify())
                    self.deferred.append((rid_of[slot], n - 1, got))
            if g._rope:
                assert g._pos[:d].tolist() == [n - 1 for n in rows.decode_lens]
                # advanced on the device: the next step's position; the padding slot stays 0
                assert core.masters.positions[slots].tolist() == list(rows.decode_lens)
                assert core.masters.positions[core.masters.pad].item() == 0
            self.steps += 1
            return out

        g.run = spy

    def verify(self, prompts_by_id: dict, got: dict) -> None:
        """The chained steps' gathered ids against the tokens read back later."""
        for rid, idx, tok in self.deferred:
            full = list(prompts_by_id[rid]) + got[rid][0]
            assert full[idx] == tok, (rid, idx)
            self.checked_tokens += 1


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("rope", [False, True])
def test_ingraph_matches_knobs_off_and_hf(kind, overlap, rope):
    ps = prompts(9, 3, 30, seed=31)
    want = run_all(engine(kind, page_size=4, max_num_seqs=8, decode_graphs="static"),
                   [EngineRequest(str(i), p, greedy(10 + 2 * i)) for i, p in enumerate(ps)])
    # request 3 stops on a token it produces mid-way (with overlap: found after the next step launched)
    stop_tok = want["3"][0][4]
    mk = lambda: [EngineRequest(str(i), p, greedy(10 + 2 * i, stop_token_ids=[stop_tok] if i == 3 else []))  # noqa: E731
                  for i, p in enumerate(ps)]
    off = run_all(engine(kind, page_size=4, max_num_seqs=8, decode_graphs="static", async_output=overlap,
                         admit_min_free=2), mk())
    core = on_engine(kind, rope, page_size=4, max_num_seqs=8, decode_graphs="static", async_output=overlap,
                     admit_min_free=2)
    spy = GraphInputSpy(core)
    got = run_all(core, mk())
    assert got == off
    assert got["3"][1] == "stop" and got["3"][0][-1] == stop_tok
    for i, p in enumerate(ps):
        if i != 3:
            assert got[str(i)][0] == hf_greedy(kind, p, 10 + 2 * i)
    spy.verify({str(i): p for i, p in enumerate(ps)}, got)
    assert spy.steps > 10 and spy.checked_tokens > 60
    if overlap == "on":
        assert core.overlap.num_chained > 0 and spy.deferred
    assert_no_leaks(core)
    assert_masters_free(core)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["recompute", "offload"])
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_ingraph_preemption(kind, mode, overlap):
    """A pool far too small: rows are preempted (slots given back) and re-admitted (a fresh slot,
    rewritten from the host: a reloaded row decodes at once from it)."""
    ps = prompts(10, 2, 50, seed=7)
    mk = lambda: [EngineRequest(str(i), p, greedy(32)) for i, p in enumerate(ps)]  # noqa: E731
    opts = dict(page_size=4, num_pages=60, max_num_batched_tokens=64, max_num_seqs=10, preemption_mode=mode,
                decode_graphs="static", async_output=overlap)
    core = on_engine(kind, True, **opts)
    spy = GraphInputSpy(core)
    reloaded = 0
    sched = core.scheduler.schedule

    def count_reloads():
        nonlocal reloaded
        out = sched()
        reloaded += sum(1 for s in out.admitted if s in out.decode)
        return out
    core.scheduler.schedule = count_reloads
    got = run_all(core, mk())
    spy.verify({str(i): p for i, p in enumerate(ps)}, got)
    assert core.scheduler.num_preemptions > 0 and spy.steps > 0
    if mode == "offload":
        assert reloaded > 0  # re-admitted straight into decode: its inputs came from the admission write
    for i, p in enumerate(ps):
        assert got[str(i)][0] == hf_greedy(kind, p, 32), f"prompt {i}"
    assert got == run_all(engine(kind, **opts), mk())
    assert_no_leaks(core)
    assert_masters_free(core)


def _abort_and_prefix_script(core, ps, ref0):
    """Aborts mid-run (with overlap: while a step is in flight), then a prefix-cache hit."""
    out = {}
    for i, p in enumerate(ps[:4]):
        core.add_request(EngineRequest(str(i), p, greedy(30 if i < 2 else 12)))
    for _ in range(5):
        for o in core.step():
            out.setdefault(o.request_id, []).append((o.new_token_ids, o.finish_reason))
    core.abort(["0", "2"])
    core.add_request(EngineRequest("late", ps[4], greedy(9)))
    for _ in range(3):
        for o in core.step():
            out.setdefault(o.request_id, []).append((o.new_token_ids, o.finish_reason))
    core.abort(["late"])
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).append((o.new_token_ids, o.finish_reason))
    hits = core.cm.stats().prefix_hit_tokens
    c = ps[0] + ref0[:8]
    again = run_all(core, [EngineRequest("c", c, greedy(6))])
    assert core.cm.stats().prefix_hit_tokens > hits
    return out, again, c


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_ingraph_aborts_and_prefix_hits(kind, overlap):
    ps = prompts(5, 6, 30, seed=12)
    ref0 = hf_greedy(kind, ps[0], 30)
    opts = dict(page_size=4, max_num_seqs=6, decode_graphs="static", async_output=overlap, admit_min_free=0)
    core = on_engine(kind, True, **opts)
    GraphInputSpy(core)
    got, again, c = _abort_and_prefix_script(core, ps, ref0)
    want, want_again, _ = _abort_and_prefix_script(engine(kind, **opts), ps, ref0)
    assert got == want and again == want_again
    assert again["c"][0] == hf_greedy(kind, c, 6)
    assert got["0"][-1][1] == "abort" and got["1"][-1][1] == "length"
    assert_no_leaks(core)
    assert_masters_free(core)


@pytest.mark.parametrize("kind", KINDS)
def test_ingraph_mixed_greedy_and_sampled_rows(kind):
    """Sampled, penalised and logprob rows beside greedy ones (the sampler's scatter; with
    overlap on, the greedy-only steps chain); one seeded request alone and in the batch."""
    ps = prompts(7, 3, 25, seed=5)

    def params(i):
        if i % 3 == 0:
            return SamplingParams(max_tokens=14, temperature=0.9, top_k=40, top_p=0.9, seed=100 + i, ignore_eos=True)
        if i == 4:
            return SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, logprobs=2,
                                  ignore_eos=True)
        return greedy(12 + i)
    mk = lambda: [EngineRequest(str(i), p, params(i)) for i, p in enumerate(ps)]  # noqa: E731
    opts = dict(page_size=4, max_num_seqs=8, decode_graphs="static", async_output="on")
    core = on_engine(kind, True, **opts)
    spy = GraphInputSpy(core)
    got = run_all(core, mk())
    assert got == run_all(engine(kind, **opts), mk())
    spy.verify({str(i): p for i, p in enumerate(ps)}, got)
    assert spy.steps > 0
    assert_no_leaks(core)
    assert_masters_free(core)
    # batch-vs-alone (fp32, CPU): the same request gives the same tokens
    for i in (0, 1):
        alone = run_all(on_engine(kind, True, **opts), [EngineRequest(str(i), ps[i], params(i))])
        assert alone[str(i)] == got[str(i)]


def test_master_capacity_error_and_slots():
    m = DecodeMasters(2, "cpu", positions=True)
    assert m.pad == 2 and m.tokens.shape == (3,) and m.positions.shape == (3,)
    a, b = m.assign("a"), m.assign("b")
    assert {a, b} == {0, 1} and m.assign("a") == a and m.num_free == 0
    with pytest.raises(MasterCapacityError, match=r"MSTAR_INGRAPH_DECODE_TOKENS.*capacity of 2"):
        m.assign("c")
    m.release("a")
    m.release("a")  # twice: nothing
    assert m.assign("c") == a
    m.check()
    m.write([a, b], [7, 8], [3, 4])
    assert m.tokens.tolist() == [7, 8, 0] and m.positions.tolist() == [3, 4, 0]
    m.scatter_tokens(torch.tensor([b]), torch.tensor([9], dtype=torch.int32))
    ids, pos, nxt = (torch.zeros(3, dtype=torch.int64) for _ in range(3))
    m.read_inputs(torch.tensor([b, a, m.pad]), ids, pos, nxt)
    assert ids.tolist() == [9, 7, 0] and pos.tolist() == [4, 3, 0]
    assert m.positions.tolist() == [4, 5, 0]  # advanced; the padding slot back to 0
    with pytest.raises(ValueError, match="capacity"):
        DecodeMasters(0, "cpu", positions=False)


def test_request_past_capacity_fails_naming_it():
    core = on_engine("qwen3", True, page_size=4, max_num_seqs=2, decode_graphs="static")
    core.scheduler.max_num_seqs = 3  # a scheduler admitting past the masters' capacity
    for i, p in enumerate(prompts(3, 3, 6, seed=1)):
        core.add_request(EngineRequest(str(i), p, greedy(4)))
    with pytest.raises(MasterCapacityError, match=r"all 2 are held.*capacity of 2 slots"):
        core.step()


def test_rope_without_tokens_fails_at_build():
    with knobs.override(MSTAR_INGRAPH_DECODE_ROPE=True):
        with pytest.raises(knobs.KnobError, match="MSTAR_INGRAPH_DECODE_ROPE=1 needs MSTAR_INGRAPH_DECODE_TOKENS=1"):
            engine("qwen3", max_num_seqs=2, decode_graphs="static")


def test_knobs_off_calls_nothing_new(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("decode masters used with the knobs off")
    for name in ("__init__", "assign", "release", "write", "scatter_tokens", "read_inputs", "slots_of"):
        monkeypatch.setattr(DecodeMasters, name, boom)
    ps = prompts(4, 3, 12, seed=3)
    core = engine("qwen3.5", page_size=4, max_num_seqs=4, decode_graphs="static", async_output="on")
    assert core.masters is None and core.sampler.masters is None and core.graphs.masters is None
    assert core.overlap._masters is None and core.graphs._ids is None and not core.graphs._rope
    staged = []
    run = core.graphs.run

    def spy(rows, loopback=None):  # the knobs-off call signature: no slots
        out = run(rows, loopback=loopback)
        d = len(rows.decode_tokens)
        staged.append((core.graphs._dev[0, :d].tolist(), rows.decode_tokens, loopback is not None))
        return out
    core.graphs.run = spy
    got = run_all(core, [EngineRequest(str(i), p, greedy(8)) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert got[str(i)][0] == hf_greedy("qwen3.5", p, 8)
    assert any(lb for _, _, lb in staged)  # chained steps used the loop-back copy
    for dev, toks, lb in staged:
        if not lb:
            assert dev == toks  # token ids staged, not slots
    assert_no_leaks(core)


def test_knob_without_effect_where_nothing_reads_the_masters():
    from mstar.models.whisper.model import WhisperForConditionalGeneration
    assert WhisperForConditionalGeneration.reads_device_loopback is False  # reads its tokens as staged
    with knobs.override(MSTAR_INGRAPH_DECODE_TOKENS=True, MSTAR_INGRAPH_DECODE_ROPE=True):
        eager = engine("qwen3", max_num_seqs=2, decode_graphs="off")
    assert eager.masters is None and eager.sampler.masters is None


def test_ingraph_with_compiled_decode_forward():
    """compile="decode": the gathers run before the compiled forward (both inside what a CUDA
    graph would capture); the compiled forward sees the gathered buffers."""
    ps = prompts(4, 3, 30, seed=8)
    core = on_engine("qwen3.5", True, page_size=4, max_num_seqs=8, decode_graphs="static", compile="decode",
                     admit_min_free=0, async_output="on")
    spy = GraphInputSpy(core)
    got = run_all(core, [EngineRequest(str(i), p, greedy(8 + i)) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert got[str(i)][0] == hf_greedy("qwen3.5", p, 8 + i)
    spy.verify({str(i): p for i, p in enumerate(ps)}, got)
    assert core._graph_forward._kinds == {(True, False)} and spy.steps > 0
    assert_no_leaks(core)
    assert_masters_free(core)


def test_sampler_scatters_only_with_masters():
    from mstar.runtime.engine.sampler import Sampler
    V = 64
    s = Sampler(4, V, "cpu")
    rows = [s.add(SamplingParams(temperature=0.0), 0, [1], []),
            s.add(SamplingParams(temperature=0.8, top_k=20, seed=3), 3, [1], []),
            s.add(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.2), 5, [1, 2], [])]
    lg = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    ref = s.sample(lg.clone(), rows, [0, 0, 0], slots=[3, 1, 0])  # no masters: slots ignored
    assert s.masters is None
    m = DecodeMasters(4, "cpu", positions=False)
    s2 = Sampler(4, V, "cpu")
    rows2 = [s2.add(SamplingParams(temperature=0.0), 0, [1], []),
             s2.add(SamplingParams(temperature=0.8, top_k=20, seed=3), 3, [1], []),
             s2.add(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.2), 5, [1, 2], [])]
    s2.masters = m
    got = s2.sample(lg.clone(), rows2, [0, 0, 0], slots=[3, 1, 0])
    assert got.tokens == ref.tokens and got.logprobs == ref.logprobs
    assert m.tokens[[3, 1, 0]].tolist() == ref.tokens and m.tokens[2].item() == 0
    greedy_only = s2.sample(lg[:1].clone(), rows2[:1], [1], slots=[2])  # the argmax-only path
    assert m.tokens[2].item() == greedy_only.tokens[0]
