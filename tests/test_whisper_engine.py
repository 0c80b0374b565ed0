"""Whisper through the engine core (CPU, fp32, tiny random checkpoint written by
transformers): tokens equal to HF `generate` for clips of different lengths running
concurrently (staggered arrivals: prefill rows beside decode rows), re-encoding after
preemption, an abort storm with leak checks of the cross slots, the offline
`LLM.transcribe` (30 s windows, language detection, verbose segments), and the errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine_helpers import assert_no_leaks, single_thread  # noqa: F401 -- fixture
from mstar.models.whisper.tokens import WhisperTokens
from mstar.runtime.engine.request import EngineRequest, RequestError, SamplingParams
from whisper_helpers import clip, hf_whisper, wav_bytes, whisper_dir

TOK = WhisperTokens.from_vocab_size(51866)
CLIPS = [(1.5, 220.0), (7.0, 523.0), (30.0, 97.0), (12.0, 330.0)]
N_NEW = 10


@pytest.fixture(scope="module")
def model_and_tok():
    from mstar.models import load_model, load_tokenizer
    d = whisper_dir()
    return load_model(d, progress=False), load_tokenizer(d)


def make_engine(model_and_tok, **opts):
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    model, tok = model_and_tok
    opts.setdefault("page_size", 4)
    opts.setdefault("max_num_seqs", 4)
    return EngineCore(EngineConfig(model=whisper_dir(), device="cpu", dtype="float32", **opts), model=model,
                      tokenizer=tok)


@pytest.fixture(scope="module")
def waves():
    return [clip(s, f, seed=i) for i, (s, f) in enumerate(CLIPS)]


@pytest.fixture(scope="module")
def hf_ref(waves):
    from mstar.models.whisper.audio import log_mel_spectrogram
    hf = hf_whisper()
    feats = log_mel_spectrogram([torch.from_numpy(w) for w in waves], n_mels=128)
    out = {}
    for lang, task in (("en", "transcribe"), ("de", "translate")):
        with torch.no_grad():
            ref = hf.generate(feats, max_new_tokens=N_NEW, min_new_tokens=N_NEW, return_timestamps=False,
                              language=lang, task=task).tolist()
        out[lang, task] = [r[-N_NEW:] for r in ref]
    return out


def run(core, reqs_by_step: dict[int, list[EngineRequest]]) -> dict[str, list[int]]:
    """Add requests at the given step numbers; step to the end; token ids per request."""
    toks: dict[str, list[int]] = {}
    step = 0
    while True:
        for r in reqs_by_step.get(step, []):
            core.add_request(r)
            toks[r.request_id] = []
        if not core.has_unfinished() and step > max(reqs_by_step):
            break
        for o in core.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    return toks


def forced(n=N_NEW):
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)


@pytest.mark.parametrize("language,task,graphs", [("en", "transcribe", "off"), ("de", "translate", "off"),
                                                  ("en", "transcribe", "static")])
def test_engine_tokens_match_hf_generate(model_and_tok, waves, hf_ref, language, task, graphs):
    """graphs="static": decode steps through the CUDA-graph runner's fixed buffers, with a
    second (cross-attention) plan per batch size and a padding cross slot."""
    core = make_engine(model_and_tok, decode_graphs=graphs, admit_min_free=0)
    if graphs == "static":
        assert core.graphs is not None and core.graphs.cross_plans and core.cm.pad_cross == core.cm.num_cross_slots
        calls = []
        run_graph = core.graphs.run
        core.graphs.run = lambda rows, **kw: calls.append(len(rows.decode_tokens)) or run_graph(rows, **kw)
    prompt = TOK.decoder_prompt(language, task)
    reqs = {0: [EngineRequest("a0", prompt, forced(), encoder_input=waves[0]),
                EngineRequest("a1", prompt, forced(), encoder_input=waves[1])],
            2: [EngineRequest("a2", prompt, forced(), encoder_input=waves[2])],
            5: [EngineRequest("a3", prompt, forced(), encoder_input=waves[3])]}
    got = run(core, reqs)
    ref = hf_ref[language, task]
    for i in range(4):
        assert got[f"a{i}"] == ref[i], f"clip {i}: {got[f'a{i}']} != HF {ref[i]}"
    assert len({tuple(v) for v in got.values()}) > 1, "clips should decode differently"
    st = core.stats()
    assert st["encoder_num_encoded"] == 4 and st["encoder_num_calls"] == 3  # a0 + a1 in one call
    if graphs == "static":
        assert 3 in calls and 1 in calls  # padded to 4 and to 1 rows
    assert_no_leaks(core)


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_features_input_and_preemption_reencode(model_and_tok, waves, hf_ref, mode):
    """Few pages: sequences are preempted (recomputed or offloaded), lose their cross slot
    and are encoded again on re-admission; tokens stay equal to HF. Log-mel features work as
    the audio input too."""
    from mstar.models.whisper.audio import log_mel_spectrogram
    core = make_engine(model_and_tok, num_pages=9, max_num_seqs=4, preemption_mode=mode)
    prompt = TOK.decoder_prompt("en")
    feats = log_mel_spectrogram([torch.from_numpy(w) for w in waves], n_mels=128)
    reqs = {0: [EngineRequest(f"p{i}", prompt, forced(), encoder_input=feats[i] if i % 2 else waves[i]) for i in range(4)]}
    got = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    assert core.stats()["encoder_num_encoded"] > 4
    for i in range(4):
        assert got[f"p{i}"] == hf_ref["en", "transcribe"][i]
    assert_no_leaks(core)


def test_abort_storm_frees_cross_slots(model_and_tok, waves):
    core = make_engine(model_and_tok, max_num_seqs=3, num_pages=40)
    rng = random.Random(3)
    prompt = TOK.decoder_prompt("en")
    live: set[str] = set()
    n = 0
    for step in range(60):
        for _ in range(rng.randint(0, 3)):
            rid = f"s{n}"
            n += 1
            p = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5,
                               temperature=rng.choice([0.0, 1.0]), seed=n)
            core.add_request(EngineRequest(rid, prompt, p, encoder_input=waves[rng.randrange(4)][:rng.randint(800, 48000)]))
            live.add(rid)
        if live and rng.random() < 0.5:
            victims = rng.sample(sorted(live), k=rng.randint(1, len(live)))
            core.abort(victims + ["never-there"])
            live -= set(victims)
        for o in core.step():
            if o.finished:
                live.discard(o.request_id)
        core.cm.check()
        s = core.cm.stats()
        assert s.total_pages - s.free_pages >= 0 and s.cross_slots_total - s.cross_slots_free <= 3
    core.abort(sorted(live))
    while core.has_unfinished():
        core.step()
    assert n > 40
    assert_no_leaks(core)


def test_request_errors(model_and_tok, waves):
    core = make_engine(model_and_tok)
    prompt = TOK.decoder_prompt("en")
    with pytest.raises(RequestError, match="encoder_input"):
        core.add_request(EngineRequest("x", prompt, forced()))  # no audio
    with pytest.raises(RequestError, match="encoder_input"):
        core.add_request(EngineRequest("y", prompt, forced(), encoder_input=np.zeros(480001, np.float32)))
    with pytest.raises(RequestError, match="encoder_input"):
        core.add_request(EngineRequest("z", prompt, forced(), encoder_input=np.zeros((80, 3000), np.float32)))
    with pytest.raises(RequestError, match="context"):
        core.add_request(EngineRequest("w", prompt, SamplingParams(max_tokens=445), encoder_input=waves[0]))
    assert_no_leaks(core)


def test_llm_engine_refuses_audio():
    from engine_helpers import engine
    core = engine("qwen3")
    with pytest.raises(RequestError, match="no encoder input"):
        core.add_request(EngineRequest("q", [1, 2, 3], SamplingParams(max_tokens=2), encoder_input=np.zeros(100, np.float32)))


def test_llm_transcribe_windows_detection_and_verbose(model_and_tok, waves, hf_ref):
    from mstar.models.whisper.audio import AudioError
    from mstar.runtime.engine.llm import LLM
    llm = LLM.__new__(LLM)  # share the module's model: build the LLM around a ready engine
    from mstar.runtime.engine.output_processor import OutputProcessor
    import itertools
    llm.engine = make_engine(model_and_tok)
    llm.config = llm.engine.config
    llm.tokenizer = llm.engine.tokenizer
    llm.processor = OutputProcessor(llm.tokenizer)
    llm._ids = itertools.count()
    # one 7 s clip as WAV bytes: same tokens as HF (forced length), text from the tokenizer
    out = llm.transcribe(wav_bytes(waves[1]), language="en", max_tokens=N_NEW, min_tokens=N_NEW, verbose=True)
    seg = out["segments"]
    assert len(seg) == 1 and seg[0]["start"] == 0.0 and abs(seg[0]["end"] - 7.0) < 0.01
    assert seg[0]["tokens"] == TOK.text_ids(hf_ref["en", "transcribe"][1])
    assert out["language"] == "english" and abs(out["duration"] - 7.0) < 0.01
    assert out["text"] == llm.tokenizer.decode(seg[0]["tokens"], skip_special_tokens=True).strip()
    # 65 s of samples: 3 windows (30 + 30 + 5 s); language detected on the first
    long = np.concatenate([waves[2], waves[2], waves[1][:80000]])
    out = llm.transcribe(long, max_tokens=4, ignore_eos=True, verbose=True)
    assert [(s["start"], s["end"]) for s in out["segments"]] == [(0.0, 30.0), (30.0, 60.0), (60.0, 65.0)]
    assert out["language"] and all(len(s["tokens"]) <= 4 for s in out["segments"])
    assert isinstance(llm.transcribe(waves[0], language="de", task="translate", max_tokens=3), str)
    with pytest.raises(AudioError):
        llm.transcribe(b"")
    with pytest.raises(AudioError):
        llm.transcribe(b"this is not audio at all")
    with pytest.raises(ValueError, match="language"):
        llm.transcribe(waves[0], language="klingon")
    assert_no_leaks(llm.engine)


def test_cache_manager_cross_slots():
    """The cross slot pool alone: admission needs a slot, free / offload give it back,
    reload / fork take one (fork copies the K/V), no prefix caching, check() sees leaks."""
    from mstar.models.context import AttentionLayerSpec, CacheSpec, CrossAttentionSpec
    from mstar.runtime.caches.cache_manager import CacheManager
    a = AttentionLayerSpec(2, 4)
    spec = CacheSpec(attention=(a, a), cross=CrossAttentionSpec(layers=(a, a), max_source_len=6))
    cm = CacheManager(spec, num_pages=16, page_size=4, num_slots=0, dtype=torch.float32, device="cpu",
                      num_cross_slots=2)
    assert [tuple(c.shape) for c in cm.caches.cross_k_caches] == [(2, 6, 2, 4)] * 2
    prompt = list(range(9))
    assert cm.admit("a", prompt) == 0 and cm.admit("b", prompt) == 0
    assert {cm.cross_slot("a"), cm.cross_slot("b")} == {0, 1}
    assert cm.admit("c", prompt) is None and not cm.can_admit(1)  # no cross slot left
    assert cm.ensure_capacity("a", 9)
    cm.commit("a", prompt, 9)
    assert cm.stats().cached_pages == 0  # prefix cache off for encoder-decoder models
    cm.free("b")
    cm.caches.cross_k_caches[0][cm.cross_slot("a")].fill_(3.0)
    assert cm.fork("a", "a2") and cm.caches.cross_k_caches[0][cm.cross_slot("a2")].eq(3.0).all()
    assert not cm.fork("a", "a3")
    cm.offload("a")
    assert cm.cross_slot("a") == -1 and cm.stats().cross_slots_free == 1
    cm.check()
    assert cm.admit("c", prompt) == 0
    assert not cm.reload("a")  # both slots taken
    cm.free("c")
    assert cm.reload("a") and cm.cross_slot("a") >= 0
    cm.check()
    for r in ("a", "a2"):
        cm.free(r)
    s = cm.stats()
    assert s.cross_slots_free == s.cross_slots_total == 2 and s.free_pages == 16
    cm.check()
    with pytest.raises(ValueError, match="num_cross_slots"):
        CacheManager(spec, num_pages=4, page_size=4, num_slots=0, dtype=torch.float32, device="cpu")


def test_warm_up_transcribes_silence_and_leaves_no_trace(model_and_tok, waves, monkeypatch):
    """Whisper's start-up warm-up (one second of silence): later transcriptions equal a cold
    engine's, and every cross slot, page and counter is back where it was."""
    from mstar.runtime.engine.engine_core import EngineCore
    tok = WhisperTokens.from_vocab_size(model_and_tok[0].config.vocab_size)
    prompt = tok.decoder_prompt("en", "transcribe")
    reqs = lambda: {0: [EngineRequest(str(i), prompt, forced(), encoder_input=w) for i, w in enumerate(waves)]}  # noqa: E731
    cold = run(make_engine(model_and_tok, warmup="off"), reqs())
    steps, step = [], EngineCore.step
    monkeypatch.setattr(EngineCore, "step", lambda self: steps.append(1) or step(self))
    core = make_engine(model_and_tok, warmup="on")
    monkeypatch.undo()
    assert len(steps) >= 2  # the warm-up ran: encoder + prefill, then decode
    assert core.num_steps == 0 and core.cm.stats().cached_pages == 0
    assert run(core, reqs()) == cold
    assert_no_leaks(core)


def test_overlapped_decode_applies_the_suppress_masks(model_and_tok, waves):
    """async_output with Whisper: its decode rows carry static suppress masks, which the
    overlapped launch applies on the device, so decode steps chain (a step launched before the
    previous one is read back) and give the synchronous path's tokens. The masks are made to
    bite: every id but a random few text tokens is suppressed."""
    prompt = TOK.decoder_prompt("en", "transcribe")
    sp = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
    allowed = set(random.Random().sample(range(TOK.eot), 48))
    outs = []
    for overlap in (False, True):
        core = make_engine(model_and_tok, decode_graphs="static", async_output=overlap, admit_min_free=0)
        core.default_suppress = tuple(i for i in range(core.vocab_size) if i not in allowed)
        outs.append(run(core, {0: [EngineRequest("a0", prompt, sp, encoder_input=waves[0]),
                                   EngineRequest("a1", prompt, sp, encoder_input=waves[1])],
                               2: [EngineRequest("a2", prompt, sp, encoder_input=waves[3])]}))
        if overlap:
            assert core.overlap is not None and core.overlap.num_chained > 0
        assert_no_leaks(core)
    assert outs[1] == outs[0]
    assert {t for v in outs[1].values() for t in v} <= allowed
