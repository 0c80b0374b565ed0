"""The Snake activation of audio codecs (SNAC, DAC, BigVGAN): per channel c,

    snake(x)[b, c, t] = x + 1 / (alpha[c] + 1e-9) * sin(alpha[c] * x)^2

x is [B, C, ...] (channels on dim 1, any trailing dims), alpha is [C]. The 1e-9 keeps a
channel whose alpha trained to zero finite. Computed in float32, returned in x.dtype as a
fresh contiguous tensor.
"""

from __future__ import annotations

import math

import torch

from mstar.ops.registry import define_op


def _snake_ref(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Snake activation x + sin(alpha * x)^2 / (alpha + 1e-9), alpha per channel (dim 1)."""
    if x.dim() < 2 or alpha.dim() != 1 or alpha.shape[0] != x.shape[1]:
        raise ValueError(f"snake: x must be [B, C, ...] and alpha [C]; got {tuple(x.shape)} and {tuple(alpha.shape)}")
    xf = x.float().reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))
    a = alpha.float().view(1, -1, 1)
    # reciprocal, then multiply: the rounding of the codecs' own float32 forward
    y = xf + (a + 1e-9).reciprocal() * torch.sin(a * xf).pow(2)
    return y.reshape(x.shape).to(x.dtype).contiguous()


def _snake_fake(x, alpha):
    return x.new_empty(x.shape)


snake = define_op("snake", "(Tensor x, Tensor alpha) -> Tensor", reference=_snake_ref, fake=_snake_fake)

__all__ = ["snake"]
