"""Qwen3-TTS served end to end (tiny-qwen3-tts on a real server) and through the offline API: the
whole file, the chunked stream and the SSE events carry the same PCM as the offline synthesize;
the first chunk's size follows initial_codec_chunk_frames; vLLM-Omni's fields and every wrong
value answer a 400 naming the field; a batch gives each request the codes it gets alone, and
aborted or finished requests leave no K/V pages or codec streams behind."""

from __future__ import annotations

import base64
import json
import random
import struct

import httpx
import numpy as np
import pytest
from server_harness import BootingServer

from mstar.runtime.engine.llm import LLM
from mstar.runtime.engine.request import RequestError
from mstar.runtime.serving.api_speech import pcm16

VOICES = ["aiden", "eric", "vivian"]
SAMPLES_PER_FRAME = 1920
FRAMES = 20  # max_new_tokens of the tests' requests: the stage's chunks of 4, 8 and 8 frames
BATCH_TOL = 1e-5  # the codec's convolutions over a batch against one row: float32 rounding


@pytest.fixture(scope="module")
def server():
    p = BootingServer("--model", "tiny-qwen3-tts")
    try:
        yield p.ready()
    finally:
        p.close()


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-qwen3-tts", device="cpu")


def _body(**kw) -> dict:
    return {"input": "Hello there, this is a test.", "voice": "vivian", "seed": 11, "max_new_tokens": FRAMES,
            "min_new_tokens": None, **kw}


def _post(s, **kw) -> httpx.Response:
    body = {k: v for k, v in _body(**kw).items() if v is not None}
    return s.post("/v1/audio/speech", body)


def _err(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["param"] == param, e
    return e


def _deltas(text: str) -> tuple[bytes, list[dict]]:
    events = [json.loads(b[len("data: "):]) for b in text.split("\n\n") if b.strip()]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return audio, events


def test_file_stream_and_sse_equal_the_offline_api(server, llm):
    whole = _post(server, response_format="pcm")
    assert whole.status_code == 200, whole.text
    assert whole.headers["x-sample-rate"] == "24000" and len(whole.content) % (2 * SAMPLES_PER_FRAME) == 0
    (sp,) = llm.synthesize("Hello there, this is a test.", "vivian", seed=11, max_new_tokens=FRAMES)
    want = np.frombuffer(pcm16(sp.samples), "<i2").astype(np.int32)
    got = np.frombuffer(whole.content, "<i2").astype(np.int32)
    assert got.shape == want.shape and int(np.abs(got - want).max()) <= 1  # one LSB: two processes' float sums
    body = {k: v for k, v in _body(stream_format="audio", response_format="pcm").items() if v is not None}
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=60, json=body) as st:
        assert st.status_code == 200 and st.headers.get("transfer-encoding") == "chunked"
        parts = [p for p in st.iter_raw() if p]
    assert b"".join(parts) == whole.content
    frames = len(whole.content) // (2 * SAMPLES_PER_FRAME)
    if frames > 4:
        assert len(parts) >= 2  # the first chunk (4 frames) comes before the rest is generated
    # vLLM-Omni's `stream: true` is the SSE stream
    audio, events = _deltas(_post(server, stream=True, response_format="pcm").text)
    assert audio == whole.content and events[-1]["type"] == "speech.audio.done"
    server.wait_idle()


def test_initial_chunk_frames_sets_the_first_chunk(llm):
    eng = llm.engine
    for first in (1, 3):
        (req,) = llm.speech_requests({"text": "one two three four", "initial_codec_chunk_frames": first,
                                      "min_new_tokens": 12}, "aiden", max_new_tokens=12)
        eng.add_request(req)
        chunks = []
        while eng.has_unfinished():
            for o in eng.step():
                chunks += [len(m.pcm) for m in o.media or ()]
        assert chunks[0] == first * SAMPLES_PER_FRAME
        assert sum(chunks) == 12 * SAMPLES_PER_FRAME  # min = max: exactly 12 frames


