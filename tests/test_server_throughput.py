"""The server's streaming path at load, with the synthetic engine (no model): every token reaches
its client exactly once and in order at c=32 (through the benchmark's own client, which also
counts multi-token chunks right), and the engine sends one message per step, not one per token.
Plus the pieces of the fast path, each checked against the plain computation it replaces."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import pytest
from server_harness import ServerProc

from mstar.bench import serve as bench
from mstar.runtime.engine.synthetic_engine import synthetic_token

MODEL = "qwen3.5-0.8b"  # a preset without a tokenizer: token ids only, as in the headline benchmark
C = 32
OUT = 48
ROUNDS = 2


@pytest.fixture(scope="module")
def server():
    old = os.environ.get("SYNTH_STEPS_PER_S")
    os.environ["SYNTH_STEPS_PER_S"] = "1000"
    try:
        s = ServerProc("--model", MODEL, "--engine-factory", "mstar.runtime.engine.synthetic_engine:SyntheticEngine",
                       "--max-num-seqs", str(C))
    finally:
        if old is None:
            os.environ.pop("SYNTH_STEPS_PER_S", None)
        else:
            os.environ["SYNTH_STEPS_PER_S"] = old
    yield s
    s.close()


class _Ids(bench._Tally):
    """The benchmark's tally, keeping every chunk's token ids and the raw events too."""

    def __init__(self):
        super().__init__(True)
        self.ids: list[int] = []
        self.events: list = []

    def line(self, line: str) -> None:
        if line.startswith("data:"):
            data = line[5:].strip()
            self.events.append(data if data == "[DONE]" else json.loads(data))
            if data != "[DONE]":
                for ch in self.events[-1].get("choices") or []:
                    self.ids.extend(ch.get("token_ids") or [])
        super().line(line)


def _stat(m: dict, name: str) -> float:
    return m.get(f'mstar_engine_stat{{name="{name}"}}', 0.0)


def _metrics_when(server, pred, timeout=15.0) -> dict:
    deadline = time.monotonic() + timeout
    m = server.metrics()
    while not pred(m) and time.monotonic() < deadline:
        time.sleep(0.1)
        m = server.metrics()
    return m


def test_every_token_once_in_order_and_one_message_per_step(server):
    vocab = server.get("/v1/models").json()["data"][0]["vocab_size"]
    m0 = server.metrics()
    prompts = bench.random_prompts(C * ROUNDS, 16, vocab, seed=7)
    tallies = [_Ids() for _ in prompts]

    def payload(p):
        return {"model": MODEL, "prompt": p, "max_tokens": OUT, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}

    _, res = asyncio.run(bench.closed_loop_raw(server.url, len(prompts), C, lambda box, cl, i: bench._one_request_raw(
        box, cl, "/v1/completions", payload(prompts[i]), {}, True, 60.0, tallies[i])))
    for p, t, r in zip(prompts, tallies, res):
        assert r.ok, r.error
        assert t.ids == [synthetic_token(p, i, vocab) for i in range(OUT)]  # each once, in order
        assert r.output_tokens == OUT and len(r.itls) == OUT - 1
        assert t.events[-1] == "[DONE]"
        assert t.events[-2]["choices"] == [] and t.events[-2]["usage"]["completion_tokens"] == OUT
        last = t.events[-3]["choices"][0]
        assert last["finish_reason"] == "length" and last["token_ids"]
        assert all(e["choices"][0]["finish_reason"] is None for e in t.events[:-3])
        assert r.chunks == len(t.events) - 2  # every other event carried tokens
    total = len(prompts) * OUT

    m = _metrics_when(server, lambda m: _stat(m, "num_generated_tokens") - _stat(m0, "num_generated_tokens")
                      >= total and m.get("mstar_num_requests_running") == 0)
    steps = _stat(m, "num_steps") - _stat(m0, "num_steps")
    messages = _stat(m, "engine_output_messages") - _stat(m0, "engine_output_messages")
    records = _stat(m, "engine_output_records") - _stat(m0, "engine_output_records")
    assert m["mstar_generation_tokens_total"] - m0.get("mstar_generation_tokens_total", 0) == total
    assert records == total  # one CoreOutput per token here (one token per request per step)
    # the outputs of a step travel together: about one message per step (a few more carry only
    # stats or errors), never one per request
    assert steps >= OUT * ROUNDS
    assert messages <= steps + 20, (messages, steps)
    assert records / messages > C / 4, (records, messages)
    server.wait_idle()


def test_httpx_and_raw_clients_agree(server):
    """The lean client and httpx read the same stream the same way (tokens, chunks, usage)."""
    vocab = server.get("/v1/models").json()["data"][0]["vocab_size"]
    (p,) = bench.random_prompts(1, 8, vocab, seed=3)
    body = {"model": MODEL, "prompt": p, "max_tokens": 20, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    import httpx

    async def both():
        a, b = _Ids(), _Ids()
        async with httpx.AsyncClient(timeout=30) as cl:
            ra = await bench._one_request(cl, server.url + "/v1/completions", body, {}, True, a)
        rb = await bench._one_request_raw([None], bench.RawClient(server.url), "/v1/completions", body, {}, True,
                                          30.0, b)
        return ra, rb, a, b

    ra, rb, a, b = asyncio.run(both())
    assert ra.ok and rb.ok and ra.output_tokens == rb.output_tokens == 20
    assert a.ids == b.ids == [synthetic_token(p, i, vocab) for i in range(20)]

    async def bad():
        return await bench._one_request_raw([None], bench.RawClient(server.url), "/v1/completions",
                                            dict(body, model="nope"), {}, True, 30.0)

    r = asyncio.run(bad())
    assert not r.ok and r.error.startswith("HTTP 404")


def test_tally_counts_coalesced_chunks():
    t = bench._Tally(True)
    for ids in ([1], [2, 3, 4], [5]):
        t.line("data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": ids,
                                                   "finish_reason": None}]}))
    t.line("data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 5}}))
    t.line("data: [DONE]")
    r = t.result()
    assert r.ok and r.output_tokens == 5 and r.chunks == 3 and len(r.itls) == 4


# -- the fast path's pieces against what they replace -------------------------------------------

def test_chunk_events_equal_sse_event():
    from mstar.runtime.serving.api_sse import ChunkEvents, sse_event
    base = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": 'm"\u00e9'}
    enc = ChunkEvents(base)
    for c in ({"index": 0, "text": "a\u00e9\n\"\\", "logprobs": None, "finish_reason": None, "token_ids": [1, 2]},
              {"index": 3, "delta": {}, "logprobs": {"content": []}, "finish_reason": "stop", "stop_reason": None}):
        assert enc.event(c) == sse_event(dict(base, choices=[c]))
        assert enc.event(c, None) == sse_event(dict(base, choices=[c], usage=None))
        u = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        assert enc.event(c, u) == sse_event(dict(base, choices=[c], usage=u))


def test_observe_many_equals_observe():
    from prometheus_client import CollectorRegistry, Histogram

    from mstar.runtime.serving.api_engine import observe_many
    rng = random.Random(1)
    b = (0.001, 0.005, 0.01, 0.1, 1.0)
    vals = [rng.choice([0.001, 0.005, 0.3, 2.0]) * rng.random() * 2 for _ in range(500)] + [0.001, 0.005, 1.0, 7.0]
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    h1, h2 = Histogram("x", "x", buckets=b, registry=r1), Histogram("x", "x", buckets=b, registry=r2)
    for v in vals:
        h1.observe(v)
    observe_many(h2, vals)
    s1 = {s.name + str(s.labels): s.value for s in next(iter(r1.collect())).samples if not s.name.endswith("_created")}
    s2 = {s.name + str(s.labels): s.value for s in next(iter(r2.collect())).samples if not s.name.endswith("_created")}
    assert s1.keys() == s2.keys()
    for k, v in s1.items():
        assert v == pytest.approx(s2[k], rel=1e-12), k


def test_outputs_pack_unpack():
    from mstar.runtime.engine.engine_process import pack_outputs, unpack_outputs
    from mstar.runtime.engine.request import CoreOutput, TokenLogprobs
    outs = [CoreOutput("a", [1, 2]), CoreOutput("b", [3], [TokenLogprobs(-0.5, [3], [-0.5])], "stop", 3, 7, 4),
            CoreOutput("c", [], None, "abort", None, 2, 0)]
    assert unpack_outputs(pack_outputs(outs)) == outs


def test_delta_output_processor_matches_cumulative():
    """The server's OutputProcessor(cumulative=False) + ChoiceState give what the cumulative one gives,
    with the fast Rust decode or without it, stop strings and logprobs included."""
    from mstar.models.tokenizer import byte_tokenizer
    from mstar.runtime.serving.api_jobs import ChoiceState
    from mstar.runtime.engine.output_processor import OutputProcessor, fast_decode
    from mstar.runtime.engine.request import CoreOutput, SamplingParams, TokenLogprobs
    tok = byte_tokenizer()
    assert fast_decode(tok) is not None
    text = " Hello w\u00f6rld, stop here \u4e16\u754c!"
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(2)
    for params in (SamplingParams(max_tokens=len(ids)), SamplingParams(max_tokens=len(ids), stop=["p h"], logprobs=1),
                   SamplingParams(max_tokens=len(ids), stop=["\u754c"], include_stop_str_in_output=True)):
        got = []
        for cumulative, fast in ((True, False), (False, True), (False, False)):
            proc = OutputProcessor(tok, cumulative=cumulative)
            if not fast:
                proc._decode = None
            proc.add_request("r", [5, 6, 7], params)
            st, deltas, i = ChoiceState(), [], 0
            rng.seed(3)
            while i < len(ids):
                k = rng.randint(1, 3)
                chunk = ids[i:i + k]
                i += len(chunk)
                lps = [TokenLogprobs(-1.0, [t], [-1.0]) for t in chunk] if params.logprobs is not None else None
                outs, _ = proc.process([CoreOutput("r", chunk, lps, "length" if i >= len(ids) else None)])
                if not outs:
                    break
                d, new_ids, new_lp = st.update(outs[0])
                deltas.append((d, new_ids, len(new_lp)))
                if outs[0].finished:
                    break
            got.append((deltas, st.text, st.token_ids, len(st.logprobs), st.finish_reason, st.stop_reason))
        assert got[0] == got[1] == got[2]


def test_synthetic_prefill_time_is_paid_by_admitting_steps(monkeypatch):
    """SYNTH_PREFILL_MS: a step that admits requests takes that much longer (an eager prefill),
    a step that only decodes does not."""
    import time

    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.request import EngineRequest, SamplingParams
    from mstar.runtime.engine.synthetic_engine import SyntheticEngine
    monkeypatch.setenv("SYNTH_STEPS_PER_S", "0")
    monkeypatch.setenv("SYNTH_PREFILL_MS", "60")
    eng = SyntheticEngine(EngineConfig(model=MODEL, max_num_seqs=4))
    eng.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    t = time.perf_counter()
    eng.step()
    admitting = time.perf_counter() - t
    t = time.perf_counter()
    eng.step()
    decoding = time.perf_counter() - t
    assert admitting >= 0.06 and decoding < 0.03
