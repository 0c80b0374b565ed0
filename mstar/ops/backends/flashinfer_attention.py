"""Paged attention through FlashInfer's batch prefill and decode wrappers.

FlashInfer splits a call into plan() (host-side scheduling from the index arrays) and
run(). Every full-attention layer of a step sees the same index tensors, so the plan is
made once per step: a wrapper remembers the tensor object it planned for (by weak
reference, so a new step's tensors can never be mistaken for the old ones) and replans
only when it is handed different ones. plan() reads indptr and last_page_len on the host;
passing them as CPU tensors (the runtime's step inputs do on CUDA) keeps it free of
device syncs.
"""

from __future__ import annotations

import time
import weakref

import flashinfer
import torch

from mstar.ops import attention, phase_clock
from mstar.ops.registry import register_backend

_WORKSPACE_BYTES = 256 * 1024 * 1024
_HALF = (torch.float16, torch.bfloat16)


class _Planned:
    """One FlashInfer wrapper and the inputs its current plan was made for."""

    def __init__(self, wrapper):
        self.wrapper = wrapper
        self.ref = None  # weakref to the indptr tensor planned for
        self.version = -1
        self.shape_key = None

    def stale(self, indptr: torch.Tensor, shape_key) -> bool:
        return not (self.ref is not None and self.ref() is indptr and self.version == _version(indptr)
                    and self.shape_key == shape_key)

    def mark(self, indptr: torch.Tensor, shape_key) -> None:
        self.ref = weakref.ref(indptr)
        self.version = _version(indptr)
        self.shape_key = shape_key


def _version(t: torch.Tensor) -> int:
    # inference tensors (the engine runs under inference_mode) keep no version counter;
    # for them the object identity alone says whether the plan is current
    try:
        return t._version
    except RuntimeError:
        return -1


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


def _prefill_wrapper(device, page: int) -> _Planned:
    key = ("prefill", str(device), page)
    if key not in _state:
        _state[key] = _Planned(flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), "NHD"))
    return _state[key]


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.cpu()


def _dev(t: torch.Tensor, device) -> torch.Tensor:
    return t if t.device == device else t.to(device, non_blocking=True)


def paged_attention_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, scale):
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if q.dtype not in _HALF:  # FlashInfer kernels are fp16 / bf16 only
        return attention.paged_attention_decode.backends["reference"].fn(
            q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, scale)
    hq, d = q.shape[1], q.shape[2]
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    p = _decode_wrapper(q.device, hq // hkv, page)
    shape_key = (hq, hkv, d, page, q.dtype, k_cache.dtype, scale)
    if p.stale(kv_indptr, shape_key):
        t0 = time.perf_counter_ns() if phase_clock.enabled else 0
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
    p = _prefill_wrapper(q.device, page)
    shape_key = (hq, hkv, d, page, q.dtype, k_cache.dtype, scale)
    if p.stale(kv_indptr, shape_key):
        t0 = time.perf_counter_ns() if phase_clock.enabled else 0
        p.wrapper.plan(_host(qo_indptr), _host(kv_indptr), _dev(kv_indices, q.device), _host(kv_last_page_len),
                       hq, hkv, d, page, causal=True, sm_scale=scale, q_data_type=q.dtype,
                       kv_data_type=k_cache.dtype)
        p.mark(kv_indptr, shape_key)
        if t0:
            phase_clock.plan_ns += time.perf_counter_ns() - t0
    return p.wrapper.run(q, (k_cache, v_cache))


register_backend(attention.paged_attention_decode, "flashinfer", paged_attention_decode, available=torch.cuda.is_available,
                 priority=30, note="one plan per step, shared by all layers")
register_backend(attention.paged_attention_prefill, "flashinfer", paged_attention_prefill,
                 available=torch.cuda.is_available, priority=30, note="one plan per step, shared by all layers")
