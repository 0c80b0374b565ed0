"""Property-based fuzz of the media routes of live servers: /v1/images/generations, /v1/videos/sync,
the async video jobs (POST /v1/videos, then GET its record, GET its content and DELETE it; and those
paths with ids that name no job) and /v1/audio/speech, served by the test families (toy-image and
toy-speech of toy_stages.py: small random models that answer in milliseconds).

Hypothesis builds each route's valid bodies and mutates them (http_fuzz: wrong types, extreme
numbers, huge strings, lone surrogates, deep nesting, unknown fields), and sends malformed bodies
and other Content-Types. Every answer must hold http_fuzz.check's properties (never a 5xx or a hang,
every 4xx in OpenAI's error schema, the server serving afterwards), and a 200 must be what its route
promises: n PNGs, an MP4, a job record that reads back, WAV / PCM, or server-sent events of strict
JSON. At the end both servers are idle and no request killed an engine.

    FUZZ_EXAMPLES=2000 pytest -q tests/test_media_fuzz.py   # a longer run
"""

from __future__ import annotations

import base64
import json
import struct
from urllib.parse import quote

import numpy as np
import pytest
import toy_stages as T
from http_fuzz import (FUZZ, JSON_TYPES, NON_JSON_TYPES, UNCLEAR_TYPES, LiveServer, Req, check, encode, fail,
                       is_json_object, json_req, mutated, nasty_values, short_text, strict_json)
from hypothesis import given
from hypothesis import strategies as st
from server_harness import toy_families_env

from mstar.runtime.serving.api_media import png_bytes

pytest.importorskip("av")

IMAGE_MODEL, SPEECH_MODEL = "toy-image", "toy-speech"
JSON_ROUTES = ("/v1/images/generations", "/v1/videos", "/v1/videos/sync", "/v1/audio/speech")
JSON_REPLIES = ("/v1/images/generations", "/v1/videos")  # the others answer with the media itself
MAX_VIDEO_JOBS = 4


@pytest.fixture(scope="module")
def live():
    env = toy_families_env()
    servers = {"image": LiveServer(IMAGE_MODEL, "--max-video-jobs", str(MAX_VIDEO_JOBS), env=env),
               "speech": LiveServer(SPEECH_MODEL, env=env)}
    yield servers
    for s in servers.values():
        s.close()


def server_of(live, path: str) -> LiveServer:
    return live["speech" if path.startswith("/v1/audio") else "image"]


# =========================================================================================
# valid bodies

def prompts():
    # the toy models fail a prompt that starts "raise:" and slow down on "slow:" (on purpose)
    return short_text().map(lambda t: "x" + t if t.startswith(("raise:", "slow:")) else t)


def sizes():
    return st.sampled_from(list(T.SIZES) + ["64x64", "32x33", "0x32", "32X32", " 32x32", "99999x99999"])


def generation_fields():
    return {"negative_prompt": prompts(), "num_inference_steps": st.integers(1, 8),
            "guidance_scale": st.floats(0, 20), "flow_shift": st.floats(0.01, 100), "seed": st.integers(0, 2 ** 32),
            "user": short_text(), "model": st.just(IMAGE_MODEL)}


def image_bodies():
    return st.fixed_dictionaries({"prompt": prompts()}, optional={
        "n": st.integers(1, 3), "size": sizes(), "response_format": st.sampled_from(["b64_json", "url"]),
        "output_format": st.sampled_from(["png", "jpeg"]), **generation_fields()})


def _png_data_url() -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(np.zeros((32, 32, 3), np.uint8))).decode()


def video_bodies():
    length = st.one_of(st.fixed_dictionaries({"num_frames": st.integers(1, 4)}),
                       st.fixed_dictionaries({"seconds": st.sampled_from([0.25, 0.5, 1, "0.5", "1"])}),
                       st.just({}))
    shape = st.one_of(st.fixed_dictionaries({"size": sizes()}),
                      st.fixed_dictionaries({"width": st.sampled_from([32, 64]), "height": st.just(32)}),
                      st.just({}))
    extra = st.fixed_dictionaries({}, optional={
        "fps": st.sampled_from([1, 8, 24.5, 120]),
        "input_reference": st.sampled_from([_png_data_url(), "aGVsbG8=", "data:text/plain;base64,aGk="]),
        **generation_fields()})
    return st.builds(lambda p, a, b, c: {"prompt": p, **a, **b, **c}, prompts(), length, shape, extra)


