"""What a careless user or a hostile client sends must hurt nobody else: each case below is
a 4xx in OpenAI's error schema (or is served correctly), the engine stays alive, and the
server is idle again afterwards. The engine dying (restart, exit once restarts are spent) is
in test_server_errors.py; the fuzz suite (test_server_fuzz.py) keeps the whole surface so.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import tempfile
import threading
import time

import httpx
import pytest
from engine_helpers import engine, greedy_requests, prompts, run_all
from server_harness import ServerProc

MODEL = "tiny-qwen3.5"
KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LEN = 512


@pytest.fixture(scope="module")
def server():
    with tempfile.NamedTemporaryFile("w", suffix=".key", delete=False) as f:
        f.write(KEY + "\n")
    s = ServerProc("--api-key-file", f.name, "--max-model-len", str(MAX_LEN), "--max-pending", "8",
                   "--max-request-tokens", "2048", "--timeout-header", "1", "--timeout-body", "1")
    yield s
    s.close()
    os.unlink(f.name)


def post(server, path, body=None, *, raw: bytes | None = None, ctype="application/json", timeout=60):
    headers = dict(AUTH)
    if ctype is not None:
        headers["Content-Type"] = ctype
    data = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=data, headers=headers, timeout=timeout)


def check_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


def still_serving(server) -> None:
    r = post(server, "/v1/completions", completion(temperature=0))
    assert r.status_code == 200, r.text
    assert server.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------
# sampling parameters the engine's tensors cannot hold

@pytest.mark.parametrize("top_k", [2 ** 31, 2 ** 63, 2 ** 64, 10 ** 30, -2])
def test_top_k_out_of_range_is_a_400_and_the_engine_lives(server, top_k):
    check_error(post(server, "/v1/completions", completion(top_k=top_k)), 400, param="top_k")
    still_serving(server)


def test_top_k_largest_allowed_is_served(server):
    assert post(server, "/v1/completions", completion(top_k=2 ** 31 - 1)).status_code == 200


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"])
def test_integer_past_float_range_is_a_400(server, field):
    raw = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "%s": 1%s}' % (MODEL.encode(), field.encode(),
                                                                           b"0" * 400)
    check_error(post(server, "/v1/completions", raw=raw), 400, param=field)
    still_serving(server)


@pytest.mark.parametrize("raw_value", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_nan_and_infinity_are_400s(server, raw_value):
    raw = b'{"model": "%s", "prompt": "hi", "temperature": %s}' % (MODEL.encode(), raw_value)
    check_error(post(server, "/v1/completions", raw=raw), 400)


@pytest.mark.parametrize("body", [completion(repetition_penalty=1e-300, logprobs=2),
                                  completion(repetition_penalty=1e300), completion(temperature=1e30),
                                  completion(seed=2 ** 70), completion(stop=["x"] * 65),
                                  completion(stop_token_ids=list(range(1025)))])
def test_degenerate_sampling_is_refused(server, body):
    check_error(post(server, "/v1/completions", body), 400)


def test_tiny_temperature_samples_greedily(server):
    """temperature 1e-45 underflows float32: it samples as temperature 0 does (never garbage)."""
    prompt = [5, 17, 42, 99]
    want = post(server, "/v1/completions", completion(prompt=prompt, max_tokens=12, temperature=0,
                                                       ignore_eos=True, return_token_ids=True)).json()
    for t in (1e-45, 1e-7):
        got = post(server, "/v1/completions", completion(prompt=prompt, max_tokens=12, temperature=t, seed=3,
                                                          ignore_eos=True, return_token_ids=True)).json()
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]


def test_logprobs_are_finite_json(server):
    """With the strongest penalty allowed, every logprob is a finite number (never NaN)."""
    for stream in (False, True):
        r = post(server, "/v1/completions", completion(max_tokens=8, logprobs=3, repetition_penalty=0.01,
                                                        frequency_penalty=2, stream=stream, ignore_eos=True))
        assert r.status_code == 200
        text = r.text
        assert "NaN" not in text and "Infinity" not in text
        bodies = [json.loads(ln[5:]) for ln in text.splitlines() if ln.startswith("data: {")] if stream \
            else [r.json()]
        lps = [v for b in bodies for c in b["choices"] for v in (c["logprobs"] or {}).get("token_logprobs", [])]
        assert lps and all(math.isfinite(v) for v in lps)


def test_engine_refuses_a_bad_request_alone():
    """Straight into the engine (no API in front): a top_k the sampler's int64 table cannot hold
    is refused at add_request, and the other requests run to their end."""
    from mstar.runtime.engine.request import EngineRequest, RequestError, SamplingParams
    core = engine("qwen3.5", max_num_seqs=4)
    good = greedy_requests(prompts(2, 3, 9, seed=11), 5)
    bad = SamplingParams(max_tokens=5)
    bad.top_k = 2 ** 63  # set after construction, as a buggy caller would
    with pytest.raises(RequestError) as e:
        core.add_request(EngineRequest("bad", [1, 2, 3], bad))
    assert e.value.field == "top_k"
    out = run_all(core, good)
    assert all(len(toks) == 5 and fin == "length" for toks, fin in out.values())


# ---------------------------------------------------------------------------------------
# bounded work per request

def test_more_sequences_than_max_pending_is_a_400_even_when_idle(server):
    t0 = time.monotonic()
    r = post(server, "/v1/completions", completion(prompt=[[1]] * 200_000))
    check_error(r, 400, param="prompt", code="request_too_large")
    check_error(post(server, "/v1/completions", completion(n=9)), 400, param="n", code="request_too_large")
    assert time.monotonic() - t0 < 10
    still_serving(server)
    server.wait_idle()


def test_prompt_tokens_per_request_are_bounded(server):
    # 8 prompts of 300 ids: each fits the context, together past --max-request-tokens 2048
    r = post(server, "/v1/completions", completion(prompt=[[7] * 300] * 8, max_tokens=1))
    check_error(r, 400, param="prompt", code="request_too_large")
    still_serving(server)


def test_aborted_requests_never_reach_the_engine():
    """Adds queued ahead of their abort are skipped, not added and then aborted: an abort never
    waits behind the adds queued before it."""
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_process import EngineProcess
    from mstar.runtime.engine.request import EngineRequest, SamplingParams
    ep = EngineProcess(EngineConfig(model=MODEL), factory="mstar.runtime.engine.synthetic_engine:SyntheticEngine")
    doomed = [EngineRequest(f"d{i}", [1, 2, 3], SamplingParams(max_tokens=50)) for i in range(3000)]
    ep.add(doomed)
    ep.abort([r.request_id for r in doomed])
    ep.add(EngineRequest("live", [4, 5], SamplingParams(max_tokens=3)))
    seen: dict[str, list] = {}
    done = threading.Event()

    def on_message(msg):
        if msg[0] == "step":
            for o in msg[1]:
                seen.setdefault(o.request_id, []).append(o)
                if o.request_id == "live" and o.finished:
                    done.set()

    try:
        ep.start()
        ep.wait_ready(120)
        ep.start_reader(on_message)
        assert done.wait(60)
        assert set(seen) == {"live"}, sorted(seen)[:5]
    finally:
        ep.shutdown()


# ---------------------------------------------------------------------------------------
# tokenization off the event loop, after a length bound

def _stream_gaps(server, stop: threading.Event, out: list) -> None:
    """Stream a long generation, noting the largest gap between events until `stop`."""
    body = completion(prompt=[3, 4], max_tokens=MAX_LEN - 2, ignore_eos=True, stream=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        last = time.monotonic()
        for ln in r.iter_lines():
            now = time.monotonic()
            if ln.startswith("data:"):
                out.append(now - last)
                last = now
            if stop.is_set():
                break


def test_huge_prompt_is_refused_fast_and_stalls_no_stream(server):
    stop, gaps = threading.Event(), []
    t = threading.Thread(target=_stream_gaps, args=(server, stop, gaps))
    t.start()
    while not gaps:
        time.sleep(0.05)
    n_before = len(gaps)
    t0 = time.monotonic()
    check_error(post(server, "/v1/completions", completion(prompt="x" * 10_000_000)), 400, param="prompt")
    check_error(post(server, "/tokenize", {"model": MODEL, "prompt": "y" * 10_000_000}), 400,
                code="context_length_exceeded")
    check_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "z" * 10_000_000}]}), 400, code="context_length_exceeded")
    took = time.monotonic() - t0
    time.sleep(0.3)
    stop.set()
    t.join(60)
    assert took < 10, took
    assert len(gaps) > n_before and max(gaps[n_before:]) < 2.0, max(gaps[n_before:])
    server.wait_idle()


# ---------------------------------------------------------------------------------------
# JSON and Unicode

def test_deep_nesting_is_a_400(server):
    for depth in (65, 10_000):
        raw = b'{"model": "%s", "prompt": %s1%s}' % (MODEL.encode(), b"[" * depth, b"]" * depth)
        check_error(post(server, "/v1/completions", raw=raw), 400, code="invalid_json")
    still_serving(server)
    assert "Traceback" not in server.log_text()


@pytest.mark.parametrize("path,raw", [
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("/v1/completions", b'{"model": "%s", "prompt": "\\udfff"}'),
    ("/tokenize", b'{"model": "%s", "prompt": "x\\ud83d"}'),
])
def test_lone_surrogate_is_a_400(server, path, raw):
    check_error(post(server, path, raw=raw % MODEL.encode()), 400, code="invalid_json")


def test_surrogate_pair_is_served(server):
    raw = b'{"model": "%s", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}' % MODEL.encode()
    assert post(server, "/v1/completions", raw=raw).status_code == 200


def test_sse_data_lines_are_ascii(server):
    """Line separators in the text (here the echoed prompt) travel escaped: a line-based SSE
    reader sees every event whole."""
    prompt = "a\u2028b\u2029c\u0085d \u00e9\u4e2d"
    body = completion(prompt=prompt, echo=True, stream=True, max_tokens=3)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        raw = r.read()
    assert raw.isascii()
    lines = [ln for ln in raw.decode().split("\n") if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    texts = [json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]]
    assert "".join(texts).startswith(prompt)


# ---------------------------------------------------------------------------------------
# browser surface, secrets, slow clients

@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_json_routes_need_a_json_content_type(server, ctype):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        check_error(post(server, path, completion(), ctype=ctype), 415, code="unsupported_media_type")


def test_json_content_type_variants_are_served(server):
    for ctype in ("application/json; charset=utf-8", "Application/JSON", None):
        assert post(server, "/v1/completions", completion(), ctype=ctype).status_code == 200


def test_nosniff_on_every_response(server):
    rs = [server.get("/health"), server.get("/metrics"), server.get("/nothing"),
          post(server, "/v1/completions", completion()), post(server, "/v1/completions", completion(stream=True)),
          post(server, "/v1/completions", completion(), ctype="text/plain")]
    for r in rs:
        assert r.headers.get("x-content-type-options") == "nosniff", (r.url, r.status_code)


def test_health_shows_internals_only_with_the_key(server):
    public = server.get("/health")
    assert public.status_code == 200 and public.json() == {"status": "ok", "engine": "alive"}
    private = server.get("/health", headers=AUTH).json()
    assert private["engine_pid"] == server.engine_pid and "device" in private
    assert "engine_pid" not in server.get("/health", headers={"Authorization": "Bearer wrong"}).json()


def test_api_key_from_file_is_required(server):
    r = httpx.post(server.url + "/v1/completions", json=completion(), timeout=30)
    check_error(r, 401, code="invalid_api_key")


def test_api_key_from_the_environment():
    from mstar import knobs
    from mstar.runtime.serving.serve import api_key, parse_args
    with knobs.override(MSTAR_API_KEY="sk-env"):
        assert api_key(parse_args([])) == "sk-env"
        assert api_key(parse_args(["--api-key", "sk-flag"])) == "sk-flag"
    assert api_key(parse_args([])) is None
    with pytest.raises(ValueError):
        api_key(parse_args(["--api-key-file", "/nonexistent/key"]))


def test_silent_and_slow_connections_are_closed(server):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))
    half = socket.create_connection((host, int(port)))
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    for sock in (silent, half):
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
        assert time.monotonic() - t0 < 5
        sock.close()
    # a body that stops arriving: a 408 after --timeout-body
    slow = socket.create_connection((host, int(port)))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"model\":")
    slow.settimeout(10)
    reply = slow.recv(65536)
    slow.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    still_serving(server)


# ---------------------------------------------------------------------------------------
# drain past --drain-timeout (last: it stops its own server)

def test_drain_timeout_ends_every_request_with_an_error_body():
    s = ServerProc("--drain-timeout", "2", "--max-model-len", "4096")
    long = {"model": MODEL, "prompt": [1, 2], "max_tokens": 4000, "ignore_eos": True}
    out: dict = {}

    def plain():
        r = httpx.post(s.url + "/v1/completions", json=long, timeout=60)
        out["plain"] = (r.status_code, r.json())

    def stream():
        with httpx.stream("POST", s.url + "/v1/completions", json=dict(long, stream=True), timeout=60) as r:
            out["lines"] = [ln for ln in r.iter_lines() if ln.startswith("data:")]

    try:
        ts = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in ts:
            t.start()
        time.sleep(1.5)
        s.proc.send_signal(signal.SIGTERM)
        for t in ts:
            t.join(60)
        assert s.proc.wait(60) == 0
        status, body = out["plain"]
        assert status == 503 and body["error"]["code"] == "server_shutting_down", body
        lines = out["lines"]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][5:])["error"]["code"] == "server_shutting_down"
        assert "Traceback" not in s.log_text() and "Internal Server Error" not in s.log_text()
    finally:
        s.close()
