"""Tensor parallelism across the devices of one host: rank 0 is the engine, ranks 1..N-1
are follower processes that run the same forward on their shard of the model.

    EngineCore (rank 0, the caller's process)          follower r (spawned, one per rank)
    scheduler, cache bookkeeping, sampler               model shard r, caches (same ids)
    StepInputBuilder -> ForwardContext ----plan---->    replay cache ops, rebuild the context
    model.forward   <== all-reduce / all-gather ==>     model.forward
    compute_logits -> sample (rank 0 only)              compute_logits (takes part in the gather)

The plan of a step is the host arrays the ForwardContext's tensors are views of (two
flat int buffers, see step_inputs.py), the context's layout, and the cache operations
rank 0's CacheManager performed since the previous plan (copy-on-write page copies,
state zeroing / copies at admission, offload / reload host copies, dropped host copies
of freed requests): followers own caches with the same page and slot ids, and replay
these on their own shard before the forward. It goes to each follower over a pipe
right after rank 0 has built its context (pickled once), so a follower's only
host work is unpacking it: it never waits on scheduling, only on receiving.
Aborts, frees and preemptions need nothing more: they are bookkeeping on rank 0, and
their tensor effects (if any) are in the ops.

Collectives: torch.distributed, NCCL on CUDA (NCCL_NVLS_ENABLE=0 is kept in the
environment), gloo on CPU; rank r uses device index base + r.

Failures: a follower that raises sends its traceback to rank 0 and exits; rank 0's next
(or current) collective fails and the engine raises TPError carrying the follower's
message. A monitor thread notices followers that died without a word (and, with NCCL,
aborts the process group so that rank 0 does not hang). Shutdown: `close()` (the engine's
close) tells followers to exit, joins them (terminate / kill after a timeout), and
destroys the process group; followers also exit when rank 0's pipe closes (rank 0 died).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import queue
import sys
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from mstar.runtime.cache_manager import CacheManager
from mstar.runtime.offload import to_device, to_host
from mstar.runtime.step_inputs import StepInputBuilder

log = logging.getLogger("mstar.runtime.tp")

START_TIMEOUT_S = 1800.0  # a follower loading a large checkpoint
JOIN_TIMEOUT_S = 10.0
ERROR_WAIT_S = 5.0  # after a failed collective: how long to wait for the follower's message
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


class TPError(RuntimeError):
    """A tensor-parallel follower failed; the message carries its traceback."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# ==========================================================================================
# the step plan: a ForwardContext as host arrays + layout
# ==========================================================================================
@dataclasses.dataclass(frozen=True)
class _Ref:
    buf: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Host:
    """A host tensor of rank 0's context (indptrs for planning): a host tensor on followers too."""
    t: torch.Tensor


def _layout(obj, bufs: list[torch.Tensor]):
    """obj with every tensor replaced by a _Ref into bufs (or a CPU copy if it is not a view of one)."""
    if isinstance(obj, torch.Tensor):
        ptr = obj.untyped_storage().data_ptr()
        for i, b in enumerate(bufs):
            if b.untyped_storage().data_ptr() == ptr and b.dtype == obj.dtype:
                return _Ref(i, obj.storage_offset() - b.storage_offset(), tuple(obj.shape), tuple(obj.stride()))
        if obj.device.type == "cpu":
            return _Host(obj.detach().clone())
        return obj.detach().cpu()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), {f.name: _layout(getattr(obj, f.name), bufs) for f in dataclasses.fields(obj)})
    return obj


def _rebuild(lay, bufs: list[torch.Tensor], device: torch.device):
    if isinstance(lay, _Ref):
        return torch.as_strided(bufs[lay.buf], lay.shape, lay.stride, bufs[lay.buf].storage_offset() + lay.offset)
    if isinstance(lay, _Host):
        return lay.t
    if isinstance(lay, torch.Tensor):
        return lay.to(device)
    if isinstance(lay, tuple) and len(lay) == 2 and isinstance(lay[0], type) and dataclasses.is_dataclass(lay[0]):
        cls, kw = lay
        return cls(**{k: _rebuild(v, bufs, device) for k, v in kw.items()})
    return lay


