"""The Wan2.2 VAE (TI2V-5B: z_dim 48, 16x spatial / 4x temporal compression) on mstar.ops, the
same function as diffusers' AutoencoderKLWan with is_residual=True (parity: tests/test_wan_vae.py).

    encode(video [B, 3, F, H, W] in [-1, 1]) -> mean latents [B, z, 1 + (F - 1) // 4, H / 16, W / 16]
    decode(latents [B, z, F', H', W'])       -> video [B, 3, 1 + 4 (F' - 1), 16 H', 16 W'] in [-1, 1]

Encode: patchify (2x2 pixel patches -> 12 channels), the encoder over the first frame alone and
then over chunks of 4 frames with one FrameCache for the video (frames past the last full chunk
are dropped, as diffusers does), quant_conv (1x1x1) to 2 z channels: mean and log-variance. The
posterior's mean is what diffusers' Wan pipelines take (retrieve_latents(..., "argmax"), i.e.
latent_dist.mode()): `encode`. `encode_moments` gives the log-variance too (clamped to
[-30, 20] as DiagonalGaussianDistribution does) for a caller that samples.

Decode: post_quant_conv (1x1x1) over all latent frames, then the decoder one latent frame at a
time (`decode_chunks` yields each step's frames: 1 for the first latent frame, 4 for every later
one), unpatchify and clamp to [-1, 1]. Each step is `decode_step(frame, cache, first)`, whose only
state is the FrameCache: a spatially tiled decode runs the same loop with one cache per tile.

Layout (`set_channels_last`; the pipelines follow MSTAR_VAE_CHANNELS_LAST): weights and
activations in channels_last_3d ([B, T, H, W, C] memory), the layout cuDNN's tensor-core
convolutions take without transposing; the layers keep whichever layout they are given.

The latents the diffusion model works in are normalised per channel with the config's
latents_mean / latents_std; that is the pipeline's business (normalize_latents after encode,
denormalize_latents before decode), not done inside encode / decode.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from mstar.models.wan.vae_blocks import (CausalConv3d, ChannelRMSNorm, DownBlock, FrameCache, MidBlock, UpBlock,
                                         causal_step)
from mstar.models.wan.vae_config import WanVAEConfig

ENCODE_CHUNK = 4  # frames per encoder chunk after the first frame (the release's, whatever the config)
LOGVAR_RANGE = (-30.0, 20.0)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, C * p * p, F, H / p, W / p]; channel c * p * p + dw * p + dh."""
    if p == 1:
        return x
    b, c, f, h, w = x.shape
    x = x.view(b, c, f, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * p * p, f, h // p, w // p)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """The inverse of patchify."""
    if p == 1:
        return x
    b, cp, f, h, w = x.shape
    x = x.view(b, cp // (p * p), p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cp // (p * p), f, h * p, w * p)


class WanVAEEncoder(nn.Module):
    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        dims = cfg.encoder_dims
        levels = len(cfg.dim_mult)
        self.conv_in = CausalConv3d(cfg.in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.ModuleList([
            DownBlock(dims[i], dims[i + 1], cfg.num_res_blocks,
                      temporal=i != levels - 1 and bool(cfg.temperal_downsample[i]), down=i != levels - 1)
            for i in range(levels)])
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = ChannelRMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], 2 * cfg.z_dim, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        """One chunk of patchified frames -> its 2 z channels (before quant_conv)."""
        x = causal_step(self.conv_in, x, cache)
        for blk in self.down_blocks:
            x = blk(x, cache)
        x = self.mid_block(x, cache)
        return causal_step(self.conv_out, F.silu(self.norm_out(x)), cache)


class WanVAEDecoder(nn.Module):
    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        dims = cfg.decoder_dims
        levels = len(cfg.dim_mult)
        up_t = cfg.temporal_upsample
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList([
            UpBlock(dims[i], dims[i + 1], cfg.num_res_blocks,
                    temporal=i != levels - 1 and bool(up_t[i]), up=i != levels - 1)
            for i in range(levels)])
        self.norm_out = ChannelRMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], cfg.out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: FrameCache, first: bool) -> torch.Tensor:
        """One latent frame (after post_quant_conv) -> its patchified frames (1 if first, else 4)."""
        x = causal_step(self.conv_in, x, cache)
        x = self.mid_block(x, cache)
        for blk in self.up_blocks:
            x = blk(x, cache, first)
        return causal_step(self.conv_out, F.silu(self.norm_out(x)), cache)


