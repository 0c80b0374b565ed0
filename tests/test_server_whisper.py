"""POST /v1/audio/transcriptions on a real `python -m mstar.runtime.serve` subprocess
serving a tiny random Whisper checkpoint (written by transformers, with a Whisper-layout
byte tokenizer), through the official `openai` client: json, text and verbose_json
(tokens equal to HF `generate`; one segment per 30 s window), language detection,
concurrency, the bad-audio suite (empty, corrupt, wrong type, over-long: 400 with
OpenAI's error body), the LLM endpoints refused, and nothing leaked afterwards."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import openai
import pytest
import torch

from engine_helpers import single_thread  # noqa: F401 -- fixture
from mstar.models.whisper.tokens import WhisperTokens
from server_harness import ServerProc
from whisper_helpers import clip, hf_whisper, wav_bytes, whisper_dir

TOK = WhisperTokens.from_vocab_size(51866)
MAX_AUDIO = 40
NAME = "tiny-whisper"


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--model", whisper_dir(), "--served-model-name", NAME, "--device", "cpu", "--dtype", "float32",
                   "--max-num-seqs", "4", "--page-size", "4", "--max-audio-seconds", str(MAX_AUDIO))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _file(x, name="clip.wav", sr=16000):
    return (name, wav_bytes(x, sr=sr), "audio/wav")


def test_json_text_verbose_match_hf(client):
    from mstar.models.whisper.audio import load_audio, log_mel_spectrogram
    x = clip(7.0, 523.0, seed=1)
    n = 10
    data = wav_bytes(x)
    with torch.no_grad():  # the reference sees the same 16-bit-quantised samples
        feats = log_mel_spectrogram([load_audio(data)], n_mels=128)
        ref = hf_whisper().generate(feats, max_new_tokens=n, min_new_tokens=n, return_timestamps=False,
                                    language="en", task="transcribe")[0, -n:].tolist()
    extra = {"max_tokens": n, "min_tokens": n}
    v = client.audio.transcriptions.create(model=NAME, file=("a.wav", data, "audio/wav"), language="en",
                                           response_format="verbose_json", extra_body=extra)
    assert v.language == "english" and abs(v.duration - 7.0) < 0.01
    assert len(v.segments) == 1
    seg = v.segments[0]
    assert seg.start == 0.0 and abs(seg.end - 7.0) < 0.01 and seg.tokens == TOK.text_ids(ref)
    j = client.audio.transcriptions.create(model=NAME, file=("a.wav", data, "audio/wav"), language="en",
                                           extra_body=extra)
    assert j.text == v.text == seg.text.strip()
    t = client.audio.transcriptions.create(model=NAME, file=("a.wav", data, "audio/wav"), language="en",
                                           response_format="text", extra_body=extra)
    assert isinstance(t, str) and t.strip() == j.text


def test_windows_detection_and_forced_length(server, client):
    x = clip(35.0, 97.0, seed=2)  # two windows: 30 s + 5 s
    v = client.audio.transcriptions.create(model=NAME, file=_file(x), response_format="verbose_json",
                                           temperature=0.0, extra_body={"max_tokens": 6, "ignore_eos": "true"})
    assert v.language  # detected
    assert [(s.start, s.end) for s in v.segments] == [(0.0, 30.0), (30.0, 35.0)]
    flac = wav_bytes(x[:48000], fmt="FLAC")
    r = httpx.post(server.url + "/v1/audio/transcriptions", files={"file": ("a.flac", flac)},
                   data={"model": NAME, "language": "de", "max_tokens": "5", "ignore_eos": "true",
                         "temperature": "0.7"}, timeout=60)
    assert r.status_code == 200, r.text
    timing = json.loads(r.headers["x-mstar-timing"])
    assert timing["completion_tokens"] == 5 and timing["windows"] == 1
    assert 0 < timing["first_token_ms"] <= timing["total_ms"]


def test_concurrent_requests(server, client):
    def one(i):
        return client.audio.transcriptions.create(model=NAME, file=_file(clip(2.0 + i, 200.0 + 50 * i, seed=i)),
                                                  language="en", extra_body={"max_tokens": 4, "ignore_eos": "true"})
    with cf.ThreadPoolExecutor(6) as ex:
        outs = list(ex.map(one, range(6)))
    assert all(isinstance(o.text, str) for o in outs)
    m = server.wait_idle()
    assert m['mstar_engine_stat{name="cross_slots_free"}'] == m['mstar_engine_stat{name="cross_slots_total"}']


def _bad(server, files=None, data=None, status=400, code=None, param="file", **kw):
    r = httpx.post(server.url + "/v1/audio/transcriptions", files=files, data=data or {"model": NAME}, timeout=60,
                   **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_bad_audio_is_400(server, client):
    _bad(server, {"file": ("empty.wav", b"", "audio/wav")}, code="invalid_audio")
    e = _bad(server, {"file": ("notes.txt", b"just some text, not audio", "text/plain")}, code="invalid_audio")
    assert "format" in e["message"]
    good = wav_bytes(clip(2.0))
    e = _bad(server, {"file": ("bad.wav", b"RIFF\x00\x00\x00\x00WAVEfmt junk" + good[40:200], "audio/wav")},
             code="invalid_audio")
    assert "WAV" in e["message"]
    long = wav_bytes(clip(MAX_AUDIO + 5, sr=8000), sr=8000)
    e = _bad(server, {"file": ("long.wav", long, "audio/wav")}, code="audio_too_long")
    assert f"limit is {MAX_AUDIO}" in e["message"]
    # the file as a text field, no file, a JSON body, bad options
    _bad(server, None, {"model": NAME, "file": "abc"}, code="invalid_type")
    _bad(server, None, {"model": NAME}, code="missing_required_parameter")
    r = httpx.post(server.url + "/v1/audio/transcriptions", json={"model": NAME, "file": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    f = {"file": ("a.wav", good, "audio/wav")}
    _bad(server, f, {"model": NAME, "response_format": "srt"}, param="response_format")
    _bad(server, f, {"model": NAME, "language": "klingon"}, param="language")
    _bad(server, f, {"model": NAME, "temperature": "hot"}, param="temperature")
    _bad(server, f, {"model": NAME, "max_tokens": "1000"}, param="max_tokens")
    _bad(server, f, {"model": NAME, "bogus": "1"}, param="bogus")
    _bad(server, f, {"model": "nope"}, status=404, param="model", code="model_not_found")
    with pytest.raises(openai.BadRequestError) as ei:  # through the client too
        client.audio.transcriptions.create(model=NAME, file=("e.wav", b"", "audio/wav"))
    assert ei.value.status_code == 400 and "empty" in str(ei.value)
    server.wait_idle()


def test_llm_endpoints_refused(server):
    for path, body in (("/v1/completions", {"model": NAME, "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}]})):
        r = server.post(path, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_endpoint", r.text
        assert "/v1/audio/transcriptions" in r.json()["error"]["message"]
    assert server.get("/health").status_code == 200


def test_translations(client):
    t = client.audio.translations.create(model=NAME, file=_file(clip(3.0, 300.0, seed=9)), response_format="json",
                                         extra_body={"max_tokens": 4, "ignore_eos": "true"})
    assert isinstance(t.text, str)
    with pytest.raises(openai.BadRequestError, match="language"):
        client.audio.translations.create(model=NAME, file=_file(clip(1.0)), extra_body={"language": "en"})


def test_client_gone_frees_everything(server):
    """Clients that give up mid-transcription: their sequences are aborted in the engine;
    no KV page or cross slot stays taken."""
    data = wav_bytes(clip(35.0, 150.0, seed=4))
    for _ in range(3):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/audio/transcriptions", files={"file": ("a.wav", data, "audio/wav")},
                       data={"model": NAME, "language": "en", "max_tokens": "400", "ignore_eos": "true"},
                       timeout=0.5)
    m = server.wait_idle()
    assert m['mstar_engine_stat{name="cross_slots_free"}'] == m['mstar_engine_stat{name="cross_slots_total"}']
    assert m['mstar_sequences_finished_total{finish_reason="abort"}'] >= 3
