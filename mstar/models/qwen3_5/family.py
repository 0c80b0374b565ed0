"""The Qwen3.5 family: hybrid Gated DeltaNet / attention text models (the text model of the
Qwen3.5 VL checkpoints too: their vision tensors are skipped)."""

from __future__ import annotations

from mstar.models import interfaces as I
from mstar.models.presets import Preset
from mstar.models.qwen3_5.presets import PRESETS
from mstar.models.registry import Family, register
from mstar.models.text_family import text_config_from_dir, text_preset_tokenizer

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


def _config_class():
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig


def _from_dir(path: str, raw: dict):
    return text_config_from_dir(path, raw, _config_class(), model_type="qwen3_5_text")


def _make_config(preset: Preset):
    return _config_class()(**preset.config)


def _model_class(config):
    from mstar.models.qwen3_5.model import Qwen3_5ForCausalLM
    return Qwen3_5ForCausalLM


FAMILY = register(Family(
    name="qwen3_5", model_types=MODEL_TYPES,
    capabilities=frozenset({I.GENERATES_TOKENS, I.RECURRENT_STATE, I.DEVICE_LOOPBACK}),
    presets=PRESETS, config_from_dir=_from_dir, make_config=_make_config, model_class=_model_class,
    preset_tokenizer=text_preset_tokenizer))
