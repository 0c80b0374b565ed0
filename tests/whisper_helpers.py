"""Test-only helpers for the Whisper runtime tests: a tiny random Whisper written by
transformers (save_pretrained) with a Whisper-layout byte tokenizer, once per process,
and synthetic clips (tones + noise) as samples or WAV bytes."""

from __future__ import annotations

import functools
import io
import os
import tempfile

import numpy as np


@functools.lru_cache(maxsize=None)
def hf_whisper():
    from test_whisper_model import make_hf_whisper
    return make_hf_whisper(seed=5)


@functools.lru_cache(maxsize=None)
def whisper_dir() -> str:
    """config.json + generation_config.json + safetensors + tokenizer of the tiny Whisper."""
    from mstar.models.whisper.tokenizer import whisper_byte_tokenizer
    path = os.path.join(tempfile.mkdtemp(prefix="mstar-whisper-tests-"), "tiny-whisper")
    hf = hf_whisper()
    hf.save_pretrained(path)
    whisper_byte_tokenizer(hf.config.vocab_size).save_pretrained(path)
    return path


def clip(seconds: float, f0: float = 220.0, seed: int = 0, sr: int = 16000) -> np.ndarray:
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sin(2 * np.pi * f0 * t) * (1 + np.sin(2 * np.pi * 0.7 * t)) + 0.05 * g.standard_normal(t.size)
    return x.astype(np.float32)


def wav_bytes(x: np.ndarray, sr: int = 16000, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    import soundfile as sf
    buf = io.BytesIO()
    sf.write(buf, x, sr, subtype=subtype, format=fmt)
    return buf.getvalue()
