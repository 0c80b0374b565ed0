"""Orpheus (mstar/models/orpheus): a Llama LM whose speech requests sample SNAC audio tokens, and
the streaming codec stage that turns them into 24 kHz audio as they come, against the references.

The checkpoint is the release's layout, tiny: an HF Llama directory (transformers' LlamaForCausalLM
with Orpheus's 156940-id vocabulary, tied embeddings, llama3 rope; save_pretrained + a tokenizer)
and beside it a SNAC directory (the snac package's SNAC with random weights at the 24 kHz layout,
a narrow width: config.json + pytorch_model.bin). mstar finds the codec beside the model.

References: the LM's greedy tokens against transformers' generate (exact, float32); a speech
request's audio against the snac package decoding the request's own tokens the way the release's
glue does (each window of the last 28 audio tokens decoded alone, samples [2048, 4096) kept, plus
the last window's [4096, 8192) at the end), its noise mstar's counter-based noise of the seed mstar
gives that window (seed * 1000003 + window index): within AUDIO_TOL (5e-6, as tests/test_snac.py states
for a window decode). A request batched with others against the same request alone: tokens exact,
audio within BATCH_TOL (1e-6: the same weights, CPU convolutions pick kernels by batch size; seen
<= 3e-8).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

snac = pytest.importorskip("snac")

from mstar.models import interfaces as I  # noqa: E402
from mstar.models import registry  # noqa: E402
from mstar.models.orpheus import tokens as T  # noqa: E402
from mstar.models.orpheus.codec_stage import window_seed  # noqa: E402
from mstar.models.orpheus.family import find_codec  # noqa: E402
from mstar.models.snac.presets import SNAC_TINY  # noqa: E402
from mstar.runtime.engine.config import EngineConfig  # noqa: E402
from mstar.runtime.engine.engine_core import EngineCore  # noqa: E402
from mstar.runtime.engine.request import EngineRequest, RequestError, SamplingParams  # noqa: E402
from orpheus_helpers import audio, run, speech  # noqa: E402
from snac_helpers import PackageNoise, release_model, save_release  # noqa: E402

AUDIO_TOL = 5e-6
BATCH_TOL = 1e-6
N = 2048  # samples per frame at 24 kHz


def _lm_config():
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=156940, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128258, 128009],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256})


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(model dir, snac dir, transformers LM, snac package model)."""
    from hf_models import make_hf_model

    from mstar.models.tokenizer import byte_tokenizer
    root = tmp_path_factory.mktemp("orpheus")
    hf = make_hf_model(_lm_config(), seed=41)
    lm_dir = root / "orpheus-tiny-ft"
    hf.save_pretrained(lm_dir)
    byte_tokenizer().save_pretrained(lm_dir)
    ref = release_model(SNAC_TINY, 42)
    snac_dir = save_release(ref, SNAC_TINY, root / "snac_24khz")
    return str(lm_dir), snac_dir, hf, ref


@pytest.fixture(scope="module")
def engine(release):
    return EngineCore(EngineConfig(model=release[0], dtype="float32", device="cpu", max_num_seqs=8))


# --- the checkpoint ---------------------------------------------------------------------------------
def test_checkpoint_is_orpheus_and_its_codec_is_found(release, tmp_path):
    lm_dir, snac_dir, _, _ = release
    assert registry.family_of(lm_dir).name == "orpheus"
    assert find_codec(lm_dir, None) == snac_dir
    assert find_codec(lm_dir, "/elsewhere/snac") == "/elsewhere/snac"  # --codec wins
    lone = tmp_path / "lone" / "orpheus"
    lone.mkdir(parents=True)
    with pytest.raises(ValueError, match="--codec"):
        find_codec(str(lone), None)
    # a plain Llama checkpoint (another vocabulary) stays a Llama
    assert registry.family_of_checkpoint({"model_type": "llama", "vocab_size": 128256}).name == "llama"


def test_lm_greedy_equals_transformers(release, engine):
    hf = release[2]
    prompt = [128259, 128000, 70, 80, 90, 128009, 128260, 128261, 128257]
    engine.add_request(EngineRequest("greedy", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                      ignore_eos=True)))
    got = []
    while engine.has_unfinished():
        for o in engine.step():
            got += o.new_token_ids
            assert not o.media  # a token request makes no audio
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert got == want.tolist()


