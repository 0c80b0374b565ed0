"""The SNAC decoder (mstar/models/snac) against the snac package's SNAC, the snake op, weight-norm
folding, the batched sliding-window decode, and Orpheus's token mapping (mstar/models/orpheus/
tokens.py) against a per-token reference written from the release's decoder.py; the snake op's
Triton kernel in Triton's CPU interpreter.

Release models are the snac package's SNAC(**config) with random weights (a fixed torch seed),
their weight-norm g scaled away from ||v|| (so folding g into the weight is exercised), Snake
alphas and biases randomised, saved as the published layout (config.json + pytorch_model.bin of
state_dict()) and read back through load_snac_decoder. Noise is made the same on both sides: the
package's NoiseBlock draws from a generator seeded as ours (or draws zeros, against noise=False).

Tolerances (float32): the decoder's audio within 5e-6 absolute of the package's (outputs in
[-1, 1]; the folded weight is g * v / ||v|| computed in float64 and rounded once, the package
recomputes it in float32 on every forward, and conv sums run in other orders: seen <= 5e-7).
The snake op against the package's snake function: 1e-6 (the same float32 operations). A batched
window decode against the package decoding each window alone: 5e-6 (as above). Streaming step by
step against all of a stream's windows in one batch: 1e-6 (the same weights and ops; only the
batch each window rides in differs, and CPU convolutions pick kernels by batch: seen <= 4e-7)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

snac = pytest.importorskip("snac")  # the `snac` pip package: the release's reference model

from mstar import ops  # noqa: E402
from mstar.models.orpheus import tokens as ot  # noqa: E402
from mstar.models.snac import (SNAC_24KHZ, build_snac_decoder, codes_from_frames, decode_stream,  # noqa: E402
                               decode_tail, decode_windows, fold_weight_norm, load_snac_decoder, sliding_windows)
from mstar.models.snac.model import SNACDecoder  # noqa: E402
from mstar.models.snac.streaming import WindowDecoder  # noqa: E402
from mstar.ops.sampling import normal_noise  # noqa: E402
from snac_helpers import PackageNoise, release_model, save_release  # noqa: E402

AUDIO_TOL = 5e-6

# tiny configs: three codebooks at strides 4/2/1 (the Orpheus layout), depthwise with noise;
# and two codebooks, dense convs, odd upsampling rates, no noise blocks
TINY = {"sampling_rate": 16000, "encoder_dim": 4, "encoder_rates": [2, 2], "decoder_dim": 32,
        "decoder_rates": [2, 2], "attn_window_size": None, "codebook_size": 64, "codebook_dim": 4,
        "vq_strides": [4, 2, 1], "noise": True, "depthwise": True}
TINY_DENSE = {"sampling_rate": 8000, "encoder_dim": 4, "encoder_rates": [3, 2], "latent_dim": 12,
              "decoder_dim": 24, "decoder_rates": [3, 2], "attn_window_size": None, "codebook_size": 32,
              "codebook_dim": 3, "vq_strides": [2, 1], "noise": False, "depthwise": False}


@pytest.fixture
def package_noise(monkeypatch):
    hook = PackageNoise(None)
    monkeypatch.setattr(snac.layers.NoiseBlock, "forward", lambda self, x: hook(self, x))
    return hook


def random_codes(cfg: dict, frames: int, batch: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    top = max(cfg["vq_strides"])
    return [torch.randint(0, cfg["codebook_size"], (batch, frames * top // s), generator=g) for s in cfg["vq_strides"]]


def package_decode(model, codes):
    with torch.inference_mode():
        return model.decode(codes)


# --- the snake op -------------------------------------------------------------------------------
def test_snake_matches_the_package():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, 41, generator=g) * 4
    alpha = torch.rand(6, generator=g) * 2
    alpha[0] = 0.0  # a dead channel: 1e-9 keeps it finite (the sine term is 0 there)
    ref = snac.layers.snake(x, alpha.view(1, -1, 1))
    got = ops.snake(x, alpha)
    assert got.shape == x.shape and got.dtype == x.dtype and torch.isfinite(got).all()
    assert (got - ref).abs().max().item() <= 1e-6
    x64, a64 = x.double(), alpha.double().view(1, -1, 1)
    exact = x64 + torch.sin(a64 * x64) ** 2 / (a64 + 1e-9)
    assert (ops.snake(x.bfloat16(), alpha).double() - exact).abs().max().item() < 0.1  # bf16: ~2^-8 of |x| <= 16
    assert ops.snake(x.bfloat16(), alpha).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        ops.snake(x, alpha[:5])
    torch.library.opcheck(ops.snake.overload, (x, alpha))


# --- weight-norm folding -------------------------------------------------------------------------
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("style", ["parametrizations", "legacy"])
def test_fold_weight_norm(transposed, style):
    torch.manual_seed(2)
    conv = (torch.nn.ConvTranspose1d(6, 4, 5) if transposed else torch.nn.Conv1d(6, 4, 5, groups=2))
    if style == "parametrizations":
        conv = torch.nn.utils.parametrizations.weight_norm(conv)
        g_name = "parametrizations.weight.original0"
    else:
        with pytest.warns(FutureWarning):
            conv = torch.nn.utils.weight_norm(conv)
        g_name = "weight_g"
    with torch.no_grad():
        dict(conv.named_parameters())[g_name].mul_(torch.linspace(0.5, 2.0, conv.weight.shape[0]).view(-1, 1, 1))
    state = {f"m.{k}": v for k, v in conv.state_dict().items()}
    folded = fold_weight_norm(state)
    assert sorted(folded) == ["m.bias", "m.weight"]
    # against the module's own forward (the legacy style recomputes its weight in a pre-hook)
    x = torch.randn(2, 6, 11)
    with torch.no_grad():
        want = conv(x)
    fn = torch.nn.functional.conv_transpose1d if transposed else torch.nn.functional.conv1d
    got = fn(x, folded["m.weight"], folded["m.bias"], groups=conv.groups)
    assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    # g is not ||v||: folding it in matters
    v = next(t for k, t in state.items() if k.endswith(("original1", "weight_v")))
    assert (folded["m.weight"] - v).abs().max() > 1e-2


def test_fold_rejects_a_lone_half():
    with pytest.raises(KeyError):
        fold_weight_norm({"a.weight_g": torch.ones(2, 1, 1)})
    with pytest.raises(KeyError):
        fold_weight_norm({"a.parametrizations.weight.original1": torch.ones(2, 1, 1)})


# --- the decoder against the package --------------------------------------------------------------
@pytest.mark.parametrize("cfg,frames,batch,seed", [(TINY, 5, 3, 10), (TINY_DENSE, 7, 2, 11), (SNAC_24KHZ, 2, 2, 12)],
                         ids=["tiny", "tiny-dense", "snac-24khz"])
def test_decoder_matches_the_package(cfg, frames, batch, seed, tmp_path, package_noise):
    ref = release_model(cfg, seed)
    state = ref.state_dict()
    assert any(k.endswith("parametrizations.weight.original0") for k in state)  # the layout the package saves
    ours = load_snac_decoder(save_release(ref, cfg, tmp_path / "snac"))
    assert ours.config.hop_length == ref.hop_length
    codes = random_codes(cfg, frames, batch, seed)
    samples = frames * max(cfg["vq_strides"]) * ref.hop_length

    package_noise.generator = None
    want = package_decode(ref, codes)
    got = ours(codes, noise=False)
    assert got.shape == want.shape == (batch, 1, samples)
    assert (got - want).abs().max().item() < AUDIO_TOL
    assert want.abs().max().item() > 1e-2  # not a silent model

    if cfg["noise"]:
        package_noise.generator = torch.Generator().manual_seed(99)
        want_n = package_decode(ref, codes)
        got_n = ours(codes, noise=True, generator=torch.Generator().manual_seed(99))
        assert (got_n - want_n).abs().max().item() < AUDIO_TOL
        assert (want_n - want).abs().max().item() > 1e-3  # the noise reaches the output
        # counter-based noise, one seed per row (the served path): the package fed the same n
        seeds = torch.randint(0, 2**62, (batch,), generator=torch.Generator().manual_seed(seed))
        package_noise.generator = None
        rows = []
        for b in range(batch):  # the package one row at a time, each with its row's seed
            package_noise.seeded(seeds[b:b + 1])
            rows.append(package_decode(ref, [c[b:b + 1] for c in codes]))
        want_s = torch.cat(rows)
        got_s = ours(codes, noise=True, generator=seeds)
        assert (got_s - want_s).abs().max().item() < AUDIO_TOL
        assert (want_s - want).abs().max().item() > 1e-3 and (want_s - want_n).abs().max().item() > 1e-3


def test_published_config_parameters():
    ref = release_model(SNAC_24KHZ, 3)
    assert abs(sum(p.numel() for p in ref.parameters()) - 19.8e6) < 0.1e6  # the published 19.8M
    ours = SNACDecoder(SNAC_24KHZ)
    # the decoder's parameters: the package's decoder + output projections + codebooks, g folded in
    want = sum(v.numel() for k, v in ref.state_dict().items()
               if (k.startswith("decoder.") or (k.startswith("quantizer.") and ".in_proj." not in k))
               and not k.endswith("original0"))
    assert sum(p.numel() for p in ours.parameters()) == want
    assert ours.samples_per_frame == 2048 and ours.config.hop_length == 512


def test_loader_refuses_a_partial_checkpoint(tmp_path):
    ref = release_model(TINY, 4)
    path = save_release(ref, TINY, tmp_path / "snac")
    state = torch.load(os.path.join(path, "pytorch_model.bin"), weights_only=True)
    del state["decoder.model.2.block.0.alpha"]
    torch.save(state, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match="missing"):
        load_snac_decoder(path)


def test_code_shape_checks():
    model = SNACDecoder(TINY).eval()
    with pytest.raises(ValueError):
        model([torch.zeros(1, 2, dtype=torch.long)] * 3)  # codebooks 1 and 2 too short
    with pytest.raises(ValueError):
        model([torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)])


# --- windows ----------------------------------------------------------------------------------
def test_codes_from_frames_layout():
    frames = torch.arange(2 * 3 * 7).view(2, 3, 7)
    c0, c1, c2 = codes_from_frames(frames)
    for b in range(2):
        f = frames[b].tolist()
        assert c0[b].tolist() == [fr[0] for fr in f]
        assert c1[b].tolist() == [x for fr in f for x in (fr[1], fr[4])]
        assert c2[b].tolist() == [x for fr in f for x in (fr[2], fr[3], fr[5], fr[6])]


@pytest.mark.parametrize("cfg,batch,seed", [(TINY, 5, 20), (SNAC_24KHZ, 2, 21)], ids=["tiny", "snac-24khz"])
def test_decode_windows_matches_the_package_per_window(cfg, batch, seed, tmp_path, package_noise):
    ref = release_model(cfg, seed)
    ours = load_snac_decoder(save_release(ref, cfg, tmp_path / "snac"))
    n = max(cfg["vq_strides"]) * ref.hop_length
    g = torch.Generator().manual_seed(seed)
    windows = torch.randint(0, cfg["codebook_size"], (batch, 4, 7), generator=g)
    got = decode_windows(ours, windows, noise=False)
    tail = decode_tail(ours, windows, noise=False)
    assert got.shape == (batch, n) and got.dtype == torch.float32 and tail.shape == (batch, 2 * n)
    for b in range(batch):
        # the release glue: the window's codebooks built per frame, decoded alone, samples [n, 2n)
        f = windows[b].tolist()
        codes = [torch.tensor([[fr[0] for fr in f]]),
                 torch.tensor([[x for fr in f for x in (fr[1], fr[4])]]),
                 torch.tensor([[x for fr in f for x in (fr[2], fr[3], fr[5], fr[6])]])]
        audio = package_decode(ref, codes)[0, 0]
        assert audio.shape == (4 * n,)
        assert (got[b] - audio[n:2 * n]).abs().max().item() < AUDIO_TOL
        assert (tail[b] - audio[2 * n:]).abs().max().item() < AUDIO_TOL
    assert decode_windows(ours, windows[:0]).shape == (0, n)


def test_normal_noise_is_seeded_per_row_and_standard_normal():
    g = torch.Generator().manual_seed(31)
    seeds = torch.randint(0, 2**63 - 1, (4,), generator=g)
    n = normal_noise(seeds, 2, 50_000)
    assert n.shape == (4, 50_000) and n.dtype == torch.float32 and torch.isfinite(n).all()
    flat = n.double().flatten()
    assert abs(flat.mean().item()) < 0.01 and abs(flat.std().item() - 1) < 0.01  # 200k draws: sd of the mean 0.0022
    assert abs((flat.abs() < 1).double().mean().item() - 0.6827) < 0.005  # the normal's mass within one sd
    assert torch.equal(normal_noise(seeds[2:3], 2, 50_000)[0], n[2])  # a row's noise is its own
    assert torch.equal(normal_noise(seeds, 2, 50_000), n)  # a pure function of its inputs
    assert not torch.equal(normal_noise(seeds, 3, 100), n[:, :100])  # another stream, other noise
    assert torch.corrcoef(torch.stack([n[0], n[1]]))[0, 1].abs() < 0.02  # rows independent


@pytest.mark.parametrize("noise", [False, True], ids=["no-noise", "noise"])
def test_window_decoder_padding_and_batches(noise):
    model = build_snac_decoder(TINY, seed=8)
    n = model.samples_per_frame
    g = torch.Generator().manual_seed(9)
    windows = torch.randint(0, TINY["codebook_size"], (5, 4, 7), generator=g)
    seeds = torch.randint(0, 2**62, (5,), generator=g)
    plain, padded = WindowDecoder(model, noise=noise), WindowDecoder(model, noise=noise, graphs="static")
    assert WindowDecoder(model, graphs="auto").graphs == "off"  # "auto" off CUDA
    got = plain(windows, seeds)
    assert got.shape == (5, 4 * n) and got.dtype == np.float32
    want = np.stack([model(codes_from_frames(windows[b:b + 1]), noise=noise, generator=seeds[b:b + 1])[0, 0].numpy()
                     for b in range(5)])
    assert np.abs(got - want).max() < 1e-6  # each window as it decodes alone (CPU kernels vary by batch)
    assert np.abs(padded(windows, seeds) - got).max() < 1e-6  # padded to 8, the same rows
    assert np.abs(padded(windows[1:2], seeds[1:2])[0] - got[1]).max() < 1e-6
    assert plain(windows[:0], seeds[:0]).shape == (0, 4 * n)
    if noise:
        other = plain(windows, seeds + 1)
        assert np.abs(other - got).max() > 1e-3  # the seed reaches the audio
    with pytest.raises(ValueError, match="graphs"):
        WindowDecoder(model, graphs="sometimes")
    with pytest.raises(ValueError, match="windows"):
        plain(windows[:, :3], seeds)


def test_sliding_windows():
    frames = torch.arange(6 * 7).view(6, 7)
    w = sliding_windows(frames)
    assert w.shape == (3, 4, 7)
    for i in range(3):
        assert torch.equal(w[i], frames[i:i + 4])
    assert sliding_windows(frames[:3]).shape == (0, 4, 7)


# --- Orpheus tokens ---------------------------------------------------------------------------------
def release_reference(ids: list[int]) -> list[tuple[list[list[int]], bool]]:
    """Per token, as the release's tokens_decoder / convert_to_audio: (codebooks, valid) of every
    window, in order. Code 0 counts as a code and 4096 as out of range (tokens.py docstring)."""
    buffer, count, out = [], 0, []
    for t in ids:
        code = t - 10 - 128256 - (count % 7) * 4096
        if code < 0:
            continue
        buffer.append(code)
        count += 1
        if count % 7 == 0 and count > 27:
            w = buffer[-28:]
            books = [[], [], []]
            for j in range(4):
                i = 7 * j
                books[0].append(w[i])
                books[1] += [w[i + 1], w[i + 4]]
                books[2] += [w[i + 2], w[i + 3], w[i + 5], w[i + 6]]
            out.append((books, all(0 <= c < 4096 for c in w)))
    return out


def random_stream(rng: random.Random, frames: int) -> list[int]:
    """Audio tokens of `frames` frames with text, control tokens, wrong-position ids and code 0 / 4095
    / out-of-range codes mixed in."""
    ids, k = [], 0
    while k < 7 * frames:
        r = rng.random()
        if r < 0.08:
            ids.append(rng.choice([128257, 128258, 128009, 128263, rng.randrange(0, 128266)]))  # never audio
            continue
        code = rng.choice([0, 4095]) if r < 0.12 else rng.randrange(4096)
        if r > 0.985 and k % 7:
            code = -rng.randrange(1, 4096 * (k % 7) + 1)  # another position's lower range: skipped
            ids.append(128266 + (k % 7) * 4096 + code)
            continue
        if r > 0.975:
            code = 4096 + rng.randrange(2 * 4096)  # out of range: counted, its windows make no audio
        ids.append(128266 + (k % 7) * 4096 + code)
        k += 1
    return ids


def test_token_mapping_matches_the_release_reference():
    rng = random.Random(7)
    checked_invalid = checked_valid = 0
    for _ in range(40):
        ids = random_stream(rng, rng.randrange(0, 12))
        want = release_reference(ids)
        stream, windows = ot.AudioTokenStream(), []
        i = 0
        while i < len(ids):  # pushed in chunks of random size, as steps sample them
            n = rng.randrange(1, 12)
            windows += stream.push(ids[i:i + n])
            i += n
        assert len(windows) == len(want)
        if not windows:
            assert stream.last_window() is None
            continue
        assert stream.last_window() == windows[-1]
        books, valid = ot.window_codebooks(torch.tensor(windows))
        assert [b.shape[1] for b in books] == [4, 8, 16]
        for j, (wb, wv) in enumerate(want):
            assert bool(valid[j]) == wv
            if wv:
                assert [b[j].tolist() for b in books] == wb
                checked_valid += 1
            else:
                assert all((b[j] == 0).all() for b in books)  # zeroed: safe to decode in a batch
                checked_invalid += 1
    assert checked_valid > 20 and checked_invalid > 2


def test_window_codes_vectorised():
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 4096, (6, 28), generator=g)
    ids = codes + 128266 + (torch.arange(28) % 7) * 4096
    frames, valid = ot.window_codes(ids)
    assert valid.all() and torch.equal(frames.view(6, 28), codes)
    ids[2, 9] += 4096  # position 2's range holds position 3's ids: out of range here
    ids[4, 0] = 128265
    frames, valid = ot.window_codes(ids)
    assert valid.tolist() == [True, True, False, True, False, True]


def test_prompt_format():
    seen = []

    def encode(s):
        seen.append(s)
        return [128000, 11, 12]

    assert ot.format_prompt(encode, "Hello there.", "tara") == [128259, 128000, 11, 12, 128009, 128260, 128261, 128257]
    assert ot.format_prompt(encode, "Hi") == [128259, 128000, 11, 12, 128009, 128260, 128261, 128257]
    assert seen == ["tara: Hello there.", "Hi"]
    assert ot.VOICES == ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
    assert ot.STOP_TOKEN_IDS == (128258,)
    assert ot.DEFAULT_SAMPLING == {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3, "max_tokens": 1200}


# --- streaming, batched over streams == each stream's windows in one batch --------------------------
def test_streaming_equals_whole_utterance_decode(tmp_path):
    ours = load_snac_decoder(save_release(release_model(TINY, 30), TINY, tmp_path / "snac"))
    n = ours.samples_per_frame
    rng = random.Random(31)
    streams = {}
    for s, frames in enumerate([9, 4, 3, 13, 6]):
        codes = [rng.randrange(TINY["codebook_size"]) for _ in range(7 * frames)]
        ids = [128266 + (k % 7) * 4096 + c for k, c in enumerate(codes)]
        ids.insert(rng.randrange(len(ids)), 128257)  # a control token in the middle: skipped
        streams[s] = dict(ids=ids, codes=torch.tensor(codes).view(frames, 7), pos=0,
                          tracker=ot.AudioTokenStream(), audio=[], done=False)
    steps = 0
    while not all(st["done"] for st in streams.values()):
        steps += 1
        ready, owners, ending = [], [], []
        for s, st in streams.items():
            if st["done"]:
                continue
            k = rng.randrange(1, 9)  # tokens this step (a multi-token step may finish two frames)
            for w in st["tracker"].push(st["ids"][st["pos"]:st["pos"] + k]):
                ready.append(w)
                owners.append(s)
            st["pos"] += k
            if st["pos"] >= len(st["ids"]):
                st["done"] = True
                ending.append(s)
        if ready:  # one codec forward for every stream's windows of this step
            frames, valid = ot.window_codes(torch.tensor(ready))
            assert valid.all()
            for s, a in zip(owners, decode_windows(ours, frames, noise=False)):
                streams[s]["audio"].append(a)
        last = [(s, streams[s]["tracker"].last_window()) for s in ending]
        last = [(s, w) for s, w in last if w is not None]  # fewer than 4 frames: nothing (as the release)
        if last:
            frames, _ = ot.window_codes(torch.tensor([w for _, w in last]))
            for (s, _), a in zip(last, decode_tail(ours, frames, noise=False)):
                streams[s]["audio"].append(a)
    assert steps > 3
    for s, st in streams.items():
        got = torch.cat(st["audio"]) if st["audio"] else torch.empty(0)
        want = decode_stream(ours, st["codes"], noise=False)
        frames = st["codes"].shape[0]
        assert got.shape == want.shape == ((frames - 3) * n + 2 * n if frames >= 4 else 0,)
        if frames >= 4:
            assert (got - want).abs().max().item() < 1e-6


# --- the snake op's Triton kernel, in Triton's CPU interpreter -----------------------------------------
_TRITON_SCRIPT = r"""
import json, torch
from mstar.ops.snake import snake
from mstar.ops.backends import triton_snake
out = []
g = torch.Generator().manual_seed(3)
for shape, dtype in (((2, 5, 37), torch.float32), ((1, 3, 4100), torch.float32), ((3, 4, 2, 9), torch.float32),
                     ((2, 6, 50), torch.bfloat16), ((0, 4, 8), torch.float32)):
    x = (torch.randn(*shape, generator=g) * 4).to(dtype)
    alpha = torch.rand(shape[1], generator=g) * 2
    alpha[0] = 0.0
    xs = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # a strided view: the kernel takes a contiguous copy
    ref = snake.backends["reference"].fn(x, alpha)
    got = triton_snake.snake(xs, alpha)
    out.append(dict(shape=list(shape), dtype=str(dtype), same_meta=got.shape == ref.shape and got.dtype == ref.dtype,
                    diff=(got.float() - ref.float()).abs().max().item() if x.numel() else 0.0,
                    scale=ref.float().abs().max().item() if x.numel() else 1.0))
