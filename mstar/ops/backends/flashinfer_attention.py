"""Paged attention through FlashInfer's batch prefill and decode wrappers.

FlashInfer splits a call into plan() (host-side scheduling from the index arrays) and
run(). Every full-attention layer of a step sees the same index tensors, so the plan is
made once per step (attention.StepMemo): a wrapper remembers the tensor object it planned
for (by weak reference, so a new step's tensors can never be mistaken for the old ones) and
replans only when it is handed different ones. plan() reads indptr and last_page_len on the host;
passing them as CPU tensors (the runtime's step inputs do on CUDA) keeps it free of
device syncs.

Each FlashInfer variant is a module compiled on first use (tens of seconds to minutes). The
decode rows run through the batch prefill kernel of the fa2 backend (tensor cores); prefill
uses the backend `prefill_backend` picks (flashinfer_prefill.py): on Hopper, fa3 where its
module is already compiled and fa2 (the decode path's module) where not, so that a cold start
compiles one module. `prepare` starts the fa2 module's compile while the runtime's start-up
goes on.
"""

from __future__ import annotations

import time

import flashinfer
import torch

from mstar.ops import attention, phase_clock
from mstar.ops.backends import flashinfer_prefill
from mstar.ops.registry import register_backend

_WORKSPACE_BYTES = 256 * 1024 * 1024
_HALF = (torch.float16, torch.bfloat16)


class _Planned(attention.StepMemo):
    """One FlashInfer wrapper and the step inputs its current plan was made for."""

    def __init__(self, wrapper):
        super().__init__()
        self.wrapper = wrapper


_state: dict[tuple, _Planned] = {}


def _workspace(device) -> torch.Tensor:
    key = ("ws", str(device))
    if key not in _state:
        _state[key] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _state[key]


def _decode_wrapper(device, group: int, page: int) -> _Planned:
    # one wrapper per page size: Whisper alternates self-attention pages and its
    # 1500-token cross-attention pages in every layer, and each keeps its own plan
    key = ("decode", str(device), group >= 4, page)
    if key not in _state:
        # tensor cores pay off once several query heads share a kv head
        _state[key] = _Planned(flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _workspace(device), "NHD", use_tensor_cores=group >= 4))
    return _state[key]


def _prefill_wrapper(device, page: int, backend: str) -> _Planned:
    key = ("prefill", str(device), page, backend)
    if key not in _state:
        _state[key] = _Planned(flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), "NHD",
                                                                             backend=backend))
    return _state[key]


def _planning():
    # the wrappers are shared by every caller and keep device buffers that plan() rewrites
    # (and sometimes reallocates): planning always in inference mode keeps them writable
    # whether the first caller ran under inference_mode (the engine) or not (a test, a bench)
    return torch.inference_mode()


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.cpu()


def _dev(t: torch.Tensor, device) -> torch.Tensor:
    return t if t.device == device else t.to(device, non_blocking=True)


