"""Tensor parallelism across the devices of one host: rank 0 is the engine, ranks 1..N-1
are follower processes that run the same forward on their shard of the model.

    EngineCore (rank 0, the caller's process)          follower r (spawned, one per rank)
    scheduler, cache bookkeeping, sampler               model shard r, caches (same ids)
    StepInputBuilder -> ForwardContext ----plan---->    replay cache ops, rebuild the context
    model.forward   <== all-reduce / all-gather ==>     model.forward
    compute_logits -> sample (rank 0 only)              compute_logits (takes part in the gather)

This file is rank 0's side, TensorParallel (built by EngineCore when tp > 1), and re-exports
the names other code uses; the rest is in
    tp_group.py     torch.distributed basics of both sides: TPError, devices, backends, timeouts, teardown
    tp_plan.py      the step plan: the context as host arrays + layout, the recorded cache operations
    tp_follower.py  the follower process (follower_main, the spawn target)
    tp_timing.py    start-up phases, per-step statistics and their log lines

Each step's plan (tp_plan.py) goes to each follower over a pipe right after rank 0 has built
its context (pickled once), so a follower's only host work is unpacking it: it never waits
on scheduling, only on receiving. Aborts, frees and preemptions need nothing more: they are
bookkeeping on rank 0, and their tensor effects (if any) are in the plan's cache operations.

Decode graphs: followers capture the same graphs as rank 0 and get only the rows of a replayed
step ("gstep"); with overlapped decode a chained step's input ids (rank 0's previous tokens, on
its device) follow the plan as a broadcast from rank 0 (send_chained_step).

Collectives: torch.distributed, NCCL on CUDA (NCCL_NVLS_ENABLE=0 is kept in the
environment), gloo on CPU; rank r uses device index base + r.

Failures: a follower that raises sends its traceback to rank 0 and exits; rank 0's next
(or current) collective fails and the engine raises TPError carrying the follower's
message. A monitor thread notices followers that died without a word (and, with NCCL,
aborts the process group so that rank 0 does not hang). Shutdown: `close()` (the engine's
close) tells followers to exit, joins them (terminate / kill after a timeout), and
destroys the process group; followers also exit when rank 0's pipe closes (rank 0 died).

Start-up overlaps: rank 0 spawns the followers and loads its own shard while they start
(interpreter, imports) and load theirs; the process group is set up once every rank has
loaded; followers allocate their caches while rank 0 allocates its own. Every rank's
start-up phases are logged once, and at close the time to stop the followers and the
per-step timing of every rank (tp_timing.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import pickle
import queue
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from mstar import knobs
from mstar.models.context import dtype_name
from mstar.runtime.parallel import tp_allreduce
from mstar.runtime.engine.step_inputs import StepInputBuilder
from mstar.runtime.parallel.tp_follower import follower_main
from mstar.runtime.parallel.tp_group import (COLLECTIVE_TIMEOUT, ERROR_WAIT_S, JOIN_TIMEOUT_S, START_TIMEOUT_S, TPError,
                                    abort_group, backend_for, kill_all, rank_device,
                                    release_group)
from mstar.runtime.parallel.tp_plan import MirroredCacheManager, PlanRecorder, layout, replay_ops
from mstar.runtime.parallel.tp_timing import STARTUP_PHASES, StepStat, dur, emit, now, startup_line, sync_once

__all__ = ["TensorParallel", "TPError", "MirroredCacheManager", "StepStat", "STARTUP_PHASES", "startup_line",
           "replay_ops", "follower_main", "rank_device", "backend_for", "START_TIMEOUT_S", "JOIN_TIMEOUT_S",
           "ERROR_WAIT_S", "COLLECTIVE_TIMEOUT"]

log = logging.getLogger("mstar.runtime.parallel.tp")

# the timeouts (tp_group.py) are read below as this module's names, when the code runs: to change one
# for rank 0, monkeypatch tp.<NAME> (the tests do), not tp_group.<NAME>


class TensorParallel:
    """Rank 0's side: spawns and talks to the followers. Built by EngineCore when tp > 1."""

    # tests: (rank, "load" | "step" | "chained", n) makes that follower raise at load, before
    # (eager) step n, or before the first chained graph step (overlapped decode) from step n on
    _test_fault: tuple | None = None

    def __init__(self, config, device: torch.device):
        import torch.distributed as dist

        from mstar.models import parallel
        from mstar.models.loader import resolve_config

        self._t0 = now()
        self.size = int(config.tp)
        self.device = torch.device(device)
        self.allreduce = "nccl"  # what sums the row-parallel outputs (tp_allreduce.py), set once the group is up
        self.follower_allreduce: list[tuple[str, str]] = []  # each follower's (asked, installed): "ready"
        self._state_dtype = "float32"  # rank 0's recurrent-state dtype, sent with the cache sizes
        self.follower_state_dtype: list[str] = []  # what each follower allocated
        if dist.is_initialized():
            raise RuntimeError("tp: torch.distributed is already initialised in this process; the engine "
                               "starts its own tensor-parallel group")
        if self.device.type == "cuda":
            base = self.device.index or 0
            if torch.cuda.device_count() < base + self.size:
                raise ValueError(f"tp: {self.size} ranks need GPUs {base}..{base + self.size - 1}, "
                                 f"{torch.cuda.device_count()} visible")
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(rank_device(self.device, 0))
        self.error: str | None = None
        self._closed = False
        # timing: rank 0's start-up phases (STARTUP_PHASES) and its waits; per step its plan cost
        # (pack + send) and the interval between plans (its whole step, idle included)
        self.startup: dict[str, float] = {}
        self.startup_waits: dict[str, float] = {}
        self.startup_config_s = 0.0
        self._t_graphs: float | None = None
        self._t_ready: float | None = None
        self._first_fwd: tuple[float, float] | None = None
        self._startup_logged = False
        self.plan_stat, self.interval_stat = StepStat(), StepStat()
        self._t_last_plan: float | None = None
        self.follower_stats: dict[int, dict] = {}  # per-step timing each follower reports when it exits
        self.follower_exit: dict[int, dict] = {}  # each follower's shutdown timing
        self.close_timing: dict[str, float] = {}
        self._frees: list[int] = []
        self.cm: MirroredCacheManager | None = None
        self._cache_kw: dict | None = None
        self._monitor: threading.Thread | None = None
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout=timedelta(seconds=START_TIMEOUT_S),
                                    wait_for_workers=False)
        mp = torch.multiprocessing.get_context("spawn")
        self._results = mp.Queue()
        self._procs, self._conns = [], []
        threads = torch.get_num_threads()
        # rank 0 reads the knob once and tells the followers: a follower reading its own environment
        # could disagree (a knobs.override in this process, a test's stale knob) and the ranks'
        # all-reduces would never pair up
        self._allreduce_mode = knobs.value("MSTAR_TP_ALLREDUCE")
        t = now()
        for r in range(1, self.size):
            recv, send = mp.Pipe(duplex=False)
            p = mp.Process(target=follower_main, name=f"mstar-tp{r}", daemon=True,
                           args=(config, r, self.size, self._store.port, recv, self._results, threads,
                                 self._test_fault, COLLECTIVE_TIMEOUT, now(), self._allreduce_mode))
            p.start()
            recv.close()
            self._procs.append(p)
            self._conns.append(send)
        self.startup["spawn"] = now() - t
        self._finalizer = weakref.finalize(self, kill_all, list(self._procs), list(self._conns))
        # the config only now: resolving it imports transformers (a second or more), which the
        # followers' start need not wait for; a tp the model cannot take stops them at once
        t = now()
        try:
            self.model_config = resolve_config(config.model)
            parallel.check_config(self.model_config, self.size)
        except BaseException:
            self.close()
            raise
        self.startup_config_s = now() - t
        # the followers now start (interpreter, imports) and load their shards while rank 0 loads its
        # own (load_model); the process group is set up when every rank has loaded

    # --- start-up ------------------------------------------------------------------------
    def load_model(self, config, dtype: torch.dtype):
        """Rank 0's shard (the followers load theirs at the same time), then the process group."""
        import torch.distributed as dist

        from mstar.models import load_model, parallel
        try:
            t = now()
            with parallel.building(0, self.size):  # only this model is sharded, not the process
                model = load_model(config.model, dtype=dtype, device=self.device,
                                   random_weights=config.random_weights, seed=config.seed,
                                   config=self.model_config)
            self.startup["load"] = now() - t
            t = now()
            self._frees = self._wait_all("loaded")
            self.startup_waits["followers loaded"] = now() - t
            t = now()
            dist.init_process_group(backend_for(self.device), store=self._store, rank=0, world_size=self.size,
                                    timeout=COLLECTIVE_TIMEOUT)
            self.allreduce = tp_allreduce.setup(self.device, dtype, self._allreduce_mode,  # the followers alike
                                                timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
            self.startup["init_process_group"] = now() - t
        except BaseException:
            self.close()
            raise
        return model

    def _wait_all(self, kind: str) -> list[Any]:
        """Wait for message `kind` from every follower; TPError if one fails or dies."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(got) < self.size - 1:
            try:
                rank, k, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                for i, p in enumerate(self._procs):
                    if not p.is_alive() and i + 1 not in got:
                        self._fail_start(f"tensor-parallel rank {i + 1} exited (code {p.exitcode}) "
                                         f"while starting")
                if time.monotonic() > deadline:
                    self._fail_start(f"tensor-parallel followers not {kind} within {START_TIMEOUT_S:.0f} s")
                continue
            if k == "error":
                self._fail_start(f"tensor-parallel rank {rank} failed:\n{payload}")
            if k == kind:
                got[rank] = payload
            else:
                self._on_message(rank, k, payload)
        return [got[r] for r in range(1, self.size)]

    def _fail_start(self, msg: str) -> None:
        self.error = msg
        self.close()
        raise TPError(msg)

    def sizing_config(self, config):
        """The config to size the caches with: on CUDA, the smallest free memory of all
        ranks after loading (every rank allocates the same pages and slots)."""
        if self.device.type != "cuda" or config.cache_memory_bytes is not None:
            return config
        from mstar.models.memory_plan import CACHE_FRACTION
        free0, _ = torch.cuda.mem_get_info(self.device)
        return dataclasses.replace(config, cache_memory_bytes=int(min([free0, *self._frees]) * CACHE_FRACTION))

    def cache_manager(self, *a, **kw) -> MirroredCacheManager:
        """Rank 0's caches; the followers are told the sizes first and allocate theirs meanwhile."""
        self._cache_kw = {k: v for k, v in kw.items() if k != "device"}
        self._state_dtype = dtype_name(a[0].state_dtype)
        try:  # with rank 0's state dtype (MSTAR_GDN_STATE_DTYPE): a follower's own knob could differ
            self._send(("caches", self._cache_kw, self._state_dtype))
        except (BrokenPipeError, EOFError, OSError):
            pass  # a follower already gone: attach's wait reports it
        try:
            t = now()
            self.cm = MirroredCacheManager(*a, **kw)
            self.startup["caches"] = now() - t
        except BaseException:  # e.g. out of memory: do not leave the followers waiting
            self.close()
            raise
        return self.cm

    def input_builder(self, **kw) -> StepInputBuilder:
        return PlanRecorder(self, **kw)

    def attach(self, model) -> None:
        """The followers have (or are allocating) the same caches: wait for them, then the
        engine may step. Rank 0's forward / compute_logits raise TPError on follower errors."""
        t = now()
        ready = self._wait_all("ready")
        self.startup_waits["followers' caches"] = now() - t
        self.follower_allreduce = [(r["asked"], r["allreduce"]) for r in ready]
        self.follower_state_dtype = [r["state_dtype"] for r in ready]
        if any(m != (self._allreduce_mode, self.allreduce) for m in self.follower_allreduce):
            # their collectives would never pair up: fail now rather than hang at the first step
            self._fail_start(f"tensor-parallel ranks sum differently: rank 0 (asked, installed) "
                             f"{(self._allreduce_mode, self.allreduce)}, followers {self.follower_allreduce}")
        if any(d != self._state_dtype for d in self.follower_state_dtype):
            self._fail_start(f"tensor-parallel ranks keep their GDN state differently: rank 0 {self._state_dtype}, "
                             f"followers {self.follower_state_dtype}")
        self._monitor = threading.Thread(target=self._watch, name="mstar-tp-monitor", daemon=True)
        self._monitor.start()
        model.forward = self._guard(model.forward, first=True)
        model.compute_logits = self._guard(model.compute_logits)

    def startup_done(self) -> None:
        """The engine is built and may step (EngineCore calls this at the end of its init): the end
        of rank 0's start-up (and of its graph capture)."""
        if self._t_ready is not None:
            return
        self._t_ready = now()
        if self._t_graphs is not None:
            self.startup["capture"] = self._t_ready - self._t_graphs
        self._log_startup()

    # --- decode graphs ---------------------------------------------------------------------
    def start_graphs(self, params: dict) -> None:
        """Followers build the same DecodeGraphRunner and capture it now, in step with rank 0
        (the captured collectives must pair up): call right before rank 0's own capture."""
        self._t_graphs = now()
        self._send(("graphs", params))

    def start_prefill_graphs(self, capture: bool) -> None:
        """Followers build the same PrefillGraphRunner (capturing it with rank 0 when capture is
        set: the segments' all-reduces must pair up) and run their eager steps through it, as
        rank 0 does: both pick it by the step's token count. Call right before rank 0 builds its own."""
        self._send(("pgraphs", capture))

    def send_graph_step(self, rows, greedy: bool = False) -> None:
        """A graph-replayed decode step: the rows (followers fill their own fixed buffers).
        greedy: rank 0 takes the step's tokens with model.greedy_tokens (overlapped decode's
        launch), not compute_logits; the followers join the same gather."""
        self._send_plan(lambda: ("gstep", self.cm.take_ops(), rows, time.monotonic(), False, greedy))

    def send_chained_step(self, rows, tokens: torch.Tensor, greedy: bool = True) -> torch.Tensor:
        """A chained graph step of overlapped decode (decode_overlap.py): its input ids are the
        previous step's tokens, still only on rank 0's device. The plan says so, then rank 0
        broadcasts them (the source is only read: no copy into a buffer of its own); each follower,
        told by the plan, joins the broadcast into its own buffer and replays with it. Every rank
        does it right before its replay, so the broadcast precedes the graph's all-reduces and the
        logits' gather everywhere. NCCL: stream-ordered, no host sync. Returns the loop-back (the
        tokens' first D entries)."""
        import torch.distributed as dist
        self._send_plan(lambda: ("gstep", self.cm.take_ops(), rows, time.monotonic(), True, greedy))
        buf = tokens[:len(rows.decode_tokens)].contiguous()  # (argmax's output: already contiguous)
        try:
            dist.broadcast(buf, src=0)
        except Exception as e:  # noqa: BLE001 -- a follower gone: its message, as TPError
            self._raise_follower_error(e)
        return buf

    # --- steps ---------------------------------------------------------------------------
    def _send(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for c in self._conns:
            c.send_bytes(data)

    def send_step(self, ctx, n_sample: int, rec: list[tuple[np.ndarray, torch.Tensor]]) -> None:
        self._send_plan(lambda: ("step", self.cm.take_ops(), layout(ctx, [t for _, t in rec]), [a for a, _ in rec],
                                 n_sample, time.monotonic()))

    def _send_plan(self, make_msg) -> None:
        """Send a step's plan (built by make_msg) to every follower; time it."""
        if self.error:
            raise TPError(self.error)
        t0 = time.monotonic()
        if self._t_last_plan is not None:
            self.interval_stat.add(t0 - self._t_last_plan)
        self._t_last_plan = t0
        msg = make_msg()
        try:
            self._send(msg)
        except (BrokenPipeError, EOFError, OSError) as e:
            self._raise_follower_error(e)
        self.plan_stat.add(time.monotonic() - t0)

    def _guard(self, fn, first: bool = False):
        # the wrapper goes into the model's own __dict__: holding the model's bound method
        # strongly would make a reference cycle (model -> wrapper -> model), so a closed engine's
        # model and caches (on CUDA the shard and most of the GPU) would stay allocated until a
        # full gc pass, i.e. usually into the next engine's start-up and sizing
        ref = weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)

        def guarded(*a, **kw):
            if self.error:
                raise TPError(self.error)
            try:
                if first and self._first_fwd is None:
                    t = now()
                    out = ref()(*a, **kw)
                    sync_once(self.device)
                    self._first_fwd = (t, now())
                    self._log_startup()
                    return out
                return ref()(*a, **kw)
            except TPError:
                raise
            except Exception as e:
                self._raise_follower_error(e)
        guarded.__wrapped__ = getattr(fn, "__func__", fn)  # (the plain function: no reference to the model)
        return guarded

    def _raise_follower_error(self, e: BaseException):
        deadline = time.monotonic() + ERROR_WAIT_S
        while self.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.error is not None:
            raise TPError(self.error) from e
        raise e

    def _on_message(self, rank: int, kind: str, payload) -> None:
        """A follower's report (the monitor thread, a start-up wait or close's drain)."""
        if kind == "error" and self.error is None:
            self.error = f"tensor-parallel rank {rank} failed:\n{payload}"
        elif kind == "stats":
            self.follower_stats[rank] = payload
        elif kind == "startup":
            emit(startup_line(rank, payload["phases"], payload["extra"]))
        elif kind == "bye":
            self.follower_exit[rank] = payload

    def _watch(self) -> None:
        dead_since: float | None = None
        while not self._closed:
            try:
                rank, kind, payload = self._results.get(timeout=0.2)
                if kind == "wake":  # close(): stop now
                    return
                self._on_message(rank, kind, payload)
            except queue.Empty:
                pass
            except (EOFError, OSError, ValueError):
                return
            if self.error is None and not self._closed:
                dead = [(i + 1, p.exitcode) for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead and dead_since is None:
                    dead_since = time.monotonic()  # its message may still be on the way
                elif dead and time.monotonic() - dead_since > 1.0:
                    self.error = f"tensor-parallel rank {dead[0][0]} exited (code {dead[0][1]})"
            if self.error is not None and not self._closed:
                if self.device.type == "cuda":
                    abort_group()  # NCCL would wait forever for the dead rank
                return

    def _log_startup(self, closing: bool = False) -> None:
        """Rank 0's start-up line: once ready and past its first forward (or at close)."""
        if self._startup_logged or self._t_ready is None:
            return
        if self._first_fwd is None and not closing:
            return
        self._startup_logged = True
        ph: dict[str, float | None] = dict(self.startup)
        ready = self._t_ready - self._t0
        total = ready
        idle = None
        if self._first_fwd is not None:
            f0, f1 = self._first_fwd
            ph["first_forward"] = f1 - f0
            if f0 >= self._t_ready:  # the first step's forward (not a capture warm-up)
                total += f1 - f0
                idle = f0 - self._t_ready
        ph["total"] = total
        known = sum(self.startup.values()) + sum(self.startup_waits.values()) + self.startup_config_s
        extra: dict[str, float | None] = {"config (resolve + check)": self.startup_config_s}
        extra.update({f"waiting for {k}": v for k, v in self.startup_waits.items()})
        extra["engine (tokenizer, sizing, sampler...)"] = max(0.0, ready - known)
        extra["idle before the first step, not in total"] = idle
        emit(startup_line(0, ph, extra))

    # --- shutdown ------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        t0 = now()
        try:
            self._send(("shutdown",))
        except Exception:  # noqa: BLE001 -- a follower already gone
            pass
        exited: dict[int, float | None] = {}
        # followers read the pipe once they wait for the cache sizes; before that (rank 0 failed while
        # loading) they would sit in the group's rendezvous: stop them at once
        deadline = t0 + (JOIN_TIMEOUT_S if self._cache_kw is not None else 0.0)
        for i, p in enumerate(self._procs):
            p.join(max(0.0, deadline - now()))
            exited[i + 1] = None if p.is_alive() else now() - t0
        kill_all(self._procs, self._conns)
        t1 = now()
        if self._monitor is not None and self._monitor.is_alive():
            try:
                self._results.put((0, "wake", None))  # the monitor returns now, not at its next poll
            except Exception:  # noqa: BLE001
                pass
            self._monitor.join(1.0)
        t2 = now()
        self._drain()
        self._log_startup(closing=True)
        self._log_phases()
        self._finalizer.detach()
        tp_allreduce.teardown()  # this process's layers fall back to torch.distributed (and free the buffer)
        released = release_group()
        t3 = now()
        self._results.close()
        self.close_timing = {"stop followers": t1 - t0, "monitor": t2 - t1, "release group": t3 - t2,
                             "total": now() - t0}
        parts = []
        for r in range(1, self.size):
            ex = self.follower_exit.get(r, {})
            got = ex.get("t_shutdown")
            parts.append(f"rank {r}: got it +{dur(None if got is None else got - t0)}, its group released in "
                         f"{dur(ex.get('release_s'))}, exited +{dur(exited.get(r))}"
                         + ("" if exited.get(r) is not None else f" (killed: still running after {dur(deadline - t0)})"))
        emit(f"tp close: stop followers {dur(t1 - t0)} ({'; '.join(parts)}), monitor joined {dur(t2 - t1)}, "
             f"group {released} in {dur(t3 - t2)}, total {dur(now() - t0)}")

    def _drain(self) -> None:
        try:
            while True:
                rank, kind, payload = self._results.get_nowait()
                if kind != "wake":
                    self._on_message(rank, kind, payload)
        except (queue.Empty, EOFError, OSError, ValueError):
            pass

    def _log_phases(self) -> None:
        """Per-step timing: rank 0's plan cost and step interval, each follower's waits and forwards."""
        if not self.plan_stat.n:
            return
        lines = [f"tp={self.size}: rank 0 sent {self.plan_stat.n} plans; pack + send {self.plan_stat.summary()}; "
                 f"interval between plans (rank 0's step, idle included) {self.interval_stat.summary()}"]
        for rank, st in sorted(self.follower_stats.items()):
            lines.append(f"tp rank {rank}: {st['steps']} steps ({st['forward_eager'].n} eager, "
                         f"{st['forward_graph'].n} graph replays); forward (host, + logits): eager "
                         f"{st['forward_eager'].summary()}; graph {st['forward_graph'].summary()}")
            lines.append(f"tp rank {rank}: wait for plan (idle included) {st['wait'].summary()}; plan transit "
                         f"{st['transit'].summary()}; unpack {st['unpack'].summary()}")
        for line in lines:
            emit(line)

