"""FlashInfer's prefill backend choice and its fa2 module compiled ahead of use (flashinfer_prefill.py),
on the CPU: FlashInfer's module specs stand in as objects that record their builds; the op
layer's start-up hook is driven as the runtime drives it."""

import threading

import pytest
import torch

from mstar.ops import attention
from mstar.ops.backends import flashinfer_prefill as fp


class FakeSpec:
    def __init__(self, compiled: bool):
        self.is_compiled = compiled
        self.builds = []  # the thread each build ran on

    def build(self):
        self.builds.append(threading.current_thread().name)
        self.is_compiled = True


@pytest.fixture()
def fake(monkeypatch):
    specs = {"fa2": FakeSpec(False), "fa3": FakeSpec(False)}
    monkeypatch.setattr(fp, "_spec", lambda backend, dtype, head_dim: specs[backend])
    monkeypatch.setattr(fp, "_hopper", lambda device: True)
    monkeypatch.setattr(fp, "_chosen", {})
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


def test_cold_process_takes_fa2_and_keeps_it(fake):
    dev = torch.device("cpu")
    assert fp.prefill_backend(dev, torch.bfloat16, 256) == "fa2"
    fake["fa3"].is_compiled = True  # compiled meanwhile (another process): this process keeps its choice
    assert fp.prefill_backend(dev, torch.bfloat16, 256) == "fa2"
    assert fp.prefill_backend(dev, torch.bfloat16, 128) == "fa3"  # a shape seen first now
    assert fake["fa3"].builds == [] and fake["fa2"].builds == []  # choosing builds nothing


def test_warm_process_takes_fa3(fake):
    fake["fa3"].is_compiled = True
    assert fp.prefill_backend(torch.device("cpu"), torch.bfloat16, 256) == "fa3"


def test_forced_backend(fake):
    from mstar import knobs
    with knobs.override(MSTAR_PREFILL_ATTENTION="fa2"):
        fake["fa3"].is_compiled = True
        assert fp.prefill_backend(torch.device("cpu"), torch.bfloat16, 128) == "fa2"
    with knobs.override(MSTAR_PREFILL_ATTENTION="fa3"):
        assert fp.prefill_backend(torch.device("cpu"), torch.float16, 128) == "fa3"




def test_prepare_compiles_the_fa2_module_in_a_thread(fake):
    fp.prepare(torch.device("cpu"), head_dim=256, dtype=torch.bfloat16)
    _join("flashinfer-build")
    assert fake["fa2"].builds == ["flashinfer-build"]
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


def test_runtime_hook_reaches_the_selected_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "_PREPARE", {})
    attention.register_prepare("reference", lambda device, **kw: calls.append((device.type, kw)))
    attention.register_prepare("not-selected", lambda device, **kw: calls.append("wrong backend"))
    attention.prepare_paged_attention("cpu", head_dim=64, dtype=torch.float32)
    assert calls == [("cpu", {"head_dim": 64, "dtype": torch.float32})]  # once for both ops


def test_knob_rejects_other_backends():
    from mstar import knobs
    with pytest.raises(knobs.KnobError):
        knobs.parse_environment({"MSTAR_PREFILL_ATTENTION": "cudnn"})
    assert knobs.parse_environment({"MSTAR_PREFILL_ATTENTION": "fa3"})["MSTAR_PREFILL_ATTENTION"] == "fa3"


def test_the_engine_prepares_its_attention_before_its_first_step(monkeypatch):
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    calls = []
    monkeypatch.setattr(attention, "_PREPARE", {"reference": lambda device, **kw: calls.append(kw)})
    core = EngineCore(EngineConfig(model="tiny-qwen3.5", device="cpu", dtype="float32", max_num_seqs=2))
    head_dims = {a.head_dim for a in core.model.cache_spec().attention}
    assert calls == [{"head_dim": d, "dtype": torch.float32} for d in sorted(head_dims)] and calls


def test_paged_attention_on_reference_keeps_the_other_ops_choices():
    from mstar import knobs
    from mstar.ops import registry
    with knobs.override(MSTAR_BACKENDS="rms_norm=reference"):
        with attention.paged_attention_on_reference():
            spec = registry.parse_backend_spec(knobs.value("MSTAR_BACKENDS"))
            assert spec == {"rms_norm": "reference", "paged_attention_decode": "reference",
                            "paged_attention_prefill": "reference"}
            assert attention.paged_attention_prefill.selected("cpu") == "reference"
        assert knobs.value("MSTAR_BACKENDS") == "rms_norm=reference"
