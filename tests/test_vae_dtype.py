"""MSTAR_VAE_DTYPE: the Wan2.2 VAE of Wan and Cosmos3 pipelines in each family's dtype by default
(auto: Wan float32, Cosmos3 the pipeline's; float32 on the parity tests' float32 pipelines), in
bfloat16 when asked: the same weights rounded, and a decode of
fresh random latents within 3% relative (measured ~1.2%) of the float32 one, pixels within 8 uint8
levels and 1% of them more than 2 levels off."""

from __future__ import annotations

import pytest
import torch

from mstar import knobs
from mstar.models import registry
from mstar.models.generation_request import media_outputs


class _Field:
    video, fps = True, 16.0


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-cosmos3"])
def test_vae_dtype_knob(model):
    build = registry.family_of(model).pipeline
    plain = build(model, device="cpu", random_weights=True, seed=3)
    assert knobs.value("MSTAR_VAE_DTYPE") == "auto" and plain.vae.dtype == torch.float32  # a float32 pipeline
    with knobs.override(MSTAR_VAE_DTYPE="bfloat16"):
        half = build(model, device="cpu", random_weights=True, seed=3)
    assert half.vae.dtype == torch.bfloat16
    for (name, a), b in zip(plain.vae.named_parameters(), half.vae.parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), name  # the same weights, rounded
    z = torch.randn(2, plain.vae.config.z_dim, 3, 6, 4)  # fresh each run
    with torch.inference_mode():
        want = plain.vae.decode(z)
        got = half.vae.decode(z.to(torch.bfloat16))
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert got.dtype == torch.bfloat16 and 0 < rel < 3e-2, rel
    px_want = media_outputs(want, [_Field(), _Field()])
    px_got = media_outputs(got, [_Field(), _Field()])
    for a, b in zip(px_want, px_got):
        d = (a[0].frames.astype(int) - b[0].frames.astype(int))
        assert abs(d).max() <= 8 and (abs(d) > 2).mean() < 0.01


def test_auto_is_each_familys_choice():
    """auto: Wan's VAE in float32 whatever the pipeline's dtype (the Wan2.2 diffusers pipelines'
    setup), Cosmos3's in the pipeline's dtype (one torch_dtype for all of Cosmos3OmniPipeline);
    a named dtype wins over both."""
    for model, want in (("tiny-wan", torch.float32), ("tiny-cosmos3", torch.bfloat16)):
        build = registry.family_of(model).pipeline
        assert build(model, dtype=torch.bfloat16, device="cpu", random_weights=True).vae.dtype == want
        with knobs.override(MSTAR_VAE_DTYPE="float32"):
            assert build(model, dtype=torch.bfloat16, device="cpu", random_weights=True).vae.dtype == torch.float32
        with knobs.override(MSTAR_VAE_DTYPE="bfloat16"):
            assert build(model, device="cpu", random_weights=True).vae.dtype == torch.bfloat16