def speech_bodies():
    return st.fixed_dictionaries({"input": prompts()}, optional={
        "model": st.just(SPEECH_MODEL), "voice": st.sampled_from(list(T.VOICES) + ["nova", ""]),
        "response_format": st.sampled_from(["wav", "pcm", "flac", "mp3", "opus", "aac"]),
        "speed": st.one_of(st.floats(0.25, 4), st.sampled_from([0.2, 1, 4.5])),
        "stream_format": st.sampled_from(["audio", "sse", "chunked"]), "stream": st.booleans(),
        "instructions": short_text(), "seed": st.integers(0, 2 ** 32), "language": st.sampled_from(["en", "", "x" * 40]),
        "max_new_tokens": st.integers(1, 64), "phonemes": short_text(), "ref_audio": short_text()})


IMAGE_FIELDS = ["model", "prompt", "n", "size", "response_format", "output_format", "seed", "user",
                "negative_prompt", "num_inference_steps", "guidance_scale", "flow_shift"]
VIDEO_FIELDS = ["model", "prompt", "negative_prompt", "size", "width", "height", "seconds", "num_frames", "fps",
                "num_inference_steps", "guidance_scale", "flow_shift", "seed", "input_reference", "image_reference",
                "user"]
SPEECH_FIELDS = ["model", "input", "voice", "response_format", "speed", "stream_format", "stream", "instructions",
                 "seed", "max_new_tokens", "language", "phonemes", "task_type", "ref_audio", "ref_text",
                 "initial_codec_chunk_frames", "non_streaming_mode"]


def requests(path: str, bodies, fields):
    return st.builds(lambda b, a: json_req(path, b, ascii_only=a), mutated(bodies, fields), st.booleans())


# =========================================================================================
# what a 200 must be

def _is_mp4(raw: bytes) -> bool:
    return raw[4:8] == b"ftyp"


def check_image(raw: bytes, body) -> None:
    out = strict_json(raw.decode())
    n = body.get("n", 1) if isinstance(body, dict) else 1
    data = out.get("data") if isinstance(out, dict) else None
    if not isinstance(data, list) or len(data) != n:
        fail("images: not n images", raw[:300].decode("utf-8", "replace"))
    for d in data:
        if base64.b64decode(d["b64_json"])[:8] != b"\x89PNG\r\n\x1a\n":
            fail("images: b64_json is not a PNG", str(d)[:200])


def check_speech(headers: dict, raw: bytes) -> None:
    ctype = headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    strict_json(line[5:].decode())
                except ValueError as e:
                    fail("speech SSE data line is not strict JSON", f"{e}: {line[:200]!r}")
    elif ctype == "audio/wav":
        riff, _, wave = struct.unpack("<4sI4s", raw[:12])
        if (riff, wave) != (b"RIFF", b"WAVE"):
            fail("speech: audio/wav is not a WAV", repr(raw[:44]))
    elif ctype == "audio/pcm":
        if len(raw) % 2:
            fail("speech: 16-bit PCM of an odd length", str(len(raw)))
    elif not ctype.startswith("audio/"):
        fail(f"speech: a 200 of {ctype!r}", repr(raw[:200]))


def check_video_job(s: LiveServer, raw: bytes) -> None:
    """A created job: its record reads back under its id; DELETE it (so that the job limit does not
    turn the next examples into 503s), and then it is gone."""
    job = strict_json(raw.decode())
    vid = job.get("id") if isinstance(job, dict) else None
    if not isinstance(vid, str) or job.get("object") != "video":
        fail("videos: a 200 that is not a job record", raw[:300].decode("utf-8", "replace"))
    status, _, rec = check(s, Req("GET", f"/v1/videos/{vid}"), JSON_REPLIES)
    if status != 200 or strict_json(rec.decode())["id"] != vid:
        fail("videos: a created job does not read back", f"{status}: {rec[:300]!r}")
    status, _, _ = check(s, Req("GET", f"/v1/videos/{vid}/content"))
    if status not in (200, 409):
        fail(f"videos: content of a live job is {status}")
    status, _, _ = check(s, Req("DELETE", f"/v1/videos/{vid}"))
    if status != 200:
        fail(f"videos: DELETE of a live job is {status}")
    status, _, _ = check(s, Req("GET", f"/v1/videos/{vid}"))
    if status != 404:
        fail(f"videos: a deleted job reads as {status}")


