"""The engine side of the API process: `Server` owns the engine process handle, the
tokenizer, the OutputProcessor and the live sequences.

The engine's messages arrive on a reader thread and are handed to the event loop; each
step's outputs are detokenized here (stop strings found here abort the sequence in the
engine at once), timed into the metrics (TTFT, ITL, end to end) and queued on their job
(api_jobs.Job).

Supervision: if the engine process dies, every live sequence and every request waiting for
admission gets a 503 at once, /health says so and the engine gauges go back to zero; then a new
engine process is started (--engine-restarts times, with back-off; mstar_engine_restarts counts
them). Once the restarts are spent, `on_fatal` is called: the server exits non-zero, so that a
supervisor (systemd, Kubernetes) restarts it.

Drain: `begin_drain` (SIGTERM) refuses new requests with a 503; what still runs when the drain
timeout ends is failed with a 503 through its job, so each client gets an error body or, on a
stream, an error event and [DONE].

Tokenization runs on a small thread pool, never on the event loop, after a length bound checked
before encoding: a text longer than the context times the longest token in the vocabulary cannot
fit, so it is refused without being encoded.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from mstar.models import interfaces as I
from mstar.runtime.serving import api_protocol as P
from mstar.runtime.serving.api_jobs import Admission, Job
from mstar.runtime.serving.api_protocol import APIError
from mstar.runtime.serving.metrics import ServerMetrics
from mstar.runtime.engine.request import EngineRequest, SamplingParams

if TYPE_CHECKING:
    from mstar.runtime.serving.api_server import ServerSettings

logger = logging.getLogger("mstar.server")


def freeze_heap() -> None:
    """Collect once, then move every object alive now (the modules: torch, transformers, FastAPI,
    ...: ~200k objects in the API process) out of the cyclic collector's reach. Without it each
    full collection walks them all (~0.1 s with the event loop stalled) and the frequent young
    collections that the per-token allocations trigger pay for them too (~10% of the API
    process's CPU at 20k tokens/s)."""
    gc.collect()
    gc.freeze()


def observe_many(hist, values: list[float]) -> None:
    """hist.observe(v) for every v, with one update per bucket hit and one of the sum (a step
    observes an inter-token latency per running sequence; observe() takes two locks each).
    Falls back to observe() where prometheus_client's Histogram is laid out differently."""
    try:
        bounds, buckets, total = hist._upper_bounds, hist._buckets, hist._sum
        if len(bounds) != len(buckets) or bounds[-1] != float("inf") or hist._labelnames:
            raise AttributeError
    except AttributeError:
        for v in values:
            hist.observe(v)
        return
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1  # the first bound >= v, as observe() picks
    total.inc(sum(values))
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)


class Seq:
    """One engine sequence (one choice of a request) as the API process tracks it."""

    __slots__ = ("arrival", "finished", "first_t", "index", "job", "last_t", "n_out", "prompt_len", "rid")

    def __init__(self, rid: str, index: int, job: Job, prompt_len: int, arrival: float):
        self.rid, self.index, self.job, self.prompt_len, self.arrival = rid, index, job, prompt_len, arrival
        self.first_t = self.last_t = None
        self.n_out = 0
        self.finished = False