# --- a speech request against the release's glue on the snac package ---------------------------------
def test_speech_audio_equals_the_package_decoding_its_tokens(release, engine, monkeypatch):
    ref = release[3]
    hook = PackageNoise(None)
    monkeypatch.setattr(snac.layers.NoiseBlock, "forward", lambda self, x: hook(self, x))
    seed, n_tokens = 123, 63  # 9 frames: 6 windows, then the tail
    d = run(engine, [speech("s", "Hello from a tiny model.", seed, n_tokens)])["s"]
    assert d["finish"] == "length" and len(d["tokens"]) == n_tokens
    # sampling is restricted to the frame position's range: every token is the next audio code
    codes = [t - T.AUDIO_TOKEN_BASE - (k % 7) * T.CODEBOOK_SIZE for k, t in enumerate(d["tokens"])]
    assert all(0 <= c < T.CODEBOOK_SIZE for c in codes)
    frames = [codes[i:i + 7] for i in range(0, n_tokens, 7)]

    def package_window(w: int) -> torch.Tensor:  # window w = frames w .. w+3, alone, as the release decodes it
        f = frames[w:w + 4]
        books = [torch.tensor([[fr[0] for fr in f]]), torch.tensor([[x for fr in f for x in (fr[1], fr[4])]]),
                 torch.tensor([[x for fr in f for x in (fr[2], fr[3], fr[5], fr[6])]])]
        hook.seeded([window_seed(seed, w)])
        with torch.inference_mode():
            return ref.decode(books)[0, 0]

    windows = [package_window(w) for w in range(len(frames) - 3)]
    want = torch.cat([w[N:2 * N] for w in windows] + [windows[-1][2 * N:]]).numpy()
    chunks = d["chunks"]
    assert [len(c.pcm) for c in chunks] == [N] * len(windows) + [2 * N]
    assert [c.final for c in chunks] == [False] * len(windows) + [True]
    assert all(c.sample_rate == 24000 and c.pcm.dtype == np.float32 for c in chunks)
    got = audio(d)
    assert np.abs(got - want).max() < AUDIO_TOL
    assert np.abs(want).max() > 1e-2  # not silence


def test_padded_window_graphs_keep_the_audio(engine, monkeypatch):
    """MSTAR_SNAC_GRAPHS's padding (graphs="static": the CUDA graphs' shapes, eagerly) gives each
    window the samples the unpadded decode gives it; on a CPU the stage decodes unpadded (the
    knob's CUDA graphs need CUDA)."""
    from mstar import knobs
    from mstar.models.snac.streaming import WindowDecoder
    stage = engine.output_stage
    assert stage.windows.graphs == "off" and knobs.value("MSTAR_SNAC_GRAPHS")
    reqs = [("p", "Padded windows.", 11, 42), ("q", "And a second stream.", 12, 49), ("r", "Third.", 13, 35)]
    plain = run(engine, [speech(rid, t, s, n) for rid, t, s, n in reqs])
    monkeypatch.setattr(stage, "windows", WindowDecoder(stage.decoder, graphs="static"))
    padded = run(engine, [speech(rid, t, s, n) for rid, t, s, n in reqs])
    for rid, _, _, n in reqs:
        assert padded[rid]["tokens"] == plain[rid]["tokens"]
        assert [len(c.pcm) for c in padded[rid]["chunks"]] == [len(c.pcm) for c in plain[rid]["chunks"]]
        assert np.abs(audio(padded[rid]) - audio(plain[rid])).max() < BATCH_TOL


