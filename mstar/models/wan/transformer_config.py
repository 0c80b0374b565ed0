"""The Wan diffusion transformer's configuration: a diffusers transformer/config.json
(WanTransformer3DModel) read into one record, checked once.

The keys are the arguments of diffusers' WanTransformer3DModel.__init__, with its defaults for
any key a config.json leaves out:

    patch_size            (t, h, w) of the Conv3d patch embedding (kernel = stride)
    num_attention_heads   heads; the model width is heads * attention_head_dim
    attention_head_dim    split for the 3-D rotary into t / h / w parts:
                          h = w = 2 * (head_dim // 6), t = head_dim - h - w
    in_channels           latent channels in
    out_channels          latent channels out (null or 0: in_channels, as diffusers does)
    text_dim              width of the text encoder's states (UMT5-XXL: 4096)
    freq_dim              width of the sinusoidal timestep embedding
    ffn_dim               the feed-forward's hidden width
    num_layers            transformer blocks
    cross_attn_norm       a LayerNorm with affine before the cross-attention (else none)
    qk_norm               "rms_norm_across_heads": RMSNorm of q and k over all heads together
                          (diffusers builds exactly this whatever the value; other values refused)
    eps                   of every norm
    image_dim             image-embedding width of the I2V models (TI2V has none; refused)
    added_kv_proj_dim     the I2V models' image K/V projections (refused)
    rope_max_seq_len      rotary table length: post-patch frames, height and width must fit
    pos_embed_seq_len     the image embedder's position table (only with image_dim)

Keys starting with "_" (diffusers' _class_name, _diffusers_version, ...) are dropped; other
unknown keys are kept in `extra`, not used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar.models.config_fields import field_values, split_fields

CLASS_NAME = "WanTransformer3DModel"
QK_NORMS = ("rms_norm_across_heads",)

# Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json (the model's keys; ~5.0e9 parameters)
WAN22_TI2V_5B_TRANSFORMER: dict[str, Any] = {
    "_class_name": CLASS_NAME,
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 14336,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 48,
    "num_attention_heads": 24,
    "num_layers": 30,
    "out_channels": 48,
    "patch_size": [1, 2, 2],
    "pos_embed_seq_len": None,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}

# A tiny shape for tests (dim 32, head_dim 16 -> rotary parts t 8, h 4, w 4).
TINY_WAN_TRANSFORMER: dict[str, Any] = {
    "_class_name": CLASS_NAME,
    "added_kv_proj_dim": None,
    "attention_head_dim": 16,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 64,
    "freq_dim": 32,
    "image_dim": None,
    "in_channels": 8,
    "num_attention_heads": 2,
    "num_layers": 2,
    "out_channels": 8,
    "patch_size": [1, 2, 2],
    "pos_embed_seq_len": None,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 64,
    "text_dim": 24,
}


@dataclass
class WanTransformerConfig:
    # defaults: diffusers' WanTransformer3DModel.__init__
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, kept for to_dict

    @classmethod
    def from_dict(cls, raw: dict) -> "WanTransformerConfig":
        kw, raw = split_fields(cls, {k: v for k, v in raw.items() if not k.startswith("_")})
        if "patch_size" in kw:
            kw["patch_size"] = tuple(int(p) for p in kw["patch_size"])
        if not kw.get("out_channels", cls.out_channels):
            kw["out_channels"] = kw.get("in_channels", cls.in_channels)
        cfg = cls(extra=raw, **kw)
        cfg.check()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The diffusers keys (WanTransformer3DModel(**to_dict()) builds the same shape)."""
        out = field_values(self)
        out["patch_size"] = list(self.patch_size)
        return out

    def check(self) -> None:
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"wan transformer config: patch_size must be 3 positive ints, got {self.patch_size}")
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
                     "freq_dim", "ffn_dim", "num_layers", "rope_max_seq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"wan transformer config: {name} must be positive, got {getattr(self, name)}")
        if self.attention_head_dim % 2:
            raise ValueError(f"wan transformer config: attention_head_dim must be even (rotary pairs), got "
                             f"{self.attention_head_dim}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"wan transformer config: qk_norm {self.qk_norm!r} is not supported (only "
                             f"{', '.join(QK_NORMS)}: diffusers builds that norm whatever the value says)")
        if self.image_dim is not None or self.added_kv_proj_dim is not None:
            raise ValueError("wan transformer config: image conditioning (image_dim / added_kv_proj_dim, the I2V "
                             "models) is not supported; TI2V-5B has neither")

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """(t, h, w) parts of head_dim that the 3-D rotary rotates by frame, row and column."""
        hw = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - 2 * hw, hw, hw
