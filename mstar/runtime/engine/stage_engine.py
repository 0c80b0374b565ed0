"""The stage engine: a non-autoregressive family's `Pipeline` (interfaces.py) behind the driving
API of EngineCore that the engine process uses (add_request, abort, step, has_unfinished,
has_running, num_unfinished, stats, close).

    engine = StageEngine(config)            # the pipeline of registry.family_of(config.model)
    engine.add_request(EngineRequest(rid, [], SamplingParams(), media=MediaRequest(rid, inputs, seed)))
    while engine.has_unfinished():
        for out in engine.step():           # CoreOutput(media=[AudioChunk | Image | VideoFrames ...])
            ...

A request goes through the pipeline's stages in order. At each stage it waits in that stage's
queue, grouped by the stage's `batch_key`. One engine step visits the stages in order:

  one-shot stage         one batch (at most max_batch requests) of one key runs: the key whose
                         oldest request has waited longest
  fixed-step loop stage  every running batch advances by one step (a batch past its last step
                         finishes); then, for every key with requests waiting and no batch
                         running, a batch of them (at most max_batch) starts, with its first step.
                         A continuous stage (one with join / leave) also takes waiting requests
                         of a running batch's key into it before its step (up to max_batch), and
                         a request past its own last step leaves its batch alone

  decode loop stage      open-ended and continuous: every running batch takes joins, then one
                         step whose outputs stream out at once; rows the stage says are done
                         leave (decode_loop.py)

so batches of different keys (image sizes) interleave step by step, and an abort takes effect
between two steps. A request whose stage finished joins the next stage's queue with the outputs
as `inputs["previous"]` (in the same engine step: later stages are visited after it); after the
last stage its outputs leave as one CoreOutput(media=outputs, finish_reason="stop"). After each
step of a loop stage every live request of the batch gets CoreOutput(progress=(stage index, steps
done, steps)) (the API shows it as a job's progress).

An aborted request leaves at once: from its queue, or from its running loop batch (a batch whose
requests are all aborted is dropped, with its state; in one that still has others a continuous
stage takes the aborted rows out before its next step, another runs them on and discards their
outputs). Its CoreOutput(finish_reason="abort") comes with the next
step. An exception inside a stage function (or outputs of the wrong shape) fails the requests of
that batch only: CoreOutput(finish_reason="error", error=...), the traceback in the engine's log.

The engine adds no host synchronisation of its own: whatever the stage functions return is handed
on as it is (the outputs are numpy arrays by contract: they are pickled to the API process).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
from typing import Any, Iterable

from mstar.models import interfaces as I
from mstar.runtime.engine.decode_loop import DecodeLoopDriver
from mstar.runtime.engine.request import CoreOutput, EngineRequest, RequestError

logger = logging.getLogger("mstar.stage_engine")


class _Req:
    __slots__ = ("collected", "key", "media", "order", "rid", "stage")

    def __init__(self, rid: str, media: I.MediaRequest, order: int):
        self.rid, self.media, self.order = rid, media, order
        self.stage = 0
        self.key: Any = None
        self.collected: list = []  # a decode loop's outputs so far, when it is not the last stage


class _Batch:
    """A running batch of a fixed-step loop stage: its requests (the state's rows, in order), the
    steps each has had (`done`), the batch's own step count `i` and the steps a request needs `n`."""
    __slots__ = ("done", "i", "key", "n", "reqs", "stage", "state")

    def __init__(self, stage: int, key, reqs: list[_Req], state, n: int):
        self.stage, self.key, self.reqs, self.state, self.n = stage, key, reqs, state, n
        self.i = 0
        self.done = [0] * len(reqs)


# fields a family's refusal may name though the request left them out (their defaults were wrong for it)
_NAMED_FIELDS = frozenset({"text", "voice", "instructions", "language", "max_new_tokens", "prompt", "size"})


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class StageEngine(DecodeLoopDriver):
    """Runs a Pipeline's stages over batches of MediaRequests (see the module docstring)."""

    is_encoder_decoder = False

    def __init__(self, config, *, family=None, pipeline: I.Pipeline | None = None):
        self.config = config
        t0 = time.perf_counter()
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        if family is None and pipeline is None:
            from mstar.models import registry
            family = registry.family_of(config.model)
        self.family = family
        self.capabilities: frozenset[str] = frozenset(family.capabilities) if family is not None else frozenset()
        if pipeline is None:
            if family.pipeline is None:
                raise ValueError(f"model: the family {family.name!r} has no stage pipeline (it is a token "
                                 "generator: EngineCore serves it)")
            pipeline = family.pipeline(config.model, dtype=self.dtype, device=self.device,
                                       random_weights=config.random_weights, seed=config.seed,
                                       max_batch=config.resolve_max_num_seqs())
        if not isinstance(pipeline, I.Pipeline) or not pipeline.stages:
            raise ValueError(f"model: the pipeline of {config.model!r} has no stages")
        for k, st in enumerate(pipeline.stages):
            if not isinstance(st, (I.OneShotStage, I.FixedStepLoopStage, I.DecodeLoopStage)):
                raise ValueError(f"stage {k} of {config.model!r} is a {type(st).__name__}, not a OneShotStage, "
                                 "FixedStepLoopStage or DecodeLoopStage")
            if not isinstance(st.max_batch, int) or st.max_batch < 1:
                raise ValueError(f"stage {k} of {config.model!r}: max_batch must be a positive integer")
        self.pipeline = pipeline
        self.stages = list(pipeline.stages)
        self.accepts = dict(pipeline.accepts or {})
        # what the engine process reports at start-up: a stage engine reads no tokens
        self.vocab_size = 0
        self.max_model_len = 0
        self.eos_token_ids: tuple[int, ...] = ()
        self.model_name = str(config.model)
        self.phase_timer = None
        # per stage: key -> the requests waiting with that key, oldest first (dict: first-seen key order)
        self._waiting: list[dict[Any, collections.deque[_Req]]] = [{} for _ in self.stages]
        self._running: list[list[_Batch]] = [[] for _ in self.stages]  # loop stages only
        self._reqs: dict[str, _Req] = {}  # every request not yet finished
        self._pending: list[CoreOutput] = []  # aborts and refusals found between steps
        self._order = itertools.count()
        self.num_waiting = 0
        # what the last step() did: (stage, "run" | "start" | "step" | "finish", key, requests)
        self.last_step: list[tuple[int, str, Any, int]] = []
        self.num_steps = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_failed = 0
        self.stage_batches = [0] * len(self.stages)
        self.stage_rows = [0] * len(self.stages)
        self.stage_seconds = [0.0] * len(self.stages)
        logger.info("stage engine for %s: %d stage(s) (%s) on %s in %.2f s", config.model, len(self.stages),
                    ", ".join(s.kind for s in self.stages), self.device, time.perf_counter() - t0)

    # -- the driving API ------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        media = getattr(req, "media", None)
        if not isinstance(media, I.MediaRequest):
            raise RequestError("model", f"{self.config.model} generates media: it takes media requests "
                                        "(/v1/audio/speech, /v1/images/generations, /v1/videos), not token prompts")
        if req.request_id in self._reqs:
            raise RequestError("request_id", f"request {req.request_id!r} is already running")
        if not isinstance(media.inputs, dict):
            raise RequestError("input", "the request's inputs must be a dict")
        r = _Req(req.request_id, media, next(self._order))
        self._reqs[r.rid] = r
        try:
            self._enqueue(r, 0)
        except BaseException:
            del self._reqs[r.rid]
            raise

    def add_requests(self, reqs: Iterable[EngineRequest]) -> None:
        for r in reqs:
            self.add_request(r)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Free what the requests hold now; their CoreOutput(finish_reason="abort") comes with the
        next step()."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            r = self._reqs.pop(rid, None)
            if r is None:
                continue
            self.num_aborted += 1
            self._pending.append(CoreOutput(rid, [], None, finish_reason="abort"))
            q = self._waiting[r.stage].get(r.key)
            if q is not None and r in q:
                q.remove(r)
                self.num_waiting -= 1
                if not q:
                    del self._waiting[r.stage][r.key]
                continue
            running = self._running[r.stage]
            for b in running:
                if r in b.reqs and not any(x.rid in self._reqs for x in b.reqs):
                    running.remove(b)  # nobody left in it: drop it, state and all
                    b.state = None
                    break

    def has_unfinished(self) -> bool:
        return bool(self._reqs) or bool(self._pending)

    def has_running(self) -> bool:
        """A loop batch in flight or outputs to emit: the next step cannot wait for arrivals."""
        return bool(self._pending) or any(self._running)

    def num_unfinished(self) -> int:
        return len(self._reqs)

    def step(self) -> list[CoreOutput]:
        outputs, self._pending = self._pending, []
        self.last_step = trace = []
        self.num_steps += 1
        grad = _no_grad()
        with grad:
            for k, stage in enumerate(self.stages):
                if isinstance(stage, I.OneShotStage):
                    self._one_shot(k, stage, outputs, trace)
                elif isinstance(stage, I.DecodeLoopStage):
                    self._decode_loop(k, stage, outputs, trace)
                else:
                    self._loop(k, stage, outputs, trace)
        return outputs

    def stats(self) -> dict:
        running = sum(1 for bs in self._running for b in bs for r in b.reqs if r.rid in self._reqs)
        d = {"running": running, "waiting": self.num_waiting, "kv_pages_used": 0, "kv_usage": 0.0,
             "num_steps": self.num_steps, "num_finished": self.num_finished, "num_aborted": self.num_aborted,
             "num_failed": self.num_failed, "max_model_len": self.max_model_len}
        for k in range(len(self.stages)):
            d[f"stage{k}_batches"] = self.stage_batches[k]
            d[f"stage{k}_rows"] = self.stage_rows[k]
            d[f"stage{k}_seconds"] = self.stage_seconds[k]
        return d

    def close(self) -> None:
        close = getattr(self.pipeline, "close", None)
        if callable(close):
            close()

    # -- queues -------------------------------------------------------------------------------
    def _enqueue(self, r: _Req, stage: int) -> None:
        """Into the queue of `stage`, under its batch key (a key the family cannot compute for the
        inputs is the client's mistake at the first stage, a family's bug later)."""
        st = self.stages[stage]
        try:
            key = st.batch_key(r.media)
            hash(key)
        except Exception as e:  # noqa: BLE001
            name, _, message = str(e).partition(": ")
            if isinstance(e, ValueError) and message and (name in r.media.inputs or name in _NAMED_FIELDS):
                raise RequestError(name, message) from None  # the family's "field: message"
            raise RequestError("input", f"the model cannot batch this request ({_error_text(e)})") from None
        r.stage, r.key = stage, key
        q = self._waiting[stage].get(key)
        if q is None:
            q = self._waiting[stage][key] = collections.deque()
        q.append(r)
        self.num_waiting += 1

    def _take(self, stage: int, key, n: int) -> list[_Req]:
        q = self._waiting[stage][key]
        batch = [q.popleft() for _ in range(min(n, len(q)))]
        if not q:
            del self._waiting[stage][key]
        self.num_waiting -= len(batch)
        return batch

    # -- stages -------------------------------------------------------------------------------
    def _one_shot(self, k: int, stage: I.OneShotStage, outputs: list, trace: list) -> None:
        waiting = self._waiting[k]
        if not waiting:
            return
        key = min(waiting, key=lambda kk: waiting[kk][0].order)  # the longest-waiting request's key
        batch = self._take(k, key, stage.max_batch)
        trace.append((k, "run", key, len(batch)))
        t0 = time.perf_counter()
        try:
            results = stage.run([r.media for r in batch])
            self._check_results(results, len(batch))
        except Exception as e:  # noqa: BLE001 -- only this batch fails
            self._fail(k, batch, e, outputs)
            return
        finally:
            self._account(k, len(batch), t0)
        self._advance(k, batch, results, outputs)

    def _loop(self, k: int, stage: I.FixedStepLoopStage, outputs: list, trace: list) -> None:
        running = self._running[k]
        waiting = self._waiting[k]
        if stage.continuous:
            for b in list(running):
                self._drop_aborted(k, stage, b, outputs, trace)
                if b in running and b.key in waiting and len(b.reqs) < stage.max_batch:
                    self._join(k, stage, b, outputs, trace)
        for b in list(running):
            self._advance_batch(k, stage, b, outputs, trace)
        if not waiting:
            return
        busy = {b.key for b in running}
        for key in [kk for kk in waiting if kk not in busy]:
            batch = self._take(k, key, stage.max_batch)
            trace.append((k, "start", key, len(batch)))
            t0 = time.perf_counter()
            try:
                state = stage.start([r.media for r in batch])
                n = int(stage.num_steps(state))
            except Exception as e:  # noqa: BLE001
                self._fail(k, batch, e, outputs)
                continue
            finally:
                self._account(k, len(batch), t0)
            b = self._new_batch(k, key, batch, state, n)
            running.append(b)
            self._advance_batch(k, stage, b, outputs, trace)  # its first step comes with its start

    @staticmethod
    def _new_batch(k: int, key, reqs: list[_Req], state, n: int = 0) -> _Batch:
        return _Batch(k, key, reqs, state, n)

    def _drop_aborted(self, k: int, stage: I.FixedStepLoopStage, b: _Batch, outputs: list, trace: list) -> None:
        """Aborted rows out of a continuous batch (their memory freed, room for joins)."""
        gone = [j for j, q in enumerate(b.reqs) if self._reqs.get(q.rid) is not q]
        if not gone or len(gone) == len(b.reqs):
            return
        trace.append((k, "leave", b.key, len(gone)))
        try:
            self._leave(stage, b, gone)
        except Exception as e:  # noqa: BLE001
            self._running[k].remove(b)
            b.state = None
            self._fail(k, b.reqs, e, outputs)

    def _join(self, k: int, stage: I.FixedStepLoopStage, b: _Batch, outputs: list, trace: list) -> None:
        """Waiting requests of a running batch's key join it (a continuous stage), up to max_batch;
        a join that fails fails the joining requests only."""
        batch = self._take(k, b.key, stage.max_batch - len(b.reqs))
        trace.append((k, "join", b.key, len(batch)))
        t0 = time.perf_counter()
        try:
            b.state = stage.join(b.state, [r.media for r in batch])
        except Exception as e:  # noqa: BLE001
            self._fail(k, batch, e, outputs)
            return
        finally:
            self._account(k, len(batch), t0)
        b.reqs.extend(batch)
        b.done.extend([0] * len(batch))

    def _leave(self, stage: I.FixedStepLoopStage, b: _Batch, rows: list[int]) -> tuple[list[_Req], list]:
        """Rows out of a running continuous batch: (their requests, their outputs)."""
        b.state, results = stage.leave(b.state, rows)
        self._check_results(results, len(rows))
        out = set(rows)
        reqs = [b.reqs[j] for j in rows]
        b.reqs = [q for j, q in enumerate(b.reqs) if j not in out]
        b.done = [d for j, d in enumerate(b.done) if j not in out]
        return reqs, results

    def _advance_batch(self, k: int, stage: I.FixedStepLoopStage, b: _Batch, outputs: list, trace: list) -> None:
        """One step of a running batch. A request past its last step moves on: in a continuous
        batch it leaves; otherwise, and when all are done, the batch finishes."""
        running = self._running[k]
        t0 = time.perf_counter()
        try:
            if min(b.done) < b.n:
                trace.append((k, "step", b.key, len(b.reqs)))
                r = stage.step(b.state, b.i)
                if r is not None:  # a step may return the new state (or update it in place)
                    b.state = r
                b.i += 1
                b.done = [d + 1 for d in b.done]
                outputs.extend(CoreOutput(q.rid, [], None, progress=(k, d, b.n)) for q, d in zip(b.reqs, b.done)
                               if self._reqs.get(q.rid) is q)
            finished = [j for j, d in enumerate(b.done) if d >= b.n]
            if len(finished) == len(b.reqs):
                running.remove(b)
                trace.append((k, "finish", b.key, len(b.reqs)))
                state, b.state = b.state, None
                results = stage.finish(state)
                self._check_results(results, len(b.reqs))
                self._advance(k, b.reqs, results, outputs)
            elif finished and stage.continuous:
                trace.append((k, "leave", b.key, len(finished)))
                self._advance(k, *self._leave(stage, b, finished), outputs)
        except Exception as e:  # noqa: BLE001
            if b in running:
                running.remove(b)
            b.state = None
            self._fail(k, b.reqs, e, outputs)
        finally:
            self.stage_seconds[k] += time.perf_counter() - t0

    def _account(self, k: int, rows: int, t0: float) -> None:
        self.stage_batches[k] += 1
        self.stage_rows[k] += rows
        self.stage_seconds[k] += time.perf_counter() - t0

    @staticmethod
    def _check_results(results, n: int) -> None:
        if not isinstance(results, (list, tuple)) or len(results) != n:
            got = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
            raise TypeError(f"the stage returned {got} output lists for {n} requests")
        for outs in results:
            if not isinstance(outs, (list, tuple)):
                raise TypeError(f"a request's outputs must be a list, got {type(outs).__name__}")

    def _advance(self, k: int, batch: list[_Req], results, outputs: list) -> None:
        """The stage's outputs of each live request: on to the next stage, or out."""
        last = k == len(self.stages) - 1
        for r, outs in zip(batch, results):
            if self._reqs.get(r.rid) is not r:  # aborted while its batch ran
                continue
            if last:
                del self._reqs[r.rid]
                self.num_finished += 1
                outputs.append(CoreOutput(r.rid, [], None, finish_reason="stop", media=list(outs)))
                continue
            r.media = I.MediaRequest(r.media.request_id, {**r.media.inputs, "previous": list(outs)}, r.media.seed)
            try:
                self._enqueue(r, k + 1)
            except RequestError as e:
                self._fail(k + 1, [r], e, outputs)

    def _fail(self, k: int, batch: list[_Req], e: BaseException, outputs: list) -> None:
        live = [r for r in batch if self._reqs.get(r.rid) is r]
        if not live:
            return
        logger.error("stage %d (%s) failed for %d request(s)", k, self.stages[k].kind, len(live), exc_info=e)
        msg = _error_text(e)
        for r in live:
            del self._reqs[r.rid]
            self.num_failed += 1
            outputs.append(CoreOutput(r.rid, [], None, finish_reason="error", error=msg))


def _no_grad():
    try:
        import torch
    except ImportError:  # pragma: no cover - a pipeline without torch
        return contextlib.nullcontext()
    return torch.inference_mode()
