"""Whisper's audio front end: decode an uploaded file, resample to 16 kHz mono, cut it
into 30-second windows and compute the log-mel features, on any torch device.

    wav = load_audio(data)                     # bytes of WAV / FLAC / OGG / MP3 ... -> [N] f32, 16 kHz
    feats = log_mel_spectrogram(windows(wav), n_mels=128, device="cuda")  # [W, 128, 3000]
    feats, info = audio_features(data, n_mels=128, device="cuda")        # both steps

Features match transformers' `WhisperFeatureExtractor` (feature_size = n_mels, 16 kHz,
n_fft 400, hop 160, 30 s): every clip is zero-padded to 480000 samples, STFT with a
periodic Hann window (centred, reflect padding), power spectrum without the last frame,
slaney-normalised slaney-scale mel filters over 0..8 kHz, log10 (floor 1e-10), floored
at the clip's maximum - 8, then (x + 4) / 4. Result [B, n_mels, 3000] float32.

Decoding uses soundfile (libsndfile >= 1.1, bundled in its wheels: WAV, FLAC, OGG/Vorbis,
OGG/Opus, MP3, AIFF, ...); no ffmpeg. Multi-channel audio is averaged to mono.
Resampling: band-limited (Kaiser-windowed sinc) polyphase filter in torch, float64 taps.

Errors: every problem with the input is an `AudioError` (a ValueError) with a message
meant for the client; the server maps it to HTTP 400 (`AudioError.status_code`):
    EmptyAudioError        no bytes, or no samples
    UnsupportedAudioError  not audio / a format we cannot decode / wrong Python type
    CorruptAudioError      a known format that fails to decode, or NaN / inf samples
    AudioTooLongError      longer than max_seconds
"""

from __future__ import annotations

import functools
import io
import math
import re
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples per window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames per window
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 2000, 768000  # files outside are refused
DEFAULT_MAX_SECONDS = 1800.0  # 30 minutes (60 windows); the server may pass its own limit


# --- errors ------------------------------------------------------------------------------------
class AudioError(ValueError):
    """Bad audio input: the client's fault (HTTP 400)."""

    status_code = 400


class EmptyAudioError(AudioError):
    pass


class UnsupportedAudioError(AudioError):
    pass


class CorruptAudioError(AudioError):
    pass


class AudioTooLongError(AudioError):
    pass


# --- decoding ----------------------------------------------------------------------------------
def _soundfile():
    try:
        import soundfile
    except ImportError as e:  # pragma: no cover - a packaging problem, not the client's
        raise RuntimeError("audio decoding needs the 'soundfile' package (pip install soundfile)") from e
    return soundfile


def _as_bytes(data) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    read = getattr(data, "read", None)
    if callable(read):
        b = read()
        if isinstance(b, (bytes, bytearray, memoryview)):
            return bytes(b)
    raise UnsupportedAudioError(f"expected the bytes of an audio file, got {type(data).__name__}")


def _sniff(b: bytes) -> str | None:
    """The container named by the first bytes, for error messages."""
    if b[:4] == b"RIFF" and b[8:12] == b"WAVE":
        return "WAV"
    if b[:4] == b"fLaC":
        return "FLAC"
    if b[:4] == b"OggS":
        return "OGG"
    if b[:3] == b"ID3" or (len(b) > 1 and b[0] == 0xFF and (b[1] & 0xE0) == 0xE0):
        return "MP3"
    if b[:4] == b"FORM":
        return "AIFF"
    return None


