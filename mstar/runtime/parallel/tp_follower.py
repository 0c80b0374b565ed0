"""A tensor-parallel follower process (ranks 1..N-1 of tp.py): loads its shard, joins the
process group, allocates the same caches as rank 0, then replays every step plan rank 0 sends
and runs the same forward, reporting errors and timing back. `follower_main` is the spawn
target (pickled by its module path: keep it here, importable without tp.py)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

from mstar.models.context import dtype_name
from mstar.runtime.parallel import tp_allreduce
from mstar.runtime.caches.cache_manager import CacheManager
from mstar.runtime.engine.step_inputs import StepInputBuilder
from mstar.runtime.parallel.tp_group import (COLLECTIVE_TIMEOUT, START_TIMEOUT_S, backend_for, rank_device, release_graphs,
                                    release_group)
from mstar.runtime.parallel.tp_plan import rebuild, replay_ops
from mstar.runtime.parallel.tp_timing import StepStat, now, sync_once


def follower_main(config, rank: int, size: int, port: int, conn, results, threads: int, fault,
                  timeout: timedelta = COLLECTIVE_TIMEOUT, t_spawn: float | None = None,
                  allreduce: str = "nccl") -> None:
    """Entry point of follower `rank`: load the shard, allocate caches, run every plan.
    allreduce: rank 0's MSTAR_TP_ALLREDUCE (tp_allreduce.py), so that every rank sums alike
    whatever this process's environment or knob overrides say.
    It leaves with os._exit once its reports are flushed: the interpreter's teardown (freeing
    the model and caches, the device context, atexit hooks) would only keep rank 0's close
    waiting, and the OS reclaims all of it."""
    t_first = now()
    import faulthandler
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 owns shutdown
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where a hung follower is
    code = 0
    try:
        _follower(config, rank, size, port, conn, results, threads, fault, timeout, t_spawn, t_first, allreduce)
    except BaseException:  # noqa: BLE001 -- reported to rank 0
        code = 1
        try:
            results.put((rank, "error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
    try:
        results.close()
        results.join_thread()  # the reports are in the pipe
    except Exception:  # noqa: BLE001
        pass
    try:  # multiprocessing's own exit work: e.g. unlinking semaphores made here (tqdm's lock)
        from multiprocessing import util
        util._exit_function()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait on collectives, process-group or interpreter teardown


class _FirstCall:
    """fn, with its first call timed (synchronised once on CUDA, unless capturing)."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.device = fn, device
        self.span: tuple[float, float] | None = None

    def __call__(self, *a, **kw):
        if self.span is not None:
            return self.fn(*a, **kw)
        t = now()
        out = self.fn(*a, **kw)
        sync_once(self.device)
        self.span = (t, now())
        return out


