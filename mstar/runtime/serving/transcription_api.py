"""POST /v1/audio/transcriptions and /v1/audio/translations for Whisper models (called by
api_server.build_app; translations: the same form without `language`, task translate).

Multipart form, OpenAI's schema:
    file             the audio (WAV, FLAC, OGG, MP3, ...)                       required
    model            a served model name
    language         ISO 639-1 code ("en") or name; omitted: detected on the first window
    prompt           previous text (conditions the decoder: <|startofprev|> ...)
    response_format  json (default) | text | verbose_json (one segment per 30 s window)
    temperature      0 (greedy, default) .. 1
    timestamp_granularities[]   "segment" only (window segments; no word timestamps)
plus vLLM-style extras for benchmarks: max_tokens, min_tokens, ignore_eos (forced output
length: max_tokens=32 + ignore_eos=true). Unknown fields are a 400 naming them.

Audio problems (empty, not audio, corrupt, longer than --max-audio-seconds) are 400s with
the decoder's message (audio.AudioError), param "file". The response carries a header
`x-mstar-timing` (JSON, milliseconds from the request's arrival): audio decode + resample,
language detection, first token of the earliest window, total; the bench reads it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
import uuid

from fastapi.responses import JSONResponse, PlainTextResponse

from mstar.runtime.serving.api_checks import check_model
from mstar.runtime.serving.api_jobs import run_job, start_job
from mstar.runtime.serving.api_protocol import APIError

FIELDS = frozenset({"file", "model", "language", "prompt", "response_format", "temperature",
                    "timestamp_granularities[]", "timestamp_granularities", "stream", "max_tokens", "min_tokens",
                    "ignore_eos"})


def task_endpoint(task: str) -> str:
    return "transcriptions" if task == "transcribe" else "translations"


def bad(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def form_reader(read_raw):
    """An async reader of a multipart body (size-limited by read_raw) -> starlette FormData."""

    async def read_form(request):
        ctype = request.headers.get("content-type", "")
        if ctype.lower().startswith("application/x-www-form-urlencoded"):  # a form without a file part
            from urllib.parse import parse_qsl

            from starlette.datastructures import FormData
            raw = await read_raw(request)
            return FormData(parse_qsl(raw.decode("latin-1"), keep_blank_values=True))
        if not ctype.lower().startswith("multipart/form-data"):
            raise bad(None, "Expected a multipart/form-data body with the audio in the 'file' field (got "
                            f"Content-Type {ctype or 'none'!r}).", "invalid_content_type")
        raw = await read_raw(request)
        from starlette.formparsers import MultiPartException, MultiPartParser

        async def stream():
            yield raw
            yield b""

        try:
            return await MultiPartParser(request.headers, stream(), max_files=1, max_fields=64).parse()
        except MultiPartException as e:
            raise bad(None, f"Malformed multipart body: {e.message}", "invalid_multipart") from None
        except AssertionError:  # python-multipart's parser on a broken body
            raise bad(None, "Malformed multipart body.", "invalid_multipart") from None

    return read_form


def _one(form, name: str):
    vals = form.getlist(name)
    if len(vals) > 1 and not name.startswith("timestamp_granularities"):
        raise bad(name, f"Invalid '{name}': given {len(vals)} times.")
    return vals[0] if vals else None


def _text(form, name: str) -> str | None:
    v = _one(form, name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad(name, f"Invalid '{name}': expected a text field, got a file.", "invalid_type")
    return v


def _number(form, name: str, kind, lo, hi):
    v = _text(form, name)
    if v is None or v.strip() == "":
        return None
    try:
        x = kind(v.strip())
    except ValueError:
        raise bad(name, f"Invalid '{name}': expected {'an integer' if kind is int else 'a number'}, got {v!r}.",
                  "invalid_type") from None
    if isinstance(x, float) and not math.isfinite(x) or not (lo <= x <= hi):
        raise bad(name, f"Invalid '{name}': must be in [{lo}, {hi}], got {v}.")
    return x


def _bool(form, name: str) -> bool:
    v = _text(form, name)
    if v is None or v.strip() == "":
        return False
    s = v.strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no"):
        return False
    raise bad(name, f"Invalid '{name}': expected true or false, got {v!r}.", "invalid_type")


async def transcribe(server, request, form, task: str = "transcribe"):
    """One transcription (task "transcribe") or translation to English ("translate": the
    /v1/audio/translations endpoint, which takes no language field)."""
    from mstar.runtime.engine.planned_requests import sampling_params
    from mstar.runtime.engine.request import RequestError
    tr = server.transcriber
    if tr is None:
        raise APIError(400, f"/v1/audio/{task_endpoint(task)} needs a speech-recognition model.", param="model",
                       code="model_not_supported")

    allowed = FIELDS if task == "transcribe" else FIELDS - {"language", "timestamp_granularities[]",
                                                             "timestamp_granularities"}
    unknown = sorted(k for k in form if k not in allowed)
    if unknown:
        raise bad(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}", "unknown_parameter")
    upload = _one(form, "file")
    if upload is None:
        raise bad("file", "Missing required parameter: 'file' (the audio file, as a multipart file field).",
                  "missing_required_parameter")
    if isinstance(upload, str):
        raise bad("file", "Invalid 'file': expected an uploaded audio file (a multipart file part), got a text "
                          "field.", "invalid_type")
    model = check_model(server.settings, _text(form, "model") or None)
    fmt = (_text(form, "response_format") or "json").strip()
    if fmt not in tr.response_formats:
        raise bad("response_format", f"Invalid 'response_format': {fmt!r} is not supported; use one of "
                                     f"{', '.join(tr.response_formats)}.")
    grans = [g for k in ("timestamp_granularities[]", "timestamp_granularities") for g in form.getlist(k)]
    if any(g != "segment" for g in grans):
        raise bad("timestamp_granularities", "Only 'segment' timestamps (one segment per 30 s window) are "
                                             "supported.")
    if _bool(form, "stream"):
        raise bad("stream", "Streaming transcriptions are not supported.")
    temperature = _number(form, "temperature", float, 0.0, 1.0) or 0.0
    max_tokens = _number(form, "max_tokens", int, 1, 448)
    min_tokens = _number(form, "min_tokens", int, 0, 448) or 0
    ignore_eos = _bool(form, "ignore_eos")
    language = (_text(form, "language") or "").strip() or None
    prompt = _text(form, "prompt") or None
    if prompt is not None:  # the model reads at most its last max_prompt_tokens tokens: this many characters
        prompt = prompt[-tr.max_prompt_tokens * server.max_token_chars:]

    t0 = request.state.arrival
    data = await upload.read()
    loop = asyncio.get_running_loop()
    build = functools.partial(tr.plan, data, language=language, task=task, prompt=prompt, temperature=temperature,
                              max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                              logprobs=fmt == "verbose_json", max_seconds=server.settings.max_audio_seconds)
    try:
        plan = await loop.run_in_executor(None, build)
        params = sampling_params(plan.requests()[0])
    except RequestError as e:
        raise bad(e.field, f"Invalid '{e.field}': {e.message}") from None
    except Exception as e:  # noqa: BLE001 -- the transcriber says which are the client's
        ce = tr.client_error(e)
        if ce is None:
            raise
        raise bad(ce.param, ce.message, ce.code) from None
    t_audio = time.monotonic()

    t_detect = None
    if plan.needs_detection:
        det = plan.detection_request()
        job = await start_job(server, request, "language_detection", [list(det.prompt_ids)], [sampling_params(det)],
                              1, extras=[{"encoder_input": det.encoder_input,
                                          "suppress_token_ids": det.suppress_token_ids,
                                          "begin_suppress_token_ids": det.begin_suppress_token_ids}])
        (st,) = await run_job(request, job, 1)
        if not st.token_ids:
            raise APIError(500, "Language detection produced no token.", code="internal_error")
        plan.set_detected(st.token_ids[0])
        t_detect = time.monotonic()

    planned = plan.requests()
    W = len(planned)
    job = await start_job(server, request, task_endpoint(task), [p.prompt_ids for p in planned], [params] * W, 1,
                          extras=[{"encoder_input": p.encoder_input} for p in planned])
    seqs = list(job.seqs)
    states = await run_job(request, job, W)
    t_end = time.monotonic()
    lps = [[getattr(lp, "logprob", lp) for lp in st.logprobs] for st in states] if fmt == "verbose_json" else None
    body = tr.result(plan, [st.token_ids for st in states], lps)
    firsts = [s.first_t for s in seqs if s.first_t is not None]
    timing = {"audio_ms": 1e3 * (t_audio - t0), "detect_ms": None if t_detect is None else 1e3 * (t_detect - t_audio),
              "first_token_ms": 1e3 * (min(firsts) - t0) if firsts else None, "total_ms": 1e3 * (t_end - t0),
              "windows": W, "duration_s": plan.duration,
              "completion_tokens": sum(len(st.token_ids) for st in states)}
    headers = {"x-mstar-timing": json.dumps(timing), "x-request-id": f"trsc-{uuid.uuid4().hex[:16]}"}
    out = tr.format_response(body, fmt)
    if fmt == "text":
        return PlainTextResponse(out + "\n" if out else out, headers=headers)
    if fmt == "verbose_json":
        out = dict(out, model=model)
    return JSONResponse(out, headers=headers)
