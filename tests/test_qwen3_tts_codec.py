"""The Qwen3-TTS 12 Hz codec decoder (mstar/models/qwen3_tts/codec*.py) against the qwen-tts
package (0.1.1, run in its reference environment), and its streaming against its own whole decode.

The release model is the package's Qwen3TTSTokenizerV2Model of a tiny config (the real structure:
16 codebooks split 1 + 15, the upsampling chain 2 * 2 * 8 * 5 * 4 * 3 = 1920 samples a frame, a
sliding window of 5 keys over 2 layers, GQA), its decoder's weights randomised from a fresh seed
(the release's initialisation keeps LayerScale, gamma and SnakeBeta near identity, and would test
little), saved with save_pretrained (the speech_tokenizer/ layout: config.json, model.safetensors
of encoder and decoder) and read back through load_codec_decoder. Codes are fresh random every
run; the seed is in every failure message.

Tolerances (float32, audio in [-1, 1], mean 0 and std ~0.2 by the setting of the last conv): the decoder against the package 1e-5 absolute
(the same operations; GEMM and convolution sums run in other orders, q/k/v and gate/up are fused
into one matrix each: seen <= 1.3e-6). Streamed chunks against the whole-utterance decode 1e-5: the
state carried between chunks is exactly the inputs the whole decode reads, so only the shapes of
the calls (and with them the kernels' summation order) differ (seen <= 1.3e-6). A stream decoded in
a batch of streams against the same chunks alone 1e-5 (likewise)."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from mstar.models.qwen3_tts.codec_config import Qwen3TTSCodecConfig
from mstar.models.qwen3_tts.codec_streaming import CodecStatePool, CodecStreamer
from mstar.models.qwen3_tts.codec_weights import load_codec_decoder
from mstar.ops.snake_beta import snake_beta
from reference_envs import reference_env, run_reference

TOL = 1e-5
SEED = int.from_bytes(os.urandom(4), "little")
Q = 16
TINY_DECODER = {"codebook_size": 64, "codebook_dim": 20, "latent_dim": 24, "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "sliding_window": 5, "num_quantizers": Q, "decoder_dim": 32, "upsampling_ratios": [2, 2],
                "upsample_rates": [8, 5, 4, 3]}
TINY_ENCODER = {"audio_channels": 1, "chunk_in_sec": None, "hidden_size": 32, "num_filters": 8,
                "num_residual_layers": 1, "upsampling_ratios": [8, 4], "codebook_size": 64,
                "vector_quantization_hidden_dimension": 64, "upsample_groups": 32, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 2, "sliding_window": 4, "codebook_dim": 64,
                "use_cache": False}

RELEASE = r'''
import torch
from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model

torch.manual_seed(ARGS["seed"])
cfg = Qwen3TTSTokenizerV2Config(encoder_config=ARGS["encoder"], decoder_config=ARGS["decoder"])
model = Qwen3TTSTokenizerV2Model(cfg).eval()
with torch.no_grad():
    for name, p in model.decoder.named_parameters():
        if name.endswith(("alpha", "beta")):  # SnakeBeta's log frequency / magnitude
            p.normal_(0, 0.3)
        elif name.endswith(("gamma", "scale")):  # ConvNeXt gamma, LayerScale
            p.uniform_(0.2, 0.5)
        elif name.endswith("cluster_usage"):
            p.uniform_(0.5, 2.0)
            p[:3] = 0  # below the release's clamp
        elif name.endswith("embedding_sum"):
            p.normal_()
        elif "norm" in name and name.endswith("weight"):
            p.normal_(1, 0.1)
        elif name.endswith("bias"):
            p.normal_(0, 0.05)
        else:
            p.normal_(0, 0.7 * p[0].numel() ** -0.5)
    # the last conv set so that its output (before the clamp to [-1, 1]) has mean 0 and std 0.2 on the
    # forward case: the random weights of some seeds would otherwise clip most samples (a large
    # offset or scale), or fall near silence
    last = model.decoder.decoder[-1].conv
    seen = []
    hook = last.register_forward_hook(lambda m, i, o: seen.append((float(o.mean()), float(o.std()))))
    model.decoder(torch.tensor(ARGS["forward"]))
    hook.remove()
    mean, std = seen[0]
    last.weight.mul_(0.2 / std)
    last.bias.sub_(mean).mul_(0.2 / std)
model.save_pretrained(ARGS["dir"])
with torch.no_grad():
    RESULT = {
        "forward": model.decoder(torch.tensor(ARGS["forward"]))[:, 0],
        "decode": model.decode(torch.tensor(ARGS["decode"]), return_dict=True).audio_values,
        "chunked": model.decoder.chunked_decode(torch.tensor(ARGS["chunked"]), chunk_size=8,
                                                left_context_size=3)[:, 0],
    }
'''


def _codes(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, TINY_DECODER["codebook_size"], shape, generator=g)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(decoder loaded from the package's checkpoint, the codes of each case, the package's audio)."""
    g = torch.Generator().manual_seed(SEED)
    path = str(tmp_path_factory.mktemp("qwen3_tts") / "speech_tokenizer")
    decode = _codes(g, 3, 20, Q)  # the package's tokenizer layout [B, T, 16]; rows 1, 2 end early (-1)
    decode[1, 13:] = -1
    decode[2, 5:] = -1
    cases = {"forward": _codes(g, 2, Q, 20), "decode": decode, "chunked": _codes(g, 1, Q, 20)}
    ref = run_reference(reference_env("qwen-tts"), RELEASE,
                        {"dir": path, "seed": SEED, "encoder": TINY_ENCODER, "decoder": TINY_DECODER,
                         **{k: v.tolist() for k, v in cases.items()}})
    return load_codec_decoder(path), cases, ref


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (SEED, a.shape, b.shape)
    return (a - b).abs().max().item()


