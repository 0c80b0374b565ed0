"""POST /v1/audio/speech and GET /v1/audio/voices end to end on real servers of both speech
families (tiny-kokoro: a stage pipeline; tiny-orpheus: a speech LM with a streaming codec), and
the offline LLM.synthesize on both: response formats that decode back to the same PCM, streamed
bodies and SSE events equal to the whole file, the phonemes field, every field error a 400 in
OpenAI's error schema (the route's own checks and the engines' refusals alike), the capability
gates, and a batch of synthesize requests equal to each request alone."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import struct
import time

import httpx
import numpy as np
import pytest
from server_harness import BootingServer, stop_all

from mstar.runtime.engine.llm import LLM, Speech
from mstar.runtime.engine.request import RequestError
from mstar.runtime.serving.api_speech import ENCODED_FORMATS, pcm16

BATCH_TOL = 5e-5  # tests/test_kokoro.py: a Kokoro batch against each request alone
ORPHEUS_TOL = 1e-6  # SNAC's convs over a batch of windows differ from one window's by ~1e-8
KOKORO_VOICES = ["af_heart", "af_bella", "am_adam", "bf_emma", "bm_george"]
ORPHEUS_VOICES = ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
TEXT = "Hello there, this is a test."
PHONEMES = "həlˈO wˈɜɹld, ðɪs ɪz kəkˈɔɹO."
ORPHEUS_TOKENS = 70  # 10 frames of 7 audio tokens: 7 windows of audio




@pytest.fixture(scope="module")
def servers():
    procs = {"kokoro": BootingServer("--model", "tiny-kokoro"), "orpheus": BootingServer("--model", "tiny-orpheus"),
             "text": BootingServer("--model", "tiny-qwen3.5", "--max-model-len", "256")}
    try:
        yield {k: p.ready() for k, p in procs.items()}
    finally:
        stop_all(procs.values())


@pytest.fixture(scope="module")
def kokoro(servers):
    return servers["kokoro"]


@pytest.fixture(scope="module")
def orpheus(servers):
    return servers["orpheus"]


def _body(family: str, **kw) -> dict:
    b = {"input": TEXT, "seed": 7}
    if family == "orpheus":
        b["max_new_tokens"] = ORPHEUS_TOKENS
    b.update(kw)
    return b


def _err(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if param is not None:
        assert e["param"] == param, e
    return e


def _wav(data: bytes) -> tuple[int, bytes, int]:
    """(sample rate, the PCM after the header, the header's data size) of a mono 16-bit WAV."""
    riff, _, wave, fmt, _, tag, ch, rate, _, _, bits, dtag, size = struct.unpack("<4sI4s4sIHHIIHH4sI", data[:44])
    assert (riff, wave, fmt, dtag, tag, ch, bits) == (b"RIFF", b"WAVE", b"fmt ", b"data", 1, 1, 16)
    return rate, data[44:], size


def _sse(text: str) -> list[dict]:
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(json.loads(block[len("data: "):]))
    return events


def _deltas(events: list[dict]) -> bytes:
    return b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")


# -- formats ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["kokoro", "orpheus"])
def test_response_formats_decode_to_the_same_pcm(servers, family):
    import soundfile as sf
    s = servers[family]
    r = s.post("/v1/audio/speech", _body(family))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav" and r.headers["x-sample-rate"] == "24000"
    rate, pcm, size = _wav(r.content)
    assert rate == 24000 and size == len(pcm) > 0
    r = s.post("/v1/audio/speech", _body(family, response_format="pcm"))
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm" and r.content == pcm
    ref = np.frombuffer(pcm, "<i2")
    assert {"flac", "mp3"} <= set(ENCODED_FORMATS)  # this libsndfile writes both
    r = s.post("/v1/audio/speech", _body(family, response_format="flac"))
    assert r.status_code == 200 and r.headers["content-type"] == "audio/flac"
    got, got_rate = sf.read(io.BytesIO(r.content), dtype="int16")
    assert got_rate == 24000 and np.array_equal(got, ref)  # lossless
    r = s.post("/v1/audio/speech", _body(family, response_format="mp3"))
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    got, got_rate = sf.read(io.BytesIO(r.content), dtype="int16")
    assert got_rate == 24000 and abs(len(got) - len(ref)) <= 1152  # within one MPEG frame
    s.wait_idle()


# -- streaming -------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["kokoro", "orpheus"])
def test_streams_equal_the_whole_file(servers, family):
    s = servers[family]
    whole = s.post("/v1/audio/speech", _body(family, response_format="pcm")).content
    with httpx.stream("POST", s.url + "/v1/audio/speech", timeout=60,
                      json=_body(family, stream_format="audio")) as st:
        assert st.status_code == 200 and st.headers.get("transfer-encoding") == "chunked"
        assert st.headers["content-type"] == "audio/wav"
        parts = list(st.iter_raw())
    rate, pcm, size = _wav(b"".join(parts))
    assert rate == 24000 and size == 0xFFFFFFFF and pcm == whole
    if family == "orpheus":
        assert len(parts) >= 2  # the codec's windows arrive as they are decoded
    r = s.post("/v1/audio/speech", _body(family, stream_format="audio", response_format="pcm"))
    assert r.status_code == 200 and r.content == whole

    # SSE: the deltas are the audio stream's bytes; then one done event with the usage
    r = s.post("/v1/audio/speech", _body(family, stream_format="sse", response_format="pcm"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-sample-rate"] == "24000"
    events = _sse(r.text)
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) >= 2
    assert events[-1]["type"] == "speech.audio.done"
    assert _deltas(events) == whole
    u = events[-1]["usage"]
    assert set(u) == {"input_tokens", "output_tokens", "total_tokens"}
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    if family == "orpheus":  # the prompt's and the audio's tokens
        assert u["input_tokens"] > len(TEXT) and 0 < u["output_tokens"] <= ORPHEUS_TOKENS
    r = s.post("/v1/audio/speech", _body(family, stream_format="sse"))
    rate, pcm, size = _wav(_deltas(_sse(r.text)))
    assert size == 0xFFFFFFFF and pcm == whole
    s.wait_idle()


# -- fields ----------------------------------------------------------------------------------------
def test_phonemes_match_the_offline_api(kokoro, kokoro_llm):
    r = kokoro.post("/v1/audio/speech", {"phonemes": PHONEMES, "voice": "bf_emma", "seed": 3,
                                         "response_format": "pcm"})
    assert r.status_code == 200, r.text
    got = np.frombuffer(r.content, "<i2").astype(np.int32)
    (sp,) = kokoro_llm.synthesize(phonemes=PHONEMES, voice="bf_emma", seed=3)
    want = np.frombuffer(pcm16(sp.samples), "<i2").astype(np.int32)
    assert got.shape == want.shape and int(np.abs(got - want).max()) <= 1  # one LSB: float sums in two processes
    # the phonemes win over the text; language reaches the front end (another one, other audio)
    r = kokoro.post("/v1/audio/speech", {"phonemes": PHONEMES, "input": "ignored", "voice": "bf_emma", "seed": 3,
                                         "response_format": "pcm"})
    assert r.status_code == 200 and r.content == got.astype("<i2").tobytes()
    a = kokoro.post("/v1/audio/speech", {"input": "Bonjour", "language": "fr-fr", "response_format": "pcm"})
    b = kokoro.post("/v1/audio/speech", {"input": "Bonjour", "response_format": "pcm"})
    assert a.status_code == b.status_code == 200 and a.content != b.content


def test_voices(servers):
    assert servers["kokoro"].get("/v1/audio/voices").json() == {"voices": KOKORO_VOICES}
    assert servers["orpheus"].get("/v1/audio/voices").json() == {"voices": ORPHEUS_VOICES}
    e = _err(servers["text"].get("/v1/audio/voices"), 400, "model")
    assert e["code"] == "unsupported_endpoint" and "/v1/audio/voices" in e["message"]


def test_bad_requests_kokoro(kokoro):
    s = kokoro
    for body, param in (({"input": ""}, "input"), ({"input": "x" * 4097}, "input"), ({"voice": "af_heart"}, "input"),
                        ({"input": "x", "voice": "nobody"}, "voice"), ({"input": "x", "speed": 5}, "speed"),
                        ({"input": "x", "response_format": "ogg"}, "response_format"),
                        ({"input": "x", "response_format": "opus"}, "response_format"),
                        ({"input": "x", "stream_format": "sse", "voice": "nobody"}, "voice"),
                        ({"input": "x", "stream_format": "sse", "speed": 0.1}, "speed"),
                        ({"input": "x", "stream_format": "sse", "response_format": "mp3"}, "response_format"),
                        ({"input": "x", "stream_format": "audio", "response_format": "flac"}, "response_format"),
                        ({"input": "x", "stream_format": "video"}, "stream_format"),
                        ({"input": "x", "language": "x" * 33}, "language"), ({"input": "x", "language": 5}, "language"),
                        ({"phonemes": ""}, "phonemes"), ({"phonemes": "a" * (4 * 4096 + 1)}, "phonemes"),
                        ({"input": "x", "max_new_tokens": 0}, "max_new_tokens"), ({"input": "x", "foo": 1}, "foo"),
                        # Qwen3-TTS's fields: a model that does not list them refuses them
                        ({"input": "x", "task_type": "Base"}, "task_type"),
                        ({"input": "x", "initial_codec_chunk_frames": 4}, "initial_codec_chunk_frames"),
                        ({"input": "x", "stream": 3}, "stream")):
        _err(s.post("/v1/audio/speech", body), 400, param)
    # refused by the pipeline (its batch key), not by the route: still a 400, naming the field
    for stream in (None, "sse", "audio"):
        body = {"phonemes": "#%&", **({"stream_format": stream} if stream else {})}
        e = _err(s.post("/v1/audio/speech", body), 400, "phonemes")
        assert "no phonemes in Kokoro's vocabulary" in e["message"]
    e = _err(s.post("/v1/audio/speech", {"input": "。。。"}), 400, "input")
    assert _err(s.post("/v1/completions", {"prompt": "hi"}), 400, "model")["code"] == "unsupported_endpoint"
    assert s.post("/v1/audio/speech", {"input": "still fine"}).status_code == 200
    m = s.wait_idle()
    assert m['mstar_requests_total{endpoint="speech",outcome="bad_request"}'] >= 3


def test_bad_requests_orpheus(orpheus):
    s = orpheus
    for body, param in (({"input": "x", "speed": 1.5}, "speed"), ({"input": "x", "voice": "bob"}, "voice"),
                        ({"input": " "}, "input"), ({"phonemes": "abc"}, "phonemes"),
                        ({"input": "x", "phonemes": "abc"}, "phonemes"),  # a text model reads no phonemes
                        # the family's hooks refuse these in the engine (media_request: "field: message")
                        ({"input": "x", "instructions": "whisper"}, "instructions"),
                        ({"input": "x", "instructions": "whisper", "stream_format": "sse"}, "instructions"),
                        # more tokens than the context holds: the engine's max_tokens, named as the route's field
                        ({"input": "x", "max_new_tokens": 65536}, "max_new_tokens")):
        e = _err(s.post("/v1/audio/speech", body), 400, param)
        assert e["code"] not in ("internal_error",)
    s.wait_idle()


def test_speech_on_a_text_model(servers):
    s = servers["text"]
    e = _err(s.post("/v1/audio/speech", {"input": "hello"}), 400, "model")
    assert e["code"] == "unsupported_endpoint" and "/v1/completions" in e["message"]


# -- the offline API -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kokoro_llm():
    return LLM("tiny-kokoro", device="cpu")


@pytest.fixture(scope="module")
def orpheus_llm():
    return LLM("tiny-orpheus", device="cpu")


def test_synthesize_kokoro_batched_equals_alone(kokoro_llm):
    llm = kokoro_llm
    items = ["Hello there.", {"input": "Good morning!", "voice": "am_adam", "seed": 11}, {"phonemes": "ðɪs ɪz ɪt."}]
    before = llm.engine.stage_batches[0]
    batched = llm.synthesize(items, seed=5, speed=1.1)
    assert llm.engine.stage_batches[0] - before == 1  # one forward for the three
    assert all(isinstance(sp, Speech) and sp.sample_rate == 24000 and sp.samples.dtype == np.float32
               for sp in batched)
    for item, want_seed, got in zip(items, (5, 11, 5), batched):
        (alone,) = llm.synthesize(item, seed=want_seed, speed=1.1)
        assert got.samples.shape == alone.samples.shape and len(alone.samples) > 0
        assert float(np.abs(got.samples - alone.samples).max()) < BATCH_TOL
    assert len({len(sp.samples) for sp in batched}) == 3  # the rows really differ


def test_synthesize_orpheus_batched_equals_alone(orpheus_llm):
    llm = orpheus_llm
    texts = ["Hello there.", "A second, longer line of text.", "Third."]
    batched = llm.synthesize(texts, "leo", seed=[1, 2, 3], max_new_tokens=ORPHEUS_TOKENS)
    for t, seed, got in zip(texts, (1, 2, 3), batched):
        (alone,) = llm.synthesize(t, "leo", seed=seed, max_new_tokens=ORPHEUS_TOKENS)
        assert got.sample_rate == alone.sample_rate == 24000
        assert got.samples.shape == alone.samples.shape and len(alone.samples) > 0
        assert float(np.abs(got.samples - alone.samples).max()) <= ORPHEUS_TOL
    assert not np.array_equal(batched[0].samples, batched[1].samples)


def test_synthesize_bad_inputs(kokoro_llm, orpheus_llm):
    for llm, kw, field in ((kokoro_llm, {"texts_or_inputs": "x", "voice": "nobody"}, "voice"),
                           (kokoro_llm, {"texts_or_inputs": ""}, "input"),
                           (kokoro_llm, {}, "input"),
                           (kokoro_llm, {"texts_or_inputs": ["a", "b"], "seed": [1]}, "seed"),
                           (kokoro_llm, {"texts_or_inputs": ["a", 3]}, "input"),
                           (kokoro_llm, {"phonemes": "#%&"}, "input"),  # the pipeline's refusal
                           (orpheus_llm, {"texts_or_inputs": "x", "speed": 1.5}, "speed"),
                           (orpheus_llm, {"texts_or_inputs": {"input": "x", "instructions": "sad"}}, "instructions"),
                           (orpheus_llm, {"texts_or_inputs": "x", "max_new_tokens": 0}, "max_new_tokens")):
        with pytest.raises(RequestError) as ei:
            llm.synthesize(**kw)
        assert ei.value.field == field, (kw, ei.value)
    assert not kokoro_llm.engine.has_unfinished() and not orpheus_llm.engine.has_unfinished()
    with pytest.raises(RequestError, match="generates media"):
        kokoro_llm.generate([[1, 2, 3]])


# -- last: the engine dies mid-stream -------------------------------------------------------------
def test_engine_death_mid_sse_stream_is_an_error_event(orpheus):
    s = orpheus
    pid = s.engine_pid
    events = []
    with httpx.stream("POST", s.url + "/v1/audio/speech", timeout=60,
                      json={"input": "a long one", "max_new_tokens": 4000, "stream_format": "sse", "seed": 1}) as st:
        assert st.status_code == 200
        buf = ""
        for text in st.iter_text():
            buf += text
            while "\n\n" in buf:
                block, buf = buf.split("\n\n", 1)
                events.append(json.loads(block[len("data: "):]))
                if len(events) == 1:
                    os.kill(pid, signal.SIGKILL)  # our server's engine process
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "engine_dead", events[-1]
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
    deadline = time.monotonic() + 120
    while s.get("/health").status_code != 200:  # the server restarts its engine
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert s.post("/v1/audio/speech", _body("orpheus")).status_code == 200