from mstar.ops.snake_beta import snake_beta
for shape, dtype in (((2, 5, 37), torch.float32), ((1, 3, 4100), torch.bfloat16)):
    x = (torch.randn(*shape, generator=g) * 4).to(dtype)
    la, lb = torch.randn(shape[1], generator=g) * 0.5, torch.randn(shape[1], generator=g) * 0.5
    ref = snake_beta.backends["reference"].fn(x, la, lb)
    got = triton_snake.snake_beta(x, la, lb)
    out.append(dict(shape=list(shape), dtype=str(dtype), same_meta=got.shape == ref.shape and got.dtype == ref.dtype,
                    diff=(got.float() - ref.float()).abs().max().item(), scale=ref.float().abs().max().item()))
print(json.dumps(out))
"""


def test_triton_snake_in_the_interpreter():
    """float32: within 1e-6 of the reference's scale (the same operations, a division for the
    reciprocal). bf16: one bf16 step of the output (the interpreter truncates, the reference
    rounds), 2^-7 of its scale."""
    from triton_interpreter import run_interpreted

    got = run_interpreted(_TRITON_SCRIPT)
    assert len(got) == 7  # five snake cases, two snake_beta
    for c in got:
        assert c["same_meta"], c
        tol = 2e-6 if c["dtype"] == "torch.float32" else 2 ** -7  # snake_beta: exp in the kernel
        assert c["diff"] <= tol * max(c["scale"], 1.0), c
