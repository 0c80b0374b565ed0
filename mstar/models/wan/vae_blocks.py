"""The Wan2.2 VAE's layers: causal 3-D convolutions that carry a few frames of history between
chunks, channel RMS norm, residual blocks, the mid block's per-frame attention, the spatial /
temporal resamplers and the parameter-free avg-down / dup-up shortcuts.

Chunked causality. The release never runs a layer over a whole video: the encoder sees the first
frame alone and then chunks of 4 frames, the decoder one latent frame at a time, and every
temporal layer keeps what it needs of the previous chunk in a `FrameCache` (one slot per layer,
one cache per video or, later, per spatial tile):

    k=3 causal conv   the last 2 frames of its input (when a chunk has a single frame, the last
                      frame of the previous cache is put in front of it); the next chunk is
                      prefixed with them and zero-padded to 2 frames of history, so the first
                      chunk sees zeros
    time downsample   (stride-2 k=3 conv, no padding) the first chunk passes unconvolved and is
                      cached whole; later chunks are prefixed with the last cached frame
    time upsample     (k=3 conv to 2x channels, interleaved into 2x frames) the first latent frame
                      passes undoubled and leaves only a marker; the next one convolves with zero
                      history, and the history it keeps has a zero frame in front when it is a
                      single frame; from then on, as the k=3 conv
    avg-down / dup-up shortcuts are per chunk: avg-down zero-pads a 1-frame chunk to 2 in front;
                      dup-up drops the first of its 2 frames on the first latent frame

so outputs match the release frame for frame only when chunked the same way (vae.py does).

Convolutions are plain torch conv3d (the 2-D ones as (1, k, k) conv3d, so activations stay
[B, C, T, H, W]); the norms and the attention run on mstar.ops (rms_norm over channels,
dense_attention with one row per frame).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mstar import ops

CACHE_T = 2  # frames of history a k=3 causal conv keeps
_FIRST = "first"  # a time upsampler's slot after the first latent frame (no history yet)


class FrameCache:
    """The temporal state of one video (or tile) between chunks: one slot per layer."""

    def __init__(self) -> None:
        self._slots: dict[int, object] = {}

    def get(self, layer: nn.Module):
        return self._slots.get(id(layer))

    def put(self, layer: nn.Module, value) -> None:
        self._slots[id(layer)] = value

    def __len__(self) -> int:
        return len(self._slots)


class CausalConv3d(nn.Module):
    """Conv3d, zero-padded in front in time only (2 * pad_t frames), symmetric in space.

    forward(x, history): history (frames of the previous chunk, at most 2 * pad_t) replaces
    that many frames of the front zero padding."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__()
        kt, kh, kw = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
        pt, ph, pw = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        self.stride = (stride,) * 3 if isinstance(stride, int) else tuple(stride)
        self.time_pad = 2 * pt
        self.space_pad = (ph, pw)
        self.weight = nn.Parameter(torch.empty(cout, cin, kt, kh, kw))
        self.bias = nn.Parameter(torch.empty(cout))

    def forward(self, x: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        pad_t = self.time_pad
        if history is not None and pad_t > 0:
            x = torch.cat([history.to(x.device), x], dim=2)
            pad_t -= history.shape[2]
        if pad_t > 0:
            x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
        return F.conv3d(x, self.weight, self.bias, self.stride, (0, *self.space_pad))


def causal_step(conv: CausalConv3d, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
    """One chunk through a k=3 causal conv: convolve with the cached history, keep the new one."""
    prev = cache.get(conv)
    keep = x[:, :, -CACHE_T:]
    if keep.shape[2] < CACHE_T and prev is not None:
        keep = torch.cat([prev[:, :, -1:].to(keep.device), keep], dim=2)
    else:
        keep = keep.clone()
    out = conv(x, prev)
    cache.put(conv, keep)
    return out


class ChannelRMSNorm(nn.Module):
    """x / rms(x over channels) * weight, on dim 1 of [B, C, ...] (the release's
    F.normalize(x, dim=1) * sqrt(C) * gamma: eps is its 1e-12 floor on the norm, moved to the
    mean square)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = 1e-24 / dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # channels last for the op (free when the activations are channels_last_3d in memory)
        y = ops.rms_norm(x.movedim(1, -1).contiguous(), self.weight, self.eps, False)
        return y.movedim(-1, 1)


class ResBlock(nn.Module):
    """x -> shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x)))))), both convs causal k=3."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = ChannelRMSNorm(cin)
        self.conv1 = CausalConv3d(cin, cout, 3, padding=1)
        self.norm2 = ChannelRMSNorm(cout)
        self.conv2 = CausalConv3d(cout, cout, 3, padding=1)
        self.conv_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        h = causal_step(self.conv1, F.silu(self.norm1(x)), cache)
        h = causal_step(self.conv2, F.silu(self.norm2(h)), cache)
        return h + skip


