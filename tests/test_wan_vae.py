"""The Wan2.2 VAE (mstar/models/wan/vae*.py) against diffusers' AutoencoderKLWan, on CPU in float32.

A tiny VAE of the TI2V-5B kind (is_residual, patch 2, two temporal and three spatial halvings,
encoder and decoder widths differing) is built by diffusers with a fixed seed, its norm gammas
and every bias moved away from their init, saved with save_pretrained and read back through
mstar's loader. Tolerance: ATOL = 5e-5 absolute on outputs of magnitude ~0.3-1 (measured max
differences ~1e-6). The two sides compute the same float32 math in a different order (per-frame
2-D convs as (1, k, k) conv3d, implicit vs explicit zero padding, 1x1 convs as linears, the op
layer's attention and RMS norm against SDPA and F.normalize), which leaves float32 rounding noise
growing with depth; a wrong weight mapping, chunking or cache rule moves outputs by > 1e-2.
"""

import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKLWan  # noqa: E402

from mstar.models.wan.vae import WanVAE  # noqa: E402
from mstar.models.wan.vae_config import (TINY_WAN22_TI2V_VAE, WAN22_TI2V_5B_VAE, WAN22_VAE,  # noqa: E402
                                         WanVAEConfig)
from mstar.models.wan.vae_weights import diffusers_key, load_wan_vae, read_config  # noqa: E402

ATOL = 5e-5
H, W = 48, 64  # latent 3 x 4


def _kwargs(raw: dict) -> dict:
    return {k: v for k, v in raw.items() if not k.startswith("_")}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    ref = AutoencoderKLWan(**_kwargs(TINY_WAN22_TI2V_VAE)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".gamma"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("wan_vae")
    ref.save_pretrained(path)
    return ref, load_wan_vae(str(path)), path


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("latent_frames", [1, 3])
def test_decode_matches_diffusers(pair, latent_frames):
    ref, ours, _ = pair
    torch.manual_seed(1)
    z = torch.randn(1, 8, latent_frames, H // 16, W // 16)
    with torch.no_grad():
        want = ref.decode(z).sample
        got = ours.decode(z)
    assert got.shape == (1, 3, 1 + 4 * (latent_frames - 1), H, W)
    assert (want.abs() < 1).float().mean() > 0.9  # the clamp hides little of the comparison
    assert _maxdiff(got, want) < ATOL


@pytest.mark.parametrize("frames", [1, 5, 9])
def test_encode_matches_diffusers(pair, frames):
    ref, ours, _ = pair
    torch.manual_seed(2)
    video = torch.rand(1, 3, frames, H, W) * 2 - 1
    with torch.no_grad():
        dist = ref.encode(video).latent_dist
        mean, logvar = ours.encode_moments(video)
        mode = ours.encode(video)
    assert mean.shape == (1, 8, 1 + (frames - 1) // 4, H // 16, W // 16)
    assert _maxdiff(mean, dist.mode()) < ATOL
    assert _maxdiff(logvar, dist.logvar) < ATOL
    assert torch.equal(mode, mean)


def test_batch_rows_match_single(pair):
    _, ours, _ = pair
    torch.manual_seed(3)
    video = torch.rand(2, 3, 5, H, W) * 2 - 1
    z = torch.randn(2, 8, 2, H // 16, W // 16)
    with torch.no_grad():
        enc, dec = ours.encode(video), ours.decode(z)
        for i in range(2):
            assert _maxdiff(enc[i:i + 1], ours.encode(video[i:i + 1])) < ATOL
            assert _maxdiff(dec[i:i + 1], ours.decode(z[i:i + 1])) < ATOL
    assert _maxdiff(enc[0], enc[1]) > 1e-2  # the rows differ: a mix-up would show


def test_decode_chunks_and_normalisation(pair):
    _, ours, path = pair
    z = torch.randn(1, 8, 3, H // 16, W // 16)
    with torch.no_grad():
        chunks = list(ours.decode_chunks(z))
    assert [c.shape[2] for c in chunks] == [1, 4, 4]
    cfg = read_config(str(path))
    assert cfg.to_dict() == _kwargs(TINY_WAN22_TI2V_VAE)
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    n = ours.normalize_latents(z)
    assert torch.allclose(n, (z - mean) / std, atol=1e-6)
    assert torch.allclose(ours.denormalize_latents(n), z, atol=1e-5)


def test_published_config_layout_matches_diffusers():
    assert WAN22_VAE.z_dim == 48 and WAN22_VAE.scale_factor_spatial == 16 and WAN22_VAE.patch_size == 2
    assert json.loads(json.dumps(WAN22_TI2V_5B_VAE))["latents_std"][-1] == 0.7744
    with torch.device("meta"):
        ref = AutoencoderKLWan(**_kwargs(WAN22_TI2V_5B_VAE))
        ours = WanVAE(WAN22_VAE)
    want = dict(diffusers_key(n, p) for n, p in ref.state_dict().items())
    got = dict(ours.state_dict().items())
    assert sorted(got) == sorted(want)
    bad = [k for k in got if tuple(got[k].shape) != tuple(want[k].shape)]
    assert not bad, bad[:5]
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())


def test_config_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="Wan2.1"):
        WanVAEConfig.from_dict({**TINY_WAN22_TI2V_VAE, "is_residual": False})
    with pytest.raises(ValueError, match="scale_factor_spatial"):
        WanVAEConfig.from_dict({**TINY_WAN22_TI2V_VAE, "scale_factor_spatial": 8})
    cfg = WanVAEConfig.from_dict({**TINY_WAN22_TI2V_VAE, "clip_output": False})
    assert cfg.extra == {"clip_output": False}
