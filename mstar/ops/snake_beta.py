"""SnakeBeta, the Snake variant of BigVGAN-style vocoders (the Qwen3-TTS 12 Hz codec) whose
frequency and magnitude are separate per-channel parameters kept on a log scale: per channel c,

    snake_beta(x)[b, c, t] = x + 1 / (exp(log_beta[c]) + 1e-9) * sin(exp(log_alpha[c]) * x)^2

x is [B, C, ...] (channels on dim 1), log_alpha and log_beta are [C] (the checkpoints store the
logarithms; the op takes them as stored). With log_alpha = log_beta = log(a) it is the `snake` op
of alpha a. Computed in float32, returned in x.dtype as a fresh contiguous tensor.
"""

from __future__ import annotations

import math

import torch

from mstar.ops.registry import define_op


def _snake_beta_ref(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> torch.Tensor:
    """SnakeBeta x + sin(x * exp(log_alpha))^2 / (exp(log_beta) + 1e-9), per channel (dim 1)."""
    if x.dim() < 2 or log_alpha.shape != (x.shape[1],) or log_beta.shape != (x.shape[1],):
        raise ValueError(f"snake_beta: x must be [B, C, ...] and log_alpha, log_beta [C]; got {tuple(x.shape)}, "
                         f"{tuple(log_alpha.shape)} and {tuple(log_beta.shape)}")
    xf = x.float().reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))
    alpha = log_alpha.float().exp().view(1, -1, 1)
    beta = log_beta.float().exp().view(1, -1, 1)
    # reciprocal, then multiply: the float32 rounding of the release's own forward
    y = xf + (beta + 1e-9).reciprocal() * torch.sin(xf * alpha).pow(2)
    return y.reshape(x.shape).to(x.dtype).contiguous()


def _snake_beta_fake(x, log_alpha, log_beta):
    return x.new_empty(x.shape)


snake_beta = define_op("snake_beta", "(Tensor x, Tensor log_alpha, Tensor log_beta) -> Tensor",
                       reference=_snake_beta_ref, fake=_snake_beta_fake)

__all__ = ["snake_beta"]
