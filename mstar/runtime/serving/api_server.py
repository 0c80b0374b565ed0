"""The OpenAI-compatible HTTP front end (FastAPI), running in the API process.

The engine runs in another process (engine_process.py). This process owns the tokenizer:
it validates and tokenizes requests, sends `EngineRequest`s (token ids only) to the
engine, and turns the engine's per-step `CoreOutput`s into text with the
`OutputProcessor` (incremental detokenization, stop strings). A stop string found here
aborts the sequence in the engine at once; so does a client that goes away, streaming or
not (its pages are freed on the engine's next loop turn).

Every error is OpenAI's error body with the right status (see api_protocol.py); an
unexpected exception is logged and answered with a 500 in the same schema, never a
dropped connection. If the engine process dies, in-flight requests get a 503 error (an
error event on a stream), new ones a 503 while a new engine starts, and /health says so
(api_engine.py: supervision).

Browser and network surface: JSON routes take only `application/json` bodies (415 otherwise,
so a page on another origin cannot post one as a "simple" cross-origin request); every
response carries `X-Content-Type-Options: nosniff`; a body must keep arriving (a gap of
`body_timeout_s` is a 408); /health shows the engine's internals only to an authorised caller.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus), GET /version, POST /tokenize and /detokenize (vLLM's shapes).
A Whisper (encoder-decoder) model serves POST /v1/audio/transcriptions (and /translations) instead of the
completion endpoints (multipart form, OpenAI's schema; transcribe.py): the audio is decoded
and cut into 30 s windows here, each window is one engine sequence carrying its samples.
Speech models (a stage pipeline such as Kokoro's, or a speech LM with its codec output stage
such as Orpheus) serve POST /v1/audio/speech and GET /v1/audio/voices (api_speech.py); image and
video models (stage pipelines) POST /v1/images/generations (api_media.py) and the /v1/videos
routes (api_video.py).
Each generation route needs its capability (interfaces.py, from the engine's start-up info);
a route the model lacks is a 400 (unsupported_endpoint).

This module builds the app: settings, API key, body size limit, errors, and the routes.
The rest lives in:
    api_engine.py        Server: the engine process handle, tokenizer, detokenizer, live sequences
    api_jobs.py          Job, Admission: a request's sequences from admission to close
    api_sse.py           streamed responses (server-sent events)
    api_checks.py        a request checked against the served model
    api_completions.py   POST /v1/completions
    api_chat.py          POST /v1/chat/completions
    api_tokenize.py      POST /tokenize, /detokenize
    transcription_api.py POST /v1/audio/transcriptions, /v1/audio/translations
    api_speech.py        POST /v1/audio/speech, GET /v1/audio/voices
    api_media.py         POST /v1/images/generations (and what the media routes share)
    api_video.py         POST /v1/videos (async jobs), /v1/videos/sync; GET, DELETE /v1/videos/{id}
    api_protocol.py      request parsing and OpenAI's error schema
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mstar.models.presets import DEFAULT_MODEL
from mstar.models import interfaces as I
from mstar.runtime.serving import api_media as AM
from mstar.runtime.serving import api_protocol as P
from mstar.runtime.serving import api_speech as AS
from mstar.runtime.serving import api_video as AV
from mstar.runtime.serving import transcription_api as TA
from mstar.runtime.serving.api_chat import chat_completions
from mstar.runtime.serving.api_completions import completions
from mstar.runtime.serving.api_engine import Server, freeze_heap
from mstar.runtime.serving.api_jobs import ClientGone
from mstar.runtime.serving.api_protocol import APIError
from mstar.runtime.serving.api_sse import RAW_SEND
from mstar.runtime.serving.api_tokenize import detokenize, tokenize
from mstar.runtime.serving.metrics import CONTENT_TYPE_LATEST

logger = logging.getLogger("mstar.server")


@dataclass
class ServerSettings:
    model: str = DEFAULT_MODEL
    served_model_names: list[str] = field(default_factory=lambda: [DEFAULT_MODEL])
    api_key: str | None = None
    max_pending: int = 1024  # sequences admitted and not yet finished; a request of more is a 400
    max_request_tokens: int = 1 << 20  # prompt tokens of one request, all its prompts together
    overload_policy: str = "reject"  # "reject" (503 + Retry-After) | "wait"
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout_s: float = 30.0  # longest gap between two parts of a request body (408 past it)
    retry_after_s: int = 1
    max_audio_seconds: float = 1800.0  # /v1/audio/transcriptions: longer audio is a 400
    max_video_jobs: int = 32  # POST /v1/videos: unfinished async jobs; one more is a 503 + Retry-After
    engine_restarts: int = 3  # engine processes started after one dies, before the server exits
    restart_backoff_s: float = 1.0  # before the first restart; doubled for each next one
    startup_timeout_s: float = 1800.0  # an engine (re)start that takes longer failed
    tokenizer_threads: int = 4


def error_response(e: APIError) -> JSONResponse:
    headers = dict(e.headers)
    if e.status == 413:
        headers["Connection"] = "close"
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


_AUDIO_ENDPOINTS = ("transcriptions", "translations")  # Whisper: multipart forms

# the capability each generation endpoint needs (interfaces.py); completions and chat also need
# the model not to be a speech recogniser (its decoder generates tokens, but from audio)
_NEEDS = {"completions": I.GENERATES_TOKENS, "chat": I.GENERATES_TOKENS, "transcriptions": I.TRANSCRIBES,
          "translations": I.TRANSCRIBES, "speech": I.SYNTHESIZES_SPEECH, "images": I.GENERATES_IMAGES,
          "videos": I.GENERATES_VIDEO, "voices": I.SYNTHESIZES_SPEECH}
_ROUTES = ((I.GENERATES_TOKENS, "POST /v1/completions and /v1/chat/completions"),
           (I.TRANSCRIBES, "POST /v1/audio/transcriptions and /v1/audio/translations"),
           (I.SYNTHESIZES_SPEECH, "POST /v1/audio/speech and GET /v1/audio/voices"),
           (I.GENERATES_IMAGES, "POST /v1/images/generations"),
           (I.GENERATES_VIDEO, "POST /v1/videos (async) and /v1/videos/sync"))
_ROUTE_OF = {"completions": "POST /v1/completions", "chat": "POST /v1/chat/completions",
             "speech": "POST /v1/audio/speech", "voices": "GET /v1/audio/voices",
             "images": "POST /v1/images/generations", "videos": "POST /v1/videos"}


_NOSNIFF = (b"x-content-type-options", b"nosniff")


class _App(FastAPI):
    """FastAPI that leaves the server's own `send` in the scope (api_sse.RAW_SEND), so that a
    stream's body chunks skip the middleware wrappers around it: one call per chunk instead of
    four (streamed tokens are the server's hottest path). Every response start gets `nosniff`."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send

            async def send_nosniff(message):
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()), _NOSNIFF]
                await send(message)

            await super().__call__(scope, receive, send_nosniff)
            return
        await super().__call__(scope, receive, send)


