"""Property-based fuzz of the live HTTP server (`python -m mstar.runtime.serve`, the tiny Qwen3.5).

Hypothesis builds request bodies from the OpenAI schemas of every route (/v1/completions,
/v1/chat/completions, /tokenize, /detokenize, the GET routes, /v1/audio/transcriptions), then
mutates them: wrong types, boundary and extreme numbers (2**63, 2**64, 10**400 as raw JSON
digits, 1e-300, -0.0, NaN/Infinity literals), huge strings and lists, lone surrogates and
U+2028/U+0085/NUL, thousands of nesting levels, unknown fields, non-object and empty bodies,
invalid UTF-8, wrong Content-Types. The bytes are written by hand (not only `json=`), so raw
JSON text that json.dumps cannot produce gets through.

Every example must hold:
  * the status is 2xx or 4xx, never 5xx, and the answer comes within TIMEOUT_S (a hang fails);
  * every 4xx (404/405 included) is OpenAI's error body {"error": {"message", "type", "param", "code"}};
  * a 2xx JSON body is strict JSON (no NaN/Infinity);
  * a stream (stream: true) is server-sent events whose every `data:` line is ASCII-only strict
    JSON (no error event) or `[DONE]`, and it ends with `data: [DONE]`;
  * JSON routes answer a non-JSON Content-Type (text/plain, a form, ...) with 415;
  * the server still serves afterwards (GET /health is 200).
At the end of the module the engine is alive, /metrics is back to idle (no running or waiting
request, no KV page used, nothing pending) and no request killed the engine.

Besides the generated examples, `test_known_shapes` sends every run a few fixed requests of the
shapes that broke the server before (Hypothesis stops exploring soon after the first failures it
finds, so the generated examples alone could miss them while another bug is open).

A request that kills the engine fails its example; the server is then restarted (and the death
recorded, so the last test fails too), so that the later examples and Hypothesis' shrinking see
a live server. Each kind of failure (the status and message of a 5xx, a hang, a bad SSE line...)
raises its own exception class, so Hypothesis reports the distinct failures separately.

Seeded and bounded: derandomized, no example database, FUZZ_EXAMPLES examples per test
(default 80: about 40 s on a 2-core CPU machine). A longer run (about 10 minutes):

    FUZZ_EXAMPLES=2000 pytest -q tests/test_server_fuzz.py

`--hypothesis-show-statistics` shows the mix of statuses each test saw.
"""

from __future__ import annotations

import json
import os
from urllib.parse import quote

import http_fuzz as H
import httpx
import pytest
from http_fuzz import (FUZZ, JSON_TYPES, NON_JSON_TYPES, RAW_NUMBERS, UNCLEAR_TYPES, LiveServer, Raw, Req,
                       deep_nesting, encode, fail, is_json_object, json_values, mutated, short_text, strict_json)
from hypothesis import given
from hypothesis import strategies as st

MODEL = "tiny-qwen3.5"
MAX_LEN = 256
VOCAB = H.BYTE_VOCAB
SERVER_ARGS = ("--max-model-len", str(MAX_LEN), "--max-num-seqs", "16", "--max-pending", "64",
               "--drain-timeout", "5")

JSON_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
POST_ROUTES = JSON_ROUTES + ("/v1/audio/transcriptions", "/v1/audio/translations")
GET_ROUTES = ("/v1/models", "/health", "/metrics", "/version")


# =========================================================================================
# the server under test

@pytest.fixture(scope="module")
def live():
    s = LiveServer(*SERVER_ARGS)
    yield s
    s.close()


# =========================================================================================
# requests: bytes written by hand

def json_req(path: str, body, **kw) -> Req:
    stream = path in ("/v1/completions", "/v1/chat/completions") and isinstance(body, dict) \
        and body.get("stream") is True
    return H.json_req(path, body, stream=stream, **kw)


def check(live: LiveServer, req: Req) -> tuple[int, dict, bytes]:
    return H.check(live, req, JSON_ROUTES)


# =========================================================================================
# strategies: values

# =========================================================================================
# strategies: valid bodies of each route (coherent, so that most of them are served)

def token_ids():
    return st.integers(0, VOCAB - 1)