class FlashInferDecodePlan(attention.StaticDecodePlan):
    """A CUDA-graph decode wrapper with fixed buffers for one batch size. `indptr` is a
    pinned host tensor: the decode op recognises it by identity and runs this wrapper
    without planning (plan() is the runtime's job, outside the graph)."""

    def __init__(self, device, batch: int, max_pages: int, *, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, dtype: torch.dtype, scale: float):
        device = torch.device(device)
        self.batch, self.max_pages = batch, max_pages
        self.shape = (num_q_heads, num_kv_heads, head_dim, page_size)
        self.dtype, self.scale = dtype, scale
        self.indptr = torch.zeros(batch + 1, dtype=torch.int32).pin_memory()
        self.last_page_len = torch.ones(batch, dtype=torch.int32).pin_memory()
        self._buffers = (torch.zeros(batch + 1, dtype=torch.int32, device=device),
                         torch.zeros(max_pages, dtype=torch.int32, device=device),
                         torch.ones(batch, dtype=torch.int32, device=device))
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _workspace(device), "NHD", use_cuda_graph=True, use_tensor_cores=num_q_heads // num_kv_heads >= 4,
            paged_kv_indptr_buffer=self._buffers[0], paged_kv_indices_buffer=self._buffers[1],
            paged_kv_last_page_len_buffer=self._buffers[2])
        self.indices = self._buffers[1]
        attention.remember_graph_plan(self)

    def plan(self, indptr, indices, last_page_len) -> None:
        """indptr / last_page_len: host int32; indices: int32 on the device (a host tensor
        here would make FlashInfer's copy a blocking one)."""
        if indptr.shape[0] != self.batch + 1 or indices.shape[0] > self.max_pages:
            raise ValueError(f"decode plan: {indptr.shape[0] - 1} rows / {indices.shape[0]} pages for "
                             f"buffers of {self.batch} rows / {self.max_pages} pages")
        if indptr is not self.indptr:
            self.indptr.copy_(indptr)
            self.last_page_len.copy_(last_page_len)
        hq, hkv, d, page = self.shape
        t0 = time.perf_counter_ns() if phase_clock.enabled else 0
        with _planning():
            self.wrapper.plan(self.indptr, indices, self.last_page_len, hq, hkv, d, page,
                              q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        if t0:
            phase_clock.plan_ns += time.perf_counter_ns() - t0


def paged_attention_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, scale):
    if q.shape[0] == 0:
        return torch.empty_like(q)
    gp = attention.graph_plan_of(kv_indptr, FlashInferDecodePlan)
    if gp is not None:  # fixed buffers, planned by the runtime
        return gp.wrapper.run(q, (k_cache, v_cache))
    if q.dtype not in _HALF:  # FlashInfer kernels are fp16 / bf16 only
        return attention.paged_attention_decode.backends["reference"].fn(
            q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, scale)
    hq, d = q.shape[1], q.shape[2]
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    p = _decode_wrapper(q.device, hq // hkv, page)
    # the plan reads indices and last_page_len too: a caller may reuse an indptr with other ones
    shape_key = (hq, hkv, d, page, q.dtype, k_cache.dtype, scale, id(kv_indices), id(kv_last_page_len))
    if p.stale(kv_indptr, shape_key):
        t0 = time.perf_counter_ns() if phase_clock.enabled else 0
        with _planning():
            p.wrapper.plan(_host(kv_indptr), _dev(kv_indices, q.device), _host(kv_last_page_len), hq, hkv, d, page,
                           q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)
        p.mark(kv_indptr, shape_key)
        if t0:
            phase_clock.plan_ns += time.perf_counter_ns() - t0
    return p.wrapper.run(q, (k_cache, v_cache))


def paged_attention_prefill(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scale):
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if q.dtype not in _HALF:
        return attention.paged_attention_prefill.backends["reference"].fn(
            q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scale)
    hq, d = q.shape[1], q.shape[2]
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    p = _prefill_wrapper(q.device, page, flashinfer_prefill.prefill_backend(q.device, q.dtype, d))
    shape_key = (hq, hkv, d, page, q.dtype, k_cache.dtype, scale, id(qo_indptr), id(kv_indices),
                 id(kv_last_page_len))
    if p.stale(kv_indptr, shape_key):
        t0 = time.perf_counter_ns() if phase_clock.enabled else 0
        with _planning():
            p.wrapper.plan(_host(qo_indptr), _host(kv_indptr), _dev(kv_indices, q.device), _host(kv_last_page_len),
                           hq, hkv, d, page, causal=True, sm_scale=scale, q_data_type=q.dtype,
                           kv_data_type=k_cache.dtype)
        p.mark(kv_indptr, shape_key)
        if t0:
            phase_clock.plan_ns += time.perf_counter_ns() - t0
    return p.wrapper.run(q, (k_cache, v_cache))


register_backend(attention.paged_attention_decode, "flashinfer", paged_attention_decode, available=torch.cuda.is_available,
                 priority=30, note="one plan per step, shared by all layers")
attention.register_decode_plan("flashinfer", FlashInferDecodePlan)
register_backend(attention.paged_attention_prefill, "flashinfer", paged_attention_prefill,
                 available=torch.cuda.is_available, priority=30, note="one plan per step, shared by all layers")
attention.register_prepare("flashinfer", flashinfer_prefill.prepare)
