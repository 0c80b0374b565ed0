"""Qwen3-TTS presets: the published 12 Hz shapes (Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice and
-0.6B-CustomVoice) with random weights, and a tiny embedded model for tests. A preset's config is
the model directory's config.json plus its codec, `speech_tokenizer` (speech_tokenizer/config.json).

    name                talker (hidden / layers / ffn, heads q / kv)   predictor        codec decoder
    qwen3-tts-1.7b      2048 / 28 / 6144, 16 / 8, head_dim 128         1024 / 5, 2048   512 / 8, 105.6 M
    qwen3-tts-0.6b      1024 / 28 / 3072, 16 / 8, head_dim 128         1024 / 5, 2048   the same
    tiny-qwen3-tts      64 / 2 / 128, 4 / 2, head_dim 16               32 / 2, 48       32 / 2

The presets are CustomVoice models: the release's nine speakers and its language table (codec ids
as the release's config.json lists them). Their text tokenizer is an offline byte-level one with
the ChatML specials and "assistant" / "user" as single tokens (the prompt's role tokens), so the
prompt has the release's structure; its ids are not the release's vocabulary (random weights).
"""

from __future__ import annotations

import copy

from mstar.models.presets import Preset
from mstar.models.qwen3_tts.config import MODEL_TYPE, PUBLISHED_SHAPES

# the CustomVoice releases' tables (talker_config.spk_id / spk_is_dialect / codec_language_id)
SPEAKERS = {"vivian": 3065, "serena": 3066, "uncle_fu": 3010, "dylan": 2878, "eric": 2875, "ryan": 3061,
            "aiden": 2861, "ono_anna": 2873, "sohee": 2864}
SPEAKER_DIALECTS = {**{s: False for s in SPEAKERS}, "dylan": "beijing_dialect", "eric": "sichuan_dialect"}
LANGUAGES = {"chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071, "spanish": 2054,
             "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069, "beijing_dialect": 2074,
             "sichuan_dialect": 2062}

# speech_tokenizer/config.json of the 12 Hz tokenizer: the decoder block (codec_config.py's defaults
# are the release's) and the rates
SPEECH_TOKENIZER_12HZ = {"decoder_config": {}, "output_sample_rate": 24000, "decode_upsample_rate": 1920}

GENERATION_CONFIG = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
                     "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_k": 50,
                     "subtalker_top_p": 1.0, "max_new_tokens": 8192}


def _custom_voice(size: str) -> dict:
    cfg = copy.deepcopy(PUBLISHED_SHAPES[size])
    cfg.update(tts_model_type="custom_voice", tokenizer_type="qwen3_tts_tokenizer_12hz", model_type=MODEL_TYPE)
    cfg["talker_config"].update(spk_id=dict(SPEAKERS), spk_is_dialect=dict(SPEAKER_DIALECTS),
                                codec_language_id=dict(LANGUAGES))
    return {**cfg, "speech_tokenizer": copy.deepcopy(SPEECH_TOKENIZER_12HZ), "generation_config": GENERATION_CONFIG}


# the byte tokenizer's ids: 256 bytes, <|endoftext|> <|im_start|> <|im_end|>, "assistant", "user"
TINY_TEXT_VOCAB = 300
TINY = {
    "model_type": MODEL_TYPE, "tts_model_type": "custom_voice", "tts_model_size": "1b7",
    "tokenizer_type": "qwen3_tts_tokenizer_12hz", "im_start_token_id": 257, "im_end_token_id": 258,
    "tts_pad_token_id": 283, "tts_bos_token_id": 284, "tts_eos_token_id": 285,
    "talker_config": {
        "vocab_size": 1072, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
        "rope_theta": 1000000, "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True},
        "num_code_groups": 16, "text_hidden_size": 32, "text_vocab_size": TINY_TEXT_VOCAB, "codec_eos_token_id": 1050,
        "codec_think_id": 1054, "codec_nothink_id": 1055, "codec_think_bos_id": 1056, "codec_think_eos_id": 1057,
        "codec_pad_id": 1048, "codec_bos_id": 1049, "spk_id": {"aiden": 1060, "eric": 1061, "vivian": 1062},
        "spk_is_dialect": {"aiden": False, "eric": "sichuan_dialect", "vivian": False},
        "codec_language_id": {"english": 1000, "chinese": 1001, "sichuan_dialect": 1002},
        "code_predictor_config": {"vocab_size": 48, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                                  "max_position_embeddings": 64, "rope_theta": 1000000, "num_code_groups": 16}},
    "speech_tokenizer": {"decoder_config": {
        "codebook_size": 48, "codebook_dim": 20, "latent_dim": 24, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": 5, "num_quantizers": 16, "decoder_dim": 32, "upsampling_ratios": [2, 2],
        "upsample_rates": [8, 5, 4, 3]}, "output_sample_rate": 24000, "decode_upsample_rate": 1920},
    "generation_config": GENERATION_CONFIG,
}

PRESETS: tuple[Preset, ...] = (
    Preset("qwen3-tts-1.7b", MODEL_TYPE, _custom_voice("1b7"), init_std=0.02,
           note="Qwen3-TTS-12Hz-1.7B-CustomVoice shape (talker + code predictor + 12 Hz codec), random weights"),
    Preset("qwen3-tts-0.6b", MODEL_TYPE, _custom_voice("0b6"), init_std=0.02,
           note="Qwen3-TTS-12Hz-0.6B-CustomVoice shape, random weights"),
    Preset("tiny-qwen3-tts", MODEL_TYPE, TINY, embedded=True, init_std=0.02,
           note="tiny random Qwen3-TTS (test model: text -> 24 kHz PCM, streamed)"),
)


def get(name: str) -> Preset | None:
    return {p.name: p for p in PRESETS}.get(name.lower())


def byte_tokenizer():
    """The presets' text tokenizer (a fresh one per call): mstar's offline byte-level ChatML
    tokenizer with "assistant" and "user" added as single tokens."""
    from mstar.models.tokenizer import byte_tokenizer as chatml_bytes
    tok = chatml_bytes()
    tok.add_tokens(["assistant", "user"])
    return tok


__all__ = ["SPEAKERS", "SPEAKER_DIALECTS", "LANGUAGES", "PRESETS", "TINY", "get", "byte_tokenizer"]
