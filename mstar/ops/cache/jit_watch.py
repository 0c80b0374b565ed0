"""Which Triton kernels specialise after start-up, and how long each took.

Triton builds a kernel variant per specialisation (integer arguments == 1 or % 16, dtypes,
constexprs; an autotuner builds one per config). The first use of a variant in a process is a
load from the on-disk cache (kernel_cache/triton, milliseconds) or a compile (seconds). A served
request that meets one stalls its whole step: on a fresh H200 host the 9B TP2 server's first
c8 / c32 requests waited 1.3 / 2.1 s (TTFT p90) for variants the start-up warm-up had not built
(notes/gpu-2026-11-30-tp2-9b.md).

`install()` chains onto Triton's jit_cache_hook (called before a variant is built) and
jit_post_compile_hook (after), process-wide, once; it never changes what Triton does (the
hooks return what a hook installed before ours returns, else None). `mark_ready()` (the engine,
after its warm-up) starts logging: each variant built from then on is a WARNING naming the
kernel and its time. `summary()` counts them. Without Triton nothing is installed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("mstar.ops.jit")


@dataclass
class JitEvent:
    kernel: str
    seconds: float
    after_ready: bool


class JitWatch:
    def __init__(self) -> None:
        self.events: list[JitEvent] = []
        self.ready = False
        self._local = threading.local()  # start times of the builds under way on this thread
        self._prev_pre = self._prev_post = None

    # --- the hooks (Triton calls them with keyword arguments) --------------------------------
    def before(self, **kw):
        self._starts().append(time.perf_counter())
        return self._prev_pre(**kw) if self._prev_pre is not None else None

    def after(self, **kw):
        starts = self._starts()
        t = time.perf_counter() - starts.pop() if starts else 0.0
        try:
            self._record(_kernel_name(kw.get("fn")), t)
        except Exception:  # noqa: BLE001 -- a report must never break a kernel build
            pass
        return self._prev_post(**kw) if self._prev_post is not None else None

    def _starts(self) -> list:
        s = getattr(self._local, "starts", None)
        if s is None:
            s = self._local.starts = []
        return s

    def _record(self, kernel: str, seconds: float) -> None:
        ev = JitEvent(kernel, seconds, self.ready)
        self.events.append(ev)
        if ev.after_ready:
            log.warning("triton: %s built after start-up in %.3f s (a step waited for it; the start-up "
                        "warm-up did not meet this specialisation)", kernel, seconds)

    # --- engine side ------------------------------------------------------------------------
    def mark_ready(self, ready: bool = True) -> None:
        self.ready = ready

    def summary(self) -> dict:
        late = [e for e in self.events if e.after_ready]
        return {"built": len(self.events), "seconds": sum(e.seconds for e in self.events),
                "after_ready": len(late), "after_ready_seconds": sum(e.seconds for e in late),
                "late_kernels": sorted({e.kernel for e in late})}


    def slowest(self, since: int = 0, n: int = 5) -> list[tuple[str, int, float]]:
        """The kernels whose variants took longest to build, from the `since`-th event on:
        (kernel, variants, seconds), slowest first."""
        by: dict[str, list] = {}
        for e in self.events[since:]:
            v = by.setdefault(e.kernel, [0, 0.0])
            v[0] += 1
            v[1] += e.seconds
        ranked = sorted(by.items(), key=lambda kv: -kv[1][1])[:n]
        return [(k, c, t) for k, (c, t) in ranked]


def _kernel_name(fn) -> str:
    if fn is None:
        return "?"
    module, name = getattr(fn, "module", ""), getattr(fn, "name", "")
    return f"{module}.{name}" if module else str(name or fn)


_WATCH: JitWatch | None = None
_LOCK = threading.Lock()


def install() -> JitWatch | None:
    """The process's watch, installed on first call; None without Triton (or its hooks)."""
    global _WATCH
    with _LOCK:
        if _WATCH is not None:
            return _WATCH
        try:
            from triton import knobs
            rt = knobs.runtime
            prev_pre, prev_post = rt.jit_cache_hook, rt.jit_post_compile_hook
        except Exception:  # noqa: BLE001 -- no Triton, or one without these hooks
            return None
        w = JitWatch()
        w._prev_pre, w._prev_post = prev_pre, prev_post
        rt.jit_cache_hook, rt.jit_post_compile_hook = w.before, w.after
        _WATCH = w
        return w


def uninstall() -> None:
    """Put back the hooks install() found (tests)."""
    global _WATCH
    with _LOCK:
        if _WATCH is None:
            return
        from triton import knobs
        rt = knobs.runtime
        if rt.jit_cache_hook == _WATCH.before:
            rt.jit_cache_hook = _WATCH._prev_pre
        if rt.jit_post_compile_hook == _WATCH.after:
            rt.jit_post_compile_hook = _WATCH._prev_post
        _WATCH = None