def send(live, req: Req, body=None) -> int:
    s = server_of(live, req.path)
    status, headers, raw = check(s, req, JSON_REPLIES)
    if status == 200 and isinstance(body, dict):
        if req.path == "/v1/images/generations":
            check_image(raw, body)
        elif req.path == "/v1/videos/sync":
            if headers.get("content-type") != "video/mp4" or not _is_mp4(raw):
                fail("videos/sync: a 200 that is not an MP4", repr(raw[:100]))
        elif req.path == "/v1/videos":
            check_video_job(s, raw)
        elif req.path == "/v1/audio/speech":
            check_speech(headers, raw)
    return status


def _body_of(req: Req):
    try:
        return json.loads(req.content)
    except (ValueError, RecursionError):
        return None


# =========================================================================================
# the tests

SMALL = {"/v1/images/generations": {"prompt": "a cat", "size": "32x32", "seed": 1},
         "/v1/videos": {"prompt": "a clip", "size": "32x32", "num_frames": 2, "seed": 1},
         "/v1/videos/sync": {"prompt": "a clip", "size": "32x32", "num_frames": 2, "seed": 1},
         "/v1/audio/speech": {"input": "hello", "voice": "echo"}}


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_small_valid_bodies_are_served(live, path):
    req = json_req(path, SMALL[path])
    assert send(live, req, SMALL[path]) == 200


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_text_plain_is_415(live, path):
    status, _, _ = check(server_of(live, path), json_req(path, SMALL[path], content_type="text/plain"))
    assert status == 415


@FUZZ
@given(req=requests("/v1/images/generations", image_bodies(), IMAGE_FIELDS))
def test_images(live, req):
    send(live, req, _body_of(req))


@FUZZ
@given(req=st.one_of(requests("/v1/videos/sync", video_bodies(), VIDEO_FIELDS),
                     requests("/v1/videos", video_bodies(), VIDEO_FIELDS)))
def test_videos(live, req):
    send(live, req, _body_of(req))


@FUZZ
@given(req=requests("/v1/audio/speech", speech_bodies(), SPEECH_FIELDS))
def test_speech(live, req):
    send(live, req, _body_of(req))


@FUZZ
@given(path=st.sampled_from(JSON_ROUTES),
       content=st.one_of(st.sampled_from([b"", b"null", b"[]", b"{", b'"x"', b"\xff\xfe", b"NaN", b"1e400"]),
                         nasty_values().map(lambda v: encode(v))))
def test_malformed_bodies(live, path, content):
    status = send(live, Req("POST", path, content, {"Content-Type": "application/json"}))
    if is_json_object(content) is False and not 400 <= status < 500:
        fail("a body that is not a JSON object is not a 4xx", f"{status}: {content[:200]!r}")


@FUZZ
@given(path=st.sampled_from(JSON_ROUTES), ct=st.sampled_from(NON_JSON_TYPES + JSON_TYPES + UNCLEAR_TYPES))
def test_content_types(live, path, ct):
    status = send(live, json_req(path, SMALL[path], content_type=ct), SMALL[path])
    if ct in NON_JSON_TYPES and status != 415:
        fail("a JSON route does not answer a non-JSON Content-Type with 415", f"{ct} -> {status}")
    if ct in JSON_TYPES and status == 415:
        fail("a JSON route refuses a JSON Content-Type (415)", ct)


@FUZZ
@given(vid=st.one_of(short_text(), st.sampled_from(["video_0", "vid-" + "0" * 32, "..", "%00", "a/b", " "])),
       tail=st.sampled_from(["", "/content"]), method=st.sampled_from(["GET", "DELETE", "POST", "PUT"]))
def test_job_paths_of_no_job(live, vid, tail, method):
    path = "/v1/videos/" + quote(vid, safe="") + tail
    status = send(live, Req(method, path, b"{}" if method in ("POST", "PUT") else b"",
                            {"Content-Type": "application/json"} if method in ("POST", "PUT") else {}))
    if status not in (404, 405):
        fail(f"a path of no video job is {status}", path)


def test_idle_and_alive_at_the_end(live):
    """Runs last: both engines alive, nothing running, waiting or pending, and no request along the
    way killed an engine."""
    for s in live.values():
        assert s.health() == 200
        s.proc.wait_idle(timeout=60)
        assert not s.deaths, (f"{len(s.deaths)} request(s) killed the engine; the server log before the first "
                              f"restart:\n{s.deaths[0]}")
