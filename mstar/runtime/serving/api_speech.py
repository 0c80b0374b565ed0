"""The speech routes (SYNTHESIZES_SPEECH): one request is one engine sequence carrying an
interfaces.MediaRequest, run by the stage engine (a one-shot pipeline: Kokoro) or by the
autoregressive engine with the family's output stage (a speech LM and its streaming codec:
Orpheus); its AudioChunks come back on the job and are encoded here.

POST /v1/audio/speech, OpenAI's schema plus vLLM-Omni's extras:
    model            a served name (default: the first)
    input            the text, at most accepts["max_input_chars"] (else 4096) characters; required
                     unless `phonemes` is given (engine inputs["text"])
    voice            one of accepts["voices"] when the model lists them (default: the first)
    response_format  wav (default) | pcm (16-bit signed little-endian mono at the model's rate;
                     the x-sample-rate header says which) | flac | mp3, the last two encoded with
                     soundfile and offered only when its libsndfile encodes them (checked at
                     import: ENCODED_FORMATS); anything else is a 400 naming response_format
    speed            0.25..4 (default 1); a model that lists accepts["speeds"] takes only those
    stream_format    absent: the whole file. "audio": the body streams (chunked) as the model's
                     audio chunks arrive, a WAV stream's header giving no length. "sse":
                     text/event-stream, one event per audio chunk,
                         data: {"type": "speech.audio.delta", "audio": "<base64>"}
                     then data: {"type": "speech.audio.done", "usage": {"input_tokens",
                     "output_tokens", "total_tokens"}} (a speech LM's prompt and audio tokens; 0
                     for a stage pipeline). The deltas, decoded and joined, are the bytes the
                     "audio" stream would send in the same response_format (pcm: the PCM; wav:
                     a header of unknown length, then the PCM). No [DONE] follows (OpenAI's
                     speech stream has none). Streaming needs wav or pcm: flac and mp3 are
                     encoded whole (soundfile writes their headers at close), so a stream of
                     them is a 400 naming response_format.
    instructions     text (a model that takes none refuses it: a 400)
    seed             default 0 (a request's audio is a function of its inputs and seed)
    max_new_tokens   a speech LM's most audio tokens, 1..65536
    language         a string of at most 32 characters (engine inputs["language"]: Kokoro's
                     espeak-ng language for the text)
    phonemes         the model's phoneme string, used instead of the text's, for a model whose
                     accepts["phonemes"] says it reads one (Kokoro; others answer 400); at most 4x
                     the input limit (engine inputs["phonemes"])
    stream           true: as stream_format "sse" when stream_format is absent (vLLM-Omni's field)
    task_type, ref_audio, ref_text, initial_codec_chunk_frames, non_streaming_mode
                     vLLM-Omni's Qwen3-TTS fields (mstar/models/qwen3_tts/stage.py says what each
                     does), taken by a model whose accepts["fields"] lists them; others answer 400
GET /v1/audio/voices: {"voices": accepts["voices"]} (a model without SYNTHESIZES_SPEECH: a 400,
    as the other capability-gated routes; api_server.py).

Errors: a field that is wrong is a 400 in OpenAI's error schema, param naming it: checked here
before the request is admitted, or refused by the engine (the family's "field: message"
ValueError, or the stage pipeline's batch key) and surfaced through the job as a 400. A model
that fails on a request is a 500 (internal_error). A stream awaits its first audio before it
answers, so a failure before any audio is still an error response; one after it is an error
event on an SSE stream ({"type": "error", "error": {...}}) and, on an audio stream, a connection
dropped without the final chunk (a truncated body, never a short success). A client that goes
away aborts its sequence in the engine at once (streaming or not).
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import struct
import uuid
from collections.abc import AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from mstar.models import interfaces as I
from mstar.runtime.serving import api_protocol as P
from mstar.runtime.serving.api_checks import check_model
from mstar.runtime.serving.api_jobs import Job, await_job
from mstar.runtime.serving.api_media import (_choice, _encode, _max_chars, _seed, _text, _typed, _unknown,
                                             collect_media, start_media_job)
from mstar.runtime.serving.api_protocol import APIError, bad
from mstar.runtime.serving.api_sse import SSEResponse, pump_until_disconnect, sse_event

logger = logging.getLogger("mstar.server")

# fields a model takes only when its accepts["fields"] lists them (Qwen3-TTS: vLLM-Omni's names)
MODEL_FIELDS = ("task_type", "ref_audio", "ref_text", "initial_codec_chunk_frames", "non_streaming_mode")
SPEECH_FIELDS = frozenset({"model", "input", "voice", "response_format", "speed", "stream_format", "stream",
                           "instructions", "seed", "max_new_tokens", "language", "phonemes", *MODEL_FIELDS})
MAX_SPEECH_CHARS = 4096  # OpenAI's limit on `input`
MAX_NEW_TOKENS = 65536
MAX_LANGUAGE_CHARS = 32
PHONEMES_PER_CHAR = 4  # `phonemes` may be this many times the input limit (as Kokoro's pipeline bounds it)
STREAM_FORMATS = ("audio", "sse")
STREAMABLE = ("wav", "pcm")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg"}
# the engine's name of a field -> the route's (an engine error names what the engine saw)
_ENGINE_PARAMS = {"max_tokens": "max_new_tokens", "text": "input"}


# -- encoders ----------------------------------------------------------------------------------
def pcm16(x: np.ndarray) -> bytes:
    """Float samples in [-1, 1] as 16-bit signed little-endian PCM (clipped, rounded)."""
    a = np.clip(np.asarray(x, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return np.rint(a * 32767.0).astype("<i2").tobytes()


def wav_header(sample_rate: int, n_samples: int | None = None) -> bytes:
    """A 44-byte header of mono 16-bit PCM; n_samples None: a stream of unknown length (the
    sizes are 0xFFFFFFFF, as streaming servers write them)."""
    data = 0xFFFFFFFF if n_samples is None else 2 * n_samples
    riff = 0xFFFFFFFF if n_samples is None else 36 + data
    return struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", riff, b"WAVE", b"fmt ", 16, 1, 1, sample_rate,
                       2 * sample_rate, 2, 16, b"data", data)


_SOUNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III")}


def _soundfile_formats() -> dict[str, tuple[str, str]]:
    """The soundfile formats this libsndfile writes: listed, and a short clip encodes."""
    try:
        import soundfile as sf
        formats = sf.available_formats()
    except Exception:  # noqa: BLE001 -- no soundfile / libsndfile: wav and pcm only
        return {}
    ok = {}
    for name, (fmt, subtype) in _SOUNDFILE.items():
        try:
            if fmt not in formats or subtype not in sf.available_subtypes(fmt):
                continue
            buf = io.BytesIO()
            sf.write(buf, np.zeros(2400, dtype=np.int16), 24000, format=fmt, subtype=subtype)
            if buf.getvalue():
                ok[name] = (fmt, subtype)
        except Exception:  # noqa: BLE001 -- listed but not working: not offered
            continue
    return ok


ENCODED_FORMATS = _soundfile_formats()
RESPONSE_FORMATS = ("wav", "pcm", *ENCODED_FORMATS)


def encode_audio(fmt: str, pcm: bytes, sample_rate: int) -> bytes:
    """16-bit PCM (little-endian mono) as a whole file of `fmt` (one of RESPONSE_FORMATS)."""
    if fmt == "pcm":
        return pcm
    if fmt == "wav":
        return wav_header(sample_rate, len(pcm) // 2) + pcm
    import soundfile as sf
    f, subtype = ENCODED_FORMATS[fmt]
    buf = io.BytesIO()
    samples = np.frombuffer(pcm, dtype="<i2")
    if len(samples):
        sf.write(buf, samples, sample_rate, format=f, subtype=subtype)
    return buf.getvalue()


# -- fields ------------------------------------------------------------------------------------
def parse_speech(server, body: dict) -> tuple[dict, int, str, str | None]:
    """A request body checked against the served model: (engine inputs, seed, response_format,
    stream_format)."""
    _unknown(body, SPEECH_FIELDS)
    check_model(server.settings, P._str(body, "model"))
    limit = _max_chars(server, MAX_SPEECH_CHARS)
    phonemes = P._str(body, "phonemes")
    if phonemes is not None:
        if not server.accepts.get("phonemes"):
            raise bad("phonemes", "Invalid 'phonemes': this model reads the text of 'input', not a phoneme string.",
                      "invalid_value")
        if not phonemes.strip():
            raise bad("phonemes", "Invalid 'phonemes': the string is empty.", "invalid_value")
        if len(phonemes) > PHONEMES_PER_CHAR * limit:
            raise bad("phonemes", f"Invalid 'phonemes': string too long. Expected a string with maximum length "
                                  f"{PHONEMES_PER_CHAR * limit}, but got a string with length {len(phonemes)} "
                                  "instead.", "string_above_max_length")
    text = _text(body, "input", limit, required=phonemes is None)
    voices = [str(v) for v in server.accepts.get("voices") or ()]
    voice = P._str(body, "voice", voices[0] if voices else None)
    if voice is not None and (len(voice) > 64 or (voices and voice not in voices)):
        raise bad("voice", f"Invalid 'voice': {voice[:64]!r} is not supported"
                           + (f"; use one of {', '.join(voices)}." if voices else "."), "invalid_value")
    fmt = _choice(body, "response_format", RESPONSE_FORMATS, "wav")
    speed = P._num(body, "speed", 1.0)
    if not 0.25 <= speed <= 4.0:
        raise bad("speed", f"Invalid 'speed': must be in [0.25, 4.0], got {speed:g}.", "invalid_value")
    speeds = server.accepts.get("speeds")
    if speeds and speed not in [float(s) for s in speeds]:
        raise bad("speed", f"Invalid 'speed': this model speaks at {', '.join(f'{float(s):g}' for s in speeds)} "
                           f"only, got {speed:g}.", "invalid_value")
    stream_format = P._str(body, "stream_format")
    if P._bool(body, "stream", False) and stream_format is None:
        stream_format = "sse"  # vLLM-Omni's `stream`: server-sent events unless stream_format says otherwise
    if stream_format is not None and stream_format not in STREAM_FORMATS:
        raise bad("stream_format", f"Invalid 'stream_format': {stream_format!r} is not supported; use 'audio' or "
                                   "'sse' (or leave it out for the whole file).", "invalid_value")
    if stream_format is not None and fmt not in STREAMABLE:
        raise bad("response_format", f"Invalid 'response_format': {fmt!r} is encoded whole, not streamed; stream "
                                     f"{' or '.join(STREAMABLE)} (or leave stream_format out).", "invalid_value")
    instructions = _text(body, "instructions", MAX_SPEECH_CHARS, required=False)
    language = P._str(body, "language")
    if language is not None and not 0 < len(language.strip()) <= MAX_LANGUAGE_CHARS:
        raise bad("language", f"Invalid 'language': expected 1 to {MAX_LANGUAGE_CHARS} characters, got "
                              f"{len(language)}.", "invalid_value")
    seed = _seed(body, 0)
    inputs: dict = {"speed": speed}
    if text is not None:
        inputs["text"] = text
    if voice is not None:
        inputs["voice"] = voice
    if phonemes is not None:
        inputs["phonemes"] = phonemes
    if language is not None:
        inputs["language"] = language.strip()
    if instructions is not None:
        inputs["instructions"] = instructions
    max_new = P._int(body, "max_new_tokens")
    if max_new is not None:
        if not 1 <= max_new <= MAX_NEW_TOKENS:
            raise bad("max_new_tokens", f"Invalid 'max_new_tokens': must be in [1, {MAX_NEW_TOKENS}], got {max_new}.",
                      "invalid_value")
        inputs["max_new_tokens"] = max_new
    inputs.update(_model_fields(server, body))
    return inputs, seed, fmt, stream_format


def _model_fields(server, body: dict) -> dict:
    """The MODEL_FIELDS the request gives, type-checked; a model whose accepts["fields"] does not list
    one refuses it."""
    takes = set(server.accepts.get("fields") or ())
    out: dict = {}
    for name in MODEL_FIELDS:
        if body.get(name) is None:
            continue
        if name not in takes:
            raise bad(name, f"Invalid '{name}': this model takes no {name}.", "invalid_value")
        if name == "initial_codec_chunk_frames":
            out[name] = P._int(body, name, lo=1, hi=1024)
        elif name == "non_streaming_mode":
            out[name] = P._bool(body, name)
        else:
            out[name] = P._str(body, name)
    return out


def _engine_error(e: APIError, inputs: dict) -> APIError:
    """An engine's refusal (a 400 naming the engine's field) named by the route's field."""
    if e.status != 400 or e.param is None:
        return e
    param = _ENGINE_PARAMS.get(e.param, e.param)
    if e.param == "input" and "phonemes" in inputs and "text" not in inputs and "phoneme" in e.message.lower():
        param = "phonemes"  # a stage pipeline's batch key refusing the phonemes (it names its inputs "input")
    if param != e.param:
        e.message = e.message.replace(f"Invalid '{e.param}'", f"Invalid '{param}'", 1)
        e.param = param
    return e


