"""The stage engine's decode loop (interfaces.DecodeLoopStage): an open-ended, continuous loop
whose rows end when the stage says so, streaming each step's outputs; joins at any step, aborts,
failures confined to their batch, and a decode loop before another stage."""

from __future__ import annotations

import random

import numpy as np

from mstar.models import interfaces as I
from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.request import EngineRequest, SamplingParams
from mstar.runtime.engine.stage_engine import StageEngine


def _req(rid: str, **inputs) -> EngineRequest:
    return EngineRequest(rid, [], SamplingParams(), media=I.MediaRequest(rid, inputs, 0))


def _engine(stages) -> StageEngine:
    return StageEngine(EngineConfig(model="toy", device="cpu"), pipeline=I.Pipeline(list(stages)))


def _chunk(v: float, final: bool = False) -> I.AudioChunk:
    return I.AudioChunk(np.full(2, v, dtype=np.float32), 24000, final=final)


def _counting(max_batch: int = 4, fail_step: str | None = None, fail_join: str | None = None,
              log: list | None = None) -> I.DecodeLoopStage:
    """Row = [request id, frames wanted, frames made]: every step makes one frame (a chunk holding
    the frame's number), a row is done after its `n` frames; leave returns a final empty chunk."""
    def start(reqs):
        return {"rows": [[r.request_id, int(r.inputs["n"]), 0] for r in reqs]}

    def join(state, reqs):
        if any(r.request_id == fail_join for r in reqs):
            raise RuntimeError("join refused")
        return {"rows": state["rows"] + start(reqs)["rows"]}

    def step(state):
        if log is not None:
            log.append([r[0] for r in state["rows"]])
        out = []
        for row in state["rows"]:
            if row[0] == fail_step:
                raise RuntimeError("step failed")
            row[2] += 1
            out.append(([_chunk(row[2])], row[2] >= row[1]))
        return state, out

    def leave(state, rows):
        out = [[_chunk(0.0, final=True)] for _ in rows]
        return {"rows": [r for j, r in enumerate(state["rows"]) if j not in rows]}, out

    return I.DecodeLoopStage(start, step, join, leave, max_batch=max_batch)


def _drain(engine: StageEngine, max_steps: int = 200):
    """({request id: every media output in order}, {request id: final CoreOutput}, traces)."""
    media: dict[str, list] = {}
    final, traces = {}, []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            assert o.request_id not in final
            media.setdefault(o.request_id, []).extend(o.media or ())
            if o.finished:
                final[o.request_id] = o
        traces.append(engine.last_step)
    assert not engine.has_unfinished()
    return media, final, traces


def _frames(chunks) -> list[float]:
    return [float(c.pcm[0]) for c in chunks]


def test_rows_stream_and_end_on_their_own_and_join_at_any_step():
    rng = random.Random()
    n = {rid: rng.randint(1, 6) for rid in "abcde"}
    eng = _engine([_counting()])
    eng.add_request(_req("a", n=n["a"]))
    streamed: dict[str, list] = {}
    early = {}
    for o in eng.step():  # a's first frame streams out with the step that started it
        streamed.setdefault(o.request_id, []).extend(o.media or ())
        if o.finished:
            early[o.request_id] = o
    for rid in "bcde":
        eng.add_request(_req(rid, n=n[rid]))
    media, final, traces = _drain(eng)
    final.update(early)
    for rid in "abcde":
        got = streamed.get(rid, []) + media.get(rid, [])
        # frames 1..n as they were made, then the final chunk with the finish
        assert _frames(got) == [float(i) for i in range(1, n[rid] + 1)] + [0.0], (rid, n)
        assert got[-1].final and not any(c.final for c in got[:-1])
        assert final[rid].finish_reason == "stop" and final[rid].media[-1].final
    # b, c, d joined a's batch before a step (max_batch 4): e waited for room
    first = traces[0]
    assert first[0] == (0, "join", None, 3) or n["a"] == 1
    assert eng.stats()["running"] == 0


def test_abort_leaves_between_steps_and_room_goes_to_waiting():
    log: list = []
    eng = _engine([_counting(max_batch=2, log=log)])
    eng.add_request(_req("a", n=5))
    eng.add_request(_req("b", n=5))
    eng.step()
    eng.add_request(_req("c", n=2))  # no room yet
    eng.step()
    eng.abort(["b"])
    media, final, traces = _drain(eng)
    assert final["b"].finish_reason == "abort"
    assert traces[0][:2] == [(0, "leave", None, 1), (0, "join", None, 1)]
    assert log[2] == ["a", "c"] and _frames(media["c"]) == [1.0, 2.0, 0.0]
    assert _frames(media["a"])[-4:] == [3.0, 4.0, 5.0, 0.0]
    # an aborted batch's last request: the batch is dropped, nothing more runs
    eng.add_request(_req("z", n=50))
    eng.step()
    eng.abort(["z"])
    _drain(eng)
    assert eng.stats()["running"] == 0 and eng.num_aborted == 2


def test_failures_stay_in_their_batch():
    eng = _engine([_counting(fail_step="bad", fail_join="badjoin")])
    eng.add_request(_req("ok", n=3))
    first = [c for o in eng.step() for c in o.media]
    eng.add_request(_req("badjoin", n=3))
    media, final, _ = _drain(eng)
    assert final["badjoin"].finish_reason == "error" and "join refused" in final["badjoin"].error
    assert final["ok"].finish_reason == "stop" and _frames(first + media["ok"]) == [1.0, 2.0, 3.0, 0.0]
    eng.add_request(_req("bad", n=3))
    media, final, _ = _drain(eng)
    assert final["bad"].finish_reason == "error" and "step failed" in final["bad"].error

    def wrong(state):
        return state, []  # no rows for a batch of one
    eng = _engine([I.DecodeLoopStage(lambda reqs: {}, wrong, None, None)])
    eng.add_request(_req("x"))
    _, final, _ = _drain(eng)
    assert final["x"].finish_reason == "error" and "0 rows for 1 requests" in final["x"].error


def test_a_decode_loop_before_another_stage_hands_on_everything():
    def total(reqs):
        return [[sum(_frames(r.inputs["previous"]))] for r in reqs]
    eng = _engine([_counting(), I.OneShotStage(total)])
    eng.add_request(_req("a", n=4))
    eng.add_request(_req("b", n=2))
    media, final, _ = _drain(eng)
    # nothing streamed from the first stage: the second got frames 1..n and the final chunk
    assert media["a"] == [10.0] and media["b"] == [3.0]
    assert final["a"].media == [10.0]
