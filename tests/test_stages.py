"""The stage engine (non-autoregressive families) and the media routes, on the toy families of
toy_stages.py: batching by key, aborts between steps, chained stages, failures confined to their
batch, typed outputs equal to the modules run by hand; then end to end through a real server
(the families loaded as a plugin: MSTAR_MODEL_PLUGINS=synthetic_families)."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import httpx
import numpy as np
import pytest
import toy_stages as T
from server_harness import BootingServer, stop_all, toy_families_env
from media_checks import assert_video_of, is_video_of, mp4_frames

from mstar.models import interfaces as I
from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.request import EngineRequest, SamplingParams
from mstar.runtime.engine.stage_engine import StageEngine
from mstar.runtime.serving.api_media import png_bytes
from mstar.runtime.serving.api_speech import pcm16
from mstar.runtime.serving.api_video import mp4_bytes

def _req(rid: str, seed: int = 0, **inputs) -> EngineRequest:
    return EngineRequest(rid, [], SamplingParams(), media=I.MediaRequest(rid, inputs, seed))


def _engine(family=None, pipeline=None) -> StageEngine:
    return StageEngine(EngineConfig(model="toy", device="cpu"), family=family, pipeline=pipeline)


def _drain(engine: StageEngine, max_steps: int = 100, progress: dict | None = None) -> tuple[dict, list]:
    """Step until done: ({request id: final CoreOutput}, [each step's trace]); the loop stages'
    progress outputs go to `progress` ({request id: [(stage, done, steps), ...]})."""
    outs, traces = {}, []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if not o.finished:
                assert o.progress is not None and not o.media and o.request_id not in outs
                if progress is not None:
                    progress.setdefault(o.request_id, []).append(o.progress)
                continue
            assert o.request_id not in outs
            outs[o.request_id] = o
        traces.append(engine.last_step)
    assert not engine.has_unfinished()
    return outs, traces


def _loop_steps(trace, stage: int = 1) -> dict:
    return {key: n for k, what, key, n in trace if k == stage and what == "step"}


def _close(a: np.ndarray, b: np.ndarray, tol: int = 1) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert int(np.abs(a.astype(np.int64) - b.astype(np.int64)).max()) <= tol


# -- the engine ------------------------------------------------------------------------------------
def test_speech_batch_equals_modules_by_hand():
    eng = _engine(T.SPEECH)
    texts = ["hi", "a longer sentence to speak", "é"]
    for i, t in enumerate(texts):
        eng.add_request(_req(f"s{i}", text=t, voice=T.VOICES[i % 2]))
    outs, traces = _drain(eng)
    assert traces[0] == [(0, "run", None, 3)]  # one batch of all three (batch_key None)
    model = T.build_speech(0)
    for i, t in enumerate(texts):
        o = outs[f"s{i}"]
        assert o.finish_reason == "stop" and o.new_token_ids == [] and o.error is None
        assert all(isinstance(c, I.AudioChunk) and c.sample_rate == T.SAMPLE_RATE for c in o.media)
        assert [c.final for c in o.media] == [False] * (len(o.media) - 1) + [True]
        pcm = np.concatenate([c.pcm for c in o.media])
        assert pcm.dtype == np.float32 and len(pcm) == len(t.encode()) * T.HOP
        np.testing.assert_allclose(pcm, T.reference_speech(model, t, T.VOICES[i % 2]), atol=1e-6)


def test_sizes_interleave_and_a_batch_is_joined_only_at_its_start():
    eng = _engine(T.IMAGE)
    reqs = [("a", 32, 32, 1), ("b", 32, 32, 2), ("c", 64, 32, 3)]
    for rid, w, h, seed in reqs:
        eng.add_request(_req(rid, seed, prompt=f"p-{rid}", width=w, height=h))
    small, wide = (32, 32, 1), (64, 32, 1)
    eng.step()
    tr = eng.last_step
    assert tr[0] == (0, "run", None, 3)  # the text encoder: one batch
    assert (1, "start", small, 2) in tr and (1, "start", wide, 1) in tr
    assert _loop_steps(tr) == {small: 2, wide: 1}  # both sizes advance in the same engine step
    eng.add_request(_req("d", 4, prompt="p-d", width=32, height=32))  # its size is running: it waits
    eng.step()
    assert eng.last_step[0] == (0, "run", None, 1)
    assert _loop_steps(eng.last_step) == {small: 2, wide: 1}
    assert eng.stats()["waiting"] == 1 and eng.stats()["running"] == 3
    progress: dict = {}
    outs, traces = _drain(eng, progress=progress)
    # "d" ran its whole loop here: one progress output per denoise step, in order
    assert progress["d"] == [(1, i, T.NUM_STEPS) for i in range(1, T.NUM_STEPS + 1)]
    starts = [i for i, tr in enumerate(traces) for k, what, key, n in tr if what == "start"]
    finishes = [i for i, tr in enumerate(traces) for k, what, key, n in tr if what == "finish" and key == small]
    assert starts and starts[0] == finishes[0]  # "d" starts in the step its size's batch finishes
    # the decoder runs one batch (one size) per step
    assert all(sum(1 for k, what, _, _ in tr if k == 2) <= 1 for tr in traces)
    m = T.build_image(0)
    for rid, w, h, seed in [*reqs, ("d", 32, 32, 4)]:
        o = outs[rid]
        assert o.finish_reason == "stop" and len(o.media) == 1 and isinstance(o.media[0], I.Image)
        _close(o.media[0].pixels, T.reference_image(m, f"p-{rid}", w, h, seed))
    s = eng.stats()
    assert s["running"] == 0 and s["waiting"] == 0 and s["num_finished"] == 4


def test_max_batch_splits_a_key():
    eng = _engine(T.IMAGE)
    for i in range(6):
        eng.add_request(_req(f"r{i}", i, prompt="x", width=32, height=32))
    eng.step()
    assert (1, "start", (32, 32, 1), 4) in eng.last_step  # max_batch 4; two wait for the next batch
    outs, _ = _drain(eng)
    assert len(outs) == 6 and all(o.finish_reason == "stop" for o in outs.values())


def test_abort_mid_loop_frees_the_batch():
    eng = _engine(T.IMAGE)
    eng.add_request(_req("a", 1, prompt="x", width=32, height=32))
    eng.add_request(_req("b", 2, prompt="y", width=64, height=32))
    eng.add_request(_req("c", 3, prompt="z", width=64, height=32))
    eng.step()
    eng.step()
    eng.abort(["a", "b"])  # "a" alone in its batch: dropped; "b" shares its batch with "c"
    assert [b.key for b in eng._running[1]] == [(64, 32, 1)]
    assert eng.stats()["running"] == 1 and eng.num_unfinished() == 1
    outs, traces = _drain(eng)
    assert outs["a"].finish_reason == "abort" and outs["b"].finish_reason == "abort"
    assert outs["a"].media is None and outs["b"].media is None
    assert outs["c"].finish_reason == "stop"
    assert all((1, "step", (32, 32, 1), 1) not in tr for tr in traces)  # no step after the abort
    _close(outs["c"].media[0].pixels, T.reference_image(T.build_image(0), "z", 64, 32, 3))
    # an abort of a waiting request (and of one unknown or finished) frees it at once
    eng.add_request(_req("w", prompt="q", width=32, height=32))
    eng.abort(["w", "nope", "c"])
    assert eng.stats()["waiting"] == 0
    outs, _ = _drain(eng)
    assert list(outs) == ["w"] and outs["w"].finish_reason == "abort"
    assert eng.stats()["num_aborted"] == 3


def test_chained_stages_see_the_previous_outputs():
    seen = []

    def first(reqs):
        return [[r.inputs["x"] * 10] for r in reqs]

    def start(reqs):
        seen.append([dict(r.inputs) for r in reqs])
        return {"v": [r.inputs["previous"][0] for r in reqs]}

    def step(state, i):
        state["v"] = [v + 1 for v in state["v"]]

    def last(reqs):
        return [[I.AudioChunk(np.full(2, r.inputs["previous"][0], np.float32), 8000)] for r in reqs]

    pipe = I.Pipeline([I.OneShotStage(first),
                       I.FixedStepLoopStage(start, step, lambda s: [[v] for v in s["v"]], lambda s: 3),
                       I.OneShotStage(last)])
    eng = _engine(pipeline=pipe)
    eng.add_request(_req("a", x=1))
    eng.add_request(_req("b", x=2))
    outs, traces = _drain(eng)
    assert seen == [[{"x": 1, "previous": [10]}, {"x": 2, "previous": [20]}]]
    assert [o.media[0].pcm.tolist() for o in (outs["a"], outs["b"])] == [[13, 13], [23, 23]]
    # step 1: stage 0, the loop's start and first step; step 3: its last step, then the last stage
    assert len(traces) == 3


def _counting_loop(max_batch: int = 4, fail_join: str | None = None) -> I.FixedStepLoopStage:
    """A continuous loop whose rows carry (request id, value): every step adds the row's own step
    count + 1 to its value, so a request's result tells exactly which steps it had."""
    def start(reqs):
        return {"rows": [[r.request_id, r.inputs["x"], 0] for r in reqs]}

    def join(state, reqs):
        if any(r.request_id == fail_join for r in reqs):
            raise RuntimeError("join refused")
        return {"rows": state["rows"] + start(reqs)["rows"]}

    def step(state, i):
        for row in state["rows"]:
            row[2] += 1
            row[1] += row[2]

    def leave(state, rows):
        out = [[state["rows"][j][1]] for j in rows]
        return {"rows": [r for j, r in enumerate(state["rows"]) if j not in rows]}, out

    return I.FixedStepLoopStage(start, step, lambda s: [[r[1]] for r in s["rows"]], lambda s: 3,
                                max_batch=max_batch, join=join, leave=leave)


def test_continuous_loop_joins_and_leaves_at_any_step():
    loop = _counting_loop()
    eng = _engine(pipeline=I.Pipeline([loop]))
    assert loop.continuous and not I.FixedStepLoopStage(None, None, None, None).continuous
    eng.add_request(_req("a", x=0))
    eng.step()
    eng.step()  # a has had 2 of its 3 steps
    eng.add_request(_req("b", x=100))
    eng.add_request(_req("c", x=200))
    progress: dict = {}
    outs, traces = _drain(eng, progress=progress)
    # every request had exactly its own 3 steps (1 + 2 + 3 added), whenever it joined
    assert {r: o.media[0] for r, o in outs.items()} == {"a": 6, "b": 106, "c": 206}
    assert progress["b"] == [(0, 1, 3), (0, 2, 3), (0, 3, 3)] and progress["a"] == [(0, 3, 3)]
    # b and c joined a's batch (one transformer call for all three), a left it alone after its step
    assert traces[0] == [(0, "join", None, 2), (0, "step", None, 3), (0, "leave", None, 1)]
    assert [t[1] for t in traces[1]] == ["step"] and traces[2][-1] == (0, "finish", None, 2)
    assert eng.stats()["running"] == 0 and not eng.has_unfinished()


def test_continuous_loop_room_aborts_and_failed_joins():
    eng = _engine(pipeline=I.Pipeline([_counting_loop(max_batch=2, fail_join="bad")]))
    eng.add_request(_req("a", x=0))
    eng.add_request(_req("b", x=10))
    eng.step()
    eng.add_request(_req("c", x=20))  # no room: waits for the batch (its key is busy)
    eng.step()
    eng.abort(["b"])  # b's row leaves before the next step: room for c (bad waits for the next)
    eng.add_request(_req("bad", x=1))
    outs, traces = _drain(eng)
    assert outs["b"].finish_reason == "abort" and outs["a"].media[0] == 6 and outs["c"].media[0] == 26
    assert traces[0] == [(0, "leave", None, 1), (0, "join", None, 1), (0, "step", None, 2), (0, "leave", None, 1)]
    assert traces[1][0] == (0, "join", None, 1)
    assert outs["bad"].finish_reason == "error" and "join refused" in outs["bad"].error
    assert eng.stats()["num_failed"] == 1 and not eng.has_unfinished()


def test_a_failing_batch_fails_only_its_requests():
    eng = _engine(T.IMAGE)
    eng.add_request(_req("bad", prompt="raise: please", width=32, height=32))
    eng.add_request(_req("good", 7, prompt="fine", width=64, height=32))
    outs, _ = _drain(eng)
    assert outs["bad"].finish_reason == "error" and "asked to fail" in outs["bad"].error
    assert outs["good"].finish_reason == "stop"
    _close(outs["good"].media[0].pixels, T.reference_image(T.build_image(0), "fine", 64, 32, 7))
    assert eng.stats()["num_failed"] == 1

    def wrong(reqs):
        return [[]]  # one output list whatever the batch
    eng = _engine(pipeline=I.Pipeline([I.OneShotStage(wrong)]))
    eng.add_request(_req("a"))
    eng.add_request(_req("b"))
    outs, _ = _drain(eng)
    assert {o.finish_reason for o in outs.values()} == {"error"}
    assert "2 requests" in outs["a"].error


def test_refusals():
    from mstar.runtime.engine.request import RequestError
    eng = _engine(T.IMAGE)
    with pytest.raises(RequestError):
        eng.add_request(EngineRequest("t", [1, 2], SamplingParams()))  # tokens, no media
    eng.add_request(_req("k", prompt="x"))  # no size: the loop stage cannot make its batch key
    outs, _ = _drain(eng)
    assert outs["k"].finish_reason == "error" and "batch" in outs["k"].error
    keyed = _engine(pipeline=I.Pipeline([I.OneShotStage(lambda rs: [[] for _ in rs],
                                                        batch_key=lambda r: r.inputs["size"])]))
    with pytest.raises(RequestError):  # at the first stage: refused at once (a 400 for the client)
        keyed.add_request(_req("k", prompt="x"))
    assert not keyed.has_unfinished()
    eng.add_request(_req("a", prompt="x", width=32, height=32))
    with pytest.raises(RequestError):
        eng.add_request(_req("a", prompt="x", width=32, height=32))


def test_engine_selection_and_info(monkeypatch):
    from mstar.models import registry
    from mstar.runtime.engine import engine_process as EP
    # the toys as the registry's answer, without registering them in this process (other tests
    # list the registered presets)
    lookup = registry.family_of
    monkeypatch.setattr(registry, "family_of", lambda name: T.IMAGE if name == "toy-image" else lookup(name))
    eng = EP.default_engine(EngineConfig(model="toy-image", device="cpu"))
    assert isinstance(eng, StageEngine)
    info = EP._engine_info(eng)
    assert info["capabilities"] == sorted([I.GENERATES_IMAGES, I.GENERATES_VIDEO])
    assert info["accepts"]["sizes"] == list(T.SIZES) and info["max_model_len"] == 0
    # a CoreOutput with typed outputs survives the trip through the queue (tuples, pickled)
    import pickle
    eng.add_request(_req("a", 1, prompt="x", width=32, height=32))
    outs, _ = _drain(eng)
    back = EP.unpack_outputs(pickle.loads(pickle.dumps(EP.pack_outputs(list(outs.values())))))
    assert np.array_equal(back[0].media[0].pixels, outs["a"].media[0].pixels)
    # a token family has no pipeline: EngineCore
    assert EP._family(EngineConfig(model="tiny-qwen3.5", device="cpu")).pipeline is None


def test_png_encoder_round_trip():
    rng = np.random.default_rng(0)
    px = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    assert np.array_equal(_png_pixels(png_bytes(px)), px)


def test_mp4_bytes_do_not_depend_on_the_cpu():
    """The MP4 of fresh frames equals, byte for byte, x264's encode of them with its assembly off (the
    same settings otherwise): x264 lets some of its algorithms follow the CPU's instruction set
    unless told not to, and an encode then depends on the CPU (on an AVX2 / FMA machine it differs)."""
    av = pytest.importorskip("av")
    from fractions import Fraction
    # the PyAV wheels of the [video] extra bundle FFmpeg with libx264 (mp4_bytes falls back to
    # MPEG-4 Part 2 only for a PyAV built without it)
    assert "libx264" in av.codecs_available
    px = np.random.default_rng().integers(0, 256, size=(4, 48, 64, 3), dtype=np.uint8)
    px[:, :24] //= 2  # some structure for the motion search and the rate control to act on
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=Fraction(8))
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast", "sliced-threads": "1", "x264-params": "asm=0"}
        for f in px:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    assert mp4_bytes(px, 8.0) == buf.getvalue()


# -- helpers to read what the server sends -------------------------------------------------------
def _png_pixels(data: bytes) -> np.ndarray:
    """A PNG (8-bit RGB, any filter) as uint8 [H, W, 3]."""
    try:
        import io

        from PIL import Image as PILImage
        return np.asarray(PILImage.open(io.BytesIO(data)).convert("RGB"))
    except ImportError:
        pass
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w = 8, b"", 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(tag + body) & 0xFFFFFFFF
        if tag == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", body[:10])
            assert (depth, color) == (8, 2)
        elif tag == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = 3 * w
    out = np.zeros((h, stride), dtype=np.int64)
    for y in range(h):
        f, line = raw[y * (stride + 1)], np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int64)
        prev = out[y - 1] if y else np.zeros(stride, np.int64)
        row = np.zeros(stride, np.int64)
        for x in range(stride):
            a = row[x - 3] if x >= 3 else 0
            b = prev[x]
            c = prev[x - 3] if x >= 3 else 0
            if f == 0:
                pred = 0
            elif f == 1:
                pred = a
            elif f == 2:
                pred = b
            elif f == 3:
                pred = (a + b) // 2
            else:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
            row[x] = (line[x] + pred) & 0xFF
        out[y] = row
    return out.reshape(h, w, 3).astype(np.uint8)