# -- POST /v1/audio/speech ---------------------------------------------------------------------
async def speech(server, request: Request, body: dict):
    inputs, seed, fmt, stream_format = parse_speech(server, body)
    job = await start_media_job(server, request, "speech", [(inputs, seed)])
    headers = {"x-request-id": f"speech-{uuid.uuid4().hex[:16]}"}
    try:
        if stream_format is not None:
            return await _stream_speech(request, job, fmt, stream_format, headers)
        (outs,) = await collect_media(request, job)
    except APIError as e:
        raise _engine_error(e, inputs) from None
    chunks = _typed(outs, I.AudioChunk, "audio")
    rate = _rate(chunks)
    pcm = b"".join(pcm16(c.pcm) for c in chunks)
    try:
        data = pcm if fmt == "pcm" else await _encode(server, encode_audio, fmt, pcm, rate)
    except Exception as e:  # noqa: BLE001 -- e.g. a rate the format has not (mp3: 8..48 kHz)
        logger.warning("encoding %s at %d Hz failed: %s", fmt, rate, e)
        raise bad("response_format", f"Invalid 'response_format': this server cannot encode the model's "
                                     f"{rate} Hz audio as {fmt} ({type(e).__name__}); use wav or pcm.",
                  "invalid_value") from None
    headers["x-sample-rate"] = str(rate)
    return Response(data, media_type=MEDIA_TYPES[fmt], headers=headers)


