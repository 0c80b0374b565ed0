"""Whisper presets: the published OpenAI Whisper shapes (random weights unless a
checkpoint directory is given).

    name                      d_model  enc/dec layers  heads  ffn   mels  vocab
    whisper-tiny                384       4 / 4          6    1536   80   51865
    whisper-base                512       6 / 6          8    2048   80   51865
    whisper-small               768      12 / 12        12    3072   80   51865
    whisper-medium             1024      24 / 24        16    4096   80   51865
    whisper-large-v2           1280      32 / 32        20    5120   80   51865
    whisper-large-v3           1280      32 / 32        20    5120  128   51866
    whisper-large-v3-turbo     1280      32 / 4         20    5120  128   51866

All: 1500 encoder positions (30 s), 448 decoder positions, exact GELU, tied output
projection. Special tokens (multilingual layout, tokens.py): <|endoftext|> 50257
(eos and bos), pad 50256, <|startoftranscript|> 50258 (decoder start), then 99 (v1/v2)
or 100 (v3: + <|yue|>) language tokens, translate, transcribe, startoflm, startofprev,
nospeech, notimestamps, 1501 timestamps.

The Whisper family (family.py) registers these presets.
"""

from __future__ import annotations

from typing import Any

from mstar.models.presets import Preset

WHISPER_EOS = 50257
WHISPER_PAD = 50256
WHISPER_SOT = 50258


def _whisper(d: int, enc: int, dec: int, heads: int, ffn: int, mels: int, vocab: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab, num_mel_bins=mels, d_model=d, encoder_layers=enc, decoder_layers=dec,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        max_source_positions=1500, max_target_positions=448, max_position_embeddings=448,  # runtime's context cap
        activation_function="gelu",
        scale_embedding=False, tie_word_embeddings=True, bos_token_id=WHISPER_EOS, eos_token_id=WHISPER_EOS,
        pad_token_id=WHISPER_PAD, decoder_start_token_id=WHISPER_SOT, begin_suppress_tokens=[220, WHISPER_EOS],
        init_std=0.02,
    )


WHISPER_PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("whisper-tiny", "whisper", _whisper(384, 4, 4, 6, 1536, 80, 51865), note="Whisper tiny (39 M)"),
    Preset("whisper-base", "whisper", _whisper(512, 6, 6, 8, 2048, 80, 51865), note="Whisper base (74 M)"),
    Preset("whisper-small", "whisper", _whisper(768, 12, 12, 12, 3072, 80, 51865), note="Whisper small (244 M)"),
    Preset("whisper-medium", "whisper", _whisper(1024, 24, 24, 16, 4096, 80, 51865),
           note="Whisper medium (769 M)"),
    Preset("whisper-large-v2", "whisper", _whisper(1280, 32, 32, 20, 5120, 80, 51865),
           note="Whisper large-v2 (1.55 B)"),
    Preset("whisper-large-v3", "whisper", _whisper(1280, 32, 32, 20, 5120, 128, 51866),
           note="Whisper large-v3 (1.55 B, 128 mel bins)"),
    Preset("whisper-large-v3-turbo", "whisper", _whisper(1280, 32, 4, 20, 5120, 128, 51866),
           note="Whisper large-v3-turbo (809 M, 4 decoder layers)"),
]}


def get(name: str) -> Preset | None:
    return WHISPER_PRESETS.get(name.lower())


def names() -> list[str]:
    return list(WHISPER_PRESETS)


def make_config(preset: Preset):
    """The transformers WhisperConfig of a preset."""
    from transformers import WhisperConfig
    if preset.model_type != "whisper":
        raise ValueError(f"preset {preset.name!r} is not a Whisper preset")
    return WhisperConfig(**preset.config)


__all__ = ["WHISPER_PRESETS", "get", "names", "make_config"]