def test_voices_and_bad_requests(server):
    assert server.get("/v1/audio/voices").json() == {"voices": VOICES}
    for kw, param in (({"voice": "nobody"}, "voice"), ({"speed": 1.5}, "speed"),
                      ({"task_type": "Base"}, "task_type"), ({"task_type": "VoiceDesign"}, "task_type"),
                      ({"task_type": "Whatever"}, "task_type"), ({"ref_audio": "data:audio/wav;base64,AAAA"}, "ref_audio"),
                      ({"ref_text": "the reference"}, "ref_text"), ({"language": "klingon"}, "language"),
                      ({"initial_codec_chunk_frames": 0}, "initial_codec_chunk_frames"),
                      ({"initial_codec_chunk_frames": "4"}, "initial_codec_chunk_frames"),
                      ({"non_streaming_mode": "yes"}, "non_streaming_mode"), ({"max_new_tokens": 5000}, "max_new_tokens"),
                      ({"input": "x" * 2049}, "input"), ({"stream": "yes"}, "stream"),
                      ({"language": "klingon", "stream_format": "sse"}, "language")):
        e = _err(_post(server, **kw), param)
        assert e["code"] != "internal_error"
    ok = _post(server, task_type="CustomVoice", language="English", non_streaming_mode=False,
               initial_codec_chunk_frames=2, instructions="cheerful")
    assert ok.status_code == 200 and len(ok.content) > 44
    server.wait_idle()


def test_batch_equals_alone_and_nothing_is_left_held(llm):
    rng = random.Random()
    items = [{"text": t, "min_new_tokens": n, "max_new_tokens": n}
             for t, n in (("first request", rng.randint(3, 14)), ("the second one, longer", rng.randint(3, 14)),
                          ("third", rng.randint(3, 14)))]
    seeds = [rng.randrange(1 << 30) for _ in items]
    together = llm.synthesize(items, "eric", seed=seeds)
    for item, s, got in zip(items, seeds, together):
        (alone,) = llm.synthesize(item, "eric", seed=s)
        assert got.samples.shape == alone.samples.shape == (item["max_new_tokens"] * SAMPLES_PER_FRAME,)
        assert float(np.abs(got.samples - alone.samples).max()) <= BATCH_TOL
    # an abort mid-utterance: its pages and its codec stream are given back
    stage = llm.engine.stages[0]
    synthesis = stage.start.__self__
    pool, streamer = synthesis.generator.pool, synthesis.streamer
    free = pool.free_pages
    reqs = llm.speech_requests([{"text": "to be cut short", "min_new_tokens": 40}, {"text": "kept"}], "aiden",
                               max_new_tokens=40)
    for r in reqs:
        llm.engine.add_request(r)
    for _ in range(3):
        llm.engine.step()
    assert pool.free_pages < free and len(streamer.streams) == 2
    llm.engine.abort([reqs[0].request_id])
    finals = {}
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            if o.finished:
                finals[o.request_id] = o.finish_reason
    assert finals == {reqs[0].request_id: "abort", reqs[1].request_id: finals[reqs[1].request_id]}
    assert pool.free_pages == free and streamer.streams == []


def test_offline_refusals_name_the_field(llm):
    for item, field in (({"text": "x", "task_type": "Base"}, "task_type"), ({"text": "x", "ref_audio": "a"}, "ref_audio"),
                        ({"text": "x", "language": "klingon"}, "language"),
                        ({"text": "x", "min_new_tokens": 9, "max_new_tokens": 3}, "min_new_tokens")):
        with pytest.raises(RequestError) as e:
            llm.synthesize(item, "vivian")
        assert e.value.field == field, e.value


def test_wav_header_of_the_whole_file(server):
    r = _post(server)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    riff, _, wave, _fmt, _, tag, ch, rate, _, _, bits, dtag, size = struct.unpack("<4sI4s4sIHHIIHH4sI", r.content[:44])
    assert (riff, wave, dtag, tag, ch, rate, bits) == (b"RIFF", b"WAVE", b"data", 1, 1, 24000, 16)
    assert size == len(r.content) - 44 > 0
