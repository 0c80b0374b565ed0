"""The harmonic-plus-noise source of Kokoro's generator (hn-NSF, as in the release's SineGen /
SourceModuleHnNSF): from the F0 curve, upsampled to samples, the sum of HARMONICS + 1 sines (the
fundamental and its overtones, voiced where F0 > VOICED_THRESHOLD), plus Gaussian noise (small
where voiced, sine_amp / 3 where not), merged into one excitation by a Linear + tanh.

The phase is integrated at the F0 rate, not the sample rate (the per-sample phase increments are
linearly downsampled by the upsampling factor, summed, and linearly upsampled back): the release
does this and the weights were trained on it.

Randomness: each overtone's initial phase (the fundamental's is 0) and the noise. Both are drawn
per row from the row's torch.Generator, in the order `draws(g, n, dim)` gives, so a row's output
is a function of (its generator's seed, its inputs) alone, batched or not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

HARMONICS = 8  # overtones above the fundamental
SINE_AMP = 0.1
NOISE_STD = 0.003
VOICED_THRESHOLD = 10.0


def draws(g: torch.Generator | None, n: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's random numbers: initial phases [1, dim] (uniform, the fundamental's set to 0) and
    noise [1, n, dim] (standard normal), drawn in this order from g."""
    phase0 = torch.rand(1, dim, generator=g, device=device)
    phase0[:, 0] = 0
    noise = torch.randn(1, n, dim, generator=g, device=device)
    return phase0, noise


class HarmonicSource(nn.Module):
    """f0 [B, n] (Hz, per sample; rows of `lengths` samples) -> excitation [B, n] in [-1, 1]."""

    def __init__(self, sample_rate: int, upsample_scale: int):
        super().__init__()
        self.sample_rate = sample_rate
        self.upsample_scale = upsample_scale
        self.dim = HARMONICS + 1
        self.l_linear = nn.Linear(self.dim, 1)

    def forward(self, f0: torch.Tensor, lengths: list[int], generators: list[torch.Generator | None]) -> torch.Tensor:
        B, n = f0.shape
        dev = f0.device
        f0 = f0.float()
        harmonics = torch.arange(1, self.dim + 1, device=dev, dtype=torch.float32)
        fn = f0[:, :, None] * harmonics  # [B, n, dim]
        rad = torch.remainder(fn / self.sample_rate, 1)
        noise = torch.zeros(B, n, self.dim, device=dev)
        for b, (g, nb) in enumerate(zip(generators, lengths)):
            phase0, z = draws(g, nb, self.dim, dev)
            rad[b, 0] += phase0[0]
            noise[b, :nb] = z[0]
        # integrate at the F0 rate: per-sample increments averaged down, summed, interpolated back
        # (scale_factor, not a size, as the release does: the source index of an output position
        # depends on the factor only, so a row's own samples are the same in any batch)
        up = float(self.upsample_scale)
        low = F.interpolate(rad.transpose(1, 2), scale_factor=1 / up, mode="linear")
        phase = torch.cumsum(low, dim=-1) * 2 * math.pi
        # the linear upsampling reads one position past a row's end there: hold its last value,
        # which is what a row alone clamps to
        nlow = [int(math.floor(nb * (1 / up))) for nb in lengths]
        for b, nl in enumerate(nlow):
            if nl < phase.shape[-1]:
                phase[b, :, nl:] = phase[b, :, nl - 1:nl]
        phase = F.interpolate(phase * up, scale_factor=up, mode="linear").transpose(1, 2)
        sines = torch.sin(phase) * SINE_AMP
        uv = (f0 > VOICED_THRESHOLD).float()[:, :, None]
        amp = uv * NOISE_STD + (1 - uv) * SINE_AMP / 3
        sig = sines[:, :n] * uv + amp * noise
        w = self.l_linear.weight.float()
        bias = self.l_linear.bias.float()
        return torch.tanh(F.linear(sig, w, bias)).squeeze(-1)


__all__ = ["HarmonicSource", "draws", "HARMONICS"]
