"""Qwen3-TTS on CUDA: the talker's paged attention through the FlashInfer backends and the code
predictor's dense attention (bf16, head_dim 128) checked op by op against the reference under
MSTAR_VERIFY, over a prefill and decode frames of a batch. The tolerance: bf16 rounding of
attention outputs of unit scale, 3e-2; attending to a stale layout (fewer keys) moves outputs by
~0.3. Then the frame CUDA graphs and the codec's chunk graphs against their own buffers and
padding run eagerly (the same kernels: equal codes, equal samples)."""

from __future__ import annotations

import copy

import pytest
import torch

from mstar import knobs, ops
from mstar.models.qwen3_tts.codec_config import Qwen3TTSCodecConfig
from mstar.models.qwen3_tts.codec_streaming import CodecStreamer
from mstar.models.qwen3_tts.codec_weights import build_codec_decoder
from mstar.models.qwen3_tts.config import Qwen3TTSConfig
from mstar.models.qwen3_tts.generate import GenerationParams, TalkerGenerator
from mstar.models.qwen3_tts.presets import TINY, byte_tokenizer
from mstar.models.qwen3_tts.prompt import PromptBuilder, SpeechRequest
from mstar.models.qwen3_tts.weights import build_talker, init_random

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlashInfer backends)")
TOL = 3e-2


def _config() -> Qwen3TTSConfig:
    raw = {k: v for k, v in copy.deepcopy(TINY).items() if k not in ("speech_tokenizer", "generation_config")}
    t = raw["talker_config"]
    t.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "interleaved": True})
    t["code_predictor_config"].update(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    return Qwen3TTSConfig.from_dict(raw)


def test_paged_attention_matches_the_reference_on_cuda():
    config = _config()
    talker = build_talker(config, "cuda", torch.bfloat16)
    init_random(talker, seed=int(torch.randint(1 << 30, ()).item()), std=0.05)
    gen = TalkerGenerator(talker, config, max_rows=4, num_pages=64)
    builder = PromptBuilder(config, byte_tokenizer())
    prompts = [builder.build(SpeechRequest(t, "vivian", "english")) for t in ("short", "a longer one to say", "mid")]
    params = GenerationParams(min_new_tokens=10, max_new_tokens=10, seed=3)
    with knobs.override(MSTAR_VERIFY=True):
        ops.reset_verify_report()
        state, _ = gen.start(prompts, params)
        for _ in range(5):
            gen.step(state)
        report = ops.verify_report()
    for op in ("paged_attention_prefill", "paged_attention_decode", "dense_attention"):
        assert report[op]["calls"] > 0, report
        assert report[op]["max_abs_diff"] < TOL, (op, report[op])


def _generate(gen: TalkerGenerator, prompts, params, frames: int) -> list[torch.Tensor]:
    state, first = gen.start(prompts, params)
    codes = [first.codes]
    for _ in range(frames - 1):
        codes.append(gen.step(state).codes)
    gen.leave(state, list(range(len(state))))
    return codes


def test_frame_graphs_replay_the_eager_frame():
    """3 rows padded to 4, 12 frames: the captured graphs (the first frame's head, then whole frames)
    give their buffers' eager codes."""
    config = _config()
    talker = build_talker(config, "cuda", torch.bfloat16)
    init_random(talker, seed=int(torch.randint(1 << 30, ()).item()), std=0.05)
    builder = PromptBuilder(config, byte_tokenizer())
    prompts = [builder.build(SpeechRequest(t, "vivian", "english")) for t in ("short", "a longer one to say", "mid")]
    params = [GenerationParams(min_new_tokens=12, max_new_tokens=12, seed=s) for s in (5, 6, 7)]
    got = {}
    for mode in ("static", "cuda"):
        gen = TalkerGenerator(talker, config, max_rows=8, num_pages=64, graphs=mode)
        got[mode] = _generate(gen, prompts, params, 12)
        if mode == "cuda":
            assert {k[:2] for k in gen.frame_graphs.graphs} == {("frame", 4), ("head", 4)}
    for a, b in zip(got["cuda"], got["static"]):
        assert torch.equal(a, b)


def test_codec_chunk_graphs_replay_the_padded_eager_chunks():
    """Three streams of 4-frame then 8-frame chunks (rows padded to 4), one ending early: every
    chunk's samples from the graphs equal the same padding run eagerly."""
    decoder = build_codec_decoder(Qwen3TTSCodecConfig.from_dict(TINY["speech_tokenizer"]), torch.bfloat16, "cuda",
                                  seed=int(torch.randint(1 << 30, ()).item()))
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ()).item()))
    q, size = decoder.config.num_quantizers, decoder.config.codebook_size
    codes = {k: torch.randint(0, size, (q, n), generator=g).cuda() for k, n in (("a", 20), ("b", 28), ("c", 9))}
    out = {}
    for mode in ("static", "cuda"):
        streamer = CodecStreamer(decoder, initial_chunk_frames=4, chunk_frames=8, graphs=mode)
        for k in codes:
            streamer.join(k)
        chunks = {k: [] for k in codes}
        fed = dict.fromkeys(codes, 0)
        while streamer.streams:
            for k, c in codes.items():
                if k in streamer.streams and fed[k] < c.shape[1]:
                    streamer.feed(k, c[:, fed[k]:fed[k] + 2])
                    fed[k] += 2
                    if fed[k] >= c.shape[1]:
                        streamer.finish(k)
            for chunk in streamer.step():
                chunks[chunk.stream].append(chunk.audio)
        out[mode] = {k: torch.cat(v) for k, v in chunks.items()}
        if mode == "cuda":
            assert streamer.pool._step.captures >= 2
    for k in codes:
        assert torch.equal(out["cuda"][k], out["static"][k]), k
