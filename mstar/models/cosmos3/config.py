"""The Cosmos3 transformer's configuration: a diffusers transformer/config.json
(Cosmos3OmniTransformer, diffusers 0.42) read into one record, checked once.

The keys are the arguments of diffusers' Cosmos3OmniTransformer.__init__, with its defaults for any
key a config.json leaves out:

    hidden_size, num_hidden_layers   the width and depth of both towers (they have the same shape)
    num_attention_heads, num_key_value_heads, head_dim
                          grouped-query attention (query head h reads kv head h // (q / kv))
    intermediate_size     the MLP's hidden width
    hidden_act            "relu2": down(relu(up(x)) ** 2) and Nemotron RMSNorms (the weight
                          multiplied in float32), the Cosmos3-Edge backbone; "silu" (the Qwen3
                          backbone of Cosmos3-Nano / Super) is refused
    qk_norm_for_text      RMSNorm of the understanding tower's q and k per head (Edge: none)
    use_und_k_norm_for_gen
                          with qk_norm_for_text false: the understanding keys the generation
                          tower reads are RMSNorm-ed per head first (Edge: true)
    attention_bias        biases on the q / k / v / out projections
    rms_norm_eps          of every norm
    vocab_size            the token embedding's rows (the prompt is part of the sequence)
    rope_theta, rope_axes_dim (or rope_scaling["mrope_section"]; default [24, 20, 20])
                          the 3-axis rotary: head_dim // 2 frequency pairs, pair i rotated by
                          the token's h position when i % 3 == 1 and i < 3 * axes[1], by its w
                          position when i % 3 == 2 and i < 3 * axes[2], else by its t position
    latent_channel, latent_patch_size, patch_latent_dim
                          the VAE latents (48 channels) in p x p patches: patch_latent_dim = p * p * C
    timestep_scale        the diffusion timestep (0..1000) is scaled by it before the sinusoid
    enable_fps_modulation, base_fps
                          a video's temporal positions scaled by (fps / 4) / (base_fps / 4), float
    unified_3d_mrope_temporal_modality_margin
                          the vision tokens' temporal positions start this far after the prompt's
    unified_3d_mrope_reset_spatial_ids
                          h / w positions start at 0 (false: at the temporal offset too)
    action_gen, action_dim, num_embodiment_domains, sound_gen, sound_dim, sound_latent_fps
                          the action / sound heads: their weights are read past (text-to-image
                          and text-to-video use neither)

Keys starting with "_" are dropped; other keys (the release's "backbone_type",
"temporal_compression_factor", ...) are kept in `extra`, unused except that a
temporal_compression_factor must agree with the VAE's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar.models.config_fields import field_values, split_fields

CLASS_NAME = "Cosmos3OmniTransformer"
DEFAULT_ROPE_AXES = (24, 20, 20)

# nvidia/Cosmos3-Edge transformer/config.json (the Nemotron-dense "Edge" backbone; action heads
# for 32 embodiment domains, no sound)
COSMOS3_EDGE_TRANSFORMER: dict[str, Any] = {
    "_class_name": CLASS_NAME,
    "action_dim": 64,
    "action_gen": True,
    "attention_bias": False,
    "backbone_type": "cosmos3_edge_nemotron_dense",
    "base_fps": 24,
    "enable_fps_modulation": True,
    "head_dim": 128,
    "hidden_act": "relu2",
    "hidden_size": 2048,
    "intermediate_size": 9216,
    "latent_channel": 48,
    "latent_patch_size": 2,
    "num_attention_heads": 16,
    "num_embodiment_domains": 32,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "patch_latent_dim": 192,
    "qk_norm_for_text": False,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"mrope_section": [24, 20, 20]},
    "rope_theta": 100000000,
    "sound_dim": None,
    "sound_gen": False,
    "sound_latent_fps": 25,
    "temporal_compression_factor": 4,
    "timestep_scale": 0.001,
    "unified_3d_mrope_reset_spatial_ids": True,
    "unified_3d_mrope_temporal_modality_margin": 15000,
    "use_und_k_norm_for_gen": True,
    "vocab_size": 131072,
}

# A tiny Edge-layout shape for tests: width 32, head_dim 16 (8 rotary pairs: t 4, h 2, w 2).
TINY_COSMOS3_TRANSFORMER: dict[str, Any] = {
    **COSMOS3_EDGE_TRANSFORMER,
    "action_gen": False,
    "action_dim": None,
    "head_dim": 16,
    "hidden_size": 32,
    "intermediate_size": 64,
    "latent_channel": 8,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "patch_latent_dim": 32,
    "rope_scaling": {"mrope_section": [4, 2, 2]},
    "vocab_size": 264,
}


@dataclass
class Cosmos3TransformerConfig:
    # defaults: diffusers' Cosmos3OmniTransformer.__init__ (0.42)
    attention_bias: bool = False
    attention_dropout: float = 0.0
    head_dim: int = 128
    hidden_size: int = 4096
    intermediate_size: int = 12288
    base_fps: float = 24
    enable_fps_modulation: bool = True
    latent_channel: int = 48
    unified_3d_mrope_reset_spatial_ids: bool = True
    unified_3d_mrope_temporal_modality_margin: int = 15000
    latent_patch_size: int = 2
    num_attention_heads: int = 32
    num_hidden_layers: int = 36
    num_key_value_heads: int = 8
    patch_latent_dim: int = 192
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None
    rope_theta: float = 5000000.0
    action_dim: int | None = None
    action_gen: bool = False
    num_embodiment_domains: int = 32
    sound_dim: int | None = None
    sound_gen: bool = False
    sound_latent_fps: float = 25.0
    timestep_scale: float = 0.001
    vocab_size: int = 151936
    hidden_act: str = "silu"
    qk_norm_for_text: bool = True
    use_und_k_norm_for_gen: bool = False
    rope_axes_dim: tuple[int, int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, kept for to_dict

    @classmethod
    def from_dict(cls, raw: dict) -> "Cosmos3TransformerConfig":
        # "dtype": a load-time hint diffusers' loader injects, not the architecture
        kw, raw = split_fields(cls, {k: v for k, v in raw.items() if not k.startswith("_") and k != "dtype"})
        if kw.get("rope_axes_dim") is not None:
            kw["rope_axes_dim"] = tuple(int(a) for a in kw["rope_axes_dim"])
        cfg = cls(extra=raw, **kw)
        cfg.check()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The diffusers keys (Cosmos3OmniTransformer(**to_dict()) builds the same shape)."""
        out = field_values(self)
        out["rope_axes_dim"] = list(self.rope_axes)
        return out

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """(t, h, w) frequency-pair counts of the 3-axis rotary (diffusers' resolution of the keys)."""
        if self.rope_axes_dim is not None:
            return tuple(self.rope_axes_dim)
        if self.rope_scaling is not None:
            return tuple(int(a) for a in self.rope_scaling.get("mrope_section", DEFAULT_ROPE_AXES))
        return DEFAULT_ROPE_AXES

    @property
    def k_norm_for_gen(self) -> bool:
        """Whether the generation tower reads the understanding keys through their own RMSNorm."""
        return bool(self.use_und_k_norm_for_gen) and not self.qk_norm_for_text

    def check(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"cosmos3 transformer config: {msg}")
        for name in ("head_dim", "hidden_size", "intermediate_size", "latent_channel", "latent_patch_size",
                     "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "patch_latent_dim",
                     "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f"{name} must be a positive integer, got {v!r}")
        if self.hidden_act != "relu2":
            raise bad(f"hidden_act {self.hidden_act!r} is not supported: mstar runs the relu2 (Nemotron-dense, "
                      "Cosmos3-Edge) backbone, not the silu (Qwen3) one")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                      f"{self.num_key_value_heads}")
        if self.head_dim % 2:
            raise bad(f"head_dim must be even (rotary pairs), got {self.head_dim}")
        axes = self.rope_axes
        if len(axes) != 3 or min(axes) < 0 or 3 * max(axes[1], axes[2]) > self.head_dim // 2:
            raise bad(f"rope axes {axes} do not fit head_dim {self.head_dim} ({self.head_dim // 2} pairs)")
        p = self.latent_patch_size
        if self.patch_latent_dim != p * p * self.latent_channel:
            raise bad(f"patch_latent_dim {self.patch_latent_dim} is not latent_patch_size^2 * latent_channel "
                      f"= {p * p * self.latent_channel}")
        if not self.rope_theta > 0 or not self.timestep_scale > 0 or not self.base_fps > 0:
            raise bad("rope_theta, timestep_scale and base_fps must be positive")
        if self.attention_dropout:
            raise bad("attention_dropout is training only and must be 0")

    def check_vae(self, z_dim: int, temporal: int) -> None:
        """The VAE's latents must be the transformer's (channels, and a declared temporal factor)."""
        if z_dim != self.latent_channel:
            raise ValueError(f"cosmos3: the transformer takes {self.latent_channel} latent channels, the VAE makes "
                             f"{z_dim}")
        declared = self.extra.get("temporal_compression_factor")
        if declared is not None and int(declared) != int(temporal):
            raise ValueError(f"cosmos3: the transformer's temporal_compression_factor {declared} is not the VAE's "
                             f"{temporal}")


__all__ = ["CLASS_NAME", "DEFAULT_ROPE_AXES", "COSMOS3_EDGE_TRANSFORMER", "TINY_COSMOS3_TRANSFORMER",
           "Cosmos3TransformerConfig"]