def decode_audio(data, *, max_seconds: float | None = DEFAULT_MAX_SECONDS) -> tuple[np.ndarray, int]:
    """Audio file bytes (or a binary file object) -> (mono float32 samples [N], sample rate)."""
    b = _as_bytes(data)
    if not b:
        raise EmptyAudioError("the audio file is empty (0 bytes)")
    sf = _soundfile()
    kind = _sniff(b)
    try:
        with sf.SoundFile(io.BytesIO(b)) as f:
            sr, frames, channels = int(f.samplerate), int(f.frames), int(f.channels)
            if not MIN_SAMPLE_RATE <= sr <= MAX_SAMPLE_RATE:
                raise UnsupportedAudioError(f"unsupported sample rate {sr} Hz (accepted: {MIN_SAMPLE_RATE} to "
                                            f"{MAX_SAMPLE_RATE} Hz)")
            if max_seconds is not None and frames > 0 and frames / sr > max_seconds:
                raise AudioTooLongError(f"audio is {frames / sr:.1f} s long; the limit is {max_seconds:g} s")
            x = f.read(dtype="float32", always_2d=True)
    except AudioError:
        raise
    except Exception as e:  # noqa: BLE001 -- libsndfile's errors: not audio, or broken
        msg = re.sub(r"Error opening <[^>]*>: ", "", str(e)).strip() or type(e).__name__
        if kind is None:
            raise UnsupportedAudioError(f"unsupported or unrecognised audio format ({msg}); send WAV, FLAC, "
                                        f"OGG or MP3") from None
        raise CorruptAudioError(f"could not decode the {kind} audio: {msg}") from None
    if x.shape[0] == 0:
        raise EmptyAudioError("the audio file contains no samples")
    if max_seconds is not None and x.shape[0] / sr > max_seconds:
        raise AudioTooLongError(f"audio is {x.shape[0] / sr:.1f} s long; the limit is {max_seconds:g} s")
    mono = x.mean(axis=1, dtype=np.float32) if channels > 1 else x[:, 0]
    if not np.isfinite(mono).all():
        raise CorruptAudioError("the audio contains NaN or infinite samples")
    return np.ascontiguousarray(mono, dtype=np.float32), sr


def load_audio(data, *, sample_rate: int = SAMPLE_RATE, max_seconds: float | None = DEFAULT_MAX_SECONDS,
               device: str | torch.device = "cpu") -> torch.Tensor:
    """Decode and resample: [N] float32 at `sample_rate` (16 kHz) on `device`."""
    x, sr = decode_audio(data, max_seconds=max_seconds)
    t = torch.from_numpy(x).to(device)
    return resample(t, sr, sample_rate)


