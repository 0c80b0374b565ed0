"""The configuration of a Qwen3-TTS 12 Hz model's language half, read from the release's config.json
(`Qwen3TTSConfig`: the top-level text token ids, `talker_config`, and inside it
`code_predictor_config`).

    talker           a Qwen3 decoder over summed text and codec embeddings; its head predicts
                     codebook 0 of each 80 ms frame (`vocab_size` codec ids: the codebook's
                     `vocab_size - 1024` codes, then the control ids: pad, bos, eos, think tags,
                     languages, speakers)
    code predictor   a small Qwen3 decoder that, per frame, predicts codebooks 1..num_code_groups-1
                     from the talker's last hidden state and the codes before them

Defaults are the reference implementation's constructor defaults, so a field the file leaves out
means what it means there. Fields of the release that inference does not read (the speaker
encoder, `position_id_per_seconds`, ...) are kept in `extra`. Sliding-window attention and rope
scaling other than the default are refused: no release uses them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from mstar.models.config_fields import split_fields

MODEL_TYPE = "qwen3_tts"
SUPPRESSED_TAIL = 1024  # the release's sampling never draws the last 1024 codec ids except EOS


def _check_decoder(c, what: str) -> None:
    if c.hidden_act != "silu":
        raise ValueError(f"{what}: hidden_act {c.hidden_act!r} is not supported (only silu)")
    if c.use_sliding_window:
        raise ValueError(f"{what}: sliding-window attention is not supported")
    if c.num_attention_heads % c.num_key_value_heads:
        raise ValueError(f"{what}: num_attention_heads must be a multiple of num_key_value_heads")
    rtype = (c.rope_scaling or {}).get("rope_type", (c.rope_scaling or {}).get("type", "default"))
    if rtype != "default":
        raise ValueError(f"{what}: rope_type {rtype!r} is not supported (only default)")


@dataclass
class CodePredictorConfig:
    vocab_size: int = 2048  # codes per codebook
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    num_code_groups: int = 32
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict) -> "CodePredictorConfig":
        known, extra = split_fields(cls, raw)
        cfg = cls(**known, extra=extra)
        _check_decoder(cfg, "qwen3-tts code predictor")
        return cfg


@dataclass
class TalkerConfig:
    code_predictor_config: CodePredictorConfig = field(default_factory=CodePredictorConfig)
    vocab_size: int = 3072  # codec ids
    hidden_size: int = 1024
    intermediate_size: int = 2048
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # {"rope_type": "default", "mrope_section": [t, h, w], "interleaved": bool}: three position
    # axes; text-only speech gives every token equal axes, which is plain rotary (talker.py)
    rope_scaling: dict | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    num_code_groups: int = 32  # codebooks per frame
    text_hidden_size: int = 2048
    text_vocab_size: int = 151936
    codec_eos_token_id: int = 4198
    codec_think_id: int = 4202
    codec_nothink_id: int = 4203
    codec_think_bos_id: int = 4204
    codec_think_eos_id: int = 4205
    codec_pad_id: int = 4196
    codec_bos_id: int = 4197
    spk_id: dict[str, Any] = field(default_factory=dict)  # speaker name -> codec id (or [codec id])
    spk_is_dialect: dict[str, Any] = field(default_factory=dict)  # speaker -> False or a dialect's language name
    codec_language_id: dict[str, int] = field(default_factory=dict)  # language name -> codec id
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict) -> "TalkerConfig":
        raw = dict(raw)  # split_fields copies what it keeps
        cp = CodePredictorConfig.from_dict(raw.pop("code_predictor_config", None) or {})
        known, extra = split_fields(cls, raw)
        for k in ("spk_id", "spk_is_dialect", "codec_language_id"):
            if known.get(k) is None:
                known.pop(k, None)
        cfg = cls(code_predictor_config=cp, **known, extra=extra)
        if cfg.head_dim is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        cfg.check()
        return cfg

    def check(self) -> None:
        _check_decoder(self, "qwen3-tts talker")
        cp = self.code_predictor_config
        if cp.num_code_groups != self.num_code_groups:
            raise ValueError(f"qwen3-tts: the talker has {self.num_code_groups} code groups, its code predictor "
                             f"{cp.num_code_groups}")
        if self.vocab_size <= SUPPRESSED_TAIL:
            raise ValueError(f"qwen3-tts talker: vocab_size {self.vocab_size} leaves no codes below the "
                             f"{SUPPRESSED_TAIL} control ids sampling suppresses")
        if self.rope_scaling is not None and "mrope_section" in self.rope_scaling:
            if 2 * sum(self.rope_scaling["mrope_section"]) != self.head_dim:
                raise ValueError(f"qwen3-tts talker: mrope_section {self.rope_scaling['mrope_section']} does not "
                                 f"cover head_dim {self.head_dim}")

    def speaker_codec_id(self, speaker: str) -> int:
        """The codec id whose embedding is `speaker`'s voice (names are lower-case)."""
        v = self.spk_id[speaker.lower()]
        if isinstance(v, (list, tuple)):
            if len(v) != 1:
                raise ValueError(f"qwen3-tts: speaker {speaker!r} maps to {v}, not one codec id")
            v = v[0]
        return int(v)

    @property
    def languages(self) -> list[str]:
        """The language names a request may ask for ("auto" and the non-dialect entries)."""
        return ["auto"] + [k for k in self.codec_language_id if "dialect" not in k]