def prompts():
    """OpenAI's four prompt shapes: str | [str] | [int] | [[int]]."""
    return st.one_of(short_text(), st.lists(short_text(), min_size=1, max_size=4),
                     st.lists(token_ids(), min_size=1, max_size=32),
                     st.lists(st.lists(token_ids(), min_size=1, max_size=16), min_size=1, max_size=3))


def sampling_fields():
    """The sampling fields both generation routes share (OpenAI's and vLLM's)."""
    return st.fixed_dictionaries({}, optional={
        "model": st.just(MODEL),
        "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1, 0.0, 2])),
        "top_p": st.one_of(st.floats(1e-6, 1), st.just(1)),
        "top_k": st.one_of(st.sampled_from([-1, 0, 1, VOCAB]), st.integers(1, 2 * VOCAB)),
        "min_p": st.floats(0, 1),
        "n": st.integers(1, 4),
        "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=4)),
        "stop_token_ids": st.lists(token_ids(), max_size=4),
        "seed": st.integers(-2 ** 63, 2 ** 64 - 1),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.one_of(st.floats(0.01, 2), st.sampled_from([1e-300, 1e-45, 1e-7])),
        "stream": st.booleans(),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 4),
        "logit_bias": st.just({}),
        "user": short_text(),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "spaces_between_special_tokens": st.booleans(),
        "return_token_ids": st.booleans(),
        "add_special_tokens": st.booleans(),
    })


def stream_options():
    return st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                               "continuous_usage_stats": st.booleans()})


def make_coherent(body: dict, max_tokens_key: str) -> dict:
    """best_of = n, stream_options only on streams, min_tokens <= max_tokens."""
    if body.get("best_of") is not None:
        body["best_of"] = body.get("n", 1)
    if not body.get("stream"):
        body.pop("stream_options", None)
    mt = body.get(max_tokens_key)
    if isinstance(mt, int) and body.get("min_tokens", 0) > mt:
        body["min_tokens"] = mt
    return body


@st.composite
def completion_bodies(draw) -> dict:
    body = {"prompt": draw(prompts())}
    if draw(st.integers(0, 9)):
        body["max_tokens"] = draw(st.integers(1, 24))
    body.update(draw(sampling_fields()))
    body.update(draw(st.fixed_dictionaries({}, optional={
        "logprobs": st.integers(0, 20), "echo": st.booleans(), "best_of": st.integers(1, 4),
        "suffix": st.none(), "stream_options": stream_options()})))
    if body.get("echo") and "logprobs" in body:
        del body[draw(st.sampled_from(["echo", "logprobs"]))]
    return make_coherent(body, "max_tokens")


ROLES = ("system", "developer", "user", "assistant", "tool")


@st.composite
def chat_messages(draw) -> dict:
    role = draw(st.sampled_from(ROLES))
    content = draw(st.one_of(
        short_text(),
        st.lists(st.builds(lambda t: {"type": "text", "text": t}, short_text()), min_size=1, max_size=3),
        st.none() if role == "assistant" else short_text()))
    m = {"role": role, "content": content}
    if role == "tool":
        m["tool_call_id"] = "call_0"
    if draw(st.booleans()) and role in ("user", "system", "assistant"):
        m["name"] = draw(st.text(min_size=1, max_size=8))
    return m


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@st.composite
def chat_bodies(draw) -> dict:
    body = {"messages": draw(st.lists(chat_messages(), min_size=1, max_size=4))}
    if draw(st.integers(0, 7)):
        body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(st.integers(1, 24))
    body.update(draw(sampling_fields()))
    body.update(draw(st.fixed_dictionaries({}, optional={
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20), "best_of": st.integers(1, 4),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}]),
        "tools": st.sampled_from([[], [TOOL]]),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
        "parallel_tool_calls": st.booleans(),
        "chat_template_kwargs": st.sampled_from([{}, {"enable_thinking": True}, {"enable_thinking": False},
                                                 {"foo": "bar"}]),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "stream_options": stream_options()})))
    if "top_logprobs" in body:
        body["logprobs"] = True
    if body.get("continue_final_message"):
        body["add_generation_prompt"] = False
        body["messages"][-1] = {"role": "assistant", "content": "partial"}
    return make_coherent(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens")


@st.composite
def tokenize_bodies(draw) -> dict:
    if draw(st.booleans()):
        body = {"prompt": draw(short_text())}
    else:
        body = {"messages": draw(st.lists(chat_messages(), min_size=1, max_size=4))}
        body.update(draw(st.fixed_dictionaries({}, optional={
            "add_generation_prompt": st.booleans(),
            "chat_template_kwargs": st.sampled_from([{}, {"enable_thinking": False}])})))
    body.update(draw(st.fixed_dictionaries({}, optional={"model": st.just(MODEL),
                                                         "add_special_tokens": st.booleans()})))
    return body


def detokenize_bodies():
    return st.fixed_dictionaries({"tokens": st.lists(token_ids(), max_size=64)}, optional={"model": st.just(MODEL)})


# =========================================================================================
# strategies: mutations

COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of",
                     "stop", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logprobs", "echo", "stream", "stream_options", "ignore_eos",
                     "min_tokens", "logit_bias", "user", "suffix", "return_token_ids", "add_special_tokens",
                     "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "echo", "suffix")] + [
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "functions", "function_call", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "metadata", "store", "service_tier", "modalities"]
TOKENIZE_FIELDS = ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "chat_template_kwargs", "tokens"]



