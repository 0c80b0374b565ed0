"""Bad input, auth, limits, overload and engine death: always OpenAI's error schema with
the right status, never a 500 or a hang, and the server keeps serving.

One server runs with --api-key, a small --max-body-bytes, --max-model-len and
--max-pending 2 (reject); another with --max-pending 1 --overload-policy wait, whose
engine is then killed (and restarted); a third exits non-zero when its engine dies with no
restart left.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from server_harness import ServerProc

MODEL = "tiny-qwen3.5"
KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LEN = 1024
MAX_BODY = 20000


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--api-key", KEY, "--max-body-bytes", str(MAX_BODY), "--max-model-len", str(MAX_LEN),
                   "--max-pending", "2", "--overload-policy", "reject", "--max-num-seqs", "4",
                   "--chat-template", "X{% for m in messages %}{{ m['content'] }}{% endfor %}")
    yield s
    s.close()


def _post(server, path, body=None, *, raw: bytes | None = None, headers=AUTH):
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers={**headers, "Content-Type": "application/json"},
                          timeout=60)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def _check_error(r: httpx.Response, status: int, param=None, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


C = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (endpoint, body overrides (None value: delete the key), expected param)
BAD_FIELDS = [
    # wrong types
    ("c", {"prompt": 123}, "prompt"),
    ("c", {"prompt": [1, "a"]}, "prompt"),
    ("c", {"prompt": [[1, 2], "x"]}, "prompt"),
    ("c", {"prompt": {"text": "hi"}}, "prompt"),
    ("c", {"max_tokens": "10"}, "max_tokens"),
    ("c", {"max_tokens": 2.5}, "max_tokens"),
    ("c", {"temperature": "hot"}, "temperature"),
    ("c", {"top_p": True}, "top_p"),
    ("c", {"top_k": 1.5}, "top_k"),
    ("c", {"min_p": "0.1"}, "min_p"),
    ("c", {"n": 1.5}, "n"),
    ("c", {"seed": "s"}, "seed"),
    ("c", {"stream": "yes"}, "stream"),
    ("c", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("c", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("c", {"stop": 5}, "stop"),
    ("c", {"stop": ["a", 1]}, "stop"),
    ("c", {"stop": [""]}, "stop"),
    ("c", {"stop_token_ids": ["a"]}, "stop_token_ids"),
    ("c", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("c", {"stop_token_ids": [100000]}, "stop_token_ids"),
    ("c", {"logprobs": "x"}, "logprobs"),
    ("c", {"logprobs": True}, "logprobs"),
    ("c", {"ignore_eos": "no"}, "ignore_eos"),
    ("c", {"echo": 1}, "echo"),
    ("c", {"presence_penalty": "1"}, "presence_penalty"),
    ("c", {"frequency_penalty": [1]}, "frequency_penalty"),
    ("c", {"repetition_penalty": None, "min_tokens": "2"}, "min_tokens"),
    ("c", {"skip_special_tokens": 0}, "skip_special_tokens"),
    ("c", {"include_stop_str_in_output": "true"}, "include_stop_str_in_output"),
    ("c", {"model": 5}, "model"),
    ("c", {"user": 5}, "user"),
    ("c", {"logit_bias": [1]}, "logit_bias"),
    # out of range
    ("c", {"max_tokens": 0}, "max_tokens"),
    ("c", {"max_tokens": -5}, "max_tokens"),
    ("c", {"temperature": -0.5}, "temperature"),
    ("c", {"top_p": 0}, "top_p"),
    ("c", {"top_p": 1.5}, "top_p"),
    ("c", {"top_k": -2}, "top_k"),
    ("c", {"min_p": 1.5}, "min_p"),
    ("c", {"n": 0}, "n"),
    ("c", {"n": 129}, "n"),
    ("c", {"best_of": 3}, "best_of"),
    ("c", {"logprobs": 21}, "logprobs"),
    ("c", {"logprobs": -1}, "logprobs"),
    ("c", {"presence_penalty": 2.5}, "presence_penalty"),
    ("c", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("c", {"repetition_penalty": 0}, "repetition_penalty"),
    ("c", {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("c", {"min_tokens": -1}, "min_tokens"),
    ("c", {"seed": 2 ** 70}, "seed"),
    ("c", {"prompt": [1, 2, 100000]}, "prompt"),
    ("c", {"prompt": [1, -2]}, "prompt"),
    ("c", {"prompt": []}, "prompt"),
    ("c", {"prompt": [[]]}, "prompt"),
    ("c", {"prompt": ""}, "prompt"),
    ("c", {"prompt": None}, "prompt"),
    ("c", {"logit_bias": {"5": 1}}, "logit_bias"),
    ("c", {"suffix": "x"}, "suffix"),
    ("c", {"echo": True, "logprobs": 1}, "echo"),
    # unknown fields are named
    ("c", {"max_token": 5}, "max_token"),
    ("c", {"messages": []}, "messages"),
    # chat
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": None}, "messages"),
    ("chat", {"messages": ["hi"]}, "messages[0]"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "bogus", "content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"max_completion_tokens": "4"}, "max_completion_tokens"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"temperature": -1}, "temperature"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("chat", {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ("chat", {"prompt": "hi"}, "prompt"),
    ("chat", {"stop": {"a": 1}}, "stop"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),
]


@pytest.mark.parametrize("endpoint,override,param", BAD_FIELDS,
                         ids=[f"{e}-{json.dumps(o)[:60]}" for e, o, _ in BAD_FIELDS])
def test_bad_field(server, endpoint, override, param):
    body = dict(C if endpoint == "c" else CHAT)
    for k, v in override.items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    path = "/v1/completions" if endpoint == "c" else "/v1/chat/completions"
    _check_error(_post(server, path, body), 400, param=param)


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b"[1, 2]", b'"str"', b"null",
                                 b'{"prompt": "x", "max_tokens": NaN}', b'{"prompt": "x", "temperature": Infinity}',
                                 b'{"prompt": "x", "temperature": 1e999}', b"\xff\xfe{}"])
def test_malformed_json(server, raw):
    _check_error(_post(server, "/v1/completions", raw=raw), 400)
    _check_error(_post(server, "/v1/chat/completions", raw=raw), 400)


def test_unknown_model_404(server):
    _check_error(_post(server, "/v1/completions", dict(C, model="gpt-4")), 404, param="model",
                 code="model_not_found")
    _check_error(_post(server, "/v1/chat/completions", dict(CHAT, model="nope")), 404, param="model")


def test_context_length(server):
    err = _check_error(_post(server, "/v1/completions", dict(C, prompt=[5] * (MAX_LEN + 10))), 400,
                       code="context_length_exceeded")
    assert str(MAX_LEN) in err["message"]
    _check_error(_post(server, "/v1/completions", dict(C, prompt=[5] * MAX_LEN)), 400,
                 code="context_length_exceeded")
    _check_error(_post(server, "/v1/completions", dict(C, prompt=[5] * (MAX_LEN - 50), max_tokens=100)), 400,
                 param="max_tokens", code="context_length_exceeded")
    _check_error(_post(server, "/v1/chat/completions",
                       dict(CHAT, messages=[{"role": "user", "content": "x" * (MAX_LEN + 10)}])), 400,
                 code="context_length_exceeded")
    # without max_tokens, chat fills the context: fine
    r = _post(server, "/v1/completions", dict(C, prompt=[5] * (MAX_LEN - 3), max_tokens=None))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_body_too_large_413(server):
    big = {"model": MODEL, "prompt": "x" * (MAX_BODY + 100), "max_tokens": 1}
    _check_error(_post(server, "/v1/completions", big), 413)

    # no Content-Length (chunked): the limit still holds
    def gen():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 4096):
            yield data[i:i + 4096]

    r = httpx.post(server.url + "/v1/completions", content=gen(), headers=AUTH, timeout=60)
    _check_error(r, 413)


def test_api_key(server):
    _check_error(_post(server, "/v1/completions", C, headers={}), 401, code="invalid_api_key")
    _check_error(_post(server, "/v1/completions", C, headers={"Authorization": "Bearer wrong"}), 401)
    _check_error(_post(server, "/v1/chat/completions", CHAT, headers={"Authorization": KEY}), 401)
    _check_error(httpx.get(server.url + "/v1/models", timeout=10), 401)
    assert httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
    import openai
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=2)


def test_chat_template_flag(server):
    r = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == list(b"Xhi")  # the byte tokenizer: one id per byte


def test_wrong_routes_and_methods(server):
    _check_error(httpx.get(server.url + "/v1/completions", headers=AUTH, timeout=10), 405)
    _check_error(httpx.post(server.url + "/v1/nothing", headers=AUTH, timeout=10), 404)


def test_overload_rejects_with_retry_after(server):
    long = dict(C, prompt=[1, 2, 3], max_tokens=MAX_LEN - 10, ignore_eos=True, stream=True)
    streams, iters = [], []
    try:
        clients = []
        for _ in range(2):  # fill --max-pending 2
            c = httpx.Client(timeout=60, headers=AUTH)
            clients.append(c)
            s = c.stream("POST", server.url + "/v1/completions", json=long)
            r = s.__enter__()
            streams.append(s)
            assert r.status_code == 200
            lines = r.iter_lines()  # keep it referenced: a collected iterator closes the response
            iters.append(lines)
            next(lines)  # started
        r = _post(server, "/v1/completions", C)
        _check_error(r, 503, code="overloaded")
        assert int(r.headers["retry-after"]) >= 1
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    server.wait_idle()
    assert _post(server, "/v1/completions", C).status_code == 200


def test_no_500_and_still_serving(server):
    m = server.metrics()
    assert m['mstar_requests_total{endpoint="completions",outcome="error"}'] == 0
    assert m['mstar_requests_total{endpoint="chat",outcome="error"}'] == 0
    assert "Traceback" not in server.log_text(), server.log_text()[-3000:]
    assert _post(server, "/v1/chat/completions", CHAT).status_code == 200
    server.wait_idle()


# ---------------------------------------------------------------------------------------
# waiting overload policy; the engine process dying

def test_wait_policy_then_engine_death_and_restart():
    s = ServerProc("--max-pending", "1", "--overload-policy", "wait")
    try:
        first_done = {}

        def first():
            r = httpx.post(s.url + "/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": "one", "max_tokens": 60, "ignore_eos": True})
            first_done["t"] = time.monotonic()
            first_done["status"] = r.status_code

        t = threading.Thread(target=first)
        t.start()
        time.sleep(0.5)
        r = httpx.post(s.url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": "two", "max_tokens": 2})
        t_second = time.monotonic()
        t.join()
        assert r.status_code == 200 and first_done["status"] == 200
        assert t_second >= first_done["t"] - 0.05  # it waited for room (the threads' clocks race a little)

        # the engine dies while a stream is in flight
        out = {}

        def streaming():
            with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": "die", "max_tokens": 3000, "ignore_eos": True,
                                    "stream": True}) as resp:
                out["status"] = resp.status_code
                out["lines"] = [ln for ln in resp.iter_lines() if ln.startswith("data:")]

        t = threading.Thread(target=streaming)
        t.start()
        time.sleep(1.0)
        old_pid = s.engine_pid
        os.kill(old_pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the stream hung after the engine died"
        assert out["status"] == 200
        err = json.loads(out["lines"][-2][5:])
        assert err["error"]["code"] == "engine_dead" and out["lines"][-1] == "data: [DONE]"
        # down: 503 on /health and for requests, the engine gauges back to zero
        h = s.get("/health")
        assert h.status_code == 503 and h.json()["engine"] in ("restarting", "dead"), h.text
        assert "engine_pid" not in h.json()  # internals only with a key
        _check_error(s.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}), 503,
                     code="engine_dead")
        m = s.metrics()
        assert m["mstar_engine_alive"] == 0 and m["mstar_num_requests_running"] == 0
        assert m["mstar_kv_cache_pages_used"] == 0 and m["mstar_num_requests_pending"] == 0
        # then a new engine serves
        deadline = time.monotonic() + 60
        while s.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.get("/health").json() == {"status": "ok", "engine": "alive"}
        assert s.engine_pid != old_pid
        r = s.post("/v1/completions", {"model": MODEL, "prompt": "again", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        m = s.metrics()
        assert m["mstar_engine_restarts_total"] == 1 and m["mstar_engine_alive"] == 1
        assert s.terminate() == 0
    finally:
        s.close()


def test_engine_death_exits_nonzero_once_restarts_are_spent():
    s = ServerProc("--engine-restarts", "0")
    try:
        os.kill(s.engine_pid, signal.SIGKILL)
        code = s.proc.wait(60)
        assert code == 1, s.log_text()[-2000:]
        assert "no engine restart is left" in s.log_text()
    finally:
        s.close()


def test_cli_help_explains_every_flag(capsys):
    from mstar import cli
    from mstar.runtime.serving import serve
    p = serve.build_parser()
    for a in p._actions:
        assert a.help and len(a.help) > 10, a.dest
    text = p.format_help()
    for flag in ("--model", "--random-weights", "--host", "--port", "--api-key", "--dtype", "--device", "--tp",
                 "--max-num-seqs", "--max-model-len", "--page-size", "--num-pages", "--max-num-batched-tokens",
                 "--no-prefix-caching", "--max-pending", "--overload-policy", "--max-body-bytes",
                 "--served-model-name"):
        assert flag in text, flag
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    assert "usage: mstar serve" in capsys.readouterr().out
    assert cli.main(["nonsense"]) == 2


def test_transcriptions_on_an_llm_server(server):
    r = httpx.post(server.url + "/v1/audio/transcriptions", headers=AUTH, data={"model": MODEL},
                   files={"file": ("a.wav", b"RIFF....WAVE", "audio/wav")}, timeout=30)
    err = _check_error(r, 400, param="model", code="unsupported_endpoint")
    assert "not a speech-recognition model" in err["message"]


def test_missing_web_stack_fails_before_loading_a_model(monkeypatch, caplog):
    """A host without fastapi/uvicorn: the server says so and exits 1 at once, without
    starting an engine process (which once kept the dying server alive while it loaded)."""
    from mstar.runtime.engine import engine_process

    from mstar.runtime.serving import serve

    monkeypatch.setattr(serve, "_WEB_STACK", ("fastapi", "no_such_web_package"))

    def no_engine(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(engine_process, "EngineProcess", no_engine)
    t0 = time.monotonic()
    assert serve.main(["--model", "tiny-qwen3.5", "--port", "0"]) == 1
    assert time.monotonic() - t0 < 5
    assert "HTTP server cannot start" in caplog.text and "no_such_web_package" in caplog.text


def test_a_web_stack_that_fails_to_import_stops_the_started_engine(monkeypatch, caplog):
    """The HTTP front end is imported while the engine process starts: when that import fails
    (a broken install the package check could not see), the engine is stopped and the server
    exits 1."""
    import sys

    from mstar.runtime.engine import engine_process

    from mstar.runtime.serving import serve

    monkeypatch.setitem(sys.modules, "mstar.runtime.serving.api_server", None)  # its import now fails
    events = []

    class StubEngine:
        def __init__(self, *a, **k):
            pass

        def start(self):
            events.append("start")

        def kill(self):
            events.append("kill")

        def wait_ready(self, timeout):
            raise AssertionError("waited for an engine the server cannot serve")

    monkeypatch.setattr(engine_process, "EngineProcess", StubEngine)
    assert serve.main(["--model", "tiny-qwen3.5", "--port", "0"]) == 1
    assert events == ["start", "kill"]
    assert "HTTP server cannot start" in caplog.text


def test_admission_flags_reach_the_engine_config():
    from mstar.runtime.serving import serve
    from mstar.runtime.engine.config import EngineConfig
    args = serve.parse_args(["--admit-min-free", "3", "--admit-max-wait", "5"], "mstar serve")
    cfg = serve.engine_config(args)
    assert (cfg.admit_min_free, cfg.admit_max_wait) == (3, 5)
    default = serve.engine_config(serve.parse_args([], "mstar serve"))
    assert (default.admit_min_free, default.admit_max_wait) == (None, 16)
    with pytest.raises(ValueError, match="admit_max_wait"):
        EngineConfig(model="tiny-qwen3.5", admit_max_wait=-1)
    with pytest.raises(SystemExit):
        serve.parse_args(["--admit-max-wait", "-2"], "mstar serve")
