"""The style-conditioned blocks Kokoro's predictor and decoder share, batched over padded rows.

Every tensor here is [B, C, T] with a mask m [B, 1, T] (1.0 on a row's own positions, 0.0 past
its length). Values at padded positions are left as they fall; what mixes positions makes sure
they never reach a row's own outputs:

    convolutions          their input is multiplied by the mask first, so a row sees zeros past its
                          end, as the release's zero-padded conv of that row alone does
    instance norms        statistics over the row's own positions only
    LSTMs                 packed sequences (lstm())

So a row's outputs equal the same row run alone (to float32 rounding), whatever it is batched with.
Statistics and LSTMs run in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from mstar import ops

RSQRT2 = 2.0 ** -0.5


def length_mask(lengths: torch.Tensor, T: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[B, 1, T]: 1 where t < lengths[b]."""
    t = torch.arange(T, device=device)
    return (t[None, :] < lengths.to(device)[:, None]).to(dtype).unsqueeze(1)


def conv_out_len(n: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    (k,), (s,), (p,), (d,) = conv.kernel_size, conv.stride, conv.padding, conv.dilation
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def conv_t_out_len(n: torch.Tensor, conv: nn.ConvTranspose1d) -> torch.Tensor:
    (k,), (s,), (p,), (d,), (op,) = conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.output_padding
    return (n - 1) * s - 2 * p + d * (k - 1) + op + 1


def lstm(module: nn.LSTM, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A batch-first LSTM over [B, T, C] rows of `lengths` (packed: padding never enters a row's
    state, forward or backward); [B, T, H] out, zeros past each row's length, in x's dtype."""
    w = module.weight_ih_l0
    packed = pack_padded_sequence(x.to(w.dtype), lengths.cpu(), batch_first=True, enforce_sorted=False)
    out, _ = module(packed)
    out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
    return out.to(x.dtype)


class InstanceNorm(nn.Module):
    """Instance norm over time with an affine (the release's InstanceNorm1d(affine=True)); a row's
    statistics come from its own positions."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        xf, mf = x.float(), m.float()
        n = mf.sum(-1, keepdim=True).clamp(min=1.0)
        mean = (xf * mf).sum(-1, keepdim=True) / n
        var = ((xf - mean) * mf).square().sum(-1, keepdim=True) / n
        y = (xf - mean) * torch.rsqrt(var + self.eps)
        return (y * self.weight.float()[:, None] + self.bias.float()[:, None]).to(x.dtype)


class AdaIN1d(nn.Module):
    """Adaptive instance norm: (1 + gamma(s)) * norm(x) + beta(s)."""

    def __init__(self, style_dim: int, channels: int):
        super().__init__()
        self.norm = InstanceNorm(channels)
        self.fc = nn.Linear(style_dim, 2 * channels)

    def forward(self, x: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.fc(s).unsqueeze(-1).chunk(2, dim=1)
        return (1 + gamma) * self.norm(x, m) + beta

    def act(self, x: torch.Tensor, s: torch.Tensor, m: torch.Tensor, *, alpha: torch.Tensor | None = None,
            slope: float = 0.0) -> torch.Tensor:
        """act(forward(x, s, m)) * m in one op (mstar.ops.adain_act): Snake with `alpha` [C],
        else a leaky ReLU of `slope`."""
        gamma, beta = self.fc(s).chunk(2, dim=1)
        a = alpha if alpha is not None else x.new_empty(0)
        return ops.adain_act(x, m, gamma, beta, self.norm.weight, self.norm.bias, a, float(slope), self.norm.eps)


class AdaLayerNorm(nn.Module):
    """Layer norm over channels, no affine of its own, then (1 + gamma(s)) * x + beta(s); x [B, T, C]."""

    def __init__(self, style_dim: int, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.fc = nn.Linear(style_dim, 2 * channels)
        self.register_buffer("_one", torch.ones(channels), persistent=False)
        self.register_buffer("_zero", torch.zeros(channels), persistent=False)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.fc(s).unsqueeze(1).chunk(2, dim=-1)
        return (1 + gamma) * ops.layer_norm(x, self._one.to(x.dtype), self._zero.to(x.dtype), self.eps) + beta


class AdainResBlk1d(nn.Module):
    """StyleTTS2's AdaIN residual block: norm -> LeakyReLU(0.2) -> [2x depthwise transposed conv]
    -> conv3 -> norm -> LeakyReLU -> conv3, plus the (nearest-upsampled, 1x1-projected) input,
    over sqrt(2). forward returns the output and its mask (twice as long when upsampling)."""

    def __init__(self, dim_in: int, dim_out: int, style_dim: int, upsample: bool = False):
        super().__init__()
        self.upsample = upsample
        self.conv1 = nn.Conv1d(dim_in, dim_out, 3, 1, 1)
        self.conv2 = nn.Conv1d(dim_out, dim_out, 3, 1, 1)
        self.norm1 = AdaIN1d(style_dim, dim_in)
        self.norm2 = AdaIN1d(style_dim, dim_out)
        self.conv1x1 = nn.Conv1d(dim_in, dim_out, 1, 1, 0, bias=False) if dim_in != dim_out else None
        self.pool = (nn.ConvTranspose1d(dim_in, dim_in, 3, stride=2, groups=dim_in, padding=1, output_padding=1)
                     if upsample else None)

    def forward(self, x: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm1.act(x, s, m, slope=0.2)  # (masked)
        m2 = m
        if self.pool is not None:
            h = self.pool(h)
            m2 = m.repeat_interleave(2, dim=-1)
            h = h * m2
        h = self.conv1(h)
        h = self.norm2.act(h, s, m2, slope=0.2)
        h = self.conv2(h)
        sc = x.repeat_interleave(2, dim=-1) if self.upsample else x  # nearest 2x
        if self.conv1x1 is not None:
            sc = self.conv1x1(sc)
        return (h + sc) * RSQRT2, m2


__all__ = ["RSQRT2", "length_mask", "conv_out_len", "conv_t_out_len", "lstm", "InstanceNorm", "AdaIN1d",
           "AdaLayerNorm", "AdainResBlk1d"]