def _rate(chunks: list, rate: int | None = None) -> int:
    for c in chunks:
        r = int(c.sample_rate)
        if rate is None:
            rate = r
        elif r != rate:
            raise APIError(500, f"The model's audio changed sample rate ({rate} -> {r} Hz).", code="internal_error")
    return rate


def _audio(o) -> list:
    return [c for c in (o.media or ()) if isinstance(c, I.AudioChunk)]


async def _stream_speech(request: Request, job: Job, fmt: str, stream_format: str, headers: dict):
    """The audio as it comes: the first outputs are awaited here (a failure before any audio is
    still an error response), then the body streams (chunked audio, or server-sent events)."""
    events = job.events()

    async def first():
        while True:
            _, o = await events.__anext__()
            if o.media or o.finished:
                return o

    try:
        o = await await_job(request, job, first(), close_on_success=False)
    except StopAsyncIteration:  # (the job is closed: error)
        raise APIError(500, "The model returned no audio.", code="internal_error") from None
    chunks = _audio(o)
    if not chunks:
        job.close("error")
        raise APIError(500, "The model returned no audio.", code="internal_error")
    rate = _rate(chunks)
    headers["x-sample-rate"] = str(rate)

    async def parts() -> AsyncIterator[tuple[bytes, object]]:
        """(bytes, the output they came with) per audio chunk; the first with the WAV header."""
        head = wav_header(rate) if fmt == "wav" else b""
        for c in chunks:  # (at least one)
            yield head + pcm16(c.pcm), o
            head = b""
        done = o.finished
        while not done:
            _, u = await events.__anext__()
            done = u.finished
            part = _audio(u)
            _rate(part, rate)
            if not part:
                yield b"", u
            for c in part:
                yield pcm16(c.pcm), u

    if stream_format == "audio":
        async def body() -> AsyncIterator[bytes]:
            async for b, _ in parts():
                yield b
        return JobStream(job, body(), MEDIA_TYPES[fmt], headers)

    async def sse() -> AsyncIterator[str]:
        outcome = "error"
        n_prompt = n_out = 0
        seen: set[int] = set()
        try:
            try:
                async for b, u in parts():
                    if id(u) not in seen:  # count each output's tokens once
                        seen.add(id(u))
                        n_prompt = max(n_prompt, int(getattr(u, "num_prompt_tokens", 0) or 0))
                        n_out += len(getattr(u, "new_token_ids", None) or ())
                    if b:
                        yield sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(b).decode("ascii")})
                outcome = "success"
                usage = {"input_tokens": n_prompt, "output_tokens": n_out, "total_tokens": n_prompt + n_out}
                yield sse_event({"type": "speech.audio.done", "usage": usage})
            except APIError as e:
                outcome = "error" if e.status >= 500 else "bad_request"
                logger.warning("speech stream failed: %s", e.message)
                yield sse_event({"type": "error", **e.body()})
            except Exception as e:  # noqa: BLE001 -- a bug while encoding: the client still gets an ending
                logger.exception("speech stream failed")
                err = APIError(500, f"Internal server error: {type(e).__name__}", code="internal_error")
                yield sse_event({"type": "error", **err.body()})
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "aborted"
            raise
        finally:
            job.close(outcome)

    resp = SSEResponse(sse(), on_close=lambda: job.close("aborted"))
    for k, v in headers.items():
        resp.headers[k] = v
    return resp


