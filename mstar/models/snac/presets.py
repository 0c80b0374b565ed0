"""Published SNAC configurations (the checkpoints' config.json, as plain dicts)."""

from __future__ import annotations

# hubertsiuzdak/snac_24khz: 0.98 kbps speech codec, hop 512, codebooks at 12 / 23 / 47 Hz;
# the codec of Orpheus TTS. ~19.8M parameters with the encoder, which the decoder does not build.
SNAC_24KHZ = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}

PRESETS = {"snac-24khz": SNAC_24KHZ}

# The 24 kHz model's layout (hop 512, three codebooks of 4096 at strides 4, 2, 1) at a fraction of
# its width: the codec of the tiny embedded speech presets (tests).
SNAC_TINY = {**SNAC_24KHZ, "encoder_dim": 4, "decoder_dim": 32}

PRESETS["snac-tiny"] = SNAC_TINY
