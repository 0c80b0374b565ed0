"""jit_watch: Triton kernel variants built after start-up are logged with their time, the
hooks chain onto any installed before (and pass their return values through: a truthy
jit_cache_hook return makes Triton skip the build), and uninstall puts the old hooks back."""

import logging
import time
from types import SimpleNamespace

import pytest

from mstar.ops.cache import jit_watch

triton = pytest.importorskip("triton")


@pytest.fixture()
def clean_hooks():
    from triton import knobs
    rt = knobs.runtime
    saved = rt.jit_cache_hook, rt.jit_post_compile_hook
    jit_watch.uninstall()
    yield rt
    jit_watch.uninstall()
    rt.jit_cache_hook, rt.jit_post_compile_hook = saved


def _build(rt, name: str, seconds: float):
    """What Triton's JITFunction._do_compile does around a build, with keyword arguments."""
    fn = SimpleNamespace(module="fla.ops.chunk", name=name)
    skip = rt.jit_cache_hook(key=("k",), repr=name, fn=fn, compile={}, is_manual_warmup=False,
                             already_compiled=False)
    time.sleep(seconds)
    rt.jit_post_compile_hook(key=("k",), repr=name, fn=fn, compile={}, is_manual_warmup=False,
                             already_compiled=False)
    return skip


def test_late_builds_are_logged_with_their_time(clean_hooks, caplog):
    rt = clean_hooks
    w = jit_watch.install()
    assert w is not None and jit_watch.install() is w  # once per process
    caplog.set_level(logging.INFO, logger="mstar.ops.jit")
    assert _build(rt, "early_kernel", 0.0) is None  # start-up: counted, not logged
    assert not caplog.records
    w.mark_ready()
    _build(rt, "late_kernel", 0.05)
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING and "fla.ops.chunk.late_kernel" in rec.getMessage()
    s = w.summary()
    assert s["built"] == 2 and s["after_ready"] == 1 and s["late_kernels"] == ["fla.ops.chunk.late_kernel"]
    assert 0.05 <= s["after_ready_seconds"] < 1.0


def test_chains_the_hooks_found_and_restores_them(clean_hooks):
    rt = clean_hooks
    calls = []

    def pre(**kw):
        calls.append(("pre", kw["fn"].name))
        return True  # "skip the build": must reach Triton unchanged

    def post(**kw):
        calls.append(("post", kw["fn"].name))

    rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
    w = jit_watch.install()
    assert _build(rt, "k1", 0.0) is True
    assert calls == [("pre", "k1"), ("post", "k1")] and w.summary()["built"] == 1
    jit_watch.uninstall()
    assert rt.jit_cache_hook is pre and rt.jit_post_compile_hook is post



def test_slowest_ranks_kernels_by_their_builds_seconds():
    w = jit_watch.JitWatch()
    for name, t in [("m.a", 1.0), ("m.b", 0.5), ("m.a", 2.0), ("m.c", 4.0), ("m.b", 0.25)]:
        w._record(name, t)
    assert w.slowest() == [("m.c", 1, 4.0), ("m.a", 2, 3.0), ("m.b", 2, 0.75)]
    assert w.slowest(since=2, n=2) == [("m.c", 1, 4.0), ("m.a", 1, 2.0)]
