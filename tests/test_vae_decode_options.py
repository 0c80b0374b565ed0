"""The Wan2.2 VAE's layout (WanVAE.set_channels_last, MSTAR_VAE_CHANNELS_LAST, on by default):
channels_last_3d keeps every convolution's input and weight in that layout (no transposing copies
between layers) and gives the same video (float64: the same function, rounding apart); off is the
contiguous path; the knob reaches both families' pipelines."""

from __future__ import annotations

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


def test_channels_last_keeps_the_layout_and_the_video(monkeypatch):
    vae, z = _vae(), _latents(3, batch=2)
    with torch.inference_mode():
        want = vae.decode(z)
    vae.set_channels_last(True)
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
    monkeypatch.setattr(F, "conv3d", plain_conv3d)
    vae.set_channels_last(False)  # and back: the contiguous path, the same bits as never switched
    assert all(p.is_contiguous() for p in vae.parameters())
    with torch.inference_mode():
        assert torch.equal(vae.decode(z), want)


def test_knob_reaches_the_pipelines_vae():
    assert knobs.value("MSTAR_VAE_CHANNELS_LAST") is True
    for model in ("tiny-wan", "tiny-cosmos3"):
        build = registry.family_of(model).pipeline
        assert build(model, device="cpu", random_weights=True, seed=1).vae.channels_last
        with knobs.override(MSTAR_VAE_CHANNELS_LAST=False):
            vae = build(model, device="cpu", random_weights=True, seed=1).vae
        assert not vae.channels_last and all(p.is_contiguous() for p in vae.parameters())
