"""Orpheus TTS presets: canopylabs/orpheus-3b-0.1-ft's config.json (Llama 3.2 3B with the
vocabulary extended to 156940 by Orpheus's custom tokens, tied embeddings) with the SNAC 24 kHz
codec, and a tiny embedded model of the same vocabulary with a tiny codec (tests).
"""

from __future__ import annotations

from mstar.models.llama.presets import llama3_config
from mstar.models.orpheus.tokens import END_OF_SPEECH, END_OF_TEXT
from mstar.models.presets import Preset

ORPHEUS_VOCAB = 156940
ORPHEUS_EOS = [END_OF_SPEECH, END_OF_TEXT]

PRESETS: tuple[Preset, ...] = (
    Preset("orpheus-3b", "llama", llama3_config(3072, 28, 8192, 24, 8, 128, True, 32.0, vocab=ORPHEUS_VOCAB,
                                                eos=ORPHEUS_EOS),
           note="Orpheus TTS: Llama 3.2 3B LM of audio tokens + SNAC 24 kHz codec"),
    Preset("tiny-orpheus", "llama", {
        **llama3_config(32, 2, 64, 2, 1, 16, True, 8.0, vocab=ORPHEUS_VOCAB, eos=ORPHEUS_EOS),
        "max_position_embeddings": 16384},
        embedded=True, init_std=0.25, note="tiny random Orpheus (byte tokenizer, tiny SNAC codec; tests)"),
)

# each preset's codec (a mstar/models/snac preset, random weights like the LM's)
CODEC_PRESETS = {"orpheus-3b": "snac-24khz", "tiny-orpheus": "snac-tiny"}
