"""Jobs: the sequences of one HTTP request on their way through the engine, in the API process.

`start_job` admits a request's sequences (`Admission`: at most --max-pending at once) and
submits them to the engine (api_engine.Server); their updates come back on the job's queue.
A non-streamed request folds them into `ChoiceState`s with `collect_job` (streamed: see
api_sse.stream_job). Whatever way a job ends (success, error, a client that goes away) it is
closed once: what still runs is aborted in the engine and the admission released.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from mstar.runtime.serving import api_protocol as P
from mstar.runtime.serving.api_protocol import APIError
from mstar.runtime.serving.metrics import ServerMetrics
from mstar.runtime.engine.request import SamplingParams

if TYPE_CHECKING:
    from mstar.runtime.serving.api_engine import Seq, Server


class Mailbox:
    """A job's updates in arrival order: put_nowait from the event loop's engine-message handler,
    drained whole by the job's one consumer (lighter than an asyncio.Queue, whose get() costs a
    future and a getter-queue round trip per item; one wake-up here takes every item queued)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self):
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def take_all(self) -> list:
        """Every item queued (at least one; waits for it)."""
        while not self._items:
            w = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                if self._waiter is w:
                    self._waiter = None
        items, self._items = self._items, []
        return items


class Job:
    """The sequences of one HTTP request; their updates arrive on one mailbox in order."""

    def __init__(self, server: Server, endpoint: str, n_seqs: int):
        self.server = server
        self.endpoint = endpoint
        self.queue = Mailbox()
        self.seqs: list[Seq] = []
        self.remaining = n_seqs
        self.n_admitted = n_seqs
        self.closed = False
        self.outcome: str | None = None

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, RequestOutput) until every sequence finished; raises APIError on failure."""
        while self.remaining > 0:
            for idx, item in await self.queue.take_all():
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
            items = await self.queue.take_all()
            if len(items) == 1:  # the common case: one update (one step) of one choice
                idx, item = items[0]
                if isinstance(item, APIError):
                    raise item
                if item.finished:
                    self.remaining -= 1
                d, ids, lps = states[idx].update(item)
                yield idx, d, ids, lps, item.finished
                continue
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
    wait in FIFO order. A request of more sequences than the limit can never be admitted: a 400."""

    def __init__(self, limit: int, policy: str, metrics: ServerMetrics, retry_after_s: int):
        self.limit, self.policy, self.metrics, self.retry_after_s = limit, policy, metrics, retry_after_s
        self.pending = 0
        self._queue: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self.broken: APIError | None = None

    def _fits(self, k: int) -> bool:
        return self.pending + k <= self.limit

    def check_size(self, k: int, param: str = "n") -> None:
        """A 400 for a request of more sequences (prompts x n) than the limit."""
        if k > self.limit:
            raise APIError(400, f"The request has {k} sequences (prompts x n); this server runs at most "
                                f"{self.limit} at once (--max-pending).", param=param, code="request_too_large")

    def _overloaded(self) -> APIError:
        return APIError(503, f"The server is overloaded ({self.pending} sequences pending, limit {self.limit}); "
                             "retry later.", code="overloaded",
                        headers={"Retry-After": str(self.retry_after_s)})

    def _take(self, k: int) -> None:
        self.pending += k
        self.metrics.pending.set(self.pending)

    async def acquire(self, k: int, request: Request) -> None:
        self.check_size(k)
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
                    raise ClientGone()
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


class ClientGone(Exception):
    def __init__(self, counted: bool = False):
        super().__init__("client disconnected")
        self.counted = counted  # already recorded in the metrics (by Job.close)


