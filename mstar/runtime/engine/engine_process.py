"""The engine in its own process, so HTTP, JSON, tokenization and slow clients never stall
the step loop.

    API process                                   engine process (spawned)
    EngineProcess.add([EngineRequest]) --in_q-->  drain commands (add / abort / shutdown; aborts first)
    EngineProcess.abort([ids])        --in_q-->   EngineCore.step() while work is left
    reader thread -> on_message(msg)  <--out_q--  ("step", outputs, errors, stats)

The loop drains its command queue without blocking whenever it has work, steps, and puts
the step's CoreOutputs on the output queue (a put never blocks: the queue's feeder thread
does the pipe writes). With no work it blocks on the command queue, waking every
`IDLE_POLL_S` to check that its parent is still alive (it exits if the API process is
gone, so a killed server leaves no orphan holding the GPU).

The engine is EngineCore, or the stage engine (stage_engine.py) when the model's family has a
stage pipeline (a family that is not autoregressive), or what --engine-factory builds.

Messages out of the engine:
  ("ready", info)                      once, after the model is loaded; info: pid, max_model_len,
                                       eos_token_ids, vocab_size, device, dtype, capabilities (the
                                       family's, sorted), accepts (stage engines: Pipeline.accepts)
  ("failed", traceback_text)           the engine could not be built (then it exits)
  ("step", outputs, errors, stats)     outputs: list[CoreOutput]; errors: [(request_id, field, message)]
                                       for requests add_request refused; stats: engine.stats() or None
  ("fatal", traceback_text)            step() raised; the process exits (the server then answers 503)

One "step" message carries all of a step's outputs (never one per request), and on the wire its
CoreOutputs travel as plain tuples (`pack_outputs`; the reader thread rebuilds them): pickling a
step of 128 dataclasses costs ~0.1 ms on each side, tuples ~6x less, and the engine's pickling
runs on the queue's feeder thread, which takes the GIL from the step loop. The stats say how many
messages and outputs were sent (engine_output_messages, engine_output_records), so the batching
is visible in /metrics.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
import multiprocessing as mp
import operator
import os
import queue
import faulthandler
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from mstar import knobs
from mstar.runtime.engine.request import CoreOutput

logger = logging.getLogger("mstar.engine_process")

IDLE_POLL_S = 0.5
STATS_INTERVAL_S = 0.2


def _family(config: Any):
    """The registered family of the engine's model, or None."""
    try:
        from mstar.models import registry
        return registry.family_of(str(getattr(config, "model", "")))
    except (ValueError, FileNotFoundError, ImportError):
        return None


