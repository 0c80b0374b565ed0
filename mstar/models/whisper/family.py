"""The Whisper family: speech recognition (an audio encoder on admission, then the decoder on
the autoregressive stage with per-request cross-attention slots)."""

from __future__ import annotations

import json
import os

import numpy as np

from mstar.models import interfaces as I
from mstar.models.presets import Preset
from mstar.models.registry import Family, register
from mstar.models.whisper.presets import WHISPER_PRESETS


def suppress_defaults(model, name_or_dir: str | None) -> tuple[list[int], list[int]]:
    """(suppress at every step, suppress at the first generated token) for a Whisper model:
    the checkpoint's generation_config.json lists (else the config's), plus every
    timestamp token (no timestamps mode)."""
    from mstar.models.whisper.tokens import WhisperTokens, suppress_lists
    cfg = model.config
    sup = list(getattr(cfg, "suppress_tokens", None) or [])
    begin = list(getattr(cfg, "begin_suppress_tokens", None) or [])
    if name_or_dir and os.path.isdir(name_or_dir):
        gp = os.path.join(name_or_dir, "generation_config.json")
        if os.path.isfile(gp):
            with open(gp) as f:
                s2, b2 = suppress_lists(json.load(f))
            sup = s2 or sup
            begin = b2 or begin
    try:
        tok = WhisperTokens.from_vocab_size(int(cfg.vocab_size))
        sup = sorted(set(sup) | set(tok.timestamp_ids()))
    except ValueError:  # not the Whisper token layout (a toy vocabulary): lists as given
        pass
    return sup, begin


class WhisperHooks(I.EngineHooks):
    def __init__(self, model, engine_config):
        from mstar.models.whisper.encoder_stage import CrossEncoder
        self.model, self.name_or_dir = model, str(engine_config.model)
        self.admission = CrossEncoder(model, model.device)
        self.vocab_size = int(model.config.vocab_size)

    def suppress_defaults(self):
        sup, begin = suppress_defaults(self.model, self.name_or_dir)
        return tuple(sup), tuple(begin)

    def warmup_rounds(self, vocab_size: int, max_len: int, page_size: int):
        """One second of silence, transcribed."""
        from mstar.models.whisper.tokens import WhisperTokens
        prompt = WhisperTokens.from_vocab_size(vocab_size).decoder_prompt("en", "transcribe")
        return [[I.WarmupRequest(prompt, np.zeros(16000, dtype=np.float32))]]


def make_transcriber(vocab_size: int, tokenizer):
    from mstar.models.whisper.transcription import WhisperTranscriber, whisper_tokens
    return WhisperTranscriber(whisper_tokens(vocab_size, tokenizer), tokenizer)


def _from_dir(path: str, raw: dict):
    from mstar.models.whisper.model import whisper_config_from_dir
    return whisper_config_from_dir(path)


def _make_config(preset: Preset):
    from mstar.models.whisper.presets import make_config
    return make_config(preset)


def _model_class(config):
    from mstar.models.whisper.model import WhisperForConditionalGeneration
    return WhisperForConditionalGeneration


def _preset_tokenizer(preset: Preset):
    """Random-weight presets: a byte-level tokenizer with Whisper's special-token layout."""
    from mstar.models.whisper.tokenizer import whisper_byte_tokenizer
    return whisper_byte_tokenizer(int(preset.config["vocab_size"]))


FAMILY = register(Family(
    name="whisper", model_types=("whisper",), capabilities=frozenset({I.TRANSCRIBES}),
    presets=tuple(WHISPER_PRESETS.values()), config_from_dir=_from_dir, make_config=_make_config,
    model_class=_model_class, preset_tokenizer=_preset_tokenizer, engine_hooks=WhisperHooks,
    transcriber=make_transcriber))
