"""The OpenAI-compatible server end to end: a real `python -m mstar.runtime.serve` process
(the embedded tiny Qwen3.5 on CPU) driven by the official `openai` client and raw HTTP.

Greedy outputs must equal the offline LLM API token for token; client disconnects must
abort in the engine (checked through /metrics: nothing running, no KV page held);
SIGTERM must drain in-flight requests and exit 0.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from server_harness import ServerProc

MODEL = "tiny-qwen3.5"


@pytest.fixture(scope="module")
def server():
    s = ServerProc()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    from mstar import LLM
    return LLM(MODEL)


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


# ---------------------------------------------------------------------------------------
# basics

def test_models_health_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert _extra(models.data[0], "max_model_len") > 0
    h = server.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = server.get("/metrics").text
    for name in ("mstar_requests_total", "mstar_prompt_tokens_total", "mstar_generation_tokens_total",
                 "mstar_time_to_first_token_seconds_bucket", "mstar_inter_token_latency_seconds_bucket",
                 "mstar_num_requests_running", "mstar_num_requests_waiting", "mstar_kv_cache_pages_used",
                 "mstar_kv_cache_usage_ratio", "mstar_prefix_cache_hit_rate"):
        assert name in text, name


def test_completion_stream_equals_nonstream(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    c = full.choices[0]
    assert c.finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == len(b"The capital of France is")  # byte tokenizer
    assert full.usage.completion_tokens >= 1
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_stream_equals_nonstream(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_uses_template_and_matches_offline(client, llm):
    from mstar import SamplingParams
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                       extra_body={"return_token_ids": True})
    ref = llm.chat(msgs, SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert _extra(r.choices[0], "token_ids") == ref.token_ids
    assert r.choices[0].message.content == ref.text
    # ChatML with the generation prompt: <|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n
    tok = llm.tokenizer
    want = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)
    assert _extra(r.choices[0], "prompt_token_ids") == want


# ---------------------------------------------------------------------------------------
# equal to the offline API, token for token (greedy), with requests batched together

PROMPTS_IDS = [[72, 101, 108, 108, 111], list(range(40, 77)), [7] * 3 + list(range(100, 150)), [200]]


def test_greedy_token_ids_and_logprobs_equal_offline(server, llm):
    from mstar import SamplingParams
    ref = llm.generate(PROMPTS_IDS, SamplingParams(max_tokens=20, temperature=0.0, logprobs=2))
    results = [None] * len(PROMPTS_IDS)

    def one(i):
        body = {"model": MODEL, "prompt": PROMPTS_IDS[i], "max_tokens": 20, "temperature": 0, "logprobs": 2,
                "return_token_ids": True}
        results[i] = server.post("/v1/completions", body).json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS_IDS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, want in zip(results, ref):
        ch = r["choices"][0]
        assert ch["token_ids"] == want.token_ids
        assert ch["text"] == want.text
        assert ch["finish_reason"] == want.finish_reason
        lp = ch["logprobs"]
        n = len(lp["token_logprobs"])
        assert n == len(want.logprobs) == len(want.token_ids)
        for got, exp in zip(lp["token_logprobs"], want.logprobs):
            assert got == pytest.approx(exp.logprob, abs=1e-4)
        assert all(len(t) <= 2 for t in lp["top_logprobs"])


def test_batched_prompts_and_n(server, llm):
    from mstar import SamplingParams
    prompts = ["abc", "Hello world"]
    r = server.post("/v1/completions", {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 8,
                                        "temperature": 0, "return_token_ids": True}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    ref = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for c in r["choices"]:
        assert c["token_ids"] == ref[c["index"] // 2].token_ids
    assert r["usage"]["prompt_tokens"] == 3 + 11
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])


def test_concurrent_streams_equal_offline(server, llm):
    from mstar import SamplingParams
    prompts = [f"Stream number {i}: " for i in range(8)]
    ref = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    got = [None] * len(prompts)
    errors = []

    def one(i):
        try:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
            ids, text = [], ""
            for ch in c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}):
                for choice in ch.choices:
                    text += choice.text
                    ids += _extra(choice, "token_ids") or []
            got[i] = (ids, text)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (ids, text), want in zip(got, ref):
        assert len(ids) == 24
        assert ids == want.token_ids
        assert text == want.text


# ---------------------------------------------------------------------------------------
# sampling options

def test_stop_string_truncates_and_frees(server, client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    # a stop string that first occurs in the middle of the output
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text.find(text[i:i + 2]) == i
                 and "\ufffd" not in text[i:i + 2]), None)
    if stop is None:
        pytest.fail("no usable stop string in this output: pick another prompt")
    cut = text.index(stop)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40,
                                        "temperature": 0, "ignore_eos": True, "stop": [stop]}).json()
    c = r["choices"][0]
    assert c["text"] == text[:cut]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40,
                                        "temperature": 0, "ignore_eos": True, "stop": stop,
                                        "include_stop_str_in_output": True}).json()
    assert r["choices"][0]["text"] == text[:cut + len(stop)]
    server.wait_idle()


def test_ignore_eos_min_tokens_stop_token_ids(server):
    r = server.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 30, "temperature": 0,
                                        "ignore_eos": True, "return_token_ids": True}).json()
    ids = r["choices"][0]["token_ids"]
    assert len(ids) == 30 and r["choices"][0]["finish_reason"] == "length"
    # stop at the 5th token's id (first occurrence)
    tid = ids[4]
    first = ids.index(tid)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 30, "temperature": 0,
                                        "ignore_eos": True, "stop_token_ids": [tid],
                                        "return_token_ids": True}).json()
    c = r["choices"][0]
    assert c["token_ids"] == ids[:first + 1] and c["finish_reason"] == "stop" and c["stop_reason"] == tid
    r = server.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 30, "temperature": 0,
                                        "min_tokens": 30, "stop_token_ids": [tid], "return_token_ids": True}).json()
    assert len(r["choices"][0]["token_ids"]) == 30


def test_seeded_sampling_is_reproducible(server):
    body = {"model": MODEL, "prompt": "Random:", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": 50,
            "min_p": 0.01, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
            "seed": 1234, "return_token_ids": True, "ignore_eos": True}
    a = server.post("/v1/completions", body).json()["choices"][0]["token_ids"]
    b = server.post("/v1/completions", body).json()["choices"][0]["token_ids"]
    c = server.post("/v1/completions", dict(body, seed=99)).json()["choices"][0]["token_ids"]
    assert a == b and a != c
    # n > 1 with a seed: reproducible, and the choices differ from one another
    r1 = server.post("/v1/completions", dict(body, n=3)).json()["choices"]
    r2 = server.post("/v1/completions", dict(body, n=3)).json()["choices"]
    assert [x["token_ids"] for x in r1] == [x["token_ids"] for x in r2]
    assert len({tuple(x["token_ids"]) for x in r1}) > 1


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob


# ---------------------------------------------------------------------------------------
# disconnects abort in the engine

def _raw_request(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_disconnect_storm_frees_everything(server):
    before = server.metrics()
    long = {"model": MODEL, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    socks = []
    # streaming clients cut after their first bytes of output
    for i in range(16):
        s = _raw_request(server.url, dict(long, prompt=f"storm {i}", stream=True))
        socks.append(s)
    for s in socks:
        assert s.recv(64)  # the response has started
    # non-streaming clients cut while the request runs
    for i in range(8):
        socks.append(_raw_request(server.url, dict(long, prompt=f"quiet {i}")))
    deadline = time.monotonic() + 60
    while True:  # the engine holds all 24 (on a loaded machine a step can take a while)
        m = server.metrics()
        if m["mstar_num_requests_pending"] == 24 and m["mstar_kv_cache_pages_used"] > 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    for s in socks:
        s.close()
    after = server.wait_idle(timeout=60)
    aborted = 'mstar_requests_total{endpoint="completions",outcome="aborted"}'
    assert after[aborted] - before[aborted] == 24
    # max_tokens 2000 would take far longer: the engine stopped generating for them
    gen = after["mstar_generation_tokens_total"] - before["mstar_generation_tokens_total"]
    assert gen < 24 * 2000 / 2
    # still serving
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "after the storm", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert after['mstar_requests_total{endpoint="completions",outcome="error"}'] == 0


def test_openai_client_stream_closed_early(server, client):
    stream = client.completions.create(model=MODEL, prompt="close me", max_tokens=3000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    server.wait_idle()


# ---------------------------------------------------------------------------------------
# small extras

def test_echo_tokenize_detokenize(server, llm):
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "Echo me", "max_tokens": 3, "temperature": 0,
                                        "echo": True}).json()
    assert r["choices"][0]["text"].startswith("Echo me")
    t = server.post("/tokenize", {"model": MODEL, "prompt": "héllo"}).json()
    assert t["tokens"] == llm.tokenizer.encode("héllo") and t["count"] == len(t["tokens"]) and t["max_model_len"] > 0
    msgs = [{"role": "user", "content": "hi"}]
    t = server.post("/tokenize", {"messages": msgs}).json()
    want = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert server.post("/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == want
    r = server.post("/detokenize", {"tokens": [1, "x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# ---------------------------------------------------------------------------------------
# graceful shutdown

def test_sigterm_drains_in_flight_and_exits_0(server):
    """Last in this file: it stops the module's server."""
    s = server
    out = {"lines": []}
    started = threading.Event()

    def stream():
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": "drain", "max_tokens": 150, "temperature": 0,
                                "ignore_eos": True, "stream": True, "return_token_ids": True}) as r:
            for ln in r.iter_lines():
                if ln.startswith("data:"):
                    out["lines"].append(ln)
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)  # the request is in flight
    s.proc.send_signal(signal.SIGTERM)
    n_at_signal = len(out["lines"])
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):  # no longer accepting connections
        httpx.get(s.url + "/health", timeout=5)
    t.join(120)
    assert s.proc.wait(60) == 0, s.log_text()
    lines = out["lines"]
    assert n_at_signal < len(lines)  # it kept streaming after the signal
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[5:]) for ln in lines[:-1]]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 150
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "shut down cleanly" in s.log_text()
