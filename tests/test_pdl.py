"""MSTAR_PDL: which launches take programmatic dependent launch. The kernels' ordering of signal,
loads and wait is checked in their sm_90 compiles (tests/test_triton_compile_sm90.py), and a chain
of them in a CUDA graph against the chain without it on the GPU (tests/test_gpu_backends.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mstar import knobs
from mstar.ops.backends import pdl


def _cuda_tensor():
    return SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))


def test_off_by_default_on_for_cuda_tensors_on_sm90(monkeypatch):
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    assert knobs.value("MSTAR_PDL") is False
    assert pdl.launch_options(_cuda_tensor()) == {"PDL": False}
    with knobs.override(MSTAR_PDL=True):
        assert pdl.launch_options(_cuda_tensor()) == {"PDL": True, "launch_pdl": True}


def test_off_below_sm90_and_on_the_cpu(monkeypatch):
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    with knobs.override(MSTAR_PDL=True):
        assert pdl.launch_options(torch.zeros(1)) == {"PDL": False}  # Triton's interpreter has no PDL
        monkeypatch.setattr(pdl, "_supported", lambda index: False)
        assert pdl.launch_options(_cuda_tensor()) == {"PDL": False}
