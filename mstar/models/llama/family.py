"""The Llama family: Llama 3.x text models (and LMs of that shape, such as Orpheus TTS)."""

from __future__ import annotations

from mstar.models import interfaces as I
from mstar.models.llama.presets import PRESETS
from mstar.models.presets import Preset
from mstar.models.registry import Family, register
from mstar.models.text_family import text_config_from_dir, text_preset_tokenizer


def _config_class():
    from transformers import LlamaConfig
    return LlamaConfig


def _from_dir(path: str, raw: dict):
    return text_config_from_dir(path, raw, _config_class())


def _make_config(preset: Preset):
    return _config_class()(**preset.config)


def _model_class(config):
    from mstar.models.llama.model import LlamaForCausalLM
    return LlamaForCausalLM


FAMILY = register(Family(
    name="llama", model_types=("llama",),
    capabilities=frozenset({I.GENERATES_TOKENS, I.DEVICE_LOOPBACK}),
    presets=PRESETS, config_from_dir=_from_dir, make_config=_make_config, model_class=_model_class,
    preset_tokenizer=text_preset_tokenizer))
