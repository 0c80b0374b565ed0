"""The Wan2.2 VAE's decode options (WanVAE.set_decode_options, the MSTAR_VAE_* knobs): off by
default and then the plain path; latent chunks of any size give the release's one-frame-at-a-time
video (float64: the same function, rounding apart); channels_last_3d keeps every convolution's
input and weight in that layout (no transposing copies between layers) and gives the same video;
cuDNN's benchmark flag is on inside a decode step and restored after."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar import knobs
from mstar.models import registry
from mstar.models.wan.family import random_vae
from mstar.models.wan.vae_config import TINY_WAN22_TI2V_VAE

CL = torch.channels_last_3d


def _vae(dtype=torch.float64):
    return random_vae(TINY_WAN22_TI2V_VAE, 5, "cpu", dtype)


def _latents(frames: int, batch: int = 1, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(batch, TINY_WAN22_TI2V_VAE["z_dim"], frames, 3, 4, dtype=dtype)  # fresh each run


def test_defaults_are_the_plain_decode():
    vae, z = _vae(torch.float32), _latents(4, dtype=torch.float32)
    assert (vae.latent_chunk, vae.channels_last, vae.cudnn_benchmark) == (1, False, False)
    with torch.inference_mode():
        want = vae.decode(z)
        got = vae.set_decode_options().decode(z)  # the defaults again: the same bits
    assert torch.equal(want, got)
    for name in ("MSTAR_VAE_CHANNELS_LAST", "MSTAR_VAE_CUDNN_BENCHMARK", "MSTAR_VAE_LATENT_CHUNK"):
        assert name not in knobs.changed()


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_latent_chunks_give_the_same_video(chunk):
    vae, z = _vae(), _latents(6, batch=2)
    with torch.inference_mode():
        want = vae.decode(z)
        vae.set_decode_options(latent_chunk=chunk)
        pieces = list(vae.decode_chunks(z))
    frames = [p.shape[2] for p in pieces]
    assert frames[0] == 1 and sum(frames) == want.shape[2] == 1 + 4 * 5
    assert len(pieces) == 1 + -(-5 // chunk)
    got = torch.cat(pieces, dim=2)
    assert (got - want).abs().max().item() < 1e-10


def test_channels_last_keeps_the_layout_and_the_video(monkeypatch):
    vae, z = _vae(), _latents(3, batch=2)
    with torch.inference_mode():
        want = vae.decode(z)
    vae.set_decode_options(channels_last=True)
    for p in vae.parameters():
        if p.dim() == 5:
            assert p.is_contiguous(memory_format=CL)
    seen = []
    plain_conv3d = F.conv3d

    def conv3d(x, w, *args):  # as cuDNN's: an output in the input's channels_last_3d layout
        seen.append((x.is_contiguous(memory_format=CL) or x[:1].is_contiguous(memory_format=CL),
                     w.is_contiguous(memory_format=CL), tuple(x.shape)))
        return plain_conv3d(x, w, *args).contiguous(memory_format=CL)

    monkeypatch.setattr(F, "conv3d", conv3d)
    with torch.inference_mode():
        got = vae.decode(z)
    assert seen and all(x_cl and w_cl for x_cl, w_cl, _ in seen), [s for s in seen if not (s[0] and s[1])]
    assert (got - want).abs().max().item() < 1e-10
    vae.set_decode_options(channels_last=False)  # and back
    assert all(p.is_contiguous() for p in vae.parameters())


def test_cudnn_benchmark_is_scoped_to_the_decode(monkeypatch):
    vae, z = _vae(torch.float32), _latents(2, dtype=torch.float32)
    vae.set_decode_options(cudnn_benchmark=True)
    flags = []
    plain_conv3d = F.conv3d

    def conv3d(*args):
        flags.append(torch.backends.cudnn.benchmark)
        return plain_conv3d(*args)

    monkeypatch.setattr(F, "conv3d", conv3d)
    before = torch.backends.cudnn.benchmark
    with torch.inference_mode():
        for _ in vae.decode_chunks(z):
            flags.append(("between", torch.backends.cudnn.benchmark))
    assert torch.backends.cudnn.benchmark == before
    assert all(f is True for f in flags if not isinstance(f, tuple))
    assert all(f == ("between", before) for f in flags if isinstance(f, tuple))


def test_bad_chunk_is_refused():
    with pytest.raises(ValueError, match="latent_chunk"):
        _vae(torch.float32).set_decode_options(latent_chunk=0)


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-cosmos3"])
def test_knobs_reach_the_pipelines_vae(model):
    build = registry.family_of(model).pipeline
    with knobs.override(MSTAR_VAE_CHANNELS_LAST=True, MSTAR_VAE_CUDNN_BENCHMARK=True, MSTAR_VAE_LATENT_CHUNK=3):
        vae = build(model, device="cpu", random_weights=True, seed=1).vae
    assert (vae.latent_chunk, vae.channels_last, vae.cudnn_benchmark) == (3, True, True)
    plain = build(model, device="cpu", random_weights=True, seed=1).vae
    assert (plain.latent_chunk, plain.channels_last, plain.cudnn_benchmark) == (1, False, False)