def test_whole_decode_matches_package(release):
    decoder, cases, ref = release
    want = ref["forward"]
    assert decoder.samples_per_frame == 1920 and want.shape == (2, 20 * 1920)
    assert want.std() > 0.02 and (want.abs() >= 1).float().mean() < 0.2, (SEED, want.std())  # audio, mostly unclipped
    got = decoder(cases["forward"])
    assert _max_diff(got, want) < TOL, (SEED, _max_diff(got, want))


def test_tokenizer_decode_matches_package(release):
    """-1 padding ends a row (audio cut to its frames), and the release's chunked decode rule."""
    decoder, cases, ref = release
    got = decoder.decode(cases["decode"].transpose(1, 2))
    assert [a.shape[0] for a in got] == [20 * 1920, 13 * 1920, 5 * 1920], SEED
    for a, b in zip(got, ref["decode"]):
        assert _max_diff(a, b) < TOL, (SEED, _max_diff(a, b))
    chunked = decoder.decode(cases["chunked"], chunk_frames=8, left_context_frames=3)[0]
    assert _max_diff(chunked, ref["chunked"][0]) < TOL, (SEED, _max_diff(chunked, ref["chunked"][0]))


def _run(streamer: CodecStreamer, codes: dict, joins: dict, rng: random.Random, leave: dict | None = None) -> dict:
    """Drive the streamer: stream k joins at step joins[k], gets 0-3 frames a step, finishes when
    its codes are fed, and (leave) is dropped at step leave[k]; returns each finished stream's
    chunks."""
    leave = leave or {}
    fed, chunks, step = dict.fromkeys(codes, 0), {k: [] for k in codes}, 0
    while any(k in streamer.streams or step <= joins[k] for k in codes):
        for k, c in codes.items():
            if step == joins[k]:
                streamer.join(k)
            if k in streamer.streams and step == leave.get(k):
                streamer.leave(k)
                chunks.pop(k)
            if k in streamer.streams and fed[k] < c.shape[1]:
                take = min(rng.randint(0, 3), c.shape[1] - fed[k])
                streamer.feed(k, c[:, fed[k]:fed[k] + take])
                fed[k] += take
                if fed[k] == c.shape[1]:
                    streamer.finish(k)
        for chunk in streamer.step():
            chunks[chunk.stream].append(chunk)
        step += 1
    return chunks