def _process_age() -> float | None:
    """Seconds since this process was started (Linux: /proc/self/stat), else None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def default_engine(config: Any):
    """The engine of the model's family: a family with a stage pipeline (not autoregressive) runs
    on the stage engine, every other on EngineCore."""
    t0 = time.perf_counter()
    family = _family(config)
    if family is not None and getattr(family, "pipeline", None) is not None:
        from mstar.runtime.engine.stage_engine import StageEngine as engine_class
        kw = {"family": family}
    else:
        from mstar.runtime.engine.engine_core import EngineCore as engine_class
        kw = {}
    # torch, the op layer and its backends (Triton, FlashInfer on CUDA), the model families
    logger.info("engine process: modules imported in %.1f s", time.perf_counter() - t0)
    return engine_class(config, **kw)


def _load_factory(path: str | None) -> Callable[[Any], Any]:
    if not path:
        return default_engine
    mod, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"engine factory must look like 'package.module:callable', got {path!r}")
    return getattr(importlib.import_module(mod), attr)


_CORE_FIELDS = tuple(f.name for f in dataclasses.fields(CoreOutput))
_core_tuple = operator.attrgetter(*_CORE_FIELDS)


def pack_outputs(outputs) -> list[tuple]:
    """A step's CoreOutputs as tuples (the fields in CoreOutput's order) for the queue."""
    return [_core_tuple(o) for o in outputs]


def unpack_outputs(packed) -> list[CoreOutput]:
    return [CoreOutput(*t) for t in packed]


def _extra_stats() -> dict[str, Any]:
    if "torch" not in sys.modules:  # an engine without torch (a synthetic one): nothing to add
        return {}
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return {"peak_gpu_mem_bytes": int(torch.cuda.max_memory_allocated())}
    except Exception:  # pragma: no cover - stats are best effort
        pass
    return {}


def _engine_info(engine: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"pid": os.getpid()}
    info["max_model_len"] = int(engine.max_model_len)
    eos = getattr(engine, "eos_token_ids", ()) or ()
    if isinstance(eos, int):
        eos = (eos,)
    info["eos_token_ids"] = tuple(int(t) for t in eos)
    for name in ("vocab_size", "device", "dtype", "model_name", "is_encoder_decoder"):
        v = getattr(engine, name, None)
        if v is not None:
            info[name] = v if isinstance(v, (int, float, str)) else str(v)
    info["gpu"] = "cpu"
    try:
        import torch
        dev = getattr(engine, "device", None)
        if dev is not None and torch.device(dev).type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(torch.device(dev))
    except Exception:  # noqa: BLE001 -- informational only
        pass
    cfg = getattr(engine, "config", None)
    caps = getattr(engine, "capabilities", None)
    if not caps and cfg is not None:  # an engine that does not say: its model's family
        family = _family(cfg)
        caps = family.capabilities if family is not None else None
    if caps:  # none known: the API process goes by is_encoder_decoder
        info["capabilities"] = sorted(str(c) for c in caps)
    accepts = getattr(engine, "accepts", None)
    if isinstance(accepts, dict):
        info["accepts"] = dict(accepts)
    if cfg is not None:
        for name in ("max_num_seqs", "page_size", "num_pages", "tp"):
            v = getattr(cfg, name, None)
            if isinstance(v, int):
                info[name] = v
    return info


def engine_main(config: Any, factory_path: str | None, in_q: mp.Queue, out_q: mp.Queue,
                log_level: int = logging.WARNING) -> None:
    """Entry point of the engine process."""
    # a spawned process starts with logging unconfigured: log as the API process does (the
    # engine's start-up breakdown and graph capture lines are INFO)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    # Ctrl-C in a terminal reaches the whole process group; the API process owns shutdown
    # (it drains in-flight requests first), so the engine ignores SIGINT/SIGTERM and exits
    # when told to, or when its parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where a stuck engine is
    age = _process_age()
    if age is not None:
        logger.info("engine process: up %.1f s after it was started (interpreter start-up, spawn)", age)
    try:
        from mstar.runtime.engine.request import RequestError
        engine = _load_factory(factory_path)(config)
        info = _engine_info(engine)
    except BaseException:
        out_q.put(("failed", traceback.format_exc()))
        out_q.close()
        out_q.join_thread()
        return
    # the model, torch and the caches live as long as the process: out of the cyclic collector's
    # reach, so a full collection (which would walk them all, ~0.1 s, inside the step loop) stays cheap
    gc.collect()
    gc.freeze()
    out_q.put(("ready", info))

    # MSTAR_PHASE_TIMING: the engine's phase timer, told how the gap between steps splits
    # into draining commands and emitting outputs (None: nothing is timed)
    pt = getattr(engine, "phase_timer", None)
    clock = time.perf_counter_ns
    t_emit = 0
    parent = mp.parent_process()
    last_parent_check = time.monotonic()
    last_stats = 0.0
    stats_dirty = True
    n_messages = n_records = 0
    gather_s = knobs.value("MSTAR_IDLE_GATHER_US") / 1e6
    refill = RefillGather(knobs.value("MSTAR_REFILL_GATHER_US") / 1e6)
    has_running = getattr(engine, "has_running", engine.has_unfinished)
    while True:
        busy = engine.has_unfinished()
        running = busy and has_running()
        cmds = []
        if pt is not None:
            t_drain = clock()
        if not busy and pt is not None:
            t_drain = 0  # blocks for requests: the timer marks that gap as waiting, not idle
        take_commands(in_q, cmds, busy, gather_s, running, refill)
        now = time.monotonic()
        if now - last_parent_check > IDLE_POLL_S:
            last_parent_check = now
            if parent is not None and not parent.is_alive():
                _close(engine)
                return

        errors = []
        if any(cmd[0] == "shutdown" for cmd in cmds):
            break
        # aborts first: a request aborted while its add still waited in the queue is never added,
        # and an abort never waits behind the adds queued before it
        aborted = {rid for cmd in cmds if cmd[0] == "abort" for rid in cmd[1]}
        for cmd in cmds:
            if cmd[0] != "add":
                continue
            for req in cmd[1]:
                if req.request_id in aborted:
                    continue
                try:
                    engine.add_request(req)
                except RequestError as e:
                    errors.append((req.request_id, e.field, e.message))
                except Exception as e:  # a bad request must not kill the engine
                    errors.append((req.request_id, None, f"{type(e).__name__}: {e}"))
        if aborted:
            try:
                engine.abort(list(aborted))
            except Exception:
                logger.exception("abort failed")
        if pt is not None and t_drain:
            pt.note_loop(drain_ns=clock() - t_drain)

        outputs = []
        stepped = False
        if engine.has_unfinished():
            stepped = True
            try:
                outputs = engine.step()
            except BaseException:
                out_q.put(("fatal", traceback.format_exc()))
                break
        if cmds or outputs:
            stats_dirty = True
        if outputs and refill.window_s > 0:
            refill.finished(sum(o.finish_reason in ("stop", "length") for o in outputs), time.monotonic())
        stats = None
        if pt is not None:
            t_emit = clock() if stepped else 0
        now = time.monotonic()
        idle = not engine.has_unfinished()
        if stats_dirty and (idle or now - last_stats >= STATS_INTERVAL_S):
            try:
                stats = dict(engine.stats())
                stats.update(_extra_stats())
                stats["engine_output_messages"] = n_messages + 1  # this one included
                stats["engine_output_records"] = n_records + len(outputs)
            except Exception:
                stats = None
            last_stats = now
            stats_dirty = False
        if outputs or errors or stats is not None:
            n_messages += 1
            n_records += len(outputs)
            out_q.put(("step", pack_outputs(outputs), errors, stats))
        if pt is not None and t_emit:
            pt.note_loop(emit_ns=clock() - t_emit)
    _close(engine)
    out_q.close()
    out_q.join_thread()


def _close(engine: Any) -> None:
    """Stop what the engine started (tensor-parallel followers) before the process exits."""
    close = getattr(engine, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 -- exiting anyway
            logger.exception("engine close failed")


class RefillGather:
    """MSTAR_REFILL_GATHER_US: requests owed by closed-loop clients. A client that waits for its
    request's end before sending its next (a benchmark's concurrency level, an agent, a batch
    script) sends it a few milliseconds after the finish; when a whole wave finishes together,
    its next requests arrive spread over those milliseconds, and an engine that steps at the
    first one prefills it alone and the rest a step later. `owed` counts finishes not yet
    followed by an arrival; while some are owed and nothing runs, the intake waits for them, up
    to `window_s` after the last finish. A lone request (c1) is its own client's: it settles what
    is owed and nothing is waited for; one that comes after the window waits nothing either."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.owed = 0
        self.until = 0.0  # monotonic time the owed requests are waited for until

    def finished(self, n: int, now: float) -> None:
        if n <= 0 or self.window_s <= 0:
            return
        if now >= self.until:
            self.owed = 0
        self.owed += n
        self.until = now + self.window_s

    def arrived(self, cmd) -> None:
        if self.owed and cmd[0] == "add":
            self.owed = max(0, self.owed - len(cmd[1]))

    def deadline(self, now: float) -> float:
        """Until when the intake waits (0.0: not at all)."""
        return self.until if self.owed and now < self.until else 0.0


