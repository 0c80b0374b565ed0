"""Backend selection by knob, verify mode, and the ops table, on test-only ops."""

import subprocess
import sys

import pytest
import torch

from mstar import knobs, ops
from mstar.ops.registry import define_op, register_backend

_scale = define_op("test_scale", "(Tensor x, float a) -> Tensor",
                   reference=lambda x, a: x * a, fake=lambda x, a: torch.empty_like(x))
register_backend(_scale, "perturbed", lambda x, a: x * a + 1e-3, devices=("cpu",), priority=5)
register_backend(_scale, "absent", lambda x, a: x, devices=("cpu",), priority=9, available=lambda: False)


def _add_into_ref(x, out):
    out.add_(x)


_add_into = define_op("test_add_into", "(Tensor x, Tensor(a!) out) -> ()",
                      reference=_add_into_ref, fake=lambda x, out: None)
register_backend(_add_into, "doubled", lambda x, out: out.add_(2 * x), devices=("cpu",), priority=5)


def test_default_picks_highest_available_priority():
    assert _scale.selected("cpu") == "perturbed"  # "absent" has higher priority but is unavailable
    x = torch.randn(4)
    assert torch.equal(_scale(x, 2.0), x * 2 + 1e-3)


def test_knob_selects_backend_and_validates_names():
    x = torch.randn(4)
    with knobs.override(MSTAR_BACKENDS="test_scale=reference"):
        assert _scale.selected("cpu") == "reference"
        assert torch.equal(_scale(x, 3.0), x * 3)
        assert torch.equal(torch.ops.mstar.test_scale(x, 3.0), x * 3)
    with knobs.override(MSTAR_BACKENDS="*=reference"):
        assert _add_into.selected("cpu") == "reference"
    with knobs.override(MSTAR_BACKENDS="no_such_op=reference"):
        with pytest.raises(knobs.KnobError, match="no_such_op"):
            ops.validate_selection()
    with knobs.override(MSTAR_BACKENDS="test_scale=nope"):
        with pytest.raises(knobs.KnobError, match="nope"):
            ops.validate_selection()
    with knobs.override(MSTAR_BACKENDS="test_scale=absent"):
        with pytest.raises(RuntimeError, match="not available"):
            _scale(x, 1.0)


def test_verify_mode_reports_the_difference_and_leaves_outputs_bit_identical():
    x = torch.randn(64)
    plain = _scale(x, 1.5)
    ops.reset_verify_report()
    with knobs.override(MSTAR_VERIFY=True):
        verified = _scale(x, 1.5)
        out = torch.randn(64)
        start = out.clone()
        _add_into(x, out)
    assert torch.equal(plain, verified)  # verify only observes
    assert torch.equal(out, start + 2 * x)  # the selected backend's write, not the reference's
    rep = ops.verify_report()
    assert rep["test_scale"]["calls"] == 1
    assert rep["test_scale"]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert rep["test_add_into"]["max_abs_diff"] == pytest.approx(x.abs().max().item(), rel=1e-6)


def test_dispatcher_path_and_compile_see_one_op():
    x = torch.randn(8)
    with knobs.override(MSTAR_BACKENDS="test_scale=reference"):
        f = torch.compile(lambda t: _scale(t, 2.0) + 1, fullgraph=True, backend="eager")
        assert torch.equal(f(x), x * 2 + 1)
    torch.library.opcheck(_scale.overload, (x, 2.0))


def test_ops_table_lists_every_op():
    out = subprocess.run([sys.executable, "-m", "mstar.ops"], capture_output=True, text=True, check=True).stdout
    for name in ["rms_norm", "fused_add_rms_norm", "gated_rms_norm", "l2_norm"]:
        assert name in out


def test_cuda_without_a_backend_package_says_so(monkeypatch, caplog):
    """A CUDA host missing FlashInfer (or Triton, fla) is told once which packages are absent, rather
    than running the reference ops silently."""
    from mstar.ops import backends
    monkeypatch.setattr(backends, "_loaded", {})
    monkeypatch.setattr(backends, "_has_package", lambda name: name != "flashinfer")
    monkeypatch.setattr(backends.importlib, "import_module", lambda mod: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level("WARNING", logger="mstar.ops"):
        status = backends.load()
    assert status["mstar.ops.backends.flashinfer_attention"] == "flashinfer not installed"
    assert status["mstar.ops.backends.triton_norm"] == "ok"
    warned = [r.getMessage() for r in caplog.records if "reference backends" in r.getMessage()]
    assert len(warned) == 1 and "CUDA without flashinfer:" in warned[0]