def _follower(config, rank, size, port, conn, results, threads, fault, timeout, t_spawn, t_first,
              allreduce) -> None:
    ph: dict[str, float | None] = {"spawn": None if t_spawn is None else t_first - t_spawn}
    extra: dict[str, float | None] = {}
    t = now()
    import torch.distributed as dist

    from mstar.models import load_model, parallel
    from mstar.models.loader import resolve_config

    torch.set_num_threads(max(1, threads))
    base = config.resolve_device()
    device = rank_device(base, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = config.resolve_dtype(device)
    mcfg = resolve_config(config.model)
    extra["imports + config"] = now() - t
    # the shard first (no collective needed), then the process group: rank 0 loads its own meanwhile
    parallel.set_tp(rank, size, None)
    if fault is not None and fault[0] == rank and fault[1] == "load":
        raise RuntimeError(f"injected fault: rank {rank} at load")
    t = now()
    model = load_model(config.model, dtype=dtype, device=device, random_weights=config.random_weights,
                       seed=config.seed, progress=False, config=mcfg)
    ph["load"] = now() - t
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    results.put((rank, "loaded", free))
    t = now()
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timedelta(seconds=START_TIMEOUT_S))
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=timeout)
    summing = tp_allreduce.setup(device, dtype, allreduce, timeout_s=timeout.total_seconds())  # rank 0 alike
    ph["init_process_group"] = now() - t

    t = now()
    msg = pickle.loads(conn.recv_bytes())
    if msg[0] == "shutdown":  # rank 0 failed before sizing the caches
        return
    assert msg[0] == "caches", msg[0]
    t2 = now()
    extra["waiting for rank 0's cache sizes"] = t2 - t
    spec = dataclasses.replace(model.cache_spec(), state_dtype=getattr(torch, msg[2]))  # rank 0's dtype
    cm = CacheManager(spec, device=device, **msg[1])
    model.bind_caches(cm.caches)
    ph["caches"] = now() - t2
    results.put((rank, "ready", {"asked": allreduce, "allreduce": summing,
                                 "state_dtype": dtype_name(spec.state_dtype)}))
    t_ready = now()

    unpack = StepInputBuilder(page_size=cm.page_size, device=device, has_attention=cm.has_attention,
                              has_state=cm.has_state)
    forward = _FirstCall(model.forward, device)
    hosts: dict[int, Any] = {}
    step = 0
    # per-step timing (host seconds): waiting for a plan, unpacking it (ops, H2D), the forward's host side
    # (+ logits), eager and graph-replayed apart, and transit (rank 0's send to this rank's receive)
    st = {k: StepStat() for k in ("wait", "transit", "unpack", "forward_eager", "forward_graph")}
    s_wait, s_transit, s_unpack = st["wait"].add, st["transit"].add, st["unpack"].add
    s_eager, s_graph = st["forward_eager"].add, st["forward_graph"].add
    t_first_plan = None
    capture_span: tuple[float, float] | None = None
    startup_sent = False

    def send_startup() -> None:
        t_end = capture_span[1] if capture_span is not None else t_ready  # could step from here
        total = t_end - (t_first if t_spawn is None else t_spawn)
        idle = None
        if forward.span is not None:
            f0, f1 = forward.span
            ph["first_forward"] = f1 - f0
            if f0 >= t_end:  # the first step's forward, not a capture warm-up
                total += f1 - f0
                idle = None if t_first_plan is None else t_first_plan - t_end
        ph["total"] = total
        extra["idle before the first step, not in total"] = idle
        results.put((rank, "startup", {"phases": dict(ph), "extra": dict(extra)}))

    clock = time.perf_counter
    pgraphs = None  # prefill graphs (prefill_graphs.py), when rank 0 uses them
    runner = None  # decode graphs (cuda_graphs.py), when rank 0 uses them
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
            if msg[0] == "pgraphs":  # the prefill graphs, built (and captured) with rank 0
                from mstar.runtime.graphs.prefill_graphs import PrefillGraphRunner
                pgraphs = PrefillGraphRunner(model, device=device, dtype=dtype, capture=msg[1],
                                             max_tokens=config.resolve_max_num_batched_tokens(device),
                                             stream=getattr(runner, "stream", None))
                continue
            if msg[0] == "graphs":  # capture the decode graphs with rank 0
                from mstar.runtime.graphs.cuda_graphs import DecodeGraphRunner
                tg = now()
                runner = DecodeGraphRunner(model, forward, device=device, **msg[1])
                # overlapped decode: a chained step's input ids arrive by broadcast from rank 0
                loopback = torch.zeros(runner.max_batch, dtype=torch.int64, device=device)
                runner.capture()  # (a failure is reported like any other: rank 0's next collective fails)
                capture_span = (tg, now())
                ph["capture"] = capture_span[1] - tg
                continue
            if t_first_plan is None:
                t_first_plan = now()
            if msg[0] == "gstep":  # a graph-replayed decode step
                _, ops, rows, t_sent, chained, greedy = msg
                s_transit(time.monotonic() - t_sent)
                step += 1
                if fault is not None and fault[0] == rank and fault[1] == "chained" and chained and step >= fault[2]:
                    raise RuntimeError(f"injected fault: rank {rank} at chained step {step}")
                replay_ops(cm, hosts, ops)
                t2 = clock()
                loop = None
                if chained:  # overlapped decode: the input ids are rank 0's previous tokens (tp.py)
                    loop = loopback[:len(rows.decode_tokens)]
                    dist.broadcast(loop, src=0)
                hidden = runner.run(rows, loopback=loop)
                # the collective rank 0 joins: the launch's vocab-parallel argmax, or the logits' gather
                model.greedy_tokens(hidden) if greedy else model.compute_logits(hidden)
                s_wait(t1 - t0)
                s_graph(clock() - t2)
            else:
                _, ops, lay, arrays, n_sample, t_sent = msg
                s_transit(time.monotonic() - t_sent)
                step += 1
                if fault is not None and fault[0] == rank and fault[1] == "step" and step >= fault[2]:
                    raise RuntimeError(f"injected fault: rank {rank} at step {step}")
                replay_ops(cm, hosts, ops)
                bufs = [unpack._to_device(a) for a in arrays]
                ctx = rebuild(lay, bufs, device)
                t2 = clock()
                if pgraphs is not None and pgraphs.fits(ctx.input_ids.shape[0]):
                    hidden = pgraphs.run(ctx)
                else:
                    hidden = forward(ctx)
                if n_sample:
                    model.compute_logits(hidden[ctx.logits_indices])
                s_wait(t1 - t0)
                s_unpack(t2 - t1)
                s_eager(clock() - t2)
            if not startup_sent:
                startup_sent = True
                send_startup()
    t_shutdown = now()
    if not startup_sent:
        send_startup()
    results.put((rank, "stats", {"steps": step, **st}))
    t = now()
    release_graphs(runner, pgraphs)  # before the group: NCCL's teardown waits for them
    release_group()
    results.put((rank, "bye", {"t_shutdown": t_shutdown, "release_s": now() - t}))

