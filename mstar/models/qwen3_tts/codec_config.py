"""The configuration of the Qwen3-TTS 12 Hz speech tokenizer's decoder (the codec that turns the
talker's codes into 24 kHz audio), read from the `speech_tokenizer/config.json` of a Qwen3-TTS
model directory: its `decoder_config` block and the top-level sample rates.

One codec frame is 80 ms: 16 codes (one semantic codebook, then 15 acoustic ones) that the
decoder turns into `samples_per_frame` = prod(upsampling_ratios) * prod(upsample_rates) = 1920
samples at 24 kHz.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields

@dataclass
class Qwen3TTSCodecConfig:
    """The decoder's settings (names as in the checkpoint's decoder_config) and the two top-level
    numbers it needs (output_sample_rate, decode_upsample_rate)."""
    codebook_size: int = 2048
    codebook_dim: int = 512  # the quantizer's output width; each codebook vector is codebook_dim // 2
    latent_dim: int = 1024
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    attention_bias: bool = False
    sliding_window: int = 72  # keys a query sees, itself included
    max_position_embeddings: int = 8000
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    num_quantizers: int = 16
    upsampling_ratios: list[int] = field(default_factory=lambda: [2, 2])
    upsample_rates: list[int] = field(default_factory=lambda: [8, 5, 4, 3])
    decoder_dim: int = 1536
    output_sample_rate: int = 24000
    decode_upsample_rate: int = 1920

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise ValueError(f"Qwen3-TTS codec: hidden_act {self.hidden_act!r} (only silu is built)")
        if self.rope_scaling and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) != "default":
            raise ValueError(f"Qwen3-TTS codec: rope_scaling {self.rope_scaling} (only default rope is built)")
        if self.num_quantizers < 2 or self.codebook_dim % 2 or self.sliding_window < 1:
            raise ValueError("Qwen3-TTS codec: needs num_quantizers >= 2 (1 semantic + acoustic), an even "
                             f"codebook_dim and sliding_window >= 1; got {self.num_quantizers}, "
                             f"{self.codebook_dim}, {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("Qwen3-TTS codec: num_attention_heads must be a multiple of num_key_value_heads")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError(f"Qwen3-TTS codec: decoder_dim {self.decoder_dim} is halved "
                             f"{len(self.upsample_rates)} times")
        if self.samples_per_frame != self.decode_upsample_rate:
            raise ValueError(f"Qwen3-TTS codec: the upsampling chain gives {self.samples_per_frame} samples a "
                             f"frame but decode_upsample_rate is {self.decode_upsample_rate}")

    @classmethod
    def from_dict(cls, raw: dict) -> "Qwen3TTSCodecConfig":
        """From a speech_tokenizer config.json (its decoder_config block and the top-level
        output_sample_rate / decode_upsample_rate), or from a bare decoder_config. Other keys
        are not read, as the release's decoder reads none of them: it fixes one semantic
        codebook and sizes every codebook by codebook_size, whatever num_semantic_quantizers
        and semantic_codebook_size say, and generic config keys change nothing."""
        dec = dict(raw.get("decoder_config", raw))
        for key in ("output_sample_rate", "decode_upsample_rate"):
            if key in raw:
                dec[key] = raw[key]
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dec.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def frame_rate(self) -> float:
        return self.output_sample_rate / self.samples_per_frame

    @property
    def receptive_field_frames(self) -> int:
        """How many earlier frames can reach a frame's audio (the left context a decode that keeps
        no state would need to reproduce a whole-utterance decode): the input conv's 2 frames, each
        attention layer's sliding_window - 1, and the upsampling convs' history in frames at their
        rates (ConvNeXt k7, the k7 convs, each block's transposed conv (one input step) and its
        k7 residual convs of dilation 1, 3, 9). 580 for the published config; the release's own
        chunked decode uses 25."""
        frames = 2.0 + self.num_hidden_layers * (self.sliding_window - 1)
        rate = 1
        for r in self.upsampling_ratios:
            rate *= r
            frames += 6 / rate
        frames += 6 / rate
        for r in self.upsample_rates:
            frames += 1 / rate
            rate *= r
            frames += 6 * (1 + 3 + 9) / rate
        return math.ceil(frames + 6 / rate)


def read_codec_config(path: str) -> Qwen3TTSCodecConfig:
    """The config of a speech_tokenizer directory (its config.json)."""
    with open(os.path.join(path, "config.json")) as f:
        return Qwen3TTSCodecConfig.from_dict(json.load(f))