def _wav(data: bytes) -> tuple[int, np.ndarray, int]:
    """(sample rate, int16 samples, the header's data size) of a mono 16-bit WAV."""
    riff, _, wave, fmt, _, tag, ch, rate, _, _, bits, dtag, size = struct.unpack("<4sI4s4sIHHIIHH4sI", data[:44])
    assert (riff, wave, fmt, dtag, tag, ch, bits) == (b"RIFF", b"WAVE", b"fmt ", b"data", 1, 1, 16)
    return rate, np.frombuffer(data[44:], "<i2"), size


def _err(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if param is not None:
        assert e["param"] == param, e
    return e


# -- end to end ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _boot():
    """toy-speech and toy-image servers, started when this module's first test starts."""
    procs = {kind: BootingServer(*args, env=toy_families_env())
             for kind, args in (("speech", ["toy-speech"]), ("image", ["toy-image", "--max-video-jobs", "2"]))}
    yield procs
    stop_all(procs.values())


@pytest.fixture(scope="module")
def servers(_boot):
    return {kind: p.ready() for kind, p in _boot.items()}


def test_speech_end_to_end(servers):
    s = servers["speech"]
    model = T.build_speech(0)
    text = "Hello from the toy voice, long enough for several chunks."
    r = s.post("/v1/audio/speech", {"model": "toy-speech", "input": text, "voice": "echo"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav" and r.headers["x-sample-rate"] == str(T.SAMPLE_RATE)
    rate, samples, size = _wav(r.content)
    n = len(text.encode()) * T.HOP
    assert rate == T.SAMPLE_RATE and len(samples) == n and size == 2 * n
    ref = np.frombuffer(pcm16(T.reference_speech(model, text, "echo")), "<i2")
    assert int(np.abs(samples.astype(np.int32) - ref).max()) <= 1

    r = s.post("/v1/audio/speech", {"input": text, "voice": "echo", "response_format": "pcm"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
    assert r.content == samples.tobytes()

    # streamed: chunked, one body part per audio chunk, a header of unknown length, the same samples
    with httpx.stream("POST", s.url + "/v1/audio/speech", timeout=30,
                      json={"input": text, "voice": "echo", "stream_format": "audio"}) as st:
        assert st.status_code == 200 and st.headers.get("transfer-encoding") == "chunked"
        parts = list(st.iter_raw())
    body = b"".join(parts)
    rate, streamed, size = _wav(body)
    assert size == 0xFFFFFFFF and np.array_equal(streamed, samples)
    assert len(parts) >= 2
    s.wait_idle()


def test_speech_bad_requests(servers):
    s = servers["speech"]
    for body, param in (({"voice": "echo"}, "input"), ({"input": ""}, "input"), ({"input": "x" * 1001}, "input"),
                        ({"input": 3}, "input"), ({"input": "x", "response_format": "ogg"}, "response_format"),
                        ({"input": "x", "voice": "nobody"}, "voice"), ({"input": "x", "speed": 9}, "speed"),
                        ({"input": "x", "stream_format": "video"}, "stream_format"), ({"input": "x", "foo": 1}, "foo")):
        _err(s.post("/v1/audio/speech", body), 400, param)
    e = _err(s.post("/v1/audio/speech", {"model": "other", "input": "x"}), 404, "model")
    assert e["code"] == "model_not_found"
    # routes the model has not the capability of
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/images/generations", {"prompt": "x"})):
        assert _err(s.post(path, body), 400, "model")["code"] == "unsupported_endpoint"
    r = s.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")})
    assert _err(r, 400)["code"] == "unsupported_endpoint"


def test_images_end_to_end(servers):
    s = servers["image"]
    m = T.build_image(0)
    r = s.post("/v1/images/generations", {"model": "toy-image", "prompt": "a red square", "n": 2, "size": "64x32",
                                          "seed": 5, "response_format": "b64_json"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 2
    for j, d in enumerate(data):
        px = _png_pixels(base64.b64decode(d["b64_json"]))
        assert px.shape == (32, 64, 3)
        _close(px, T.reference_image(m, "a red square", 64, 32, 5 + j))
    r = s.post("/v1/images/generations", {"prompt": "default size", "seed": 1})
    assert r.status_code == 200
    assert _png_pixels(base64.b64decode(r.json()["data"][0]["b64_json"])).shape == (32, 32, 3)
    s.wait_idle()


def test_videos_sync_and_async_jobs(servers):
    s = servers["image"]
    m = T.build_image(0)
    ref = T.reference_image(m, "a clip", 32, 32, 9, num_frames=3)
    other = T.reference_image(m, "a clip", 32, 32, 10, num_frames=3)
    body = {"prompt": "a clip", "size": "32x32", "num_frames": 3, "seed": 9}
    r = s.post("/v1/videos/sync", body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4" and r.headers["x-num-frames"] == "3"
    frames = mp4_frames(r.content)
    # the seed-9 clip through the encoder, not the seed-10 one (H.264 of the toy's noisy frames
    # loses ~7 levels; the two seeds' encodes are ~8 apart)
    assert_video_of(frames, ref, T.FPS)
    assert not is_video_of(frames, other, T.FPS)

    r = s.post("/v1/videos", body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress", "completed")
    assert (job["size"], job["num_frames"], job["prompt"]) == ("32x32", 3, "a clip")
    deadline = time.monotonic() + 60
    while (rec := s.get(f"/v1/videos/{job['id']}").json())["status"] != "completed":
        assert rec["status"] in ("queued", "in_progress") and time.monotonic() < deadline, rec
        time.sleep(0.05)
    assert rec["progress"] == 100 and rec["completed_at"] >= rec["created_at"] and rec["error"] is None
    r = s.get(f"/v1/videos/{job['id']}/content")
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    assert_video_of(mp4_frames(r.content), ref, T.FPS)  # the same request, the same video
    assert job["id"] in [v["id"] for v in s.get("/v1/videos").json()["data"]]
    r = httpx.delete(s.url + f"/v1/videos/{job['id']}", timeout=30)
    assert r.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert _err(s.get(f"/v1/videos/{job['id']}"), 404, "video_id")["code"] == "video_not_found"

    # a slow job: progress while it runs, content not ready, cancelled by DELETE (engine idle after)
    r = s.post("/v1/videos", {"prompt": "slow: clip", "size": "32x32", "num_frames": 2, "seed": 1})
    vid = r.json()["id"]
    seen = set()
    deadline = time.monotonic() + 30
    while not any(0 < p < 100 for p in seen):
        rec = s.get(f"/v1/videos/{vid}").json()
        seen.add(rec["progress"])
        assert rec["status"] != "failed" and time.monotonic() < deadline, rec
        time.sleep(0.02)
    assert rec["status"] == "in_progress"
    assert _err(s.get(f"/v1/videos/{vid}/content"), 409, "video_id")["code"] == "video_not_ready"
    assert httpx.delete(s.url + f"/v1/videos/{vid}", timeout=30).json()["deleted"] is True
    stats = s.wait_idle()
    assert stats.get("running", 0) == 0
    assert _err(s.get(f"/v1/videos/{vid}"), 404, "video_id")


def test_video_job_limit(servers):
    """--max-video-jobs 2: a third unfinished job is a 503 with Retry-After; a cancelled one frees
    its place."""
    s = servers["image"]
    ids = [s.post("/v1/videos", {"prompt": f"slow: clip {i}", "size": "32x32", "num_frames": 2}).json()["id"]
           for i in range(2)]
    r = s.post("/v1/videos", {"prompt": "one too many", "size": "32x32", "num_frames": 2})
    assert _err(r, 503)["code"] == "overloaded" and int(r.headers["retry-after"]) >= 1
    assert httpx.delete(s.url + f"/v1/videos/{ids[0]}", timeout=30).json()["deleted"] is True
    r = s.post("/v1/videos", {"prompt": "room now", "size": "32x32", "num_frames": 2})
    assert r.status_code == 200, r.text
    for vid in (ids[1], r.json()["id"]):
        httpx.delete(s.url + f"/v1/videos/{vid}", timeout=30)
    assert s.wait_idle().get("running", 0) == 0


def test_video_bad_requests(servers):
    s = servers["image"]
    for route in ("/v1/videos", "/v1/videos/sync"):
        for body, param in (({"prompt": "x", "num_frames": 99}, "num_frames"),
                            ({"prompt": "x", "seconds": "forever"}, "seconds"),
                            ({"prompt": "x", "num_frames": 2, "seconds": 1}, "seconds"),
                            ({"num_frames": 2}, "prompt"), ({"prompt": "x", "num_frames": 2, "size": "31x31"}, "size"),
                            ({"prompt": "x", "num_frames": 2, "width": 32}, "height"),
                            ({"prompt": "x", "num_frames": 2, "num_inference_steps": 0}, "num_inference_steps"),
                            ({"prompt": "x", "num_frames": 2, "guidance_scale": 30}, "guidance_scale"),
                            ({"prompt": "x", "num_frames": 2, "flow_shift": 0}, "flow_shift"),
                            ({"prompt": "x", "num_frames": 2, "fps": 0}, "fps"),
                            ({"prompt": "x", "num_frames": 2, "input_reference": "aGVsbG8="}, "input_reference"),
                            ({"prompt": "x", "num_frames": 2, "image_reference": "x"}, "image_reference"),
                            ({"prompt": "x", "num_frames": 2, "quality": "hd"}, "quality")):
            _err(s.post(route, body), 400, param)
    _err(s.get("/v1/videos/nope/content"), 404, "video_id")
    assert _err(httpx.delete(s.url + "/v1/videos/nope", timeout=30), 404)["code"] == "video_not_found"
    # the speech server has no video routes
    assert _err(servers["speech"].get("/v1/videos"), 400)["code"] == "unsupported_endpoint"
    s.wait_idle()


def test_images_bad_requests_and_failures(servers):
    s = servers["image"]
    for body, param in (({"n": 1}, "prompt"), ({"prompt": "x", "size": "100x100"}, "size"),
                        ({"prompt": "x", "size": "big"}, "size"), ({"prompt": "x", "n": 0}, "n"),
                        ({"prompt": "x", "n": 11}, "n"), ({"prompt": "x", "n": "2"}, "n"),
                        ({"prompt": "x", "response_format": "url"}, "response_format"),
                        ({"prompt": "x", "seed": 1.5}, "seed"), ({"prompt": "x" * 201}, "prompt"),
                        ({"prompt": "x", "style": "vivid"}, "style")):
        _err(s.post("/v1/images/generations", body), 400, param)
    assert _err(s.post("/v1/audio/speech", {"input": "x"}), 400)["code"] == "unsupported_endpoint"
    assert _err(s.post("/v1/completions", {"prompt": "x"}), 400)["code"] == "unsupported_endpoint"
    # the model fails on a request: a 500 for it, and the server goes on
    e = _err(s.post("/v1/images/generations", {"prompt": "raise: now"}), 500)
    assert e["code"] == "internal_error" and "asked to fail" in e["message"]
    assert s.post("/v1/images/generations", {"prompt": "after"}).status_code == 200
    s.wait_idle()


def test_disconnect_frees_the_engine(servers):
    s = servers["image"]
    before = s.metrics().get('mstar_engine_stat{name="num_aborted"}', 0.0)
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up mid-loop (4 steps of SLOW_STEP_S)
        httpx.post(s.url + "/v1/images/generations", json={"prompt": "slow: take your time"}, timeout=0.3)
    deadline = time.monotonic() + 10
    while s.metrics().get('mstar_engine_stat{name="num_aborted"}', 0.0) < before + 1:
        assert time.monotonic() < deadline, "the engine never saw the abort"
        time.sleep(0.05)
    assert time.monotonic() - t0 < T.NUM_STEPS * T.SLOW_STEP_S + 5
    m = s.wait_idle()
    assert m['mstar_requests_total{endpoint="images",outcome="aborted"}'] >= 1
    assert m['mstar_engine_stat{name="num_finished"}'] >= 1
    assert s.get("/health").json()["status"] == "ok"
    assert s.post("/v1/images/generations", {"prompt": "still here"}).status_code == 200