def take_commands(in_q, cmds: list, busy: bool, gather_s: float = 0.0, running: bool | None = None,
                  refill: RefillGather | None = None) -> None:
    """Append the commands waiting in in_q to cmds. Busy: only those already there. Idle: block
    for the first (up to IDLE_POLL_S). Then, when nothing runs (idle, or only requests waiting
    for admission: running False), keep taking arrivals: with gather_s > 0
    (MSTAR_IDLE_GATHER_US) until gather_s later, and with `refill` while finished requests'
    clients are owed (RefillGather), so that a burst starts in one step. The second case of
    "nothing runs" is a closed-loop wave whose first request came in while the previous wave's
    last rows were still decoding: without it that request is prefilled alone and the wave stays
    split in two steps for good."""
    if running is None:
        running = busy

    def take(cmd) -> None:
        cmds.append(cmd)
        if refill is not None:
            refill.arrived(cmd)
    try:
        if not busy:
            take(in_q.get(timeout=IDLE_POLL_S))
        if not running:
            gather_end = time.monotonic() + gather_s if gather_s > 0 else 0.0
            while True:
                now = time.monotonic()
                end = max(gather_end, refill.deadline(now) if refill is not None else 0.0)
                if end <= now:
                    break
                try:
                    take(in_q.get(timeout=end - now))
                except queue.Empty:
                    break
        while True:
            take(in_q.get_nowait())
    except queue.Empty:
        pass