def affordable(path: str, body) -> bool:
    """Leave out the valid requests too big for a CPU to serve within the timeout (many
    sequences times long outputs): those are legitimately slow, not a hang."""
    if not isinstance(body, dict):
        return True

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    n = body.get("n")
    n = n if is_int(n) and 1 <= n <= 128 else 1
    p = body.get("prompt")
    seqs = 1
    if isinstance(p, list) and p and not all(is_int(t) for t in p):
        ok = all((isinstance(x, str) and x) or (isinstance(x, list) and x and all(is_int(t) and 0 <= t < VOCAB
                                                                                   for t in x)) for x in p)
        seqs = len(p) if ok else 0
    mt = body.get("max_completion_tokens") if path.endswith("chat/completions") else None
    mt = mt if mt is not None else body.get("max_tokens", None if path.endswith("chat/completions") else 16)
    tokens = mt if is_int(mt) and 1 <= mt <= MAX_LEN else MAX_LEN
    return n * seqs <= 16 and n * seqs * tokens <= 2048


def generation_requests(path: str, bodies, fields: list[str]):
    return st.builds(lambda body, ascii_only: (path, body, ascii_only), mutated(bodies, fields),
                     st.sampled_from([True, True, False])) \
        .filter(lambda t: affordable(t[0], t[1])) \
        .map(lambda t: json_req(t[0], t[1], ascii_only=t[2]))


def completion_requests():
    return generation_requests("/v1/completions", completion_bodies(), COMPLETION_FIELDS)


def chat_requests():
    return generation_requests("/v1/chat/completions", chat_bodies(), CHAT_FIELDS)


def tokenizer_requests():
    return st.one_of(
        st.builds(lambda b, a: json_req("/tokenize", b, ascii_only=a), mutated(tokenize_bodies(), TOKENIZE_FIELDS),
                  st.booleans()),
        st.builds(lambda b, a: json_req("/detokenize", b, ascii_only=a),
                  mutated(detokenize_bodies(), TOKENIZE_FIELDS), st.booleans()))


SMALL_BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [104, 105]},
}


def raw_bodies():
    """Whole bodies that are not a JSON object, or not JSON at all, or not UTF-8."""
    def around(path: str, kind: str) -> bytes:
        ok = encode(SMALL_BODIES[path])
        return {"bom": b"\xef\xbb\xbf" + ok, "trailing": ok + b" x", "truncated": ok[:-1], "nul": ok + b"\x00",
                "twice": ok + ok, "dup_keys": ok[:-1] + b"," + ok[1:], "utf16": ok.decode().encode("utf-16"),
                "latin1": ok[:-1] + b',"user":"\xe9"}', "cesu": ok[:-1] + b',"user":"\xed\xa0\x80"}',
                "overlong": ok[:-1] + b',"user":"\xc0\xaf"}', "crlf": ok.replace(b",", b",\r\n")}[kind]

    fixed = st.sampled_from([b"", b" ", b"\n\t", b"null", b"true", b"0", b"-0", b'"x"', b"[]", b"[{}]", b"{}",
                             b"{", b"}", b"[", b"\xff\xfe", b"\x00", b"NaN", b"Infinity", b"1e400", b"\xef\xbb\xbf",
                             b'{"a":1,}', b"{'prompt': 'hi'}", b'{"prompt":"hi" "max_tokens":2}',
                             b'{"prompt": "\\x41"}', b'{"prompt": "\\u12"}', b'{"prompt": "a\nb"}'])
    derived = st.builds(around, st.sampled_from(JSON_ROUTES),
                        st.sampled_from(["bom", "trailing", "truncated", "nul", "twice", "dup_keys", "utf16", "latin1",
                                         "cesu", "overlong", "crlf"]))
    nested = deep_nesting().map(lambda r: r.text.encode())
    numbers = st.sampled_from(RAW_NUMBERS).map(str.encode)
    return st.builds(lambda path, content: Req("POST", path, content, {"Content-Type": "application/json"}),
                     st.sampled_from(JSON_ROUTES), st.one_of(fixed, derived, nested, numbers))