class WanVAE(nn.Module):
    def __init__(self, config: WanVAEConfig):
        super().__init__()
        config.check()
        self.config = config
        z = config.z_dim
        self.encoder = WanVAEEncoder(config)
        self.quant_conv = CausalConv3d(2 * z, 2 * z, 1)
        self.post_quant_conv = CausalConv3d(z, z, 1)
        self.decoder = WanVAEDecoder(config)
        self.channels_last = False

    def set_channels_last(self, on: bool = True) -> "WanVAE":
        """Convolution weights (the 2-D ones as channels_last) and decode activations in
        channels_last_3d, or back to contiguous."""
        if bool(on) != self.channels_last:
            self.channels_last = bool(on)
            formats = ({4: torch.channels_last, 5: torch.channels_last_3d} if self.channels_last else
                       {4: torch.contiguous_format, 5: torch.contiguous_format})
            with torch.no_grad():
                for p in self.parameters():
                    if p.dim() in formats:
                        p.data = p.data.contiguous(memory_format=formats[p.dim()])
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.quant_conv.weight.dtype

    # ---- encode -----------------------------------------------------------------------------------
    def _check_video(self, video: torch.Tensor) -> None:
        cfg = self.config
        s = cfg.scale_factor_spatial
        if video.dim() != 5 or video.shape[1] != cfg.video_channels:
            raise ValueError(f"wan vae encode: want video [B, {cfg.video_channels}, F, H, W], got {tuple(video.shape)}")
        if video.shape[2] < 1 or video.shape[3] % s or video.shape[4] % s:
            raise ValueError(f"wan vae encode: H and W must be multiples of {s} and F >= 1, "
                             f"got {tuple(video.shape[2:])}")

    def encode_moments(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, logvar) of the posterior, each [B, z, 1 + (F - 1) // 4, H / 16, W / 16]."""
        self._check_video(video)
        x = patchify(video.to(self.dtype), self.config.patch)
        n = 1 + (x.shape[2] - 1) // ENCODE_CHUNK
        cache = FrameCache()
        outs = [self.encoder(x[:, :, :1], cache)]
        for i in range(1, n):
            outs.append(self.encoder(x[:, :, 1 + ENCODE_CHUNK * (i - 1):1 + ENCODE_CHUNK * i], cache))
        moments = self.quant_conv(torch.cat(outs, dim=2))
        mean, logvar = moments.chunk(2, dim=1)
        return mean, logvar.clamp(*LOGVAR_RANGE)

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """The posterior mean (the mode; what the Wan pipelines condition on)."""
        return self.encode_moments(video)[0]

    # ---- decode -----------------------------------------------------------------------------------
    def decode_step(self, frame: torch.Tensor, cache: FrameCache, first: bool) -> torch.Tensor:
        """One latent frame [B, z, 1, h, w] (after post_quant_conv) -> video frames
        [B, 3, 1 if first else 4, 16 h, 16 w] in [-1, 1], advancing `cache`."""
        out = self.decoder(frame, cache, first)
        return unpatchify(out, self.config.patch).clamp_(-1.0, 1.0)

    def decode_chunks(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """The video of `latents` [B, z, F', h, w], one latent frame's worth of frames at a time."""
        cfg = self.config
        if latents.dim() != 5 or latents.shape[1] != cfg.z_dim:
            raise ValueError(f"wan vae decode: want latents [B, {cfg.z_dim}, F', H', W'], got {tuple(latents.shape)}")
        x = latents.to(self.dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        x = self.post_quant_conv(x)
        cache = FrameCache()
        for i in range(x.shape[2]):
            yield self.decode_step(x[:, :, i:i + 1], cache, first=i == 0)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, z, F', h, w] -> [B, 3, 1 + 4 (F' - 1), 16 h, 16 w] in [-1, 1]."""
        return torch.cat(list(self.decode_chunks(latents)), dim=2)

    # ---- the pipeline's latent normalisation --------------------------------------------------------
    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.config.latents_mean).view(shape).to(like.device, like.dtype)
        inv_std = 1.0 / torch.tensor(self.config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, inv_std

    def normalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        """Encoder latents -> the diffusion model's: (z - mean) / std (as diffusers' Wan pipelines)."""
        mean, inv_std = self._stats(z)
        return (z - mean) * inv_std

    def denormalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        """The diffusion model's latents -> the decoder's: z * std + mean."""
        mean, inv_std = self._stats(z)
        return z / inv_std + mean


__all__ = ["ENCODE_CHUNK", "patchify", "unpatchify", "WanVAEEncoder", "WanVAEDecoder", "WanVAE"]
