"""Orpheus TTS (canopyai): a Llama 3 LM that samples SNAC 24 kHz codes as tokens, decoded to
speech by the SNAC decoder (mstar/models/snac). tokens.py: its prompt format and token -> code
mapping."""