def content_type_requests():
    """A small valid body of a JSON route under each kind of Content-Type."""
    return st.builds(lambda path, ct: json_req(path, SMALL_BODIES[path], content_type=ct),
                     st.sampled_from(JSON_ROUTES), st.sampled_from(NON_JSON_TYPES + JSON_TYPES + UNCLEAR_TYPES))


def get_requests():
    """The GET routes (with query strings and Accept headers), unknown paths and wrong methods."""
    query = st.one_of(st.just(""), st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3)
                      .map(lambda d: "?" + str(httpx.QueryParams(d))))
    accept = st.sampled_from([{}, {"Accept": "text/plain"}, {"Accept": "application/xml"}, {"Accept": "*/*"}])
    known = st.builds(lambda p, q, a: Req("GET", p + q, headers=a), st.sampled_from(GET_ROUTES), query, accept)
    segment = st.text(st.characters(codec="ascii", exclude_characters="/?#%"), min_size=1, max_size=12)
    unknown = st.builds(lambda segs, m: Req(m, "/" + "/".join(quote(s, safe="") for s in segs)),
                        st.lists(segment, min_size=1, max_size=3), st.sampled_from(["GET", "POST", "DELETE"]))
    wrong_method = st.builds(lambda p, m: Req(m, p),
                             st.sampled_from(POST_ROUTES + GET_ROUTES + ("/v1/completions/", "/v1", "/", "//health")),
                             st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]))
    return st.one_of(known, unknown, wrong_method)


def transcription_requests():
    """POST /v1/audio/transcriptions on this LLM server: multipart forms, JSON, nothing."""
    audio = st.sampled_from([b"", b"RIFF....WAVE", b"\x00" * 1000, b"ID3\x03" + b"\xff" * 100, os.urandom(64)])
    form = st.fixed_dictionaries({}, optional={
        "model": st.sampled_from([MODEL, "whisper-1", ""]), "language": st.sampled_from(["en", "xx", ""]),
        "response_format": st.sampled_from(["json", "text", "srt", "verbose_json", "bogus"]),
        "temperature": st.sampled_from(["0", "-1", "NaN", "1e400"]), "prompt": st.text(max_size=8)})
    multipart = st.builds(lambda a, f: Req("POST", "/v1/audio/transcriptions", files=(("file", ("a.wav", a,
                                                                                                "audio/wav")),),
                                           data=tuple(sorted(f.items()))), audio, form)
    other = st.builds(lambda body, ct: json_req("/v1/audio/transcriptions", body, content_type=ct),
                      st.one_of(json_values(), st.just({"model": MODEL, "file": "x"})),
                      st.sampled_from(["application/json", "text/plain", None, "multipart/form-data"]))
    return st.one_of(multipart, other)


# =========================================================================================
# the checks

# =========================================================================================
# the tests

