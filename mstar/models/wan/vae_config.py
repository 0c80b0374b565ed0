"""The Wan VAE's configuration: a diffusers vae/config.json (AutoencoderKLWan) read into one
record, checked once.

The keys are the arguments of diffusers' AutoencoderKLWan.__init__ (0.36), with its defaults for
any key a config.json leaves out:

    base_dim              encoder width of the first level (level i: base_dim * dim_mult[i])
    decoder_base_dim      the same for the decoder (null: base_dim)
    z_dim                 latent channels (the encoder emits 2 * z_dim: mean and log-variance)
    dim_mult              width multipliers per level; every level but the last halves H and W
    num_res_blocks        residual blocks per encoder level (the decoder has one more per level)
    attn_scales           unused by the residual (Wan2.2) VAE: its only attention is the mid block's
    temperal_downsample   per down level (len(dim_mult) - 1): halves the frames too (the
                          release's spelling); the decoder upsamples in the reverse order
    dropout               training only
    latents_mean/_std     per-channel statistics of the latents; the pipeline normalises with them
                          (z - mean) / std after encode and undoes it before decode: WanVAE's
                          normalize_latents / denormalize_latents, never applied inside encode/decode
    is_residual           the Wan2.2 VAE (residual down / up blocks with avg-down / dup-up
                          shortcuts); the Wan2.1 VAE (False) is not implemented here and refused
    in_channels           channels the encoder sees: 3 * patch_size ** 2 (pixels are patchified)
    out_channels          channels the decoder emits before unpatchify
    patch_size            2x2 pixel patches folded into channels (null: none)
    scale_factor_temporal frames per latent frame (4); checked against temperal_downsample
    scale_factor_spatial  pixels per latent pixel (16); checked against dim_mult and patch_size

Keys starting with "_" (diffusers' _class_name, _diffusers_version, ...) are dropped; other
unknown keys (e.g. a "clip_output", which diffusers 0.36 does not take: it always clamps the
decoded video to [-1, 1], as the release does) are kept in `extra`, not used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar.models.config_fields import field_values, split_fields

CLASS_NAME = "AutoencoderKLWan"

# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: the constructor keys (diffusers'
# scripts/convert_wan_to_diffusers.py, vae22_diffusers_config; the rest are the class defaults).
WAN22_TI2V_5B_VAE: dict[str, Any] = {
    "_class_name": CLASS_NAME,
    "attn_scales": [],
    "base_dim": 160,
    "decoder_base_dim": 256,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "in_channels": 12,
    "is_residual": True,
    "latents_mean": [
        -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
        -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
        -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
        -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
        -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
        0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
    ],
    "latents_std": [
        0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
        0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
        0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
        0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
        0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
        0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
    ],
    "num_res_blocks": 2,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "temperal_downsample": [False, True, True],
    "z_dim": 48,
}

# A tiny shape of the same kind for tests: every block type of the release (two temporal and
# three spatial halvings, 16x / 4x compression, patch 2), encoder and decoder widths differing.
TINY_WAN22_TI2V_VAE: dict[str, Any] = {
    "_class_name": CLASS_NAME,
    "attn_scales": [],
    "base_dim": 8,
    "decoder_base_dim": 12,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "in_channels": 12,
    "is_residual": True,
    "latents_mean": [-0.21, 0.05, 0.33, -0.4, 0.12, 0.0, -0.07, 0.26],
    "latents_std": [0.48, 1.04, 0.45, 1.17, 0.53, 0.5, 0.81, 0.69],
    "num_res_blocks": 1,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "temperal_downsample": [False, True, True],
    "z_dim": 8,
}


@dataclass
class WanVAEConfig:
    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: list[int] = field(default_factory=lambda: [1, 2, 4, 4])
    num_res_blocks: int = 2
    attn_scales: list[float] = field(default_factory=list)
    temperal_downsample: list[bool] = field(default_factory=lambda: [False, True, True])
    dropout: float = 0.0
    latents_mean: list[float] | None = None  # diffusers' defaults are Wan2.1's 16 channels: required here
    latents_std: list[float] | None = None
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int = 4
    scale_factor_spatial: int = 8
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict) -> "WanVAEConfig":
        kw, raw = split_fields(cls, {k: v for k, v in raw.items() if not k.startswith("_")})
        cfg = cls(extra=raw, **kw)
        cfg.check()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The diffusers constructor keys (AutoencoderKLWan(**cfg.to_dict()) builds the same model)."""
        return field_values(self)

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def patch(self) -> int:
        return self.patch_size or 1

    @property
    def video_channels(self) -> int:
        """Channels of the pixel video (3: RGB) before patchify / after unpatchify."""
        return self.in_channels // (self.patch * self.patch)

    @property
    def encoder_dims(self) -> list[int]:
        """Widths: conv_in's output, then each down level's output."""
        return [self.base_dim * m for m in [1, *self.dim_mult]]

    @property
    def decoder_dims(self) -> list[int]:
        """Widths: conv_in's output (= the mid block's), then each up level's output."""
        d = self.decoder_base_dim or self.base_dim
        return [d * m for m in [self.dim_mult[-1], *self.dim_mult[::-1]]]

    @property
    def temporal_upsample(self) -> list[bool]:
        return list(self.temperal_downsample[::-1])

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a video of `frames` frames (frames beyond 1 + 4k are dropped, as diffusers does)."""
        return 1 + (frames - 1) // self.scale_factor_temporal

    def video_frames(self, latent_frames: int) -> int:
        return 1 + (latent_frames - 1) * self.scale_factor_temporal

    def check(self) -> None:
        if not self.is_residual:
            raise ValueError("wan vae config: is_residual false is the Wan2.1 VAE, which mstar does not implement "
                             "(only the Wan2.2 TI2V-5B kind)")
        levels = len(self.dim_mult)
        if levels < 1 or len(self.temperal_downsample) != levels - 1:
            raise ValueError(f"wan vae config: temperal_downsample {self.temperal_downsample} needs "
                             f"len(dim_mult) - 1 = {levels - 1} entries")
        if self.num_res_blocks < 1:
            raise ValueError(f"wan vae config: num_res_blocks {self.num_res_blocks} < 1")
        p = self.patch
        if self.patch_size is not None and self.patch_size < 1:
            raise ValueError(f"wan vae config: patch_size {self.patch_size}")
        if self.in_channels % (p * p) or self.out_channels != self.in_channels:
            raise ValueError(f"wan vae config: in_channels {self.in_channels} / out_channels {self.out_channels} "
                             f"must be equal and a multiple of patch_size ** 2 = {p * p}")
        spatial = 2 ** (levels - 1) * p
        temporal = 2 ** sum(bool(t) for t in self.temperal_downsample)
        if spatial != self.scale_factor_spatial or temporal != self.scale_factor_temporal:
            raise ValueError(f"wan vae config: the blocks compress {temporal}x in time and {spatial}x in space, "
                             f"the config says scale_factor_temporal {self.scale_factor_temporal}, "
                             f"scale_factor_spatial {self.scale_factor_spatial}")
        if self.scale_factor_temporal != 4:
            raise ValueError("wan vae config: the release encodes in chunks of 4 frames: "
                             f"scale_factor_temporal must be 4, not {self.scale_factor_temporal}")
        for name in ("latents_mean", "latents_std"):
            v = getattr(self, name)
            if v is None or len(v) != self.z_dim:
                raise ValueError(f"wan vae config: {name} needs z_dim = {self.z_dim} values, "
                                 f"got {None if v is None else len(v)}")
        if any(s <= 0 for s in self.latents_std):
            raise ValueError("wan vae config: latents_std must be positive")
        # the shortcuts regroup channels: avg-down averages in * factor / out channels, dup-up repeats
        enc, dec = self.encoder_dims, self.decoder_dims
        for i in range(levels):
            down = i != levels - 1
            f = (2 if down and self.temperal_downsample[i] else 1) * (4 if down else 1)
            if (enc[i] * f) % enc[i + 1]:
                raise ValueError(f"wan vae config: encoder level {i}: {enc[i]} * {f} channels do not group "
                                 f"into {enc[i + 1]}")
            if down:
                f = (2 if self.temporal_upsample[i] else 1) * 4
                if (dec[i + 1] * f) % dec[i]:
                    raise ValueError(f"wan vae config: decoder level {i}: {dec[i + 1]} * {f} channels are "
                                     f"not a multiple of {dec[i]}")


WAN22_VAE = WanVAEConfig.from_dict(WAN22_TI2V_5B_VAE)
TINY_WAN22_VAE = WanVAEConfig.from_dict(TINY_WAN22_TI2V_VAE)

__all__ = ["CLASS_NAME", "WAN22_TI2V_5B_VAE", "TINY_WAN22_TI2V_VAE", "WanVAEConfig", "WAN22_VAE", "TINY_WAN22_VAE"]
