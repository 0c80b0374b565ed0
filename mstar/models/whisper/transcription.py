"""Whisper's transcriber: how a transcription or translation becomes engine requests, and
their tokens a response. What the offline API (`LLM.transcribe`) and the server's
POST /v1/audio/transcriptions read of a TRANSCRIBES family (`EngineHooks.transcriber`).

    t = WhisperTranscriber(tokens, tokenizer)
    plan = t.plan(audio, language=None, task="transcribe", ...)      # TranscriptionInputError: 400
    if plan.needs_detection: run plan.detection_request(), then plan.set_detected(token id)
    run plan.requests() (one PlannedRequest per 30 s window) -> plan.result(token ids per window)

Audio: the bytes of a file (WAV, FLAC, OGG, MP3, ...: decoded and resampled to 16 kHz) or
raw 16 kHz mono samples (numpy / torch / list). Longer than 30 s: consecutive 30-second
windows, one engine sequence each (decoded in parallel, without conditioning on the
previous window's text). Language omitted on a multilingual model: detected on the first
window (one extra one-token sequence whose only allowed tokens are the language tokens:
the greedy pick is the most likely language), then used for every window.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field

import numpy as np

from mstar.models.whisper.audio import (DEFAULT_MAX_SECONDS, SAMPLE_RATE, EmptyAudioError, as_waveform, decode_audio,
                                resample, windows)
from mstar.models.whisper.audio import AudioError, AudioTooLongError
from mstar.models.whisper.tokens import WhisperPromptError, WhisperTokens

RESPONSE_FORMATS = ("json", "text", "verbose_json")


def whisper_tokens(vocab_size: int, tokenizer=None) -> WhisperTokens:
    """The special-token layout of the vocabulary, checked against the tokenizer if any (a
    tokenizer that disagrees is reported and the layout of the vocabulary size is used)."""
    if tokenizer is not None:
        try:
            return WhisperTokens.from_tokenizer(tokenizer, vocab_size)
        except ValueError as e:
            import logging
            logging.getLogger("mstar.models").warning("%s; using the Whisper layout of vocab %d", e, vocab_size)
    return WhisperTokens.from_vocab_size(vocab_size)


def load_windows(audio, *, max_seconds: float | None = DEFAULT_MAX_SECONDS) -> tuple[list[np.ndarray], float]:
    """(16 kHz float32 windows of <= 30 s, duration in seconds). Raises AudioError (HTTP 400)."""
    import torch
    if isinstance(audio, (bytes, bytearray, memoryview)) or callable(getattr(audio, "read", None)):
        x, sr = decode_audio(audio, max_seconds=max_seconds)
        wav = resample(torch.from_numpy(x), sr, SAMPLE_RATE)
    else:
        wav = as_waveform(audio, max_seconds=max_seconds)
    if wav.numel() == 0:
        raise EmptyAudioError("the audio contains no samples")
    dur = wav.numel() / SAMPLE_RATE
    return [np.ascontiguousarray(w.numpy(), dtype=np.float32) for w in windows(wav)], dur


@functools.lru_cache(maxsize=4)
def _not_language_ids(vocab_size: int) -> tuple[int, ...]:
    t = WhisperTokens.from_vocab_size(vocab_size)
    keep = set(t.languages.values())
    return tuple(i for i in range(vocab_size) if i not in keep)


@dataclass
class PlannedRequest:
    """An engine request in plain fields (the runtime builds its EngineRequest from them):
    sampling holds SamplingParams fields; suppress lists None: the model's defaults."""
    prompt_ids: list[int]
    sampling: dict
    encoder_input: object = None
    suppress_token_ids: tuple[int, ...] | None = None
    begin_suppress_token_ids: tuple[int, ...] | None = None