# shapes that broke the server once, checked every run whatever Hypothesis draws
C = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
SEEDS = [
    ("/v1/completions", dict(C, top_k=2 ** 63)),
    ("/v1/completions", dict(C, top_k=2 ** 64)),
    ("/v1/chat/completions", dict(CHAT, top_k=-2 ** 63 - 1)),
    ("/v1/completions", dict(C, temperature=10 ** 400)),
    ("/v1/completions", dict(C, top_p=Raw("1" + "0" * 400))),
    ("/v1/completions", dict(C, max_tokens=2 ** 63)),
    ("/v1/completions", dict(C, prompt=[2 ** 63])),
    ("/v1/completions", dict(C, stop_token_ids=[2 ** 64])),
    ("/v1/completions", dict(C, prompt=Raw('"\\ud800"'))),
    ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": Raw('"a\\udfff"')}])),
    ("/tokenize", {"prompt": Raw('"\\ud800"')}),
    ("/detokenize", {"tokens": [2 ** 63]}),
    ("/v1/completions", dict(C, repetition_penalty=1e-300, logprobs=5)),
    ("/v1/chat/completions", dict(CHAT, repetition_penalty=1e-300, logprobs=True, top_logprobs=5)),
    ("/v1/completions", dict(C, temperature=1e-45, top_p=1e-45, min_p=1e-300, logprobs=2)),
    ("/v1/completions", dict(C, prompt=Raw("[" * 5000 + "]" * 5000))),
    ("/v1/chat/completions", dict(CHAT, messages=Raw('[{"a":' * 5000 + "1" + "}]" * 5000))),
    ("/v1/completions", dict(C, prompt="\u2028\u2029\u0085\x00\u00e9", echo=True, stream=True)),
    ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": "\u2028"}], stream=True,
                                  logprobs=True, top_logprobs=2)),
]


def _seed_id(path: str, body: dict) -> str:
    base = C if path == "/v1/completions" else CHAT
    return path + ":" + ",".join(k for k in body if k not in base or body[k] != base[k])


@pytest.mark.parametrize("path,body", SEEDS, ids=[_seed_id(p, b) for p, b in SEEDS])
def test_known_shapes(live, path, body):
    check(live, json_req(path, body))


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_text_plain_is_415(live, path):
    status, _, _ = check(live, json_req(path, SMALL_BODIES[path], content_type="text/plain"))
    assert status == 415


@FUZZ
@given(req=completion_requests())
def test_completions(live, req):
    check(live, req)


@FUZZ
@given(req=chat_requests())
def test_chat_completions(live, req):
    check(live, req)


@FUZZ
@given(req=tokenizer_requests())
def test_tokenize_detokenize(live, req):
    status, _, raw = check(live, req)
    if status == 200:
        out = json.loads(raw)
        if req.path == "/tokenize":
            assert out["count"] == len(out["tokens"]) and all(0 <= t < VOCAB for t in out["tokens"]), out
        else:
            assert isinstance(out["prompt"], str), out


@FUZZ
@given(req=raw_bodies())
def test_malformed_bodies(live, req):
    status, _, _ = check(live, req)
    if is_json_object(req.content) is False:
        assert 400 <= status < 500, (status, req)


@FUZZ
@given(req=content_type_requests())
def test_content_types(live, req):
    status, _, raw = check(live, req)
    ct = req.headers.get("Content-Type")
    if ct in NON_JSON_TYPES and status != 415:
        fail("a JSON route does not answer a non-JSON Content-Type with 415",
             f"{ct} -> {status}: {raw[:300].decode('utf-8', 'replace')}")
    if ct in JSON_TYPES and status == 415:
        fail("a JSON route refuses a JSON Content-Type (415)", ct)


@FUZZ
@given(req=get_requests())
def test_get_routes_and_unknown_paths(live, req):
    status, headers, raw = check(live, req)
    path = req.path.split("?")[0]
    if req.method == "GET" and path in GET_ROUTES:
        assert status == 200, (status, raw[:300])
        if req.path.startswith("/metrics"):
            assert b"mstar_num_requests_running" in raw
        else:
            out = strict_json(raw.decode())
            if req.path.startswith("/v1/models"):
                assert out["data"][0]["id"] == MODEL and out["data"][0]["max_model_len"] == MAX_LEN, out
    elif not (req.method == "POST" and path in POST_ROUTES):
        assert status in (404, 405), (status, raw[:300])


@FUZZ
@given(req=transcription_requests())
def test_transcriptions_on_an_llm_server(live, req):
    status, _, raw = check(live, req)
    assert 400 <= status < 500, (status, raw[:300])


def test_idle_and_alive_at_the_end(live):
    """Runs last: the engine alive, nothing running, waiting or pending, every KV page free, and no
    request along the way killed the engine."""
    assert live.health() == 200
    live.proc.wait_idle(timeout=60)
    assert not live.deaths, (f"{len(live.deaths)} request(s) killed the engine; the server log before the "
                             f"first restart:\n{live.deaths[0]}")
