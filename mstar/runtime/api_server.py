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
error event on a stream), new ones a 503, and /health says so.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus), GET /version, POST /tokenize and /detokenize (vLLM's shapes).
A Whisper (encoder-decoder) model serves POST /v1/audio/transcriptions (and /translations) instead of the
completion endpoints (multipart form, OpenAI's schema; transcribe.py): the audio is decoded
and cut into 30 s windows here, each window is one engine sequence carrying its samples.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mstar.runtime import api_protocol as P
from mstar.runtime.api_protocol import APIError
from mstar.runtime.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from mstar.runtime.request import EngineRequest, SamplingParams

logger = logging.getLogger("mstar.server")


@dataclass
class ServerSettings:
    model: str = "tiny-qwen3.5"
    served_model_names: list[str] = field(default_factory=lambda: ["tiny-qwen3.5"])
    api_key: str | None = None
    max_pending: int = 1024  # sequences admitted and not yet finished
    overload_policy: str = "reject"  # "reject" (503 + Retry-After) | "wait"
    max_body_bytes: int = 32 * 1024 * 1024
    retry_after_s: int = 1
    max_audio_seconds: float = 1800.0  # /v1/audio/transcriptions: longer audio is a 400


# ---------------------------------------------------------------------------------------
# per-sequence and per-request state

class _Seq:
    __slots__ = ("arrival", "finished", "first_t", "index", "job", "last_t", "n_out", "prompt_len", "rid")

    def __init__(self, rid: str, index: int, job: _Job, prompt_len: int, arrival: float):
        self.rid, self.index, self.job, self.prompt_len, self.arrival = rid, index, job, prompt_len, arrival
        self.first_t = self.last_t = None
        self.n_out = 0
        self.finished = False


class _Job:
    """The sequences of one HTTP request; their updates arrive on one queue in order."""

    def __init__(self, server: Server, endpoint: str, n_seqs: int):
        self.server = server
        self.endpoint = endpoint
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seqs: list[_Seq] = []
        self.remaining = n_seqs
        self.n_admitted = n_seqs
        self.closed = False
        self.outcome: str | None = None

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, RequestOutput) until every sequence finished; raises APIError on failure."""
        while self.remaining > 0:
            idx, item = await self.queue.get()
            if isinstance(item, APIError):
                raise item
            if item.finished:
                self.remaining -= 1
            yield idx, item

    async def merged(self, states: list) -> AsyncIterator[tuple[int, str, list, list, bool]]:
        """For streaming: (index, text delta, new token ids, new logprobs, finished) per choice,
        folding together every update already queued (a client or an event loop that falls
        behind gets fewer, larger chunks instead of a growing backlog)."""
        while self.remaining > 0:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            acc: dict[int, list] = {}
            for idx, item in items:
                if isinstance(item, APIError):
                    raise item
                if item.finished:
                    self.remaining -= 1
                d, ids, lps = states[idx].update(item)
                a = acc.get(idx)
                if a is None:
                    acc[idx] = [d, ids, lps, item.finished]
                else:
                    a[0] += d
                    a[1] = a[1] + ids
                    a[2] = a[2] + lps
                    a[3] = a[3] or item.finished
            for idx, (d, ids, lps, fin) in acc.items():
                yield idx, d, ids, lps, fin

    def close(self, outcome: str) -> None:
        """Abort what is still running (client gone, error) and release the admission."""
        if self.closed:
            return
        self.closed = True
        self.outcome = outcome
        live = [s.rid for s in self.seqs if not s.finished]
        if live:
            self.server.abort_seqs(live)
        self.server.admission.release(self.n_admitted)
        self.server.metrics.requests.labels(self.endpoint, outcome).inc()


class Admission:
    """At most `limit` sequences admitted at once; beyond it reject (503 + Retry-After) or
    wait in FIFO order. A request larger than the limit is admitted when nothing else is."""

    def __init__(self, limit: int, policy: str, metrics: ServerMetrics, retry_after_s: int):
        self.limit, self.policy, self.metrics, self.retry_after_s = limit, policy, metrics, retry_after_s
        self.pending = 0
        self._queue: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self.broken: APIError | None = None

    def _fits(self, k: int) -> bool:
        return self.pending == 0 or self.pending + k <= self.limit

    def _overloaded(self) -> APIError:
        return APIError(503, f"The server is overloaded ({self.pending} sequences pending, limit {self.limit}); "
                             "retry later.", code="overloaded",
                        headers={"Retry-After": str(self.retry_after_s)})

    def _take(self, k: int) -> None:
        self.pending += k
        self.metrics.pending.set(self.pending)

    async def acquire(self, k: int, request: Request) -> None:
        if self.broken is not None:
            raise self.broken
        if not self._queue and self._fits(k):
            self._take(k)
            return
        if self.policy == "reject":
            raise self._overloaded()
        fut = asyncio.get_running_loop().create_future()
        entry = (k, fut)
        self._queue.append(entry)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=0.5)
                if done:
                    fut.result()  # admitted (pending already counted), or the engine died
                    return
                if await request.is_disconnected():
                    raise _ClientGone()
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(k)  # admitted just as we gave up
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._queue.remove(entry)
                self._admit_waiters()
            raise

    def release(self, k: int) -> None:
        self.pending -= k
        self.metrics.pending.set(self.pending)
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        while self._queue:
            k, fut = self._queue[0]
            if fut.done():
                self._queue.popleft()
                continue
            if not self._fits(k):
                break
            self._queue.popleft()
            self._take(k)
            fut.set_result(None)

    def fail_waiters(self, err: APIError) -> None:
        self.broken = err
        while self._queue:
            _, fut = self._queue.popleft()
            if not fut.done():
                fut.set_exception(err)


class _ClientGone(Exception):
    def __init__(self, counted: bool = False):
        super().__init__("client disconnected")
        self.counted = counted  # already recorded in the metrics (by _Job.close)


# ---------------------------------------------------------------------------------------
# the engine side of the API process

class Server:
    """Owns the engine process handle, the tokenizer, the OutputProcessor and the live sequences."""

    def __init__(self, settings: ServerSettings, engine, tokenizer, output_processor=None):
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        if output_processor is None:
            from mstar.runtime.output_processor import OutputProcessor
            output_processor = OutputProcessor(tokenizer)
        self.proc = output_processor
        self.metrics = ServerMetrics(settings.served_model_names[0])
        self.admission = Admission(settings.max_pending, settings.overload_policy, self.metrics,
                                   settings.retry_after_s)
        info = engine.info
        self.max_model_len: int = info["max_model_len"]
        self.eos_token_ids: tuple[int, ...] = tuple(info.get("eos_token_ids", ()))
        self.vocab_size: int = int(info.get("vocab_size") or (len(tokenizer) if tokenizer is not None else 0))
        self.is_whisper = bool(info.get("is_encoder_decoder"))  # speech recognition: transcriptions only
        self.whisper_tokens = None
        if self.is_whisper:
            from mstar.runtime.transcribe import whisper_tokens
            self.whisper_tokens = whisper_tokens(self.vocab_size, tokenizer)
        self.seqs: dict[str, _Seq] = {}
        self.dead: str | None = None
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())
        self._tok_str: dict[int, str] = {}
        self.metrics.engine_alive.set(1)

    # -- engine messages (reader thread -> event loop) ----------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

        def on_message(msg):
            try:
                loop.call_soon_threadsafe(self._on_message, msg)
            except RuntimeError:  # loop closed at shutdown
                pass

        self.engine.start_reader(on_message)

    def _on_message(self, msg: tuple) -> None:
        try:
            kind = msg[0]
            if kind == "step":
                self._on_step(*msg[1:])
            elif kind == "exited" and self.stopping:
                return
            elif kind in ("fatal", "exited"):
                if kind == "fatal":
                    logger.error("the engine failed:\n%s", msg[1])
                self._engine_died("the engine process failed" if kind == "fatal"
                                  else f"the engine process exited (code {msg[1]})")
        except Exception:  # never let one bad message stop delivery of the others
            logger.exception("error while handling an engine message")

    def _on_step(self, outputs, errors, stats) -> None:
        now = time.monotonic()
        for rid, fld, message in errors:
            seq = self.seqs.pop(rid, None)
            if seq is None:
                continue
            seq.finished = True
            with contextlib.suppress(Exception):
                self.proc.abort(rid)
            seq.job.queue.put_nowait((seq.index, APIError(400, f"Invalid '{fld}': {message}" if fld else message,
                                                          param=fld, code="invalid_value")))
        live = [o for o in outputs if o.request_id in self.seqs]
        if live:
            try:
                updates, stopped = self.proc.process(live)
            except Exception:  # never leave these requests hanging: fail them, free them in the engine
                logger.exception("detokenization failed; failing %d request(s)", len(live))
                err = APIError(500, "Internal error while detokenizing the output.", code="internal_error")
                rids = [o.request_id for o in live]
                for rid in rids:
                    seq = self.seqs.get(rid)
                    if seq is not None:
                        seq.job.queue.put_nowait((seq.index, err))
                self.abort_seqs(rids)
                live, updates, stopped = [], [], []
            if stopped:
                self.engine.abort(list(stopped))
            m = self.metrics
            for u in updates:
                seq = self.seqs.get(u.request_id)
                if seq is None:
                    continue
                k = len(u.new_token_ids or ())
                if k:
                    if seq.first_t is None:
                        seq.first_t = now
                        m.ttft.observe(now - seq.arrival)
                        k_itl = k - 1
                    else:
                        k_itl = k
                    if k_itl and seq.last_t is not None:
                        dt = (now - seq.last_t) / k_itl
                        for _ in range(k_itl):
                            m.itl.observe(dt)
                    seq.last_t = now
                    seq.n_out += k
                    m.generation_tokens.inc(k)
                if u.finished:
                    seq.finished = True
                    del self.seqs[u.request_id]
                    m.finished.labels(u.finish_reason or "stop").inc()
                    m.e2e.observe(now - seq.arrival)
                    if u.num_cached_tokens:
                        m.cached_prompt_tokens.inc(u.num_cached_tokens)
                seq.job.queue.put_nowait((seq.index, u))
        if stats:
            self.metrics.update_engine_stats(stats)

    def _engine_died(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        logger.error("%s; answering 503 from now on", why)
        self.metrics.engine_alive.set(0)
        err = APIError(503, f"The engine is not available: {why}.", code="engine_dead")
        self.admission.fail_waiters(err)
        for rid, seq in list(self.seqs.items()):
            seq.finished = True
            seq.job.queue.put_nowait((seq.index, err))
        self.seqs.clear()

    # -- submitting and aborting ---------------------------------------------------------------
    def submit(self, job: _Job, index: int, prompt_ids: list[int], params: SamplingParams,
               arrival: float, extra: dict | None = None) -> None:
        rid = f"{job.endpoint[:4]}-{uuid.uuid4().hex}"
        seq = _Seq(rid, index, job, len(prompt_ids), arrival)
        job.seqs.append(seq)
        self.seqs[rid] = seq
        self.proc.add_request(rid, list(prompt_ids), params)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self.engine.add(EngineRequest(rid, list(prompt_ids), params, eos_token_ids=self.eos_token_ids,
                                      arrival_time=time.time(), **(extra or {})))

    def abort_seqs(self, rids: list[str]) -> None:
        gone = []
        for rid in rids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                seq.finished = True
                gone.append(rid)
                self.metrics.finished.labels("abort").inc()
                with contextlib.suppress(Exception):
                    self.proc.abort(rid)
        if gone and self.dead is None:
            self.engine.abort(gone)

    def check_alive(self) -> None:
        if self.dead is not None:
            raise APIError(503, f"The engine is not available: {self.dead}.", code="engine_dead")

    # -- tokens ---------------------------------------------------------------------------------
    def token_str(self, tid: int) -> str:
        s = self._tok_str.get(tid)
        if s is None:
            if self.tokenizer is None:
                return f"token_id:{tid}"
            try:
                s = self.tokenizer.decode([tid], skip_special_tokens=False)
            except Exception:
                s = ""
            if len(self._tok_str) < 1_000_000:
                self._tok_str[tid] = s
        return s

    def need_tokenizer(self, param: str, what: str) -> None:
        if self.tokenizer is None:
            raise P.bad(param, f"This model has no tokenizer, so {what} cannot be used; send prompts as "
                               "token ids (and read token_ids with return_token_ids).", "no_tokenizer")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.need_tokenizer("prompt", "text prompts")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(ids)


# ---------------------------------------------------------------------------------------
# responses

def error_response(e: APIError) -> JSONResponse:
    headers = dict(e.headers)
    if e.status == 413:
        headers["Connection"] = "close"
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class SSEResponse(StreamingResponse):
    """Server-sent events from an async iterator of strings.

    A client that goes away cancels the iterator at its current await (its `finally`
    aborts the request in the engine), whatever the ASGI server's spec version."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close=None):
        super().__init__(events, status_code=200, headers={"Cache-Control": "no-cache",
                                                           "X-Accel-Buffering": "no"})
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for ev in self.events:
                await send({"type": "http.response.body", "body": ev.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def listen():
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return

        pump_t = asyncio.ensure_future(pump())
        listen_t = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({pump_t, listen_t}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_t, listen_t):
                if not t.done():
                    t.cancel()
            await asyncio.gather(pump_t, listen_t, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.events.aclose()
            if self.on_close is not None:  # the iterator may never have started (no finally ran)
                self.on_close()
        if pump_t.done() and not pump_t.cancelled() and pump_t.exception() is not None:
            exc = pump_t.exception()
            if not isinstance(exc, OSError):
                logger.error("stream failed", exc_info=exc)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


_DONE = "data: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _until_done_or_gone(request: Request, coro):
    """Run coro; if the client disconnects first, cancel it and raise _ClientGone."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not gone.done():
            gone.cancel()
        if not work.done() and not gone.done():  # we were cancelled ourselves
            work.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(BaseException):
        await work
    raise _ClientGone()


class _ChoiceState:
    __slots__ = (
        "finish_reason",
        "logprobs",
        "lp_seen",
        "num_cached",
        "num_prompt",
        "started",
        "stop_reason",
        "text",
        "token_ids",
    )

    def __init__(self):
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason = None
        self.stop_reason = None
        self.num_prompt = 0
        self.num_cached = 0
        self.started = False
        self.lp_seen = 0

    def update(self, u) -> tuple[str, list[int], list]:
        """Fold in one RequestOutput; returns (text delta, new token ids, new logprobs)."""
        delta = u.text_delta or ""
        new_ids = list(u.new_token_ids or ())
        self.text = u.text if u.text is not None else self.text + delta
        if u.token_ids is not None:
            self.token_ids = list(u.token_ids)
        else:
            self.token_ids.extend(new_ids)
        new_lp = []
        if u.logprobs is not None:  # cumulative: every token's so far
            new_lp = list(u.logprobs[self.lp_seen:])
            self.lp_seen += len(new_lp)
            self.logprobs.extend(new_lp)
        self.num_prompt = u.num_prompt_tokens or self.num_prompt
        self.num_cached = u.num_cached_tokens or self.num_cached
        if u.finished:
            self.finish_reason = u.finish_reason or "stop"
            self.stop_reason = u.stop_reason
        return delta, new_ids, new_lp


# ---------------------------------------------------------------------------------------
# the app

_AUDIO_ENDPOINTS = ("transcriptions", "translations")  # Whisper: multipart forms


def build_app(settings: ServerSettings, engine, tokenizer, output_processor=None) -> FastAPI:
    server = Server(settings, engine, tokenizer, output_processor)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.attach(asyncio.get_running_loop())
        yield
        logger.info("stopping the engine")
        server.stopping = True
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="mstar", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
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
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise APIError(413, f"The request body exceeds the limit of {limit} bytes.",
                               code="request_too_large")
        return bytes(buf)

    def check_model(model: str | None) -> str:
        if model is None:
            return settings.served_model_names[0]
        if model not in settings.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                                f"{', '.join(settings.served_model_names)}.", param="model",
                           code="model_not_found")
        return model

    def prompt_ids_for(p, add_special_tokens: bool, where: str) -> list[int]:
        if isinstance(p, str):
            ids = server.encode(p, add_special_tokens)
        else:
            ids = p
            V = server.vocab_size
            for t in ids:
                if t < 0 or t >= V:
                    raise P.bad(where, f"Invalid '{where}': token id {t} is out of range [0, {V}).",
                                "invalid_value")
        if not ids:
            raise P.bad(where, f"Invalid '{where}': the prompt is empty.", "invalid_value")
        return ids

    def max_tokens_for(n_prompt: int, req, where: str) -> int:
        L = server.max_model_len
        if n_prompt >= L:
            raise APIError(400, f"This model's maximum context length is {L} tokens. However, your prompt has "
                                f"{n_prompt} tokens. Please reduce the length of the {where}.", param=where,
                           code="context_length_exceeded")
        mt = req.max_tokens
        if mt is None:
            return L - n_prompt
        if n_prompt + mt > L:
            raise APIError(400, f"This model's maximum context length is {L} tokens. However, you requested "
                                f"{n_prompt + mt} tokens ({n_prompt} in the {where}, {mt} in the completion). "
                                f"Please reduce the length of the {where} or {req.max_tokens_field}.",
                           param=req.max_tokens_field, code="context_length_exceeded")
        return mt

    def check_stop_ids(sampling: dict) -> None:
        if sampling["stop"]:
            server.need_tokenizer("stop", "stop strings")
        V = server.vocab_size
        for t in sampling["stop_token_ids"]:
            if V and t >= V:
                raise P.bad("stop_token_ids", f"Invalid 'stop_token_ids': token id {t} is out of range [0, {V}).",
                            "invalid_value")

    def choice_params(base: SamplingParams, j: int) -> SamplingParams:
        if j == 0:
            return base
        p = SamplingParams(**{f: getattr(base, f) for f in base.__dataclass_fields__})
        if p.seed is not None:
            p.seed = (p.seed + j) % P.MAX_SEED
        p.stop = list(base.stop)
        p.stop_token_ids = list(base.stop_token_ids)
        return p

    async def start_job(request: Request, endpoint: str, prompts: list[list[int]], params: list[SamplingParams],
                        n: int, extras: list[dict] | None = None) -> _Job:
        job = _Job(server, endpoint, len(prompts) * n)
        await server.admission.acquire(job.n_admitted, request)
        arrival = request.state.arrival
        try:
            server.check_alive()
            for i, ids in enumerate(prompts):
                for j in range(n):
                    server.submit(job, i * n + j, ids, choice_params(params[i], j), arrival,
                                  extras[i] if extras else None)
        except BaseException as e:
            job.close("error" if not isinstance(e, APIError) or e.status >= 500 else "bad_request")
            if isinstance(e, APIError):
                e.counted = True
            raise
        return job

    def usage(states: list[_ChoiceState], n: int) -> dict:
        prompt = sum(states[i].num_prompt for i in range(0, len(states), n))
        cached = sum(states[i].num_cached for i in range(0, len(states), n))
        completion = sum(len(s.token_ids) for s in states)
        u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if cached:
            u["prompt_tokens_details"] = {"cached_tokens": cached}
        return u

    async def handle(request: Request, endpoint: str, prepare):
        """Common frame: auth, body, parse, admission, run; maps errors to responses and metrics."""
        request.state.arrival = time.monotonic()  # TTFT and latency are measured from here
        try:
            check_auth(request)
            server.check_alive()
            check_endpoint(endpoint)
            body = await (read_form(request) if endpoint in _AUDIO_ENDPOINTS else read_body(request))
            return await prepare(request, body)
        except APIError as e:
            outcome = ("rejected" if e.code == "overloaded" else "error" if e.status >= 500 else "bad_request")
            if e.status != 401 and not e.counted:
                server.metrics.requests.labels(endpoint, outcome).inc()
            return error_response(e)
        except _ClientGone as e:
            if not e.counted:
                server.metrics.requests.labels(endpoint, "aborted").inc()
            return Response(status_code=499)

    def check_endpoint(endpoint: str) -> None:
        name = settings.served_model_names[0]
        if server.is_whisper and endpoint in ("completions", "chat"):
            raise APIError(400, f"The model `{name}` is a speech-recognition model; it serves "
                                "POST /v1/audio/transcriptions, not text completions.", param="model",
                           code="unsupported_endpoint")
        if endpoint in _AUDIO_ENDPOINTS and not server.is_whisper:
            raise APIError(400, f"The model `{name}` is not a speech-recognition model; "
                                f"/v1/audio/{endpoint} needs a Whisper model.", param="model",
                           code="unsupported_endpoint")

    # -- /v1/completions ------------------------------------------------------------------------
    async def collect_job(request: Request, job: _Job, states: list[_ChoiceState]) -> None:
        """Fold a non-streamed job's updates into `states`; the job is closed with its outcome
        (a client that goes away aborts it at once)."""
        async def collect():
            async for i, u in job.events():
                states[i].update(u)

        try:
            await _until_done_or_gone(request, collect())
        except _ClientGone:
            job.close("aborted")
            raise _ClientGone(counted=True) from None
        except APIError as e:
            job.close("error" if e.status >= 500 else "bad_request")
            e.counted = True
            raise
        except BaseException:
            job.close("error")
            raise
        job.close("success")

    def stream_job(job: _Job, chunks) -> SSEResponse:
        """SSE response over `chunks` (an async iterator of events): always ends with [DONE],
        an engine error becomes an error event, and the job is closed with its outcome."""
        async def events():
            outcome = "error"
            try:
                async for ev in chunks:
                    yield ev
                outcome = "success"
                yield _DONE
            except APIError as e:
                outcome = "error" if e.status >= 500 else "bad_request"
                yield _sse(e.body())
                yield _DONE
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "aborted"
                raise
            finally:
                job.close(outcome)

        return SSEResponse(events(), on_close=lambda: job.close("aborted"))

    async def completions_impl(request: Request, body: dict):
        req = P.parse_completion(body)
        model = check_model(req.model)
        prompts, texts = [], []
        for i, p in enumerate(req.prompts):
            where = "prompt"
            ids = prompt_ids_for(p, req.add_special_tokens, where)
            prompts.append(ids)
            texts.append(p if isinstance(p, str) else None)
        check_stop_ids(req.sampling)
        params = []
        for ids in prompts:
            mt = max_tokens_for(len(ids), req, "prompt")
            params.append(P.build_params(req.sampling, mt, max_tokens_field=req.max_tokens_field,
                                         logprobs=req.logprobs))
        job = await start_job(request, "completions", prompts, params, req.n)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        n_choices = len(prompts) * req.n
        states = [_ChoiceState() for _ in range(n_choices)]

        def echo_text(i: int) -> str:
            pi = i // req.n
            t = texts[pi]
            if t is not None or server.tokenizer is None:
                return t or ""
            return server.tokenizer.decode(prompts[pi], skip_special_tokens=False)

        def lp_block(st: _ChoiceState, ids: list[int], lps: list, offset0: int) -> dict | None:
            if req.logprobs is None:
                return None
            tokens, tlp, top, offs = [], [], [], []
            off = offset0
            for tid, lp in zip(ids, lps):
                s = server.token_str(tid)
                tokens.append(s)
                tlp.append(lp.logprob)
                top.append({server.token_str(a): b for a, b in zip(lp.top_ids, lp.top_logprobs)}
                           if req.logprobs > 0 else None)
                offs.append(off)
                off += len(s)
            return {"tokens": tokens, "token_logprobs": tlp, "top_logprobs": top, "text_offset": offs}

        def choice_extra(c: dict, st: _ChoiceState, i: int, new_ids: list[int] | None) -> dict:
            if st.stop_reason is not None or st.finish_reason is not None:
                c["stop_reason"] = st.stop_reason
            if req.return_token_ids:
                c["token_ids"] = new_ids if new_ids is not None else st.token_ids
                if not st.started or new_ids is None:
                    c["prompt_token_ids"] = prompts[i // req.n]
            return c

        if req.stream:
            offsets = [0] * n_choices

            async def events():
                async for i, delta, new_ids, new_lp, fin in job.merged(states):
                    st = states[i]
                    if not (delta or new_ids or fin):
                        continue
                    if req.echo and not st.started:
                        delta = echo_text(i) + delta
                    c = {"index": i, "text": delta,
                         "logprobs": lp_block(st, new_ids, new_lp, offsets[i]),
                         "finish_reason": st.finish_reason}
                    offsets[i] += len(delta)
                    c = choice_extra(c, st, i, new_ids)
                    st.started = True
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [c]}
                    if req.stream_options.include_usage:
                        chunk["usage"] = usage(states, req.n) if req.stream_options.continuous_usage_stats \
                            else None
                    yield _sse(chunk)
                if req.stream_options.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": usage(states, req.n)})

            return stream_job(job, events())

        await collect_job(request, job, states)
        choices = []
        for i, st in enumerate(states):
            prefix = echo_text(i) if req.echo else ""
            c = {"index": i, "text": prefix + st.text,
                 "logprobs": lp_block(st, st.token_ids[:len(st.logprobs)], st.logprobs, 0),
                 "finish_reason": st.finish_reason}
            choices.append(choice_extra(c, st, i, None))
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": usage(states, req.n)})

    # -- /v1/chat/completions -------------------------------------------------------------------
    def chat_prompt(req: P.ChatRequest) -> list[int]:
        server.need_tokenizer("messages", "chat completions")
        tok = server.tokenizer
        if not getattr(tok, "chat_template", None):
            raise P.bad("messages", "This model has no chat template; use /v1/completions.", "no_chat_template")
        try:
            text = tok.apply_chat_template(req.messages, tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message,
                                           **req.chat_template_kwargs)
        except Exception as e:  # jinja errors, raise_exception() in the template
            raise P.bad("messages", f"The chat template could not render these messages: {e}",
                        "invalid_messages") from None
        return prompt_ids_for(text, req.add_special_tokens, "messages")

    async def chat_impl(request: Request, body: dict):
        req = P.parse_chat(body)
        model = check_model(req.model)
        ids = chat_prompt(req)
        check_stop_ids(req.sampling)
        mt = max_tokens_for(len(ids), req, "messages")
        params = P.build_params(req.sampling, mt, max_tokens_field=req.max_tokens_field,
                                logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                logprobs_field="top_logprobs")
        job = await start_job(request, "chat", [ids], [params], req.n)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        states = [_ChoiceState() for _ in range(req.n)]

        def lp_content(ids_: list[int], lps: list) -> list[dict]:
            out = []
            for tid, lp in zip(ids_, lps):
                s = server.token_str(tid)
                tops = [{"token": server.token_str(a), "logprob": b,
                         "bytes": list(server.token_str(a).encode("utf-8"))}
                        for a, b in zip(lp.top_ids, lp.top_logprobs)] if req.top_logprobs else []
                out.append({"token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8")),
                            "top_logprobs": tops})
            return out

        def choice_extra(c: dict, st: _ChoiceState, new_ids: list[int] | None) -> dict:
            if st.finish_reason is not None:
                c["stop_reason"] = st.stop_reason
            if req.return_token_ids:
                c["token_ids"] = new_ids if new_ids is not None else st.token_ids
                if new_ids is None:
                    c["prompt_token_ids"] = ids
            return c

        if req.stream:
            async def events():
                base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
                use_usage = req.stream_options.include_usage
                for i in range(req.n):
                    c = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                    if req.return_token_ids:
                        c["prompt_token_ids"] = ids
                    chunk = dict(base, choices=[c])
                    if use_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
                async for i, delta, new_ids, new_lp, fin in job.merged(states):
                    st = states[i]
                    if not (delta or new_ids or fin):
                        continue
                    c = {"index": i, "delta": {"content": delta} if (delta or not fin) else {},
                         "logprobs": {"content": lp_content(new_ids, new_lp)} if req.logprobs else None,
                         "finish_reason": st.finish_reason}
                    c = choice_extra(c, st, new_ids)
                    chunk = dict(base, choices=[c])
                    if use_usage:
                        chunk["usage"] = usage(states, req.n) if req.stream_options.continuous_usage_stats \
                            else None
                    yield _sse(chunk)
                if use_usage:
                    yield _sse(dict(base, choices=[], usage=usage(states, req.n)))

            return stream_job(job, events())

        await collect_job(request, job, states)
        choices = []
        for i, st in enumerate(states):
            c = {"index": i, "message": {"role": "assistant", "content": st.text},
                 "logprobs": {"content": lp_content(st.token_ids[:len(st.logprobs)], st.logprobs)}
                 if req.logprobs else None,
                 "finish_reason": st.finish_reason}
            choices.append(choice_extra(c, st, None))
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": usage(states, req.n)})

    # -- /v1/audio/transcriptions (Whisper) -------------------------------------------------------
    from mstar.runtime import transcription_api as TA

    read_form = TA.form_reader(read_raw)

    async def run_job(request: Request, job: _Job, n: int) -> list[_ChoiceState]:
        states = [_ChoiceState() for _ in range(n)]
        await collect_job(request, job, states)
        return states

    async def transcriptions_impl(request: Request, form):
        return await TA.transcribe(server, settings, request, form, check_model, start_job, run_job)

    async def translations_impl(request: Request, form):
        return await TA.transcribe(server, settings, request, form, check_model, start_job, run_job,
                                   task="translate")

    # -- routes ---------------------------------------------------------------------------------
    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        return await handle(request, "transcriptions", transcriptions_impl)

    @app.post("/v1/audio/translations")
    async def translations(request: Request):
        return await handle(request, "translations", translations_impl)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions", completions_impl)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat", chat_impl)

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

    async def simple(request: Request, fn):
        """Auth + body + errors for the small endpoints."""
        try:
            check_auth(request)
            return JSONResponse(fn(await read_body(request)))
        except APIError as e:
            return error_response(e)

    def tokenize(body: dict) -> dict:
        check_model(P._str(body, "model"))
        if "messages" in body:
            P._check_unknown(body, frozenset({"model", "messages", "add_generation_prompt",
                                              "continue_final_message", "chat_template_kwargs",
                                              "add_special_tokens"}))
            req = P.parse_chat(dict(body))
            ids = chat_prompt(req)
        else:
            P._check_unknown(body, frozenset({"model", "prompt", "add_special_tokens"}))
            prompt = P._str(body, "prompt")
            if prompt is None:
                raise P.bad("prompt", "Missing required parameter: 'prompt' (or 'messages').",
                            "missing_required_parameter")
            ids = server.encode(prompt, P._bool(body, "add_special_tokens", True)) if prompt else []
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}

    def detokenize(body: dict) -> dict:
        P._check_unknown(body, frozenset({"model", "tokens"}))
        check_model(P._str(body, "model"))
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise P.bad("tokens", "Invalid 'tokens': expected an array of integer token ids.", "invalid_type")
        if any(t < 0 or t >= server.vocab_size for t in toks):
            raise P.bad("tokens", f"Invalid 'tokens': ids must be in [0, {server.vocab_size}).", "invalid_value")
        server.need_tokenizer("tokens", "detokenization")
        return {"prompt": server.tokenizer.decode(toks, skip_special_tokens=False)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await simple(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await simple(request, detokenize)

    @app.get("/health")
    async def health():
        if server.dead is not None:
            return JSONResponse({"status": "error", "engine": "dead", "message": server.dead}, status_code=503)
        return JSONResponse({"status": "ok", "engine": "alive", "engine_pid": engine.pid,
                             "device": engine.info.get("device"), "gpu": engine.info.get("gpu"),
                             "pending": server.admission.pending})

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        import mstar
        return {"version": mstar.__version__}

    return app