class Server:
    """Owns the engine process handle, the tokenizer, the OutputProcessor and the live sequences."""

    def __init__(self, settings: ServerSettings, engine, tokenizer, output_processor=None,
                 make_engine: Callable[[], object] | None = None, on_fatal: Callable[[str], None] | None = None):
        self.settings = settings
        self.engine = engine
        self.make_engine = make_engine  # a new, unstarted engine process (None: no restarts)
        self.on_fatal = on_fatal  # the engine is gone for good: the server should exit non-zero
        self.restarts = 0
        self.tokenizer = tokenizer
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=settings.tokenizer_threads,
                                                          thread_name_prefix="mstar-tokenize")
        # a token covers at most this many characters of text (the longest vocabulary entry;
        # byte-level vocabularies spell one byte per character, and a byte is at most a character)
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer else 1
        if output_processor is None:
            from mstar.runtime.engine.output_processor import OutputProcessor
            output_processor = OutputProcessor(tokenizer, cumulative=False)  # deltas: no O(length) copies
        self.proc = output_processor
        self.metrics = ServerMetrics(settings.served_model_names[0])
        self.admission = Admission(settings.max_pending, settings.overload_policy, self.metrics,
                                   settings.retry_after_s)
        info = engine.info
        self.max_model_len: int = info["max_model_len"]
        self.eos_token_ids: tuple[int, ...] = tuple(info.get("eos_token_ids", ()))
        self.vocab_size: int = int(info.get("vocab_size") or (len(tokenizer) if tokenizer is not None else 0))
        # what the model serves (interfaces.py names; the routes are gated on them) and, for a
        # stage-engine model, what its routes may send (Pipeline.accepts)
        self.capabilities: frozenset[str] = engine_capabilities(info)
        self.accepts: dict = dict(info.get("accepts") or {})
        self.transcriber = _transcriber(info.get("model_name"), self.vocab_size, tokenizer)
        self.seqs: dict[str, Seq] = {}
        self.media_rids: set[str] = set()  # the live sequences of stage-engine (media) requests
        self.dead: str | None = None
        self.stopping = False
        self.draining = False
        self.restarting = False  # a new engine process is being started
        self._generation = 0  # which engine process the reader's messages come from
        self.loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())
        self._tok_str: dict[int, str] = {}
        self.metrics.engine_alive.set(1)

    def can(self, capability: str) -> bool:
        """Whether the served model has `capability` (an interfaces.py name)."""
        return capability in self.capabilities

    # -- engine messages (reader thread -> event loop) ----------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._read(self.engine)

    def _read(self, engine) -> None:
        """Deliver `engine`'s messages to the event loop, tagged with its generation (a message
        of an engine replaced since is dropped)."""
        self._generation += 1
        gen, loop = self._generation, self.loop

        def on_message(msg):
            try:
                loop.call_soon_threadsafe(self._on_message, msg, gen)
            except RuntimeError:  # loop closed at shutdown
                pass

        engine.start_reader(on_message)

    def _on_message(self, msg: tuple, gen: int | None = None) -> None:
        if gen is not None and gen != self._generation:
            return
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
            self.media_rids.discard(rid)
            if seq is None:
                continue
            seq.finished = True
            with contextlib.suppress(Exception):
                self.proc.abort(rid)
            seq.job.queue.put_nowait((seq.index, APIError(400, f"Invalid '{fld}': {message}" if fld else message,
                                                          param=fld, code="invalid_value")))
        if self.media_rids:
            outputs = self._on_media(outputs, now)
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
            seqs = self.seqs
            n_tokens = 0
            itls: list[float] = []
            for u in updates:
                seq = seqs.get(u.request_id)
                if seq is None:
                    continue
                k = len(u.new_token_ids or ())
                if k:
                    n_tokens += k
                    if seq.first_t is None:
                        seq.first_t = now
                        m.ttft.observe(now - seq.arrival)
                        k_itl = k - 1
                    else:
                        k_itl = k
                    if k_itl and seq.last_t is not None:
                        dt = (now - seq.last_t) / k_itl
                        itls.extend([dt] * k_itl)
                    seq.last_t = now
                    seq.n_out += k
                if u.finished:
                    seq.finished = True
                    del self.seqs[u.request_id]
                    m.finished.labels(u.finish_reason or "stop").inc()
                    m.e2e.observe(now - seq.arrival)
                    if u.num_cached_tokens:
                        m.cached_prompt_tokens.inc(u.num_cached_tokens)
                seq.job.queue.put_nowait((seq.index, u))
            if n_tokens:
                m.generation_tokens.inc(n_tokens)
            if itls:
                observe_many(m.itl, itls)
        if stats:
            self.metrics.update_engine_stats(stats)

    def _on_media(self, outputs, now: float) -> list:
        """Hand the outputs of media sequences (typed outputs, no tokens) to their jobs as they
        are; the others are returned (token outputs, for the detokenizer)."""
        rest = []
        m = self.metrics
        for o in outputs:
            rid = o.request_id
            if rid not in self.media_rids:
                rest.append(o)
                continue
            seq = self.seqs.get(rid)
            if o.finished:
                self.media_rids.discard(rid)
            if seq is None:  # aborted here already
                continue
            if seq.first_t is None:
                seq.first_t = now
            seq.last_t = now
            seq.n_out += len(o.media or ())
            item = o
            if o.finished:
                seq.finished = True
                del self.seqs[rid]
                m.finished.labels(o.finish_reason).inc()
                m.e2e.observe(now - seq.arrival)
                if o.finish_reason == "error":
                    logger.warning("request %s failed in the engine: %s", rid, o.error)
                    item = APIError(500, f"The model failed on this request: {(o.error or 'unknown error')[:500]}",
                                    code="internal_error")
                elif o.finish_reason == "abort":  # the engine dropped it (this process did not ask)
                    item = APIError(503, "The request was aborted by the engine.", code="aborted")
            seq.job.queue.put_nowait((seq.index, item))
        return rest

    def _engine_died(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        self.metrics.engine_alive.set(0)
        self.metrics.reset_engine_gauges()
        err = APIError(503, f"The engine is not available: {why}.", code="engine_dead")
        self.fail_live(err)
        self.admission.fail_waiters(err)
        with contextlib.suppress(Exception):
            self.engine.kill()  # reap it (and whatever it started)
        left = self.settings.engine_restarts - self.restarts
        if self.make_engine is None or left <= 0 or self.stopping:
            logger.error("%s; no engine restarts left", why)
            if self.on_fatal is not None:
                self.on_fatal(why)
            return
        logger.error("%s; restarting it (%d restart(s) left)", why, left)
        self.restarting = True
        self.loop.create_task(self._restart())

    async def _restart(self) -> None:
        try:
            await self._start_new_engine()
        finally:
            self.restarting = False

    async def _start_new_engine(self) -> None:
        """Start a new engine process after a back-off; on failure try again while restarts are
        left, then give up (on_fatal)."""
        while self.restarts < self.settings.engine_restarts and not self.stopping:
            delay = min(self.settings.restart_backoff_s * 2 ** self.restarts, 30.0)
            self.restarts += 1
            self.metrics.engine_restarts.inc()
            await asyncio.sleep(delay)
            engine = self.make_engine()
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, engine.start)
                info = await loop.run_in_executor(None, engine.wait_ready, self.settings.startup_timeout_s)
            except Exception as e:  # noqa: BLE001 -- an engine that cannot start: try again or give up
                logger.error("the engine restart failed: %s", e)
                with contextlib.suppress(Exception):
                    engine.kill()
                continue
            if self.stopping:
                engine.shutdown()
                return
            self.engine = engine
            self._read(engine)
            self.dead = None
            self.admission.broken = None
            self.metrics.engine_alive.set(1)
            logger.info("engine restarted (pid %s, restart %d of %d)", info.get("pid"), self.restarts,
                        self.settings.engine_restarts)
            return
        if not self.stopping and self.on_fatal is not None:
            self.on_fatal(self.dead or "the engine could not be restarted")

    def fail_live(self, err: APIError) -> None:
        """Fail every live sequence with `err` (through its job: the client gets the error)."""
        for rid, seq in list(self.seqs.items()):
            seq.finished = True
            with contextlib.suppress(Exception):
                self.proc.abort(rid)
            seq.job.queue.put_nowait((seq.index, err))
        self.seqs.clear()
        self.media_rids.clear()

    # -- drain (SIGTERM) -----------------------------------------------------------------------
    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests; fail what still runs after timeout_s (a 503 each)."""
        if self.draining:
            return
        self.draining = True
        logger.info("draining: %d sequence(s) in flight, %.0f s to finish", len(self.seqs), timeout_s)

        def expire():
            if not self.seqs and not self.admission.pending:
                return
            logger.warning("drain timeout: failing %d sequence(s) still running", len(self.seqs))
            err = APIError(503, "The server is shutting down; the request did not finish within the "
                                "drain timeout.", code="server_shutting_down")
            rids = list(self.seqs)
            self.fail_live(err)
            self.admission.fail_waiters(err)
            if rids and self.dead is None:
                self.engine.abort(rids)

        self.loop.call_later(timeout_s, expire)

    # -- submitting and aborting ---------------------------------------------------------------
    def submit(self, job: Job, seqs: list[tuple[int, list[int], SamplingParams, dict | None]],
               arrival: float) -> None:
        """Send a job's sequences, (index, prompt ids, params, extra EngineRequest fields) each,
        to the engine in one message."""
        reqs = []
        now = time.time()
        for index, prompt_ids, params, extra in seqs:
            rid = f"{job.endpoint[:4]}-{uuid.uuid4().hex}"
            seq = Seq(rid, index, job, len(prompt_ids), arrival)
            job.seqs.append(seq)
            self.seqs[rid] = seq
            self.proc.add_request(rid, list(prompt_ids), params)
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            reqs.append(EngineRequest(rid, list(prompt_ids), params, eos_token_ids=self.eos_token_ids,
                                      arrival_time=now, **(extra or {})))
        self.engine.add(reqs)

    def submit_media(self, job: Job, items: list[tuple[int, dict, int]], arrival: float) -> None:
        """Send a job's media sequences, (index, inputs, seed) each, to the (stage) engine in one
        message: each an EngineRequest carrying an interfaces.MediaRequest and no tokens."""
        reqs = []
        now = time.time()
        params = SamplingParams(max_tokens=1)
        for index, inputs, seed in items:
            rid = f"{job.endpoint[:4]}-{uuid.uuid4().hex}"
            seq = Seq(rid, index, job, 0, arrival)
            job.seqs.append(seq)
            self.seqs[rid] = seq
            self.media_rids.add(rid)
            reqs.append(EngineRequest(rid, [], params, arrival_time=now,
                                      media=I.MediaRequest(rid, dict(inputs), int(seed))))
        self.engine.add(reqs)

    def abort_seqs(self, rids: list[str]) -> None:
        gone = []
        for rid in rids:
            self.media_rids.discard(rid)
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
        if self.draining:
            raise APIError(503, "The server is shutting down.", code="server_shutting_down")
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

    def check_text_length(self, n_chars: int, param: str) -> None:
        """Refuse, before encoding, a text that cannot fit in the context: n_chars characters are
        at least n_chars / max_token_chars tokens."""
        limit = self.max_model_len * self.max_token_chars
        if n_chars > limit:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; a text of "
                                f"{n_chars} characters cannot fit (at most {limit} characters can).",
                           param=param, code="context_length_exceeded")

    async def in_pool(self, fn, *args):
        """fn(*args) on the tokenizer threads (tokenizing a long text must not stall the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        self.need_tokenizer(param, "text prompts")
        self.check_text_length(len(text), param)
        ids = await self.in_pool(lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(ids)


def _transcriber(model_name, vocab_size: int, tokenizer):
    """The transcription routes' request planner of a TRANSCRIBES family (registry.py), else None."""
    from mstar.models import registry
    try:
        fam = registry.family_of(model_name) if model_name else None
    except (ValueError, FileNotFoundError):
        return None
    if fam is None or fam.transcriber is None:
        return None
    return fam.transcriber(vocab_size, tokenizer)


def engine_capabilities(info: dict) -> frozenset[str]:
    """The served model's capabilities, from the engine's start-up info; an engine that does not
    report them (a custom --engine-factory) is taken for what it looks like: speech recognition
    when it is an encoder-decoder, else a token generator."""
    caps = info.get("capabilities")
    if caps is not None:
        return frozenset(str(c) for c in caps)
    return frozenset({I.TRANSCRIBES} if info.get("is_encoder_decoder") else {I.GENERATES_TOKENS})
