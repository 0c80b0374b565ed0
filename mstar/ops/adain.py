"""Adaptive instance norm over time with its activation and the length mask, the AdaIN blocks of
StyleTTS2 / Kokoro (its decoder's residual blocks and ISTFTNet's):

    norm[b, c, t] = (x - mean_bc) / sqrt(var_bc + eps) * weight[c] + bias[c]
    y             = act((1 + gamma[b, c]) * norm + beta[b, c]) * mask[b, 0, t]

mean and var are over the positions of row b where mask is 1 (the other rows of a batch and the
padding do not count), in float32. act: the Snake activation with per-channel `alpha`
(mstar.ops.snake) when alpha is not empty, else a leaky ReLU of slope `slope`. x is [B, C, T],
mask [B, 1, T] of 0 / 1 in x.dtype, gamma and beta [B, C], weight, bias (and alpha) [C]. The
result is in x.dtype; the reference rounds the norm to x.dtype before the affine, as the
composition of separate modules does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.ops.registry import define_op
from mstar.ops.snake import _snake_ref


def _check(x, mask, gamma, beta, weight, bias, alpha):
    B, C = x.shape[0], x.shape[1] if x.dim() == 3 else -1
    if x.dim() != 3 or tuple(mask.shape) != (B, 1, x.shape[2]) or tuple(gamma.shape) != (B, C) \
            or tuple(beta.shape) != (B, C) or tuple(weight.shape) != (C,) or tuple(bias.shape) != (C,) \
            or alpha.numel() not in (0, C):
        raise ValueError(f"adain_act: x [B, C, T], mask [B, 1, T], gamma / beta [B, C], weight / bias / alpha [C]; "
                         f"got {tuple(x.shape)}, {tuple(mask.shape)}, {tuple(gamma.shape)}, {tuple(beta.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(bias.shape)}, {tuple(alpha.shape)}")


def _adain_act_ref(x: torch.Tensor, mask: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                   weight: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, slope: float,
                   eps: float) -> torch.Tensor:
    """Masked instance norm (float32 statistics, two passes), affine, AdaIN, activation, mask."""
    _check(x, mask, gamma, beta, weight, bias, alpha)
    xf, mf = x.float(), mask.float()
    n = mf.sum(-1, keepdim=True).clamp(min=1.0)
    mean = (xf * mf).sum(-1, keepdim=True) / n
    var = ((xf - mean) * mf).square().sum(-1, keepdim=True) / n
    y = (xf - mean) * torch.rsqrt(var + eps)
    y = (y * weight.float()[:, None] + bias.float()[:, None]).to(x.dtype)
    y = (1 + gamma.unsqueeze(-1)) * y + beta.unsqueeze(-1)
    y = _snake_ref(y, alpha) if alpha.numel() else F.leaky_relu(y, slope)
    return y * mask


def _adain_act_fake(x, mask, gamma, beta, weight, bias, alpha, slope, eps):
    return x.new_empty(x.shape)


adain_act = define_op("adain_act", "(Tensor x, Tensor mask, Tensor gamma, Tensor beta, Tensor weight, Tensor bias, "
                      "Tensor alpha, float slope, float eps) -> Tensor", reference=_adain_act_ref,
                      fake=_adain_act_fake)

__all__ = ["adain_act"]