def test_streaming_equals_whole_decode(release):
    decoder = release[0]
    g, rng = torch.Generator().manual_seed(SEED + 1), random.Random(SEED + 1)
    codes = _codes(g, Q, 23)
    chunks = _run(CodecStreamer(decoder, initial_chunk_frames=3, chunk_frames=5), {"a": codes}, {"a": 0}, rng)["a"]
    assert [c.frames for c in chunks if c.frames] == [3, 5, 5, 5, 5], SEED
    assert [c.first_frame for c in chunks if c.frames] == [0, 3, 8, 13, 18] and chunks[-1].last, SEED
    got = torch.cat([c.audio for c in chunks])
    want = decoder(codes[None])[0]
    assert _max_diff(got, want) < TOL, (SEED, _max_diff(got, want))


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_batched_streams_equal_each_alone(release, graphs):
    """Streams at different positions in one batch, joining late, one leaving early (its slot
    reused), the pool growing from one slot: each stream's audio is its audio alone. "static":
    the CUDA graphs' padding (rows to 1, 2, 4, 8k from the empty slot 0, frames to a chunk size),
    run eagerly."""
    decoder = release[0]
    g, rng = torch.Generator().manual_seed(SEED + 2), random.Random(SEED + 2)
    codes = {k: _codes(g, Q, 19 if k == 1 else rng.randint(4, 19)) for k in range(5)}  # 1 is still going at step 3
    joins = {0: 0, 1: 0, 2: 2, 3: 5, 4: 7}
    streamer = CodecStreamer(decoder, initial_chunk_frames=2, chunk_frames=4, capacity=1, graphs=graphs)
    chunks = _run(streamer, codes, joins, rng, leave={1: 3})
    assert set(chunks) == {0, 2, 3, 4} and streamer.pool.capacity >= 3 and not streamer.streams, SEED
    if graphs == "static":  # slot 0 (the padding rows' state) was never written
        assert all(not h[0].any() for h in streamer.pool.history) and int(streamer.pool.positions[0]) == 0
    for k, ch in chunks.items():
        got = torch.cat([c.audio for c in ch])
        alone = CodecStreamer(decoder, initial_chunk_frames=2, chunk_frames=4)
        alone.join(k)
        alone.feed(k, codes[k])
        alone.finish(k)
        solo = []
        while alone.streams:
            solo += [c.audio for c in alone.step()]
        assert _max_diff(got, torch.cat(solo)) < TOL, (SEED, k, _max_diff(got, torch.cat(solo)))
        assert _max_diff(got, decoder(codes[k][None])[0]) < TOL, (SEED, k)


def test_pool_rows_of_any_length(release):
    """One pool step: a row continuing at position 6 with 3 frames beside a new row with 7 and a
    row with none (its state unchanged)."""
    decoder = release[0]
    g = torch.Generator().manual_seed(SEED + 3)
    a, b, c = _codes(g, Q, 9), _codes(g, Q, 7), _codes(g, Q, 4)
    pool = CodecStatePool(decoder, capacity=3)
    sa, sb, sc = pool.acquire(), pool.acquire(), pool.acquire()
    first = pool.decode([sa, sc], torch.stack([a[:, :6], torch.cat([c, c[:, :2]], 1)]), [6, 4])
    rows = torch.zeros(3, Q, 7, dtype=torch.long)
    rows[0, :, :3], rows[1], rows[2] = a[:, 6:], b, 5
    before = [h[sc].clone() for h in pool.history]
    second = pool.decode([sa, sb, sc], rows, torch.tensor([3, 7, 0]))
    third = pool.decode([sc], torch.zeros(1, Q, 0, dtype=torch.long), [0])
    spf = decoder.samples_per_frame
    assert pool.positions.tolist() == [9, 7, 4] and third.shape == (1, 0), SEED
    assert all(torch.equal(h[sc], b) for h, b in zip(pool.history, before)), SEED
    assert _max_diff(torch.cat([first[0], second[0, :3 * spf]]), decoder(a[None])[0]) < TOL, SEED
    assert _max_diff(second[1], decoder(b[None])[0]) < TOL, SEED
    assert _max_diff(first[1, :4 * spf], decoder(c[None])[0]) < TOL, SEED


