"""dense_attention's opt-in "flashinfer" backend (ops/backends/flashinfer_dense_attention.py).

On CPU, with a stand-in for FlashInfer's single-sequence prefill (the reference attention of one
row, causal aligned to the row's last keys as FlashInfer aligns it): the backend's row slicing,
its arguments and the output's assembly against the op's reference, for ragged rows, an empty row,
rows not covering q, grouped heads and causal rows; the fallback to cuDNN's backend for a head dim
FlashInfer has no kernel for. On CUDA (gpu mark): FlashInfer itself against the reference."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

dense = importlib.import_module("mstar.ops.dense_attention")
REF = dense.dense_attention.backends["reference"].fn


def _row_reference(q, k, v, causal, sm_scale, backend):
    n, L = q.shape[0], k.shape[0]
    return REF(q, k, v, torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, L], dtype=torch.int32), sm_scale,
               causal)


@pytest.fixture
def backend(monkeypatch):
    calls = []

    def single_prefill_with_kv_cache(q, k, v, causal, sm_scale, backend):
        calls.append((q.shape[0], k.shape[0], causal, backend))
        return _row_reference(q, k, v, causal, sm_scale, backend)

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        single_prefill_with_kv_cache=single_prefill_with_kv_cache))
    sys.modules.pop("mstar.ops.backends.flashinfer_dense_attention", None)
    saved = dict(dense.dense_attention.backends)
    mod = importlib.import_module("mstar.ops.backends.flashinfer_dense_attention")
    monkeypatch.setattr(mod, "_kernel_backend", lambda device: "fa3")
    yield mod, calls
    dense.dense_attention.backends.clear()
    dense.dense_attention.backends.update(saved)
    dense.dense_attention._resolved.clear()
    sys.modules.pop("mstar.ops.backends.flashinfer_dense_attention", None)


@pytest.mark.parametrize("qlens,kvlens,causal,hq,hkv", [
    ([5, 3, 0, 4], [9, 3, 2, 7], False, 4, 2),
    ([3, 3], [5, 7], True, 4, 4),
])
def test_rows_match_the_reference(backend, qlens, kvlens, causal, hq, hkv):
    mod, calls = backend
    assert dense.dense_attention.backends["flashinfer"].priority < dense.dense_attention.backends["cudnn"].priority
    g = torch.Generator().manual_seed(sum(qlens) + hkv)
    q = torch.randn(sum(qlens), hq, 64, generator=g).to(torch.bfloat16)
    k, v = torch.randn(2, sum(kvlens), hkv, 64, generator=g).to(torch.bfloat16)
    qi = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    ki = torch.tensor([0, *torch.tensor(kvlens).cumsum(0).tolist()], dtype=torch.int32)
    got = mod.dense_attention_flashinfer(q, k, v, qi, ki, 0.125, causal)
    assert torch.equal(got, REF(q, k, v, qi, ki, 0.125, causal))
    assert calls == [(n, L, causal, "fa3") for n, L in zip(qlens, kvlens) if n]


def test_rows_not_covering_q_and_the_fallback(backend, monkeypatch):
    mod, calls = backend
    q = torch.randn(8, 2, 64).to(torch.bfloat16)
    k, v = torch.randn(2, 10, 2, 64).to(torch.bfloat16)
    qi, ki = torch.tensor([2, 5, 7], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)
    got = mod.dense_attention_flashinfer(q, k, v, qi, ki, 0.125, False)
    assert torch.equal(got, REF(q, k, v, qi, ki, 0.125, False)) and got[:2].abs().max() == 0
    wide = torch.randn(4, 1, 1024).to(torch.bfloat16)  # the VAE's frame attention: no FlashInfer kernel
    seen = []
    monkeypatch.setattr(dense, "dense_attention_cudnn", lambda *a: seen.append(a[0].shape) or REF(*a))
    ip = torch.tensor([0, 4], dtype=torch.int32)
    assert torch.equal(mod.dense_attention_flashinfer(wide, wide, wide, ip, ip, 0.03, False),
                       REF(wide, wide, wide, ip, ip, 0.03, False))
    assert seen == [wide.shape] and len(calls) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_on_cuda():
    pytest.importorskip("flashinfer")
    mod = importlib.import_module("mstar.ops.backends.flashinfer_dense_attention")
    g = torch.Generator().manual_seed(0)
    for qlens, kvlens, causal, hq, hkv in (([300, 200], [500, 200], False, 16, 8), ([64, 64], [64, 64], True, 4, 4)):
        q = torch.randn(sum(qlens), hq, 128, generator=g).to("cuda", torch.bfloat16)
        k, v = torch.randn(2, sum(kvlens), hkv, 128, generator=g).to("cuda", torch.bfloat16)
        qi = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        ki = torch.tensor([0, *torch.tensor(kvlens).cumsum(0).tolist()], dtype=torch.int32)
        got = mod.dense_attention_flashinfer(q, k, v, qi, ki, 128 ** -0.5, causal)
        torch.testing.assert_close(got.float(), REF(q, k, v, qi, ki, 128 ** -0.5, causal).float(), atol=2e-2, rtol=2e-2)
