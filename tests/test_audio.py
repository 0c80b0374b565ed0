"""Whisper's audio front end (mstar/models/whisper/audio.py): log-mel features against transformers'
WhisperFeatureExtractor, resampling against a float64 reference and against exact
sinusoids, decoding round trips through soundfile (WAV / FLAC / OGG / MP3), windows, and
the errors the server maps to HTTP 400."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from mstar.models.whisper import audio
from mstar.models.whisper.audio import (AudioError, AudioTooLongError, CorruptAudioError, EmptyAudioError,
                                UnsupportedAudioError, audio_features, decode_audio, load_audio, log_mel_spectrogram,
                                resample, windows)

sf = pytest.importorskip("soundfile")


def _fe(n_mels: int):
    from transformers import WhisperFeatureExtractor
    return WhisperFeatureExtractor(feature_size=n_mels)


def _hf_features(clips: list[np.ndarray], n_mels: int) -> torch.Tensor:
    return _fe(n_mels)([c.astype(np.float32) for c in clips], sampling_rate=16000, return_tensors="pt").input_features


def _noise(n: int, seed: int, scale: float = 0.1) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def _encode(x: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    b = io.BytesIO()
    sf.write(b, x, sr, format=fmt, subtype=subtype)
    return b.getvalue()


# --- float64 reference resampler ----------------------------------------------------------------
def reference_resample(x: np.ndarray, orig: int, new: int, p: audio.ResampleParams = audio.DEFAULT_RESAMPLE) -> np.ndarray:
    """Direct float64 evaluation of y[j] = sum_n x[n] h(j * orig / new - n) with the same
    Kaiser-windowed sinc (numpy, no polyphase decomposition, no conv)."""
    g = math.gcd(orig, new)
    up, down = new // g, orig // g
    fc = p.rolloff * min(1.0, up / down)
    half = p.zero_crossings / fc
    x = np.asarray(x, dtype=np.float64)
    n_out = -(-len(x) * up // down)
    t = np.arange(n_out) * down / up  # output positions in input samples
    taps = np.arange(-math.ceil(half) - 1, math.ceil(half) + 2)
    n = np.floor(t)[:, None].astype(np.int64) + taps[None, :]  # [n_out, taps]
    d = t[:, None] - n
    w_arg = d * fc / p.zero_crossings
    win = np.where(np.abs(w_arg) <= 1, np.i0(p.beta * np.sqrt(np.clip(1 - w_arg ** 2, 0, None))) / np.i0(p.beta), 0.0)
    h = fc * np.sinc(fc * d) * win
    xs = np.where((n >= 0) & (n < len(x)), x[np.clip(n, 0, len(x) - 1)], 0.0)
    return (xs * h).sum(1)


# --- features ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n_mels", [128, 80])
def test_log_mel_matches_feature_extractor(n_mels):
    clips = [_noise(16000 * 3, 1), _noise(16000 * 30, 2, 0.5), _noise(12345, 3, 0.01), _noise(400, 4)]
    ref = _hf_features(clips, n_mels)
    ours = log_mel_spectrogram([torch.from_numpy(c) for c in clips], n_mels=n_mels)
    assert ours.shape == ref.shape == (4, n_mels, 3000)
    assert (ours - ref).abs().max() < 1e-4
    # a [B, N] tensor (padded by us) gives the same as the list form
    stacked = torch.stack([torch.nn.functional.pad(torch.from_numpy(c), (0, 16000 * 3 - len(c)))
                           for c in clips if len(c) <= 16000 * 3])
    assert torch.allclose(log_mel_spectrogram(stacked, n_mels=n_mels), ours[[0, 2, 3]], atol=1e-5)


def test_mel_filters_match_transformers():
    for n_mels in (80, 128):
        assert np.abs(audio.mel_filters(n_mels) - _fe(n_mels).mel_filters).max() < 1e-9


@pytest.mark.parametrize("orig", [44100, 48000, 8000, 22050])
def test_resample_matches_float64_reference(orig):
    x = _noise(orig * 2, orig, 0.3)
    ours = resample(torch.from_numpy(x), orig, 16000).double().numpy()
    ref = reference_resample(x, orig, 16000)
    assert ours.shape == ref.shape == (-(-len(x) * 16000 // orig),)
    assert np.abs(ours - ref).max() < 2e-5 * np.abs(ref).max()
    # float64 in: float64 all the way
    ours64 = resample(torch.from_numpy(x.astype(np.float64)), orig, 16000).numpy()
    assert np.abs(ours64 - ref).max() < 1e-10


@pytest.mark.parametrize("orig", [44100, 48000, 8000, 44101, 7999, 3001])
def test_resample_reproduces_band_limited_signals(orig):
    """Tones below both Nyquist rates come out as the same tones sampled at 16 kHz (odd
    rates: at the rational rate actually used, within 1.3e-4 of the requested one)."""
    tones = [(440.0, 0.5), (0.37 * min(orig, 16000), 0.3), (min(3000.0, 0.4 * orig), 0.2)]

    def sig(sr, n):
        t = np.arange(n) / sr
        return sum(a * np.sin(2 * np.pi * f * t + f) for f, a in tones)

    up, down = audio.resample_ratio(orig, 16000)
    assert abs(up / down * orig / 16000 - 1) < 1.3e-4 and max(up, down) <= audio.MAX_PHASES
    x = sig(orig, orig * 2).astype(np.float32)
    y = resample(torch.from_numpy(x), orig, 16000).numpy()
    want = sig(orig * up / down, len(y))
    inner = slice(400, len(y) - 400)  # away from the zero-padded edges
    assert np.abs(y[inner] - want[inner]).max() < 1e-3


@pytest.mark.parametrize("orig", [44100, 48000, 8000])
def test_log_mel_after_resampling(orig):
    clips = [_noise(int(orig * 2.5), 10 + orig, 0.2), _noise(orig * 4, 20 + orig, 0.05)]
    ours = log_mel_spectrogram([resample(torch.from_numpy(c), orig, 16000) for c in clips], n_mels=128)
    ref = _hf_features([reference_resample(c, orig, 16000) for c in clips], 128)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max() < 2e-3 and (ours - ref).abs().mean() < 1e-5


# --- decoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,subtype,exact", [("WAV", "FLOAT", 0.0), ("WAV", "PCM_16", 1 / 32768), ("FLAC", None, 1 / 32768),
                                                ("OGG", None, None), ("MP3", None, None)])
def test_decode_round_trip(fmt, subtype, exact):
    t = np.arange(16000 * 2) / 16000
    x = (0.4 * np.sin(2 * np.pi * 330 * t) + 0.1 * np.sin(2 * np.pi * 1200 * t)).astype(np.float32)
    data = _encode(x, 16000, fmt, subtype)
    y, sr = decode_audio(data)
    assert sr == 16000 and y.dtype == np.float32
    if exact is not None:
        assert y.shape == x.shape and np.abs(y - x).max() <= exact
    else:  # lossy: same length within codec padding, same signal up to codec error
        if fmt == "MP3":  # encoder delay: align by cross-correlation
            lag = int(np.argmax(np.correlate(y[:4000], x[:2000], "valid")))
            y = y[lag:]
        assert abs(len(y) - len(x)) < 0.1 * len(x)
        n = min(len(x), len(y))
        inner = slice(2000, n - 2000)
        err = np.sqrt(np.mean((y[inner] - x[inner]) ** 2)) / np.sqrt(np.mean(x[inner] ** 2))
        assert err < 0.2, f"{fmt}: relative rms error {err:.3f}"
    # file objects work too
    y2, _ = decode_audio(io.BytesIO(data))
    assert np.array_equal(y, y2) or fmt == "MP3"


def test_stereo_and_resampled_files():
    x = _noise(44100 * 3, 7, 0.2)
    stereo = np.stack([x, 0.5 * x], axis=1)
    data = _encode(stereo, 44100, "FLAC", "PCM_24")
    y, sr = decode_audio(data)
    assert sr == 44100 and np.abs(y - 0.75 * x).max() < 1e-5
    wav16 = load_audio(data)
    assert wav16.shape == (16000 * 3,) and wav16.dtype == torch.float32
    ref = reference_resample(y, 44100, 16000)
    assert np.abs(wav16.double().numpy() - ref).max() < 1e-5


def test_windows_and_audio_features():
    x = _noise(16000 * 65, 9, 0.2)
    data = _encode(x, 16000, "WAV", "FLOAT")
    feats, info = audio_features(data, n_mels=80)
    assert feats.shape == (3, 80, 3000) and info.num_windows == 3
    assert info.window_seconds == [30.0, 30.0, 5.0] and info.duration == 65.0
    ref = _hf_features([x[:480000], x[480000:960000], x[960000:]], 80)
    assert (feats - ref).abs().max() < 1e-4
    assert [w.shape[0] for w in windows(torch.from_numpy(x))] == [480000, 480000, 80000]
    with pytest.raises(AudioTooLongError):
        log_mel_spectrogram(torch.from_numpy(x))  # one clip > 30 s: must be windowed first


# --- errors -----------------------------------------------------------------------------------
def _raises(cls, data, **kw):
    with pytest.raises(cls) as ei:
        decode_audio(data, **kw)
    e = ei.value
    assert isinstance(e, AudioError) and isinstance(e, ValueError) and e.status_code == 400
    assert str(e) and "0x" not in str(e)  # a message for the client, no object reprs
    return e


def test_errors_map_to_400():
    good = _encode(_noise(16000, 1), 16000, "WAV", "PCM_16")
    flac = _encode(_noise(16000, 2), 16000, "FLAC")
    _raises(EmptyAudioError, b"")
    _raises(EmptyAudioError, _encode(np.zeros(0, np.float32), 16000, "WAV"))
    _raises(UnsupportedAudioError, b"this is not audio at all, just some text")
    _raises(UnsupportedAudioError, b"\x89PNG\r\n\x1a\n" + bytes(200))
    _raises(UnsupportedAudioError, 12345)
    _raises(UnsupportedAudioError, "/etc/passwd")  # paths are not read
    _raises(CorruptAudioError, good[:20])  # a WAV header cut short
    _raises(CorruptAudioError, flac[:len(flac) // 2])
    _raises(CorruptAudioError, flac[:8] + bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8)))
    nan = _noise(1600, 3)
    nan[100] = np.nan
    _raises(CorruptAudioError, _encode(nan, 16000, "WAV", "FLOAT"))
    e = _raises(AudioTooLongError, _encode(_noise(16000 * 3, 4), 16000, "WAV"), max_seconds=2.0)
    assert "3.0 s" in str(e) and "2 s" in str(e)
    decode_audio(good, max_seconds=None)  # no limit
    _raises(UnsupportedAudioError, _encode(_noise(1000, 5), 1000, "WAV"))  # 1 kHz: below the accepted rates
    with pytest.raises(AudioError):
        audio_features(b"", n_mels=80)
    with pytest.raises(AudioError):
        audio.as_waveform(np.zeros((2, 100), np.float32))
    with pytest.raises(EmptyAudioError):
        audio.as_waveform([])