class _PlanRecorder(StepInputBuilder):
    """Rank 0's step input builder: builds the context as usual, then sends the plan."""

    def __init__(self, tp: "TensorParallel", **kw):
        super().__init__(**kw)
        self._tp = tp
        self._rec: list[tuple[np.ndarray, torch.Tensor]] = []

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        t = super()._to_device(arr)
        self._rec.append((arr, t))
        return t

    def build(self, rows):
        self._rec = []
        ctx, n_sample = super().build(rows)
        self._tp.send_step(ctx, n_sample, self._rec)
        return ctx, n_sample


# ==========================================================================================
# cache operations, recorded on rank 0 and replayed by followers
# ==========================================================================================
class MirroredCacheManager(CacheManager):
    """Rank 0's CacheManager: every tensor operation on the caches is also logged (in
    page / slot ids, valid on every rank) for the followers to replay."""

    def __init__(self, *a, **kw):
        self.ops: list[tuple] = []
        self._host_keys = 0
        super().__init__(*a, **kw)

    def take_ops(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def _copy_pages(self, src, dst):
        if src and self.has_attention:
            self.ops.append(("copy_pages", list(src), list(dst)))
        super()._copy_pages(src, dst)

    def _copy_state(self, src, dst):
        self.ops.append(("copy_state", src, dst))
        super()._copy_state(src, dst)

    def _zero_state(self, slot):
        self.ops.append(("zero_state", slot))
        super()._zero_state(slot)

    def _to_host(self, pages, slot):
        h = super()._to_host(pages, slot)
        self._host_keys += 1
        h.tp_key = self._host_keys
        self.ops.append(("to_host", h.tp_key, list(pages), slot))
        return h

    def _to_device(self, host, dst, rows, slot):
        self.ops.append(("to_device", host.tp_key, list(dst), list(rows), slot))
        super()._to_device(host, dst, rows, slot)

    def free(self, req_id):
        r = self._reqs.get(req_id)
        if r is not None and r.host is not None:
            self.ops.append(("drop_host", r.host.tp_key))
        super().free(req_id)


def replay_ops(cm: CacheManager, hosts: dict, ops: list[tuple]) -> None:
    for op in ops:
        kind = op[0]
        if kind == "copy_pages":
            cm._copy_pages(op[1], op[2])
        elif kind == "copy_state":
            cm._copy_state(op[1], op[2])
        elif kind == "zero_state":
            cm._zero_state(op[1])
        elif kind == "to_host":
            hosts[op[1]] = to_host(cm.caches, op[2], op[3])
        elif kind == "to_device":
            to_device(hosts.pop(op[1]), cm.caches, op[2], op[3], op[4])
        elif kind == "drop_host":
            hosts.pop(op[1], None)
        else:
            raise ValueError(f"unknown cache op {kind!r}")


# ==========================================================================================
# rank 0
# ==========================================================================================
class TensorParallel:
    """Rank 0's side: spawns and talks to the followers. Built by EngineCore when tp > 1."""

    # tests: (rank, "load" | "step", n) makes that follower raise at load or before step n
    _test_fault: tuple | None = None

    def __init__(self, config, device: torch.device):
        import torch.distributed as dist

        from mstar.models import parallel
        from mstar.models.loader import resolve_config

        self.size = int(config.tp)
        self.device = torch.device(device)
        mcfg = resolve_config(config.model)
        parallel.check_config(mcfg, self.size)
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
        self.plan_steps, self.plan_send_s = 0, 0.0  # rank 0: plans sent, host time packing + sending
        self.follower_stats: dict[int, dict] = {}  # phase timing each follower reports when it exits
        self.cm: MirroredCacheManager | None = None
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout=timedelta(seconds=START_TIMEOUT_S),
                                    wait_for_workers=False)
        mp = torch.multiprocessing.get_context("spawn")
        self._results = mp.Queue()
        self._procs, self._conns = [], []
        threads = torch.get_num_threads()
        for r in range(1, self.size):
            recv, send = mp.Pipe(duplex=False)
            p = mp.Process(target=follower_main, name=f"mstar-tp{r}", daemon=True,
                           args=(config, r, self.size, self._store.port, recv, self._results, threads,
                                 self._test_fault, COLLECTIVE_TIMEOUT))
            p.start()
            recv.close()
            self._procs.append(p)
            self._conns.append(send)
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs), list(self._conns))
        self._wait_all("hello")
        dist.init_process_group(backend_for(self.device), store=self._store, rank=0, world_size=self.size,
                                timeout=COLLECTIVE_TIMEOUT)
        self._monitor: threading.Thread | None = None

    # --- start-up ------------------------------------------------------------------------
    def load_model(self, config, dtype: torch.dtype):
        """Rank 0's shard (the followers load theirs at the same time)."""
        from mstar.models import load_model, parallel
        try:
            with parallel.building(0, self.size):  # only this model is sharded, not the process
                return load_model(config.model, dtype=dtype, device=self.device,
                                  random_weights=config.random_weights, seed=config.seed)
        except BaseException:
            self.close()
            raise

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
        return [got[r] for r in range(1, self.size)]

    def _fail_start(self, msg: str) -> None:
        self.error = msg
        self.close()
        raise TPError(msg)

    def sizing_config(self, config):
        """The config to size the caches with: on CUDA, the smallest free memory of all
        ranks (every rank allocates the same pages and slots)."""
        frees = self._wait_all("loaded")
        if self.device.type != "cuda" or config.cache_memory_bytes is not None:
            return config
        from mstar.runtime.config import CUDA_CACHE_FRACTION
        free0, _ = torch.cuda.mem_get_info(self.device)
        return dataclasses.replace(config, cache_memory_bytes=int(min([free0, *frees]) * CUDA_CACHE_FRACTION))

    def cache_manager(self, *a, **kw) -> MirroredCacheManager:
        try:
            self.cm = MirroredCacheManager(*a, **kw)
        except BaseException:  # e.g. out of memory: do not leave the followers waiting
            self.close()
            raise
        self._cache_kw = {k: v for k, v in kw.items() if k != "device"}
        return self.cm

    def input_builder(self, **kw) -> StepInputBuilder:
        return _PlanRecorder(self, **kw)

    def attach(self, model) -> None:
        """Caches are allocated on rank 0: followers allocate theirs (same sizes), then the
        engine may step. Rank 0's forward / compute_logits raise TPError on follower errors."""
        self._send(("caches", self._cache_kw))
        self._wait_all("ready")
        self._monitor = threading.Thread(target=self._watch, name="mstar-tp-monitor", daemon=True)
        self._monitor.start()
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._guard(getattr(model, name)))

    # --- decode graphs ---------------------------------------------------------------------
    def start_graphs(self, params: dict) -> None:
        """Followers build the same DecodeGraphRunner and capture it now, in step with rank 0
        (the captured collectives must pair up): call right before rank 0's own capture."""
        self._send(("graphs", params))

    def send_graph_step(self, rows) -> None:
        """A graph-replayed decode step: the rows (followers fill their own fixed buffers)."""
        self._send_plan(lambda: ("gstep", self.cm.take_ops(), rows, time.monotonic()))

    # --- steps ---------------------------------------------------------------------------
    def _send(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for c in self._conns:
            c.send_bytes(data)

    def send_step(self, ctx, n_sample: int, rec: list[tuple[np.ndarray, torch.Tensor]]) -> None:
        self._send_plan(lambda: ("step", self.cm.take_ops(), _layout(ctx, [t for _, t in rec]), [a for a, _ in rec],
                                 n_sample, time.monotonic()))

    def _send_plan(self, make_msg) -> None:
        """Send a step's plan (built by make_msg) to every follower; time it."""
        if self.error:
            raise TPError(self.error)
        t0 = time.perf_counter()
        msg = make_msg()
        try:
            self._send(msg)
        except (BrokenPipeError, EOFError, OSError) as e:
            self._raise_follower_error(e)
        self.plan_steps += 1
        self.plan_send_s += time.perf_counter() - t0

    def _guard(self, fn):
        def guarded(*a, **kw):
            if self.error:
                raise TPError(self.error)
            try:
                return fn(*a, **kw)
            except TPError:
                raise
            except Exception as e:
                self._raise_follower_error(e)
        guarded.__wrapped__ = fn
        return guarded

    def _raise_follower_error(self, e: BaseException):
        deadline = time.monotonic() + ERROR_WAIT_S
        while self.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.error is not None:
            raise TPError(self.error) from e
        raise e

    def _watch(self) -> None:
        dead_since: float | None = None
        while not self._closed:
            try:
                rank, kind, payload = self._results.get(timeout=0.2)
                if kind == "error" and self.error is None:
                    self.error = f"tensor-parallel rank {rank} failed:\n{payload}"
                elif kind == "stats":
                    self.follower_stats[rank] = payload
            except queue.Empty:
                pass
            except (EOFError, OSError):
                return
            if self.error is None and not self._closed:
                dead = [(i + 1, p.exitcode) for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead and dead_since is None:
                    dead_since = time.monotonic()  # its message may still be on the way
                elif dead and time.monotonic() - dead_since > 1.0:
                    self.error = f"tensor-parallel rank {dead[0][0]} exited (code {dead[0][1]})"
            if self.error is not None and not self._closed:
                if self.device.type == "cuda":
                    _abort_group()  # NCCL would wait forever for the dead rank
                return

    # --- shutdown ------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._send(("shutdown",))
        except Exception:  # noqa: BLE001 -- a follower already gone
            pass
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        _kill_all(self._procs, self._conns)
        if self._monitor is not None:
            self._monitor.join(1.0)
        self._log_phases()
        self._finalizer.detach()
        import torch.distributed as dist
        if dist.is_initialized():
            try:
                if self.error is not None and self.device.type == "cuda":
                    _abort_group()
                else:
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                log.exception("destroying the tensor-parallel group")
        self._results.close()

    def _log_phases(self) -> None:
        """Phase timing: rank 0's plan cost and each follower's time waiting for plans."""
        try:
            while True:
                rank, kind, payload = self._results.get_nowait()
                if kind == "stats":
                    self.follower_stats[rank] = payload
        except (queue.Empty, EOFError, OSError, ValueError):
            pass
        if not self.plan_steps:
            return
        lines = [f"tp={self.size}: rank 0 sent {self.plan_steps} plans, "
                 f"{1e6 * self.plan_send_s / self.plan_steps:.1f} us each (pack + send)"]
        for rank, st in sorted(self.follower_stats.items()):
            n = max(1, st["steps"])
            lines.append(f"tp rank {rank}: {st['steps']} steps; per step: plan transit "
                         f"{1e6 * st['transit_s'] / n:.1f} us, wait for plan {1e6 * st['wait_s'] / n:.1f} us "
                         f"(idle included), unpack {1e6 * st['unpack_s'] / n:.1f} us, forward (host) "
                         f"{1e6 * st['forward_s'] / n:.1f} us")
        for line in lines:
            if logging.getLogger().handlers or log.handlers:
                log.info("%s", line)
            else:  # e.g. the server's engine process, which configures no logging
                print(f"mstar.runtime.tp: {line}", file=sys.stderr, flush=True)


def _abort_group() -> None:
    try:
        from torch.distributed import distributed_c10d as c10d
        fn = getattr(c10d, "_abort_process_group", None)
        if fn is not None:
            fn()
    except Exception:  # noqa: BLE001
        log.exception("aborting the tensor-parallel group")


def _kill_all(procs, conns) -> None:
    for c in conns:
        try:
            c.close()
        except Exception:  # noqa: BLE001
            pass
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(3)
        if p.is_alive():
            p.kill()
            p.join(3)


# ==========================================================================================
# followers
# ==========================================================================================
def follower_main(config, rank: int, size: int, port: int, conn, results, threads: int, fault,
                  timeout: timedelta = COLLECTIVE_TIMEOUT) -> None:
    """Entry point of follower `rank`: load the shard, allocate caches, run every plan."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 owns shutdown
    try:
        _follower(config, rank, size, port, conn, results, threads, fault, timeout)
    except BaseException:  # noqa: BLE001 -- reported to rank 0
        try:
            results.put((rank, "error", traceback.format_exc()))
            results.close()
            results.join_thread()
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)  # do not wait on collectives or process-group teardown


def _follower(config, rank, size, port, conn, results, threads, fault, timeout) -> None:
    import torch.distributed as dist

    from mstar.models import load_model, parallel

    torch.set_num_threads(max(1, threads))
    base = config.resolve_device()
    device = rank_device(base, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = config.resolve_dtype(device)
    results.put((rank, "hello", None))
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timedelta(seconds=START_TIMEOUT_S))
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=timeout)
    parallel.set_tp(rank, size, None)
    if fault is not None and fault[0] == rank and fault[1] == "load":
        raise RuntimeError(f"injected fault: rank {rank} at load")
    model = load_model(config.model, dtype=dtype, device=device, random_weights=config.random_weights,
                       seed=config.seed, progress=False)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    results.put((rank, "loaded", free))

    msg = pickle.loads(conn.recv_bytes())
    assert msg[0] == "caches", msg[0]
    cm = CacheManager(model.cache_spec(), device=device, **msg[1])
    model.bind_caches(cm.caches)
    results.put((rank, "ready", None))

    unpack = StepInputBuilder(page_size=cm.page_size, device=device, has_attention=cm.has_attention,
                              has_state=cm.has_state)
    hosts: dict[int, Any] = {}
    step = 0
    # phase timing (host seconds): waiting for a plan, unpacking it (ops, H2D), the forward's host side
    # and transit (rank 0's send to this rank's receive; CLOCK_MONOTONIC is host-wide)
    t_wait = t_unpack = t_forward = t_transit = 0.0
    clock = time.perf_counter
    with torch.inference_mode():
        while True:
            t0 = clock()
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break  # rank 0 is gone
            t1 = clock()
            msg = pickle.loads(data)
            if msg[0] == "shutdown":
                break
            if msg[0] == "graphs":  # capture the decode graphs with rank 0
                from mstar.runtime.cuda_graphs import DecodeGraphRunner
                runner = DecodeGraphRunner(model, model.forward, device=device, **msg[1])
                runner.capture()  # (a failure is reported like any other: rank 0's next collective fails)
                continue
            if msg[0] == "gstep":  # a graph-replayed decode step
                _, ops, rows, t_sent = msg
                t_transit += time.monotonic() - t_sent
                step += 1
                replay_ops(cm, hosts, ops)
                t2 = clock()
                model.compute_logits(runner.run(rows))
                t_wait += t1 - t0
                t_forward += clock() - t2
                continue
            _, ops, lay, arrays, n_sample, t_sent = msg
            t_transit += time.monotonic() - t_sent
            step += 1
            if fault is not None and fault[0] == rank and fault[1] == "step" and step >= fault[2]:
                raise RuntimeError(f"injected fault: rank {rank} at step {step}")
            replay_ops(cm, hosts, ops)
            bufs = [unpack._to_device(a) for a in arrays]
            ctx = _rebuild(lay, bufs, device)
            t2 = clock()
            hidden = model.forward(ctx)
            if n_sample:
                model.compute_logits(hidden[ctx.logits_indices])
            t_wait += t1 - t0
            t_unpack += t2 - t1
            t_forward += clock() - t2
    results.put((rank, "stats", {"steps": step, "wait_s": t_wait, "unpack_s": t_unpack, "forward_s": t_forward,
                             "transit_s": t_transit}))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    parallel.reset_tp()