class FrameAttention(nn.Module):
    """Single-head self-attention over the H * W positions of each frame (no temporal mixing)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = ChannelRMSNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        n = h * w
        tokens = x.permute(0, 2, 3, 4, 1).reshape(b * t * n, c)
        tokens = ops.rms_norm(tokens, self.norm.weight, self.norm.eps, False)
        q, k, v = self.to_qkv(tokens).unsqueeze(1).chunk(3, dim=-1)  # [N, 1, C] each
        indptr = torch.arange(0, (b * t + 1) * n, n, dtype=torch.int32)
        o = ops.dense_attention(q, k, v, indptr, indptr, c ** -0.5, False)
        o = self.proj(o.squeeze(1)).view(b, t, h, w, c).permute(0, 4, 1, 2, 3)
        return o + x


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResBlock(dim, dim), ResBlock(dim, dim)])
        self.attentions = nn.ModuleList([FrameAttention(dim)])

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = self.resnets[0](x, cache)
        return self.resnets[1](self.attentions[0](x), cache)


def _conv2d_frames(x: torch.Tensor, conv: nn.Conv2d, stride: int, padding: int) -> torch.Tensor:
    """A 2-D conv applied to every frame of [B, C, T, H, W] (as a (1, k, k) conv3d)."""
    return F.conv3d(x, conv.weight.unsqueeze(2), conv.bias, (1, stride, stride), (0, padding, padding))


class Downsample(nn.Module):
    """Halve H and W (zero pad right / bottom by 1, 3x3 stride 2), and with temporal=True the
    frames (stride-2 k=3 conv over [last frame of the previous chunk, this chunk])."""

    def __init__(self, dim: int, temporal: bool):
        super().__init__()
        self.spatial = nn.Conv2d(dim, dim, 3)
        self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if temporal else None

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = _conv2d_frames(F.pad(x, (0, 1, 0, 1)), self.spatial, 2, 0)
        if self.time_conv is None:
            return x
        prev = cache.get(self.time_conv)
        if prev is None:  # the first chunk: kept, not convolved
            cache.put(self.time_conv, x.clone())
            return x
        keep = x[:, :, -1:].clone()
        x = self.time_conv(torch.cat([prev[:, :, -1:].to(x.device), x], dim=2))
        cache.put(self.time_conv, keep)
        return x


class Upsample(nn.Module):
    """With temporal=True double the frames (k=3 causal conv to 2C channels, the halves
    interleaved as frames 2i, 2i+1; not on the first latent frame), then double H and W
    (nearest) and 3x3 conv."""

    def __init__(self, dim: int, temporal: bool):
        super().__init__()
        self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0)) if temporal else None
        self.spatial = nn.Conv2d(dim, dim, 3)

    def _double_frames(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        prev = cache.get(self.time_conv)
        if prev is None:  # the first latent frame: one frame out, no history yet
            cache.put(self.time_conv, _FIRST)
            return x
        first = isinstance(prev, str)
        keep = x[:, :, -CACHE_T:]
        if keep.shape[2] < CACHE_T:
            front = torch.zeros_like(keep) if first else prev[:, :, -1:].to(keep.device)
            keep = torch.cat([front, keep], dim=2)
        else:
            keep = keep.clone()
        y = self.time_conv(x, None if first else prev)
        cache.put(self.time_conv, keep)
        return interleave_frames(y)

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        if self.time_conv is not None:
            x = self._double_frames(x, cache)
        x = F.interpolate(x, scale_factor=(1.0, 2.0, 2.0), mode="nearest")  # each pixel 2 x 2: one kernel
        return _conv2d_frames(x, self.spatial, 1, 1)


def interleave_frames(y: torch.Tensor) -> torch.Tensor:
    """[B, 2C, T, H, W] -> [B, C, 2T, H, W]: channel half j of frame t becomes frame 2t + j, in
    the memory layout y has (channels_last_3d stays so: no layout flip between convolutions)."""
    b, c2, t, h, w = y.shape
    c = c2 // 2
    if _channels_last(y):
        z = y.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, 2, c).permute(0, 1, 4, 2, 3, 5).contiguous()
        return z.view(b, 2 * t, h, w, c).permute(0, 4, 1, 2, 3)
    return y.view(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)


def _channels_last(x: torch.Tensor) -> bool:
    """Whether x is laid out [B, T, H, W, C] in memory (and not also plainly contiguous)."""
    return x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()


def avg_down(x: torch.Tensor, cout: int, ft: int, fs: int) -> torch.Tensor:
    """The down blocks' shortcut: fold ft x fs x fs neighbourhoods into channels
    (c, dt, dh, dw order) and average consecutive groups down to `cout` channels. A chunk whose
    frame count is not a multiple of ft is zero-padded in front."""
    pad_t = (-x.shape[2]) % ft
    if pad_t:
        x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
    b, c, t, h, w = x.shape
    x = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
    x = x.reshape(b, cout, (c * ft * fs * fs) // cout, t // ft, h // fs, w // fs)
    return x.mean(dim=2)


def dup_up(x: torch.Tensor, cout: int, ft: int, fs: int, first: bool) -> torch.Tensor:
    """The up blocks' shortcut: repeat channels and unfold them into ft x fs x fs neighbourhoods
    (the inverse layout of avg_down); on the first latent frame the first ft - 1 frames go."""
    b, c, t, h, w = x.shape
    r = (cout * ft * fs * fs) // c
    if _channels_last(x):  # the same values, built in [B, T, H, W, C] memory
        y = x.permute(0, 2, 3, 4, 1).repeat_interleave(r, dim=-1).view(b, t, h, w, cout, ft, fs, fs)
        y = y.permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous()  # (a size-1 dim would let reshape keep a view)
        x = y.view(b, t * ft, h * fs, w * fs, cout).permute(0, 4, 1, 2, 3)
    else:
        x = x.repeat_interleave(r, dim=1)
        x = x.view(b, cout, ft, fs, fs, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
        x = x.reshape(b, cout, t * ft, h * fs, w * fs)
    return x[:, :, ft - 1:] if first else x


class DownBlock(nn.Module):
    """num_res_blocks residual blocks, then a Downsample (all levels but the last), plus the
    avg-down shortcut of the block's input."""

    def __init__(self, cin: int, cout: int, num_res_blocks: int, temporal: bool, down: bool):
        super().__init__()
        self.cout = cout
        self.ft, self.fs = (2 if temporal else 1), (2 if down else 1)
        self.resnets = nn.ModuleList([ResBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks)])
        self.downsampler = Downsample(cout, temporal) if down else None

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        skip = avg_down(x, self.cout, self.ft, self.fs)
        for r in self.resnets:
            x = r(x, cache)
        if self.downsampler is not None:
            x = self.downsampler(x, cache)
        return x + skip


class UpBlock(nn.Module):
    """num_res_blocks + 1 residual blocks, then an Upsample (all levels but the last), plus the
    dup-up shortcut of the block's input (only where it upsamples)."""

    def __init__(self, cin: int, cout: int, num_res_blocks: int, temporal: bool, up: bool):
        super().__init__()
        self.cout = cout
        self.ft = 2 if temporal else 1
        self.resnets = nn.ModuleList([ResBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks + 1)])
        self.upsampler = Upsample(cout, temporal) if up else None

    def forward(self, x: torch.Tensor, cache: FrameCache, first: bool) -> torch.Tensor:
        skip = dup_up(x, self.cout, self.ft, 2, first) if self.upsampler is not None else None
        for r in self.resnets:
            x = r(x, cache)
        if self.upsampler is None:
            return x
        return self.upsampler(x, cache) + skip


__all__ = ["CACHE_T", "FrameCache", "CausalConv3d", "causal_step", "ChannelRMSNorm", "ResBlock", "FrameAttention",
           "MidBlock", "Downsample", "Upsample", "interleave_frames", "avg_down", "dup_up", "DownBlock", "UpBlock"]
