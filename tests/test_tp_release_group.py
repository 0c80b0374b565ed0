"""release_group (tp_group.py): how a rank leaves the group at close. NCCL aborts (a destroy
hung every tp=2 close on two H200s), gloo destroys, and a release that does not return in
time is left behind instead of hanging close()."""

import threading
import time

import torch.distributed as dist

from mstar.runtime import tp_group


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
