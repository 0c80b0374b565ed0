"""The Qwen3-TTS family: text-to-speech with the 12 Hz talker, code predictor and codec, served as
one streaming decode-loop stage of the stage engine (stage.py). Presets qwen3-tts-1.7b and
qwen3-tts-0.6b (the published CustomVoice shapes, random weights) and the embedded tiny-qwen3-tts;
a checkpoint directory is the release's layout:

    config.json               Qwen3TTSConfig (model_type qwen3_tts)
    generation_config.json    the sampling defaults
    model.safetensors         the talker and code predictor (weights.py)
    tokenizer files           the text tokenizer (AutoTokenizer)
    speech_tokenizer/         the 12 Hz codec: config.json and its safetensors (codec_weights.py)

dtype: the talker's and the codec's (bfloat16 on GPU by default).
"""

from __future__ import annotations

import os

from mstar.models import interfaces as I
from mstar.models.presets import Preset, random_weights_preset
from mstar.models.qwen3_tts.config import MODEL_TYPE, Qwen3TTSConfig
from mstar.models.qwen3_tts.presets import PRESETS
from mstar.models.registry import Family, register

SPEECH_TOKENIZER_DIR = "speech_tokenizer"


def _random_parts(raw: dict, codec_raw: dict, seed: int, device, dtype, std: float = 0.02):
    from mstar.models.qwen3_tts.codec_config import Qwen3TTSCodecConfig
    from mstar.models.qwen3_tts.codec_weights import build_codec_decoder
    from mstar.models.qwen3_tts.weights import build_talker, init_random
    config = Qwen3TTSConfig.from_dict(raw)
    talker = build_talker(config, device, dtype)
    init_random(talker, seed, std)
    codec = build_codec_decoder(Qwen3TTSCodecConfig.from_dict(codec_raw), dtype, device, seed=seed + 1)
    return config, talker, codec


def qwen3_tts_pipeline(name_or_dir: str, dtype=None, device="cpu", random_weights: bool = False, seed: int = 0,
                       max_batch: int = 32) -> I.Pipeline:
    """The stage pipeline of a model directory or a preset (random weights: the preset's shapes, or
    the directory's configs with its tokenizer)."""
    import torch

    from mstar.models.qwen3_tts.stage import Qwen3TTSSynthesis
    dtype = dtype or torch.float32
    if os.path.isdir(name_or_dir):
        import json

        from transformers import AutoTokenizer

        from mstar.models.qwen3_tts.config import read_generation_config
        codec_dir = os.path.join(name_or_dir, SPEECH_TOKENIZER_DIR)
        if not os.path.isdir(codec_dir):
            raise FileNotFoundError(f"{name_or_dir!r}: no {SPEECH_TOKENIZER_DIR}/ directory (the release's codec)")
        tokenizer = AutoTokenizer.from_pretrained(name_or_dir)
        gc = read_generation_config(name_or_dir)
        if random_weights:
            with open(os.path.join(name_or_dir, "config.json"), encoding="utf-8") as f:
                raw = json.load(f)
            with open(os.path.join(codec_dir, "config.json"), encoding="utf-8") as f:
                codec_raw = json.load(f)
            config, talker, codec = _random_parts(raw, codec_raw, seed, device, dtype)
        else:
            from mstar.models.qwen3_tts.codec_weights import load_codec_decoder
            from mstar.models.qwen3_tts.weights import load_model
            lm = load_model(name_or_dir, device, dtype)
            config, talker = lm.config, lm.talker
            codec = load_codec_decoder(codec_dir, dtype, device)
    else:
        from mstar.models.qwen3_tts.presets import byte_tokenizer, get
        preset = random_weights_preset(get(name_or_dir), name_or_dir, random_weights, "Qwen3-TTS",
                                       "model directory")
        raw = {k: v for k, v in preset.config.items() if k not in ("speech_tokenizer", "generation_config")}
        config, talker, codec = _random_parts(raw, preset.config["speech_tokenizer"], seed, device, dtype,
                                              preset.init_std or 0.02)
        tokenizer = byte_tokenizer()
        gc = dict(preset.config.get("generation_config") or {})
    # at most 64 rows: the per-row K/V reservation (4096 positions) of more would be tens of GiB at 1.7B
    synthesis = Qwen3TTSSynthesis(config, talker, codec, tokenizer, generation_config=gc,
                                  max_batch=max(1, min(int(max_batch), 64)))
    return synthesis.pipeline


def _from_dir(path: str, raw: dict) -> Qwen3TTSConfig:
    return Qwen3TTSConfig.from_dict(raw)


def _make_config(preset: Preset) -> Qwen3TTSConfig:
    return Qwen3TTSConfig.from_dict({k: v for k, v in preset.config.items()
                                     if k not in ("speech_tokenizer", "generation_config")})


FAMILY = register(Family(
    name="qwen3_tts", model_types=(MODEL_TYPE,), capabilities=frozenset({I.SYNTHESIZES_SPEECH}),
    presets=PRESETS, config_from_dir=_from_dir, make_config=_make_config, pipeline=qwen3_tts_pipeline))