class TranscriptionInputError(ValueError):
    """A client error in a transcription request: `param` names the field, `code` the kind."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.message, self.code = param, message, code


def detection_request(tokens: WhisperTokens, window: np.ndarray) -> PlannedRequest:
    """One greedy token after <|startoftranscript|>, restricted to the language tokens."""
    return PlannedRequest([tokens.sot], dict(max_tokens=1, temperature=0.0, ignore_eos=True), encoder_input=window,
                          suppress_token_ids=_not_language_ids(tokens.vocab_size), begin_suppress_token_ids=())


def language_of(tokens: WhisperTokens, token_id: int) -> str:
    for code, tid in tokens.languages.items():
        if tid == token_id:
            return code
    raise RuntimeError(f"language detection returned token {token_id}, not a language token")


def language_name(code: str) -> str:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES
    return LANGUAGES.get(code, code)


@dataclass
class TranscriptionPlan:
    tokens: WhisperTokens
    windows: list[np.ndarray]
    duration: float
    task: str = "transcribe"
    language: str | None = None  # code; None until detected (multilingual models)
    prev_ids: list[int] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)  # SamplingParams fields of every window

    @classmethod
    def build(cls, tokens: WhisperTokens, tokenizer, audio, *, language: str | None = None,
              task: str = "transcribe", prompt: str | None = None, temperature: float = 0.0,
              max_tokens: int | None = None, min_tokens: int = 0, ignore_eos: bool = False,
              logprobs: bool = False, max_seconds: float | None = DEFAULT_MAX_SECONDS) -> "TranscriptionPlan":
        """Validate everything (WhisperPromptError / AudioError / RequestError: client errors)
        and cut the audio into windows."""
        tokens.task_id(task)
        if language is not None:
            tokens.language_id(language)  # validates
            code = language.strip().lower()
            if code.startswith("<|"):
                code = code[2:-2]
            language = code if code in tokens.languages else tokens.names.get(code, code)
        elif not tokens.multilingual:
            language = "en"
        prev: list[int] = []
        if prompt:
            if tokenizer is None:
                raise WhisperPromptError("this model has no tokenizer, so a text prompt cannot be used")
            prev = [int(i) for i in tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)]
            prev = [i for i in prev if i < tokens.eot]
        # the longest prompt (with the language token) fixes the room left for new tokens
        n_prompt = len(tokens.decoder_prompt(language or "en", task, prev_ids=prev)) if tokens.multilingual \
            else len(tokens.decoder_prompt(None, task, prev_ids=prev))
        room = tokens.max_new_tokens(n_prompt)
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise WhisperPromptError(f"max_tokens must be a positive integer, got {max_tokens!r}")
            if max_tokens > room:
                raise WhisperPromptError(f"max_tokens {max_tokens} exceeds the {room} tokens Whisper can decode "
                                         f"after a {n_prompt}-token prompt (448 positions)")
        mt = room if max_tokens is None else max_tokens
        sampling = dict(max_tokens=mt, temperature=float(temperature), ignore_eos=bool(ignore_eos),
                        min_tokens=min(int(min_tokens), mt), logprobs=0 if logprobs else None)
        wins, dur = load_windows(audio, max_seconds=max_seconds)
        return cls(tokens=tokens, windows=wins, duration=dur, task=task, language=language, prev_ids=prev,
                   sampling=sampling)

    @property
    def needs_detection(self) -> bool:
        return self.language is None

    @property
    def prompt(self) -> list[int]:
        lang = self.language if self.tokens.multilingual else None
        return self.tokens.decoder_prompt(lang, self.task, prev_ids=self.prev_ids)

    def requests(self) -> list[PlannedRequest]:
        """One request per 30 s window, the same prompt each."""
        p = self.prompt
        return [PlannedRequest(list(p), dict(self.sampling), encoder_input=w) for w in self.windows]

    def detection_request(self) -> PlannedRequest:
        return detection_request(self.tokens, self.windows[0])

    def set_detected(self, token_id: int) -> None:
        self.language = language_of(self.tokens, token_id)

    def result(self, tokenizer, outputs: list[list[int]], logprobs: list[list[float]] | None = None) -> dict:
        """The verbose_json body (OpenAI's shape) from each window's generated token ids."""
        segs = []
        t = self.tokens
        for i, ids in enumerate(outputs):
            text_ids = t.text_ids(ids)
            text = t.decode_text(tokenizer, ids) if tokenizer is not None else ""
            start = i * 30.0
            end = min(self.duration, start + len(self.windows[i]) / SAMPLE_RATE)
            lps = (logprobs[i] if logprobs else None) or []
            raw = text.encode("utf-8")
            segs.append({"id": i, "seek": i * 3000, "start": round(start, 3), "end": round(end, 3),
                         "text": text, "tokens": text_ids, "temperature": self.sampling.get("temperature", 0.0),
                         "avg_logprob": float(np.mean(lps)) if lps else 0.0,
                         "compression_ratio": len(raw) / max(1, len(zlib.compress(raw))) if raw else 0.0,
                         "no_speech_prob": 0.0})
        text = " ".join(s["text"] for s in segs if s["text"]).strip()
        return {"task": self.task, "language": language_name(self.language or "en"),
                "duration": round(self.duration, 3), "text": text, "segments": segs}


def format_response(body: dict, response_format: str) -> dict | str:
    if response_format == "text":
        return body["text"]
    if response_format == "json":
        return {"text": body["text"], "usage": {"type": "duration", "seconds": int(np.ceil(body["duration"]))}}
    return body


class WhisperTranscriber:
    """The transcriber of a Whisper model (Family.transcriber): plans requests, formats responses."""

    response_formats = RESPONSE_FORMATS
    max_prompt_tokens = 448  # Whisper reads at most the last 448 tokens of a text prompt
    max_new_tokens = 448

    def __init__(self, tokens: WhisperTokens, tokenizer):
        self.tokens, self.tokenizer = tokens, tokenizer

    def plan(self, audio, **kw) -> TranscriptionPlan:
        """Validate and cut the audio (AudioError / WhisperPromptError: client errors, see
        client_error)."""
        return TranscriptionPlan.build(self.tokens, self.tokenizer, audio, **kw)

    @staticmethod
    def client_error(e: BaseException) -> TranscriptionInputError | None:
        """What a client did wrong, if `e` (raised by plan) is a client error."""
        if isinstance(e, AudioTooLongError):
            return TranscriptionInputError("file", f"Invalid 'file': {e}", "audio_too_long")
        if isinstance(e, AudioError):
            return TranscriptionInputError("file", f"Invalid 'file': {e}", "invalid_audio")
        if isinstance(e, WhisperPromptError):
            msg = str(e)
            param = "language" if "language" in msg else "max_tokens" if "max_tokens" in msg else "prompt"
            return TranscriptionInputError(param, f"Invalid '{param}': {msg}")
        return None

    def result(self, plan: TranscriptionPlan, outputs, logprobs=None) -> dict:
        return plan.result(self.tokenizer, outputs, logprobs)

    @staticmethod
    def format_response(body: dict, response_format: str) -> dict | str:
        return format_response(body, response_format)


__all__ = ["WhisperTranscriber", "TranscriptionInputError", "PlannedRequest", "TranscriptionPlan", "RESPONSE_FORMATS", "detection_request", "language_of", "language_name",
           "load_windows", "whisper_tokens", "format_response"]