class ChoiceState:
    __slots__ = (
        "_text_parts",
        "finish_reason",
        "logprobs",
        "lp_seen",
        "num_cached",
        "num_prompt",
        "started",
        "stop_reason",
        "token_ids",
    )

    def __init__(self):
        self._text_parts: list[str] = []  # joined on read: no O(length) copy per streamed delta
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason = None
        self.stop_reason = None
        self.num_prompt = 0
        self.num_cached = 0
        self.started = False
        self.lp_seen = 0

    @property
    def text(self) -> str:
        parts = self._text_parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def update(self, u) -> tuple[str, list[int], list]:
        """Fold in one RequestOutput; returns (text delta, new token ids, new logprobs)."""
        delta = u.text_delta or ""
        new_ids = list(u.new_token_ids or ())
        if u.text is not None:
            self._text_parts = [u.text]
        elif delta:
            self._text_parts.append(delta)
        if u.token_ids is not None:
            self.token_ids = list(u.token_ids)
        else:
            self.token_ids.extend(new_ids)
        new_lp = []
        if u.logprobs is not None:  # cumulative: every token's so far
            new_lp = list(u.logprobs[self.lp_seen:])
            self.lp_seen += len(new_lp)
            self.logprobs.extend(new_lp)
        elif getattr(u, "new_logprobs", None) is not None:  # deltas only (OutputProcessor(cumulative=False))
            new_lp = list(u.new_logprobs)
            self.lp_seen += len(new_lp)
            self.logprobs.extend(new_lp)
        self.num_prompt = u.num_prompt_tokens or self.num_prompt
        self.num_cached = u.num_cached_tokens or self.num_cached
        if u.finished:
            self.finish_reason = u.finish_reason or "stop"
            self.stop_reason = u.stop_reason
        return delta, new_ids, new_lp


def usage(states: list[ChoiceState], n: int) -> dict:
    """The response's usage block; `n` choices share each prompt."""
    prompt = sum(states[i].num_prompt for i in range(0, len(states), n))
    cached = sum(states[i].num_cached for i in range(0, len(states), n))
    completion = sum(len(s.token_ids) for s in states)
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


# ---------------------------------------------------------------------------------------
# starting and finishing a job

def choice_params(base: SamplingParams, j: int) -> SamplingParams:
    if j == 0:
        return base
    p = SamplingParams(**{f: getattr(base, f) for f in base.__dataclass_fields__})
    if p.seed is not None:
        p.seed = (p.seed + j) % P.MAX_SEED
    p.stop = list(base.stop)
    p.stop_token_ids = list(base.stop_token_ids)
    return p


async def start_job(server: Server, request: Request, endpoint: str, prompts: list[list[int]],
                    params: list[SamplingParams], n: int, extras: list[dict] | None = None) -> Job:
    job = Job(server, endpoint, len(prompts) * n)
    await server.admission.acquire(job.n_admitted, request)
    arrival = request.state.arrival
    try:
        server.check_alive()
        server.submit(job, [(i * n + j, ids, choice_params(params[i], j), extras[i] if extras else None)
                            for i, ids in enumerate(prompts) for j in range(n)], arrival)
    except BaseException as e:
        job.close("error" if not isinstance(e, APIError) or e.status >= 500 else "bad_request")
        if isinstance(e, APIError):
            e.counted = True
        raise
    return job


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def until_done_or_gone(request: Request, coro):
    """Run coro; if the client disconnects first, cancel it and raise ClientGone."""
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
    raise ClientGone()


async def await_job(request: Request, job: Job, aw, *, close_on_success: bool = True):
    """`aw`'s result, awaited while the client is there: a client that goes away aborts the job
    at once, a failure closes it with its outcome (error, bad_request), success closes it as
    success unless the caller goes on with it (close_on_success=False: a stream's first part)."""
    try:
        result = await until_done_or_gone(request, aw)
    except ClientGone:
        job.close("aborted")
        raise ClientGone(counted=True) from None
    except APIError as e:
        job.close("error" if e.status >= 500 else "bad_request")
        e.counted = True
        raise
    except BaseException:
        job.close("error")
        raise
    if close_on_success:
        job.close("success")
    return result


async def collect_job(request: Request, job: Job, states: list[ChoiceState]) -> None:
    """Fold a non-streamed job's updates into `states`; the job is closed with its outcome
    (a client that goes away aborts it at once)."""
    async def collect():
        async for i, u in job.events():
            states[i].update(u)

    await await_job(request, job, collect())


async def run_job(request: Request, job: Job, n: int) -> list[ChoiceState]:
    """collect_job into `n` fresh states (one per sequence), returned."""
    states = [ChoiceState() for _ in range(n)]
    await collect_job(request, job, states)
    return states