class EngineStartError(RuntimeError):
    pass


class EngineProcess:
    """The API side of the engine process: start it, feed it, read what it says."""

    def __init__(self, config: Any, factory: str | None = None):
        self.config = config
        self.factory = factory
        ctx = mp.get_context("spawn")
        self._in_q = ctx.Queue()
        self._out_q = ctx.Queue()
        level = logging.getLogger().getEffectiveLevel()
        self._proc = ctx.Process(target=engine_main, args=(config, factory, self._in_q, self._out_q, level),
                                 name="mstar-engine", daemon=False)
        self.info: dict[str, Any] = {}
        self._reader: threading.Thread | None = None
        self._stopping = False
        self.fatal: str | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._proc.start()

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                msg = self._out_q.get(timeout=0.2)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise EngineStartError(f"the engine process exited (code {self._proc.exitcode}) "
                                           "before it was ready") from None
                if deadline is not None and time.monotonic() > deadline:
                    self.kill()
                    raise EngineStartError(f"the engine was not ready within {timeout:.0f} s") from None
                continue
            if msg[0] == "ready":
                self.info = msg[1]
                return self.info
            if msg[0] == "failed":
                self._proc.join(5)
                raise EngineStartError("the engine failed to start:\n" + msg[1])

    def start_reader(self, on_message: Callable[[tuple], None]) -> None:
        """Deliver every later message to on_message (called on a reader thread)."""

        def run():
            while True:
                try:
                    msg = self._out_q.get(timeout=IDLE_POLL_S)
                except queue.Empty:
                    if not self._proc.is_alive():
                        break
                    continue
                except (EOFError, OSError):
                    break
                if msg[0] == "step":
                    msg = ("step", unpack_outputs(msg[1]), msg[2], msg[3])
                elif msg[0] == "fatal":
                    self.fatal = msg[1]
                on_message(msg)
            on_message(("exited", self._proc.exitcode))

        self._reader = threading.Thread(target=run, name="mstar-engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    # -- commands ---------------------------------------------------------------------------
    def add(self, reqs: Any) -> None:
        """Queue one EngineRequest, or a list of them as one message."""
        self._in_q.put(("add", reqs if isinstance(reqs, list) else [reqs]))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._in_q.put(("abort", list(request_ids)))

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._proc.is_alive():
            try:
                self._in_q.put(("shutdown",))
            except Exception:
                pass
            self._proc.join(timeout)
        if self._proc.is_alive():
            self.kill()
        if self._reader is not None:
            self._reader.join(2 * IDLE_POLL_S + 1)

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(3)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(3)
