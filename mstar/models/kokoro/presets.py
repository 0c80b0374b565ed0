"""Kokoro presets: the published Kokoro-82M shape (hexgrad/Kokoro-82M, v1.0) with random weights
and random voice tables, and a tiny embedded model for tests.

    name          plbert (hidden/layers/heads/ffn)  hidden  style  decoder  istft (rates, n_fft/hop)   params
    kokoro-82m      768 / 12 / 12 / 2048             512     128    1024     [10, 6], 20 / 5             82 M
    tiny-kokoro      32 /  2 /  2 /   64              32      16      64     [2, 2], 8 / 2             ~0.3 M

PHONEME_VOCAB is the release's config.json vocab (phoneme -> id; the kokoro package downloads
config.json and ships no copy): 114 symbols with ids in [1, 178), id 0 pads and bounds a sequence.
"""

from __future__ import annotations

from mstar.models.kokoro.config import MODEL_TYPE
from mstar.models.presets import Preset

# runs of consecutive ids: (first id, the symbols taking it and the ids after it)
_VOCAB_RUNS = (
    (1, ";:,.!?"), (9, "\u2014\u2026\"()\u201c\u201d \u0303\u02a3\u02a5\u02a6\u02a8\u1d5d\uab67AI"),
    (31, "O"), (33, "Q"), (35, "ST"), (39, "W"), (41, "Y\u1d4a"), (43, "abcdef"), (50, "hijklmnopqrstuvwxyz"),
    (69, "\u0251\u0250\u0252\u00e6"), (75, "\u03b2\u0254\u0255\u00e7"), (80, "\u0256\u00f0\u02a4\u0259"),
    (85, "\u025a\u025b\u025c"), (90, "\u025f"), (92, "\u0261"), (99, "\u0265"), (101, "\u0268\u026a\u029d"),
    (110, "\u026f\u0270\u014b\u0273\u0272\u0274\u00f8"), (118, "\u0278\u03b8\u0153"), (123, "\u0279"),
    (125, "\u027e\u027b"), (128, "\u0281\u027d\u0282\u0283\u0288\u02a7"), (135, "\u028a\u028b"),
    (138, "\u028c\u0263\u0264"), (142, "\u03c7\u028e"), (147, "\u0292\u0294"), (156, "\u02c8\u02cc\u02d0"),
    (162, "\u02b0"), (164, "\u02b2"), (169, "\u2193"), (171, "\u2192\u2197\u2198"), (177, "\u1d7b"),
)
PHONEME_VOCAB: dict[str, int] = {ch: start + k for start, run in _VOCAB_RUNS for k, ch in enumerate(run)}

# voice names of the release (the first letter is the language: a American, b British English;
# the second the speaker's gender); presets give each a random table
PRESET_VOICES = ("af_heart", "af_bella", "am_adam", "bf_emma", "bm_george")

KOKORO_82M = {
    "vocab": PHONEME_VOCAB, "n_token": 178, "hidden_dim": 512, "style_dim": 128, "n_layer": 3, "max_dur": 50,
    "text_encoder_kernel_size": 5, "dim_in": 64, "dropout": 0.2, "max_conv_dim": 512, "multispeaker": True,
    "n_mels": 80,
    "plbert": {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 2048,
               "max_position_embeddings": 512, "num_hidden_layers": 12, "dropout": 0.1},
    "istftnet": {"upsample_rates": [10, 6], "upsample_kernel_sizes": [20, 12], "upsample_initial_channel": 512,
                 "resblock_kernel_sizes": [3, 7, 11], "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                 "gen_istft_n_fft": 20, "gen_istft_hop_size": 5},
}

TINY_KOKORO = {
    "vocab": PHONEME_VOCAB, "n_token": 178, "hidden_dim": 32, "style_dim": 16, "n_layer": 1, "max_dur": 4,
    "text_encoder_kernel_size": 5, "decoder_dim": 64, "decoder_res_dim": 8,
    "plbert": {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128,
               "num_hidden_layers": 2, "embedding_size": 16},
    "istftnet": {"upsample_rates": [2, 2], "upsample_kernel_sizes": [4, 4], "upsample_initial_channel": 32,
                 "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]],
                 "gen_istft_n_fft": 8, "gen_istft_hop_size": 2},
}

PRESETS: tuple[Preset, ...] = (
    Preset("kokoro-82m", MODEL_TYPE, KOKORO_82M, note="Kokoro-82M v1.0 (StyleTTS2 + iSTFTNet, 24 kHz), random weights"),
    Preset("tiny-kokoro", MODEL_TYPE, TINY_KOKORO, embedded=True,
           note="tiny random Kokoro (test model: phonemes -> 24 kHz PCM)"),
)


def get(name: str) -> Preset | None:
    return {p.name: p for p in PRESETS}.get(name.lower())


__all__ = ["PHONEME_VOCAB", "PRESET_VOICES", "KOKORO_82M", "TINY_KOKORO", "PRESETS", "get"]
