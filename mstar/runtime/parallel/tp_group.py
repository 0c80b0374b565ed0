"""The torch.distributed group basics of tensor parallelism (tp.py), used by rank 0 (tp.py) and
the followers (tp_follower.py) alike: the error type, each rank's device and backend, the
timeouts, and tearing a group or the follower processes down."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch

log = logging.getLogger("mstar.runtime.parallel.tp")  # one logger for all of tensor parallelism

# rank 0's code (tp.py) reads these as tp.py's own names (it re-exports them), when it runs: to change
# one for rank 0, monkeypatch tp.<NAME> (the tests do); followers get COLLECTIVE_TIMEOUT from rank 0
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


def abort_group() -> None:
    try:
        from torch.distributed import distributed_c10d as c10d
        fn = getattr(c10d, "_abort_process_group", None)
        if fn is not None:
            fn()
    except Exception:  # noqa: BLE001
        log.exception("aborting the tensor-parallel group")


RELEASE_TIMEOUT_S = 10.0


def release_graphs(*runners) -> None:
    """Destroy the graph runners' captured graphs (None: skipped) before the group is released:
    NCCL's teardown spins until every graph that captured one of its collectives is destroyed
    (its comm's persistent references), so with graphs alive it never returns."""
    for r in runners:
        if r is not None:
            r.release()


def release_group(timeout_s: float = RELEASE_TIMEOUT_S) -> str:
    """Leave the default group at close, every rank on its own: returns how it went.

    NCCL: abort (local: a destroy can wait on peers that have gone). Either waits for the graphs
    that captured its collectives: release_graphs first (without it every tp=2
    close on two H200s hung here: notes/gpu-2026-11-30-tp2-9b.md). gloo: destroy. Bounded either way: past timeout_s the process
    goes on (the thread is a daemon) and says so."""
    import threading

    import torch.distributed as dist
    if not dist.is_initialized():
        return "none"
    nccl = dist.get_backend() == "nccl"
    err: list[BaseException] = []

    def run() -> None:
        try:
            if nccl:
                abort_group()
            else:
                dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 -- reported below
            err.append(e)

    t = threading.Thread(target=run, name="tp-release-group", daemon=True)
    t.start()
    t.join(timeout_s)
    how = "aborted" if nccl else "destroyed"
    if t.is_alive():
        log.warning("tp: the group was not %s within %.0f s; going on without it", how, timeout_s)
        return "timed out"
    if err:
        log.warning("tp: releasing the group failed: %r", err[0])
        return "failed"
    return how


def kill_all(procs, conns) -> None:
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