class JobStream(StreamingResponse):
    """A job's bytes as a chunked body. The job is closed with its outcome when the body ends; a
    client that goes away aborts it at once; a failure after the body began drops the connection
    without the final chunk (the client sees a truncated response, not a short success)."""

    def __init__(self, job: Job, chunks: AsyncIterator[bytes], media_type: str, headers: dict):
        super().__init__(chunks, status_code=200, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self.job = job
        self.chunks = chunks

    async def __call__(self, scope, receive, send) -> None:
        job = self.job

        async def pump():
            outcome = "error"
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                try:
                    async for b in self.chunks:
                        if b:
                            await send({"type": "http.response.body", "body": b, "more_body": True})
                    outcome = "success"
                except APIError as e:
                    logger.warning("stream failed: %s", e.message)
                except Exception:  # noqa: BLE001
                    logger.exception("stream failed")
            except asyncio.CancelledError:
                outcome = "aborted"
                raise
            finally:
                job.close(outcome)
            if outcome == "success":
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        # the job closed as aborted when the client left first (a no-op when the pump closed it)
        await pump_until_disconnect(pump(), receive, self.chunks, lambda: job.close("aborted"))


# -- GET /v1/audio/voices ----------------------------------------------------------------------
def voices(server) -> dict:
    """The served model's voices (accepts["voices"]; none listed: an empty list)."""
    return {"voices": [str(v) for v in server.accepts.get("voices") or ()]}