def _json_content_type(request: Request) -> None:
    """A 415 unless the body is declared JSON (or not declared at all: curl and some clients send
    none; a browser's cross-origin "simple" request always declares text/plain or a form)."""
    ct = request.headers.get("content-type")
    if ct is None:
        return
    media = ct.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(415, f"Unsupported Content-Type {ct!r}: send the body as application/json.",
                   code="unsupported_media_type")


def build_app(settings: ServerSettings, engine, tokenizer, output_processor=None, make_engine=None,
              on_fatal=None) -> FastAPI:
    """The app. `make_engine()` builds a new (unstarted) engine process when the running one dies;
    `on_fatal(why)` is called once no restart is left (the caller exits non-zero)."""
    server = Server(settings, engine, tokenizer, output_processor, make_engine=make_engine, on_fatal=on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.attach(asyncio.get_running_loop())
        freeze_heap()
        yield
        logger.info("stopping the engine")
        server.stopping = True
        await asyncio.get_running_loop().run_in_executor(None, server.engine.shutdown)
        server.pool.shutdown(wait=False, cancel_futures=True)

    # no slash redirects: a 307 to a route that then wants a body surprises clients; a 404 says it
    app = _App(title="mstar", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
               redirect_slashes=False)
    app.state.server = server

    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request: Request, exc: StarletteHTTPException):
        msg = {404: f"Not found: {request.method} {request.url.path}",
               405: f"Method {request.method} not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                     str(exc.detail))
        return error_response(APIError(exc.status_code, msg, code=exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(APIError(500, f"Internal server error: {type(exc).__name__}", code="internal_error"))

    # -- helpers ------------------------------------------------------------------------------
    def authorised(request: Request) -> bool:
        """A valid API key came with the request (False when the server has none)."""
        try:
            check_auth(request)
        except APIError:
            return False
        return bool(settings.api_key)

    def check_auth(request: Request) -> None:
        key = settings.api_key
        if not key:
            return
        got = request.headers.get("authorization", "")
        if not got:
            raise APIError(401, "You didn't provide an API key. Provide it in the Authorization header "
                                "(Authorization: Bearer YOUR_KEY).", code="invalid_api_key")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read_body(request: Request) -> dict:
        _json_content_type(request)
        return P.parse_json_body(await read_raw(request))

    async def read_raw(request: Request) -> bytes:
        limit = settings.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                if int(cl) > limit:
                    raise APIError(413, f"The request body ({int(cl)} bytes) exceeds the limit of {limit} bytes.",
                                   code="request_too_large")
            except ValueError:
                raise APIError(400, "Invalid Content-Length header.") from None
        buf = bytearray()
        chunks = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), settings.body_timeout_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise APIError(408, f"The request body stopped arriving for {settings.body_timeout_s:g} s.",
                               code="request_timeout", headers={"Connection": "close"}) from None
            buf += chunk
            if len(buf) > limit:
                raise APIError(413, f"The request body exceeds the limit of {limit} bytes.",
                               code="request_too_large")
        return bytes(buf)

    read_form = TA.form_reader(read_raw)

    async def handle(request: Request, endpoint: str, prepare):
        """Common frame: auth, body, parse, admission, run; maps errors to responses and metrics.
        `prepare(server, request, body)` does the endpoint's work."""
        request.state.arrival = time.monotonic()  # TTFT and latency are measured from here
        try:
            check_auth(request)
            server.check_alive()
            check_endpoint(endpoint)
            body = await (read_form(request) if endpoint in _AUDIO_ENDPOINTS else read_body(request))
            return await prepare(server, request, body)
        except APIError as e:
            outcome = ("rejected" if e.code == "overloaded" else "error" if e.status >= 500 else "bad_request")
            if e.status != 401 and not e.counted:
                server.metrics.requests.labels(endpoint, outcome).inc()
            return error_response(e)
        except ClientGone as e:
            if not e.counted:
                server.metrics.requests.labels(endpoint, "aborted").inc()
            return Response(status_code=499)

    def check_endpoint(endpoint: str) -> None:
        """A 400 for a route the served model has not the capability of."""
        need = _NEEDS.get(endpoint)
        if need is None or (server.can(need) and not (need == I.GENERATES_TOKENS and server.can(I.TRANSCRIBES))):
            return
        name = settings.served_model_names[0]
        if server.can(I.TRANSCRIBES) and endpoint in ("completions", "chat"):
            raise APIError(400, f"The model `{name}` is a speech-recognition model; it serves "
                                "POST /v1/audio/transcriptions, not text completions.", param="model",
                           code="unsupported_endpoint")
        if endpoint in _AUDIO_ENDPOINTS:
            raise APIError(400, f"The model `{name}` is not a speech-recognition model; "
                                f"/v1/audio/{endpoint} needs a Whisper model.", param="model",
                           code="unsupported_endpoint")
        serves = [route for cap, route in _ROUTES if server.can(cap)]
        raise APIError(400, f"The model `{name}` does not serve {_ROUTE_OF[endpoint]}"
                            + (f"; it serves {', '.join(serves)}." if serves else "."), param="model",
                       code="unsupported_endpoint")

    async def simple(request: Request, fn):
        """Auth + body + errors for the small endpoints; `await fn(server, body)` makes the response."""
        try:
            check_auth(request)
            return JSONResponse(await fn(server, await read_body(request)))
        except APIError as e:
            return error_response(e)

    # -- routes ---------------------------------------------------------------------------------
    @app.post("/v1/audio/transcriptions")
    async def transcriptions_route(request: Request):
        return await handle(request, "transcriptions", TA.transcribe)

    @app.post("/v1/audio/translations")
    async def translations_route(request: Request):
        return await handle(request, "translations", functools.partial(TA.transcribe, task="translate"))

    @app.post("/v1/audio/speech")
    async def speech_route(request: Request):
        return await handle(request, "speech", AS.speech)

    def gated(request: Request, endpoint: str, fn):
        """Auth + capability + errors for the GET / DELETE routes without a body."""
        try:
            check_auth(request)
            check_endpoint(endpoint)
            out = fn()
            return out if isinstance(out, Response) else JSONResponse(out)
        except APIError as e:
            return error_response(e)

    @app.get("/v1/audio/voices")
    async def voices_route(request: Request):
        return gated(request, "voices", lambda: AS.voices(server))

    @app.post("/v1/images/generations")
    async def images_route(request: Request):
        return await handle(request, "images", AM.images)

    @app.post("/v1/videos")
    async def videos_route(request: Request):
        return await handle(request, "videos", AV.create)

    @app.post("/v1/videos/sync")
    async def videos_sync_route(request: Request):
        return await handle(request, "videos", AV.sync)

    @app.get("/v1/videos")
    async def videos_list_route(request: Request):
        return gated(request, "videos", lambda: AV.listing(server))

    @app.get("/v1/videos/{video_id}")
    async def video_route(request: Request, video_id: str):
        return gated(request, "videos", lambda: AV.retrieve(server, video_id))

    @app.get("/v1/videos/{video_id}/content")
    async def video_content_route(request: Request, video_id: str):
        return gated(request, "videos", lambda: AV.content(server, video_id))

    @app.delete("/v1/videos/{video_id}")
    async def video_delete_route(request: Request, video_id: str):
        return gated(request, "videos", lambda: AV.delete(server, video_id))

    @app.post("/v1/completions")
    async def completions_route(request: Request):
        return await handle(request, "completions", completions)

    @app.post("/v1/chat/completions")
    async def chat_completions_route(request: Request):
        return await handle(request, "chat", chat_completions)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_auth(request)
        except APIError as e:
            return error_response(e)
        data = [{"id": name, "object": "model", "created": server.created, "owned_by": "mstar",
                 "root": settings.model, "parent": None, "max_model_len": server.max_model_len,
                 "vocab_size": server.vocab_size} for name in settings.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await simple(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await simple(request, detokenize)

    @app.get("/health")
    async def health(request: Request):
        """200 while the engine serves; 503 while it is down (restarting) or the server drains.
        The engine's internals only with a valid API key."""
        if server.dead is not None:
            body = {"status": "error", "engine": "restarting" if server.restarting else "dead"}
        elif server.draining:
            body = {"status": "error", "engine": "alive", "draining": True}
        else:
            body = {"status": "ok", "engine": "alive"}
        if authorised(request):
            eng = server.engine
            body.update(engine_pid=eng.pid, device=eng.info.get("device"), gpu=eng.info.get("gpu"),
                        pending=server.admission.pending, engine_restarts=server.restarts,
                        message=server.dead)
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        import mstar
        return {"version": mstar.__version__}

    return app