def test_receptive_field_is_the_left_context_a_stateless_decode_needs(release):
    decoder = release[0]
    g = torch.Generator().manual_seed(SEED + 4)
    rf = decoder.config.receptive_field_frames
    assert rf == math.ceil(2 + 2 * 4 + 9.38) == 20  # input conv, 2 layers x (window - 1), the convs
    codes, spf = _codes(g, 1, Q, rf + 8), decoder.samples_per_frame
    tail = decoder(codes)[0, -3 * spf:]
    assert _max_diff(decoder(codes[..., -3 - rf:])[0, -3 * spf:], tail) < TOL, SEED
    # less than the frame-rate part (input conv and attention: 10 frames) changes the audio, by far
    # more than float rounding (< TOL above; seen 9e-5 and up over fresh seeds)
    assert _max_diff(decoder(codes[..., -3 - 8:])[0, -3 * spf:], tail) > 3 * TOL, SEED


def test_published_config():
    raw = {"decode_upsample_rate": 1920, "output_sample_rate": 24000,
           "decoder_config": {"codebook_dim": 512, "head_dim": 64, "hidden_size": 512, "latent_dim": 1024,
                              "num_semantic_quantizers": 1, "semantic_codebook_size": 4096,
                              "vector_quantization_hidden_dimension": 512, "model_type": ""}}
    cfg = Qwen3TTSCodecConfig.from_dict(raw)
    assert (cfg.samples_per_frame, cfg.frame_rate, cfg.attention_head_dim) == (1920, 12.5, 64)
    assert cfg.receptive_field_frames == 580
    with pytest.raises(ValueError, match="decode_upsample_rate"):
        Qwen3TTSCodecConfig.from_dict({**raw, "decode_upsample_rate": 960})


def test_snake_beta_op():
    """SnakeBeta of equal log parameters is Snake (the ops' formulas), other shapes are refused."""
    from mstar import ops
    g = torch.Generator().manual_seed(SEED + 5)
    x = torch.randn(2, 6, 11, generator=g) * 3
    alpha = torch.rand(6, generator=g) + 0.2
    torch.testing.assert_close(snake_beta(x, alpha.log(), alpha.log()), ops.snake(x, alpha), rtol=1e-6, atol=1e-6)
    log_alpha, log_beta = torch.randn(6, generator=g) * 0.3, torch.randn(6, generator=g) * 0.3
    want = x + torch.sin(x * log_alpha.exp()[:, None]) ** 2 / (log_beta.exp()[:, None] + 1e-9)
    torch.testing.assert_close(snake_beta(x, log_alpha, log_beta), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        snake_beta(x, log_alpha[:5], log_beta)


def test_codec_graphs_are_opt_in(release):
    """By default (and off CUDA) the pool decodes each chunk as it comes: no padding slot."""
    from mstar import knobs
    decoder = release[0]
    assert CodecStreamer(decoder).pool.graphs == "off" and not knobs.value("MSTAR_TTS_CODEC_GRAPHS")
    assert CodecStatePool(decoder, graphs="auto").graphs == "off"  # "auto" off CUDA
    pool = CodecStatePool(decoder, capacity=3)
    assert pool.capacity == pool.positions.shape[0] == 3 and [pool.acquire() for _ in range(3)] == [0, 1, 2]