def as_waveform(x, *, max_seconds: float | None = DEFAULT_MAX_SECONDS, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Raw samples (numpy / torch / list, [N] mono at `sample_rate`) -> checked float32 tensor."""
    if isinstance(x, np.ndarray):
        t = torch.from_numpy(np.asarray(x, dtype=np.float32))
    elif isinstance(x, torch.Tensor):
        t = x.float()
    elif isinstance(x, (list, tuple)):
        try:
            t = torch.tensor(x, dtype=torch.float32)
        except (TypeError, ValueError):
            raise UnsupportedAudioError("samples must be numbers") from None
    else:
        raise UnsupportedAudioError(f"expected audio samples, got {type(x).__name__}")
    if t.dim() != 1:
        raise UnsupportedAudioError(f"expected mono samples [N], got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise EmptyAudioError("the audio contains no samples")
    if max_seconds is not None and t.numel() / sample_rate > max_seconds:
        raise AudioTooLongError(f"audio is {t.numel() / sample_rate:.1f} s long; the limit is {max_seconds:g} s")
    if not bool(torch.isfinite(t).all()):
        raise CorruptAudioError("the audio contains NaN or infinite samples")
    return t


# --- resampling --------------------------------------------------------------------------------
def _kaiser(t: torch.Tensor, beta: float) -> torch.Tensor:
    """Kaiser window at t in [-1, 1] (0 outside)."""
    inside = t.abs() <= 1
    arg = torch.sqrt(torch.clamp(1 - t * t, min=0.0))
    return torch.where(inside, torch.special.i0(beta * arg) / torch.special.i0(torch.tensor(beta, dtype=t.dtype)),
                       torch.zeros_like(t))


def sinc_filter(t: torch.Tensor, cutoff: float, zero_crossings: int, beta: float) -> torch.Tensor:
    """The interpolation filter h(t), t in input samples (float64): a low-pass at `cutoff`
    (fraction of the input Nyquist rate) windowed by Kaiser(beta) over |t| <= zero_crossings / cutoff."""
    return cutoff * torch.special.sinc(cutoff * t) * _kaiser(t * cutoff / zero_crossings, beta)


@dataclass(frozen=True)
class ResampleParams:
    zero_crossings: int = 24  # filter half-width, in zero crossings of the sinc
    rolloff: float = 0.945  # cutoff as a fraction of the lower Nyquist rate
    beta: float = 8.6  # Kaiser window shape (about -85 dB stop band)


DEFAULT_RESAMPLE = ResampleParams()


MAX_PHASES = 2000  # bound on up and down (filter bank size up x (down + taps))


def resample_ratio(orig: int, new: int) -> tuple[int, int]:
    """(up, down) with new / orig = up / down exactly when both fit in MAX_PHASES (every
    common rate: 44100 -> 16000 is 160 / 441), else the nearest fraction that fits: an odd
    rate plays back slightly fast or slow (44101 Hz: by 1e-6; 7999 Hz: by 1.3e-4, 0.2 s
    over 30 minutes), which does not matter for recognition."""
    g = math.gcd(orig, new)
    up, down = new // g, orig // g
    if up <= MAX_PHASES and down <= MAX_PHASES:
        return up, down
    f = Fraction(new, orig).limit_denominator(max(1, min(MAX_PHASES, MAX_PHASES * orig // new)))
    return f.numerator, f.denominator


@functools.lru_cache(maxsize=16)
def _polyphase_kernel(orig: int, new: int, params: ResampleParams) -> tuple[torch.Tensor, int, int, int]:
    """float64 kernel [up, 1, K] (one row per output phase), left padding, up, down."""
    up, down = resample_ratio(orig, new)
    cutoff = params.rolloff * min(1.0, up / down)
    half = math.ceil(params.zero_crossings / cutoff)  # support |t| <= half input samples
    k = torch.arange(-half, down + half + 1, dtype=torch.float64)  # input offsets relative to the block start
    phase_off = torch.arange(up, dtype=torch.float64) * down / up  # output phase position within the block
    kern = sinc_filter(phase_off[:, None] - k[None, :], cutoff, params.zero_crossings, params.beta)
    # out[j] = sum_n x[n] h(j * down / up - n); sum_n h(t - n) = 1 (unit DC gain) either way
    return kern[:, None, :], half, up, down


def resample(x: torch.Tensor, orig_sr: int, new_sr: int, params: ResampleParams = DEFAULT_RESAMPLE) -> torch.Tensor:
    """Band-limited resampling of [..., N] float samples: y[j] = sum_n x[n] h(j * orig/new - n).
    Output length ceil(N * new / orig); computed in float32 with float64-designed taps
    (float64 in, float64 out)."""
    orig_sr, new_sr = int(orig_sr), int(new_sr)
    if orig_sr <= 0 or new_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {new_sr}")
    if orig_sr == new_sr:
        return x
    kern, half, up, down = _polyphase_kernel(orig_sr, new_sr, params)
    shape = x.shape
    n = shape[-1]
    out_len = -(-n * up // down)
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = x.reshape(-1, 1, n).to(dt)
    blocks = -(-out_len // up)  # output blocks of `up` samples, block b starts at input b * down
    k = kern.shape[-1]
    need = (blocks - 1) * down + k  # padded input length the conv reads
    right = max(0, need - half - n)
    xp = torch.nn.functional.pad(flat, (half, right))
    y = torch.nn.functional.conv1d(xp, kern.to(device=x.device, dtype=dt), stride=down)  # [B, up, blocks]
    y = y.transpose(1, 2).reshape(flat.shape[0], -1)[:, :out_len]
    return y.reshape(*shape[:-1], out_len).to(x.dtype if x.is_floating_point() else dt)


# --- log-mel -----------------------------------------------------------------------------------
def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz (3 mel / 200 Hz), logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    lin = 3.0 * f / 200.0
    logstep = math.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-12) / 1000.0) / logstep, lin)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    logstep = math.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(logstep * (m - 15.0)), 200.0 * m / 3.0)


@functools.lru_cache(maxsize=8)
def mel_filters(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT,
                fmin: float = 0.0, fmax: float = 8000.0) -> np.ndarray:
    """Triangular slaney-scale filters with slaney (area) normalisation: [n_fft // 2 + 1, n_mels] float64."""
    n_freqs = n_fft // 2 + 1
    fft_hz = np.linspace(0.0, sample_rate / 2, n_freqs)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    lower, center, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = (fft_hz[:, None] - lower[None, :]) / (center - lower)[None, :]
    falling = (upper[None, :] - fft_hz[:, None]) / (upper - center)[None, :]
    fb = np.maximum(0.0, np.minimum(rising, falling))
    return fb * (2.0 / (upper - lower))[None, :]


@functools.lru_cache(maxsize=8)
def _device_consts(n_mels: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    fb = torch.from_numpy(mel_filters(n_mels)).to(device=device, dtype=torch.float32).T.contiguous()
    window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float32, device=device)
    return fb, window


def pad_or_check(x: torch.Tensor, length: int = N_SAMPLES) -> torch.Tensor:
    """[B, n] (n <= length) -> [B, length], zero-padded on the right."""
    n = x.shape[-1]
    if n > length:
        raise AudioTooLongError(f"a window has {n} samples; at most {length} (30 s) fit one Whisper window: "
                                f"split longer audio with windows()")
    return torch.nn.functional.pad(x, (0, length - n)) if n < length else x


def log_mel_spectrogram(audio, n_mels: int = 128, device: str | torch.device | None = None) -> torch.Tensor:
    """16 kHz clips -> Whisper log-mel features [B, n_mels, 3000] float32 on `device`.

    audio: a tensor [N] or [B, N] (each clip <= 30 s, zero-padded to 30 s), or a list of
    1-D tensors / arrays of different lengths."""
    if isinstance(audio, (list, tuple)):
        if not audio:
            raise EmptyAudioError("no audio clips")
        clips = [torch.as_tensor(a, dtype=torch.float32).reshape(-1) for a in audio]
        dev = torch.device(device) if device is not None else clips[0].device
        x = torch.stack([pad_or_check(c.to(dev)) for c in clips])
    else:
        x = torch.as_tensor(audio)
        if x.dim() == 1:
            x = x[None]
        if x.dim() != 2:
            raise UnsupportedAudioError(f"expected audio [N] or [B, N], got shape {tuple(x.shape)}")
        dev = torch.device(device) if device is not None else x.device
        x = pad_or_check(x.to(device=dev, dtype=torch.float32))
    fb, window = _device_consts(n_mels, str(dev))
    spec = torch.stft(x, N_FFT, HOP_LENGTH, window=window, center=True, pad_mode="reflect", return_complex=True)
    power = spec[..., :-1].abs().pow(2)  # [B, 201, 3000]
    mel = torch.matmul(fb, power)  # [B, n_mels, 3000]
    logs = torch.clamp(mel, min=1e-10).log10()
    peak = logs.amax(dim=(1, 2), keepdim=True)
    logs = torch.maximum(logs, peak - 8.0)
    return (logs + 4.0) / 4.0


# --- windows -----------------------------------------------------------------------------------
def windows(audio: torch.Tensor, window: int = N_SAMPLES) -> list[torch.Tensor]:
    """Consecutive 30-second windows of a 16 kHz clip [N] (the last one shorter)."""
    n = audio.shape[-1]
    if n == 0:
        raise EmptyAudioError("the audio contains no samples")
    return [audio[..., s:s + window] for s in range(0, n, window)]


@dataclass
class AudioInfo:
    duration: float  # seconds, after decoding
    sample_rate: int  # of the file
    num_windows: int
    window_seconds: list[float]  # duration of each window (the last may be shorter)


def audio_features(data, *, n_mels: int = 128, device: str | torch.device = "cpu",
                   max_seconds: float | None = DEFAULT_MAX_SECONDS) -> tuple[torch.Tensor, AudioInfo]:
    """Audio file bytes -> (features [W, n_mels, 3000] on device, one row per 30 s window; info)."""
    x, sr = decode_audio(data, max_seconds=max_seconds)
    wav = resample(torch.from_numpy(x).to(device), sr, SAMPLE_RATE)
    wins = windows(wav)
    feats = log_mel_spectrogram(wins, n_mels=n_mels, device=device)
    info = AudioInfo(duration=x.shape[0] / sr, sample_rate=sr, num_windows=len(wins),
                     window_seconds=[w.shape[-1] / SAMPLE_RATE for w in wins])
    return feats, info


__all__ = ["SAMPLE_RATE", "N_SAMPLES", "N_FRAMES", "DEFAULT_MAX_SECONDS", "AudioError", "EmptyAudioError",
           "UnsupportedAudioError", "CorruptAudioError", "AudioTooLongError", "decode_audio", "load_audio",
           "as_waveform", "resample", "ResampleParams", "sinc_filter", "mel_filters", "log_mel_spectrogram",
           "windows", "audio_features", "AudioInfo"]
