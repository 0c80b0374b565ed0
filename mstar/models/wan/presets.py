"""Wan presets: the published Wan2.2 TI2V-5B shapes (Wan-AI/Wan2.2-TI2V-5B-Diffusers) with random
weights, and a tiny embedded model for tests. A preset's config is the whole pipeline, as the
diffusers directory spells it:

    transformer     transformer/config.json (WanTransformer3DModel)
    vae             vae/config.json (AutoencoderKLWan, the Wan2.2 residual kind)
    text_encoder    text_encoder/config.json (UMT5EncoderModel)
    scheduler       scheduler/scheduler_config.json (UniPCMultistepScheduler, flow sigmas)
    expand_timesteps  model_index.json's (Wan2.2 TI2V: per-token timesteps; image-to-video keeps the
                    first latent frame at t = 0)
    sizes, max_frames, fps, num_inference_steps, guidance_scale
                    what the routes may ask and the defaults (the release's: 1280x704 / 704x1280,
                    121 frames at 24 fps, 50 steps, guidance 5; flow_shift is the scheduler's)

    name             transformer (dim / layers / ffn)   text encoder (d_model / layers)   VAE z   params
    wan2.2-ti2v-5b   3072 / 30 / 14336                  UMT5-XXL 4096 / 24                48      ~5.0 B + 5.7 B + VAE
    tiny-wan         32 / 2 / 64                        24 / 2                            8       ~0.1 M

The tiny model's tokenizer is the offline byte tokenizer (text_encoder.byte_tokenizer), and so is
the published shape's with random weights (the real UMT5 tokenizer is not here; with random
weights any ids in the vocabulary do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar.models.config_fields import field_values, split_fields
from mstar.models.presets import Preset
from mstar.models.wan.scheduler_config import WAN22_TI2V_5B_SCHEDULER
from mstar.models.wan.transformer_config import TINY_WAN_TRANSFORMER, WAN22_TI2V_5B_TRANSFORMER
from mstar.models.wan.vae_config import TINY_WAN22_TI2V_VAE, WAN22_TI2V_5B_VAE

MODEL_TYPE = "wan"
BYTE_VOCAB = 3 + 256  # text_encoder.byte_tokenizer's: <pad>, </s>, <unk>, then the bytes (kept here: no torch import)

# google/umt5-xxl's encoder (Wan2.2-TI2V-5B-Diffusers text_encoder/config.json)
UMT5_XXL: dict[str, Any] = {
    "architectures": ["UMT5EncoderModel"],
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "dense_act_fn": "gelu_new",
    "dropout_rate": 0.1,
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "initializer_factor": 1.0,
    "is_encoder_decoder": True,
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "umt5",
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "vocab_size": 256384,
}

TINY_UMT5: dict[str, Any] = {
    "architectures": ["UMT5EncoderModel"],
    "d_ff": 48,
    "d_kv": 8,
    "d_model": TINY_WAN_TRANSFORMER["text_dim"],
    "dense_act_fn": "gelu_new",
    "dropout_rate": 0.0,
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "umt5",
    "num_decoder_layers": 2,
    "num_heads": 3,
    "num_layers": 2,
    "pad_token_id": 0,
    "relative_attention_max_distance": 16,
    "relative_attention_num_buckets": 8,
    "tie_word_embeddings": False,
    "vocab_size": BYTE_VOCAB,
}

SIZES_720P = ("1280x704", "704x1280")  # Wan2.2 TI2V-5B's (generate.py SUPPORTED_SIZES["ti2v-5B"])
# and 480p, which the release does not list but diffusers' pipeline runs (the usual benchmark size)
PUBLISHED_SIZES = SIZES_720P + ("832x480", "480x832")
TINY_SIZES = ("64x64", "96x64", "64x96", "32x32")  # multiples of 32: VAE 16 x patch 2


@dataclass
class WanConfig:
    """A Wan pipeline's configuration (a preset's, or read from a diffusers directory)."""
    transformer: dict[str, Any]
    vae: dict[str, Any]
    text_encoder: dict[str, Any]
    scheduler: dict[str, Any]
    expand_timesteps: bool = True
    sizes: tuple[str, ...] = PUBLISHED_SIZES
    max_frames: int = 121
    fps: float = 24.0
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    model_type: str = MODEL_TYPE
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict) -> "WanConfig":
        kw, raw = split_fields(cls, raw)
        if "sizes" in kw:
            kw["sizes"] = tuple(kw["sizes"])
        return cls(extra=raw, **kw)

    def to_dict(self) -> dict[str, Any]:
        out = field_values(self)
        out["sizes"] = list(self.sizes)
        return out


WAN22_TI2V_5B: dict[str, Any] = {
    "transformer": WAN22_TI2V_5B_TRANSFORMER, "vae": WAN22_TI2V_5B_VAE, "text_encoder": UMT5_XXL,
    "scheduler": WAN22_TI2V_5B_SCHEDULER, "expand_timesteps": True, "sizes": list(PUBLISHED_SIZES), "max_frames": 121,
    "fps": 24.0, "num_inference_steps": 50, "guidance_scale": 5.0,
}

TINY_WAN: dict[str, Any] = {
    "transformer": TINY_WAN_TRANSFORMER, "vae": TINY_WAN22_TI2V_VAE, "text_encoder": TINY_UMT5,
    "scheduler": WAN22_TI2V_5B_SCHEDULER, "expand_timesteps": True, "sizes": list(TINY_SIZES), "max_frames": 17,
    "fps": 8.0, "num_inference_steps": 4, "guidance_scale": 5.0,
}

PRESETS: tuple[Preset, ...] = (
    Preset("wan2.2-ti2v-5b", MODEL_TYPE, WAN22_TI2V_5B,
           note="Wan2.2 TI2V-5B (text/image to video, 720p 24 fps, UMT5-XXL), random weights"),
    Preset("tiny-wan", MODEL_TYPE, TINY_WAN, embedded=True,
           note="tiny random Wan2.2 TI2V (test model: text / image -> video, byte tokenizer)"),
)


def get(name: str) -> Preset | None:
    return {p.name: p for p in PRESETS}.get(name.lower())


__all__ = ["MODEL_TYPE", "UMT5_XXL", "TINY_UMT5", "SIZES_720P", "PUBLISHED_SIZES", "TINY_SIZES", "WanConfig",
           "WAN22_TI2V_5B", "TINY_WAN", "PRESETS", "get"]