def test_candidate_sampling_gives_the_default_tokens(release, engine):
    """MSTAR_CANDIDATE_SAMPLING (each step on the frame position's 4097 candidate columns): the
    tokens and audio of the path with the knob off (vocabulary-wide mask)."""
    from mstar import knobs
    assert engine._candidates and knobs.value("MSTAR_CANDIDATE_SAMPLING")
    reqs = [("c1", "Candidates only.", 21, 42), ("c2", "A second, longer request here.", 22, 56)]
    with knobs.override(MSTAR_CANDIDATE_SAMPLING=False):
        whole = EngineCore(EngineConfig(model=release[0], dtype="float32", device="cpu", max_num_seqs=8))
    assert not whole._candidates
    want = run(whole, [speech(rid, t, s, n) for rid, t, s, n in reqs])
    cand = EngineCore(EngineConfig(model=release[0], dtype="float32", device="cpu", max_num_seqs=8))
    assert cand._candidates
    calls = []
    at = cand.model.compute_logits_at
    cand.model.compute_logits_at = lambda *a: calls.append(a[2].shape) or at(*a)
    got = run(cand, [speech(rid, t, s, n) for rid, t, s, n in reqs])
    assert len(calls) >= 56 and all(c[1] == 4097 for c in calls)  # every step sampled on the columns
    for rid, _, _, n in reqs:
        assert got[rid]["tokens"] == want[rid]["tokens"] and len(got[rid]["tokens"]) == n
        assert np.array_equal(audio(got[rid]), audio(want[rid]))
    ids = cand.hooks._cands
    assert ids.shape == (7, 4097) and ids[0, 0].item() == T.END_OF_SPEECH and (ids[1:, -1] == -1).all()
    assert all(bool((r[r >= 0].diff() > 0).all()) for r in ids)  # ascending


def test_batched_equals_alone(engine):
    reqs = [("a", "One.", 5, 42), ("b", "Two, and a longer sentence.", 6, 35), ("c", "Three.", 7, 56)]
    alone = {rid: run(engine, [speech(rid, t, s, n)])[rid] for rid, t, s, n in reqs}
    together = run(engine, [speech(rid, t, s, n) for rid, t, s, n in reqs])
    for rid, _, _, n in reqs:
        assert together[rid]["tokens"] == alone[rid]["tokens"] and len(alone[rid]["tokens"]) == n
        a, b = audio(alone[rid]), audio(together[rid])
        assert a.shape == b.shape == ((n // 7 - 3) * N + 2 * N,)
        assert np.abs(a - b).max() < BATCH_TOL
    assert len(engine.output_stage) == 0


def test_abort_frees_the_stream_and_the_others_are_unchanged(engine):
    alone = run(engine, [speech("keep", "Stay.", 9, 49)])["keep"]
    both = run(engine, [speech("keep", "Stay.", 9, 49), speech("gone", "Leave early.", 10, 700)],
               abort_after={"gone": 12})
    assert both["gone"]["finish"] == "abort" and len(both["gone"]["tokens"]) < 700
    assert both["keep"]["tokens"] == alone["tokens"]
    assert np.abs(audio(both["keep"]) - audio(alone)).max() < BATCH_TOL
    assert len(engine.output_stage) == 0  # the codec holds no stream
    assert engine.stats()["kv_pages_used"] == 0 and engine.stats()["running"] == 0


def test_short_stream_is_silent_and_ends(engine):
    d = run(engine, [speech("tiny", "Hi.", 1, 21)])["tiny"]  # 3 frames: no window, as the release
    assert d["finish"] == "length" and len(d["chunks"]) == 1 and d["chunks"][0].final
    assert d["chunks"][0].pcm.shape == (0,)


@pytest.mark.parametrize("inputs,field", [
    ({"text": "Hi", "speed": 2.0}, "speed"),
    ({"text": "Hi", "instructions": "whisper it"}, "instructions"),
    ({"text": "   "}, "input"),
    ({"text": "Hi", "max_new_tokens": 10 ** 6}, "max_tokens"),
])
def test_refusals_name_the_field(engine, inputs, field):
    with pytest.raises(RequestError) as e:
        engine.add_request(EngineRequest("bad", [], None, media=I.MediaRequest("bad", inputs, 0)))
    assert e.value.field == field
    assert not engine.has_unfinished() and len(engine.output_stage) == 0


def test_preset_runs_with_its_codec_preset():
    eng = EngineCore(EngineConfig(model="tiny-orpheus", dtype="float32", device="cpu"))
    assert eng.hooks.accepts["voices"][0] == "tara" and eng.hooks.accepts["sample_rate"] == 24000
    d = run(eng, [speech("p", "Preset.", 3, 35)])["p"]
    assert audio(d).shape == (2 * N + 2 * N,)
    assert os.path.basename(find_codec("tiny-orpheus", None)) == "snac-tiny"