@dataclass
class Qwen3TTSConfig:
    talker_config: TalkerConfig = field(default_factory=TalkerConfig)
    tokenizer_type: str | None = None
    tts_model_size: str | None = None  # "1b7", "0b6"
    tts_model_type: str | None = None  # "custom_voice", "voice_design", "base"
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    model_type: str = MODEL_TYPE
    extra: dict[str, Any] = field(default_factory=dict)  # speaker_encoder_config, architectures, ...

    @classmethod
    def from_dict(cls, raw: dict) -> "Qwen3TTSConfig":
        raw = dict(raw)  # split_fields copies what it keeps
        mt = raw.get("model_type", MODEL_TYPE)
        if mt != MODEL_TYPE:
            raise ValueError(f"not a Qwen3-TTS config: model_type {mt!r}")
        talker = TalkerConfig.from_dict(raw.pop("talker_config", None) or {})
        known, extra = split_fields(cls, raw)
        return cls(talker_config=talker, **known, extra=extra)

    @property
    def talker(self) -> TalkerConfig:
        return self.talker_config

    @property
    def code_predictor(self) -> CodePredictorConfig:
        return self.talker_config.code_predictor_config


def read_config(path: str) -> Qwen3TTSConfig:
    """The config of a checkpoint directory (its config.json) or of a config.json file."""
    fpath = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(fpath, encoding="utf-8") as f:
        return Qwen3TTSConfig.from_dict(json.load(f))


def read_generation_config(path: str) -> dict:
    """The directory's generation_config.json (the release's sampling defaults), {} if absent."""
    fpath = os.path.join(path, "generation_config.json")
    if not os.path.isfile(fpath):
        return {}
    with open(fpath, encoding="utf-8") as f:
        return json.load(f)


# The published shapes (Qwen/Qwen3-TTS-12Hz-1.7B-* and -0.6B-*): talker and code predictor sizes,
# without the speaker and language tables (those come with a checkpoint).
_PREDICTOR = dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                  max_position_embeddings=65536, num_code_groups=16)
_TALKER = dict(vocab_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
               rope_theta=1e6, rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "interleaved": True},
               num_code_groups=16, text_hidden_size=2048, text_vocab_size=151936, codec_eos_token_id=2150,
               codec_think_id=2154, codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
               codec_pad_id=2148, codec_bos_id=2149)
PUBLISHED_SHAPES: dict[str, dict] = {
    "1b7": {"talker_config": {**_TALKER, "hidden_size": 2048, "intermediate_size": 6144,
                              "code_predictor_config": _PREDICTOR}, "tts_model_size": "1b7"},
    "0b6": {"talker_config": {**_TALKER, "hidden_size": 1024, "intermediate_size": 3072,
                              "code_predictor_config": _PREDICTOR}, "tts_model_size": "0b6"},
}
