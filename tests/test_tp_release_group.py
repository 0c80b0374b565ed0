"""release_group (tp_group.py): how a rank leaves the group at close. NCCL aborts (a destroy
hung every tp=2 close on two H200s), gloo destroys, and a release that does not return in
time is left behind instead of hanging close()."""

import threading
import time

import torch.distributed as dist

from mstar.runtime.parallel import tp_group


def _fake_group(monkeypatch, backend: str, calls: list, hang_s: float = 0.0):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)

    def abort():
        calls.append("abort")
        time.sleep(hang_s)

    def destroy(group=None):
        calls.append("destroy")
        time.sleep(hang_s)

    monkeypatch.setattr(tp_group, "abort_group", abort)
    monkeypatch.setattr(dist, "destroy_process_group", destroy)


def test_nccl_aborts_gloo_destroys(monkeypatch):
    for backend, want, how in (("nccl", "abort", "aborted"), ("gloo", "destroy", "destroyed")):
        calls: list = []
        _fake_group(monkeypatch, backend, calls)
        assert tp_group.release_group(5.0) == how
        assert calls == [want]


def test_a_hanging_release_is_left_behind(monkeypatch):
    calls: list = []
    _fake_group(monkeypatch, "nccl", calls, hang_s=3.0)
    t0 = time.perf_counter()
    assert tp_group.release_group(0.2) == "timed out"
    assert time.perf_counter() - t0 < 1.5
    (t,) = [t for t in threading.enumerate() if t.name == "tp-release-group"]
    assert t.daemon  # the process can still exit


def test_a_failing_release_is_reported(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")

    def boom(group=None):
        raise RuntimeError("peer gone")

    monkeypatch.setattr(dist, "destroy_process_group", boom)
    assert tp_group.release_group(5.0) == "failed"


def test_no_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert tp_group.release_group(5.0) == "none"


class _Graph:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def reset(self):
        self.log.append(self.name)


def test_runners_release_every_graph():
    from types import SimpleNamespace

    from mstar.runtime.graphs.cuda_graphs import DecodeGraphRunner
    from mstar.runtime.graphs.prefill_graphs import PrefillGraphRunner
    log: list = []
    dec = SimpleNamespace(graphs={1: _Graph(log, "d1"), 8: _Graph(log, "d8")})
    pre = SimpleNamespace(graphs={16: [_Graph(log, "p16.0"), _Graph(log, "p16.1")], 32: [_Graph(log, "p32.0")]})
    dec.release = lambda: DecodeGraphRunner.release(dec)
    pre.release = lambda: PrefillGraphRunner.release(pre)
    tp_group.release_graphs(dec, None, pre)
    assert sorted(log) == ["d1", "d8", "p16.0", "p16.1", "p32.0"]
    assert dec.graphs == {} and pre.graphs == {}


def test_rank0_releases_its_graphs_before_the_group(monkeypatch):
    """EngineCore.close at tp = 2 (gloo, static graphs): the graph runners, then the group."""
    from engine_helpers import model_dir
    from mstar.runtime.engine import engine_core
    from mstar.runtime.parallel import tp
    from mstar.runtime.engine.config import EngineConfig
    order: list = []
    real_graphs, real_group = engine_core.release_graphs, tp.release_group

    def graphs(*runners):
        order.append(("graphs", [r is not None for r in runners]))
        real_graphs(*runners)

    def group(*a, **k):
        order.append(("group", dist.is_initialized()))
        return real_group(*a, **k)

    monkeypatch.setattr(engine_core, "release_graphs", graphs)
    monkeypatch.setattr(tp, "release_group", group)
    core = engine_core.EngineCore(EngineConfig(model=model_dir("qwen3"), tp=2, device="cpu", dtype="float32",
                                               max_model_len=128, decode_graphs="static"))
    core.close()
    assert order == [("graphs", [True, False]), ("group", True)], order
    assert not dist.is_initialized()
