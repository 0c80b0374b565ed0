"""The Kokoro family: text-to-speech (hexgrad/Kokoro-82M) as one one-shot stage of the stage
engine (pipeline.py). Presets kokoro-82m (the published shape, random weights and voices) and the
embedded tiny-kokoro; a checkpoint directory is the release's layout (weights.py). The release's
config.json has no `model_type`: the family claims a config with its `istftnet` and `plbert`
sections (or "model_type": "kokoro")."""

from __future__ import annotations

import os

from mstar.models import interfaces as I
from mstar.models.kokoro.config import MODEL_TYPE, KokoroConfig
from mstar.models.kokoro.presets import PRESET_VOICES, PRESETS
from mstar.models.presets import Preset, random_weights_preset
from mstar.models.registry import Family, register

MAX_INPUT_CHARS = 4096


def kokoro_pipeline(name_or_dir: str, dtype=None, device="cpu", random_weights: bool = False, seed: int = 0,
                    max_batch: int = 8) -> I.Pipeline:
    """A KokoroPipeline of a checkpoint directory or a preset (random weights: the preset's, or
    the directory's config with random weights and, where it has none, random voices)."""
    import torch

    from mstar.models.kokoro.pipeline import KokoroPipeline
    from mstar.models.kokoro.voices import load_voices, random_voices
    from mstar.models.kokoro.weights import load_model, random_model, read_config

    dtype = dtype or torch.float32
    if os.path.isdir(name_or_dir):
        config = read_config(name_or_dir)
        if random_weights:
            model = random_model(config, seed, device, dtype)
        else:
            model = load_model(name_or_dir, device, dtype)
        voices = load_voices(name_or_dir, config.style_dim)
        if random_weights and not voices.names:
            voices = random_voices(PRESET_VOICES, config.style_dim, seed)
    else:
        from mstar.models.kokoro.presets import get
        preset = random_weights_preset(get(name_or_dir), name_or_dir, random_weights, "Kokoro",
                                       "checkpoint directory")
        config = KokoroConfig.from_dict(preset.config)
        model = random_model(config, seed, device, dtype)
        voices = random_voices(PRESET_VOICES, config.style_dim, seed)
    return KokoroPipeline(model, voices, max_batch=max_batch, max_input_chars=MAX_INPUT_CHARS)


def _from_dir(path: str, raw: dict) -> KokoroConfig:
    return KokoroConfig.from_dict(raw)


def _detect(raw: dict) -> bool:
    return isinstance(raw.get("istftnet"), dict) and isinstance(raw.get("plbert"), dict)


def _make_config(preset: Preset) -> KokoroConfig:
    return KokoroConfig.from_dict(preset.config)


FAMILY = register(Family(
    name="kokoro", model_types=(MODEL_TYPE,), capabilities=frozenset({I.SYNTHESIZES_SPEECH}),
    presets=PRESETS, config_from_dir=_from_dir, make_config=_make_config, pipeline=kokoro_pipeline,
    detect=_detect))
