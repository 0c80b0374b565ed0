"""FlashInfer's prefill backend choice and its modules compiled ahead of use (flashinfer_prefill.py),
on the CPU: FlashInfer's module specs stand in as objects that record their builds; the
start-up hooks of the op layer are driven as the runtime drives them."""

import threading

import pytest
import torch

from mstar.ops import attention
from mstar.ops.backends import flashinfer_prefill as fp


class FakeSpec:
    def __init__(self, compiled: bool):
        self.is_compiled = compiled
        self.builds = []  # (thread name, its nice value)

    def build(self):
        self.builds.append((threading.current_thread().name, _nice()))
        self.is_compiled = True


def _nice():
    import os
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None


@pytest.fixture()
def fake(monkeypatch):
    specs = {"fa2": FakeSpec(False), "fa3": FakeSpec(False)}
    monkeypatch.setattr(fp, "_spec", lambda backend, dtype, head_dim: specs[backend])
    monkeypatch.setattr(fp, "_hopper", lambda device: True)
    monkeypatch.setattr(fp, "_chosen", {})
    monkeypatch.setattr(fp, "_for_later", set())
    from mstar import knobs
    with knobs.override(MSTAR_PREFILL_ATTENTION="auto"):
        yield specs


def _join(name):
    for t in threading.enumerate():
        if t.name == name:
            t.join(10)


@pytest.mark.parametrize("setting,hopper,compiled,want", [
    ("auto", True, True, "fa3"), ("auto", True, False, "fa2"), ("auto", False, False, "auto"),
    ("auto", False, True, "auto"), ("fa2", True, True, "fa2"), ("fa3", True, False, "fa3"), ("fa3", False, False, "fa3")])
def test_choice(setting, hopper, compiled, want):
    assert fp.choose(setting, hopper, compiled) == want


def test_cold_process_takes_fa2_and_compiles_fa3_after_start_up(fake):
    dev = torch.device("cpu")
    assert fp.prefill_backend(dev, torch.bfloat16, 256) == "fa2"
    fake["fa3"].is_compiled = True  # compiled meanwhile (another process): this process keeps its choice
    assert fp.prefill_backend(dev, torch.bfloat16, 256) == "fa2"
    fake["fa3"].is_compiled = False
    assert fake["fa3"].builds == []  # nothing before the start-up is over
    fp.after_start_up()
    _join("flashinfer-build-later")
    assert len(fake["fa3"].builds) == 1 and fake["fa3"].builds[0][0] == "flashinfer-build-later"
    nice = fake["fa3"].builds[0][1]
    assert nice is None or nice >= 10  # the background compile runs below the serving threads
    fp.after_start_up()  # once only
    _join("flashinfer-build-later")
    assert len(fake["fa3"].builds) == 1


def test_warm_process_takes_fa3_and_builds_nothing(fake):
    fake["fa3"].is_compiled = True
    assert fp.prefill_backend(torch.device("cpu"), torch.bfloat16, 256) == "fa3"
    fp.after_start_up()
    _join("flashinfer-build-later")
    assert fake["fa3"].builds == [] and fake["fa2"].builds == []


def test_forced_backend_queues_no_build(fake):
    from mstar import knobs
    with knobs.override(MSTAR_PREFILL_ATTENTION="fa2"):
        assert fp.prefill_backend(torch.device("cpu"), torch.bfloat16, 128) == "fa2"
    fp.after_start_up()
    _join("flashinfer-build-later")
    assert fake["fa3"].builds == []


def test_prepare_compiles_the_fa2_module_in_a_thread(fake):
    fp.prepare(torch.device("cpu"), head_dim=256, dtype=torch.bfloat16)
    _join("flashinfer-build")
    assert [b[0] for b in fake["fa2"].builds] == ["flashinfer-build"]
    fp.prepare(torch.device("cpu"), head_dim=256, dtype=torch.bfloat16)  # compiled: nothing to do
    fp.prepare(torch.device("cpu"), head_dim=256, dtype=torch.float32)  # not FlashInfer's dtype
    _join("flashinfer-build")
    assert len(fake["fa2"].builds) == 1


def test_a_failed_build_ahead_of_use_only_warns(fake, caplog):
    def broken():
        raise RuntimeError("nvcc not found")
    fake["fa2"].build = broken
    fp.prepare(torch.device("cpu"), head_dim=256, dtype=torch.bfloat16)
    _join("flashinfer-build")
    assert "ahead of use failed: nvcc not found" in caplog.text


def test_runtime_hooks_reach_the_selected_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "_PREPARE", {})
    monkeypatch.setattr(attention, "_prepared", [])
    attention.register_prepare("reference", lambda device, **kw: calls.append(("prepare", device.type, kw)),
                               lambda: calls.append("started"))
    attention.register_prepare("not-selected", lambda device, **kw: calls.append("wrong backend"))
    attention.prepare_paged_attention("cpu", head_dim=64, dtype=torch.float32)
    assert calls == [("prepare", "cpu", {"head_dim": 64, "dtype": torch.float32})]  # once for both ops
    attention.paged_attention_started()
    attention.paged_attention_started()
    assert calls[1:] == ["started"]


def test_knob_rejects_other_backends():
    from mstar import knobs
    with pytest.raises(knobs.KnobError):
        knobs.parse_environment({"MSTAR_PREFILL_ATTENTION": "cudnn"})
    assert knobs.parse_environment({"MSTAR_PREFILL_ATTENTION": "fa3"})["MSTAR_PREFILL_ATTENTION"] == "fa3"
