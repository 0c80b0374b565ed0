"""Paged-KV decode attention for small batches in two Triton kernels (split, then merge).

FlashInfer's decode path runs a few rows through its batch prefill kernel and a merge-states
kernel, sized for large batches: one row over a few hundred keys takes ~12 us in the two. Here a
program owns one row, one KV head and one slice of the row's keys: it loads the query heads that
share the KV head (padded to 16 rows for the tensor-core product), walks its slice in blocks of
BLOCK_N keys gathered through the page table, and keeps the online softmax in float32. Each
program stores its slice's output (normalised) and log-sum-exp; the merge kernel weighs the
slices of each (row, query head). The grid is fixed per batch size (so a CUDA graph captures
one grid) and each row cuts its own keys into slices at run time, as many as the grid holds but
none shorter than a minimum, so one graph serves every context length and a short row does not
pay for a long row's slices.

The kernels read the page table on the device. Under the runtime's decode graphs the plan
(`TritonDecodePlan`) holds the index arrays and the slices' scratch in fixed buffers; an eager
step's page table (on the host) is copied to the device once a step for all its layers, as
FlashInfer plans once a step. Graph and eager steps of up to MAX_ROWS rows thus run the same
kernels with the same slices, and give a row the same output. Larger batches and shapes the
kernels do not take go to FlashInfer's decode (or the reference where FlashInfer is absent).
Measured against FlashInfer: notes/llm-decode-step.md.

The default decode backend on CUDA (`MSTAR_BACKENDS=paged_attention_decode=flashinfer` runs
FlashInfer's for every batch); the correctness gate (`python -m mstar.bench.gate`, greedy tokens
and logprobs against transformers on a trained checkpoint) passes with it.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from mstar.ops import attention
from mstar.ops.registry import register_backend

# Decode batches above this many rows go to FlashInfer (see the module docstring).
MAX_ROWS = 8
_HALF = (torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
_MMA_ROWS = 16  # the tensor-core product's smallest row count: the query group is padded to it
MIN_GROUP = 4  # query heads a KV head, at least (takes())
# The slice policy (measured: notes/llm-decode-step.md): a graph's grid holds about WAVES waves of
# programs (at most MAX_SPLITS slices a row), and no slice is shorter than MIN_SLICE_BLOCKS blocks.
WAVES = 2
MAX_SPLITS = 64
MIN_SLICE_BLOCKS = 1


@triton.jit
def _slice_len(indptr_ptr, last_ptr, row, page_size, min_chunk, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """(the row's key count, its slice length): at most SPLITS slices of whole blocks, none shorter
    than min_chunk keys, so a short row fills few slices and the rest of its programs idle."""
    p0 = tl.load(indptr_ptr + row)
    kv_len = (tl.load(indptr_ptr + row + 1) - p0 - 1) * page_size + tl.load(last_ptr + row)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N, min_chunk)
    return p0, kv_len, chunk


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, last_ptr, part_o_ptr, part_lse_ptr, page_size,
                  min_chunk, qk_scale, stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
                  stride_vh, HQ: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    p0, kv_len, chunk = _slice_len(indptr_ptr, last_ptr, row, page_size, min_chunk, BLOCK_N, SPLITS)
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)  # the softmax's sum
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        live = t < end
        page = tl.load(indices_ptr + p0 + t // page_size, mask=live, other=0).to(tl.int64)
        off = (t % page_size).to(tl.int64)
        k = tl.load(k_ptr + page[:, None] * stride_kp + off[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                    mask=live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                    mask=live[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    # a slice past the row's end stores nothing: the merge reads only the slices the row fills
    o = acc / denom[:, None]
    lse = m + tl.log2(denom)
    slot = (row * HQ + heads) * SPLITS + split
    keep = g < tl.where(start < kv_len, GROUP, 0)
    tl.store(part_o_ptr + slot.to(tl.int64)[:, None] * D + d[None, :], o, mask=keep[:, None])
    tl.store(part_lse_ptr + slot, lse, mask=keep)


@triton.jit
def _merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, indptr_ptr, last_ptr, page_size, min_chunk, stride_ob,
                  stride_oh, HQ: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    _, kv_len, chunk = _slice_len(indptr_ptr, last_ptr, row, page_size, min_chunk, BLOCK_N, SPLITS)
    s = tl.arange(0, SPLITS)
    filled = s < tl.cdiv(kv_len, chunk)  # slice 0 always holds keys: the max below is finite
    d = tl.arange(0, D)
    base = (row * HQ + h) * SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=filled, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    o = tl.load(part_o_ptr + (base + s).to(tl.int64)[:, None] * D + d[None, :], mask=filled[:, None], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + row.to(tl.int64) * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


def splits_for(batch: int, num_kv_heads: int, sm_count: int, waves: int = WAVES) -> int:
    """Slices a (row, KV head) at most: enough programs for about `waves` waves of the GPU, a
    power of two (the merge's arange) from 2 to MAX_SPLITS. It depends on the batch rounded up to
    a power of two, so a decode graph's padded batch (1, 2, 4, 8, or a size in between rounding
    to the same) slices a row as the unpadded eager step does: the same row, the same output."""
    rows = 1 << max(0, batch - 1).bit_length()
    want = max(1, waves * sm_count // max(1, rows * num_kv_heads))
    return max(2, min(MAX_SPLITS, 1 << int(math.log2(want))))


def block_n(head_dim: int) -> int:
    return 32 if head_dim >= 256 else 64


def min_chunk_for(head_dim: int, blocks: int = MIN_SLICE_BLOCKS) -> int:
    """The fewest keys a slice holds: a row of fewer keys than the grid's slices can fill uses
    fewer slices, and the rest of its programs store nothing."""
    return blocks * block_n(head_dim)


def takes(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether these kernels serve a decode batch of this shape: 4 to 16 query heads a KV head
    (the measured shapes have 4; with fewer, most of the padded product's rows are padding, and
    FlashInfer runs such groups on its CUDA-core decode kernel)."""
    group = num_q_heads // max(1, num_kv_heads)
    return (0 < batch <= MAX_ROWS and dtype in _HALF and num_q_heads % num_kv_heads == 0
            and MIN_GROUP <= group <= _MMA_ROWS and head_dim in (64, 128, 256))


def decode(q, k_cache, v_cache, indptr, indices, last_page_len, scale, part_o, part_lse, splits: int,
           out=None, config: tuple[int, int, int] | None = None, min_chunk: int | None = None) -> torch.Tensor:
    """q [B, Hq, D] over pages whose index arrays (int32) are on q's device; part_o
    [B, Hq, splits, D] and part_lse [B, Hq, splits] float32 scratch. -> [B, Hq, D].
    config: (keys a block, warps, pipeline stages) of the split kernel; None: the default.
    min_chunk: the fewest keys a slice holds (None: min_chunk_for(D))."""
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged decode: q and the caches need a contiguous head dimension")
    block, warps, stages = config or (block_n(d), 4, 2)
    min_chunk = max(1, min_chunk or min_chunk_for(d))
    page_size = k_cache.shape[1]
    _split_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, indptr, indices, last_page_len, part_o, part_lse, page_size, min_chunk,
        scale * _LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=hq, GROUP=group, GROUP_PAD=_MMA_ROWS, D=d, BLOCK_N=block, SPLITS=splits, num_warps=warps,
        num_stages=stages)
    _merge_kernel[(b, hq)](part_o, part_lse, out, indptr, last_page_len, page_size, min_chunk, out.stride(0),
                           out.stride(1), HQ=hq, D=d, BLOCK_N=block, SPLITS=splits, num_warps=4)
    return out


class TritonDecodePlan(attention.StaticDecodePlan):
    """The fixed buffers of one decode batch size under CUDA graphs: the page table's arrays on
    the device (copied by plan()) and the slices' scratch. The decode op recognises its indptr
    by identity."""

    def __init__(self, device, batch: int, max_pages: int, *, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, **_):
        super().__init__(device, batch, max_pages)
        device = torch.device(device)
        self.splits = splits_for(batch, num_kv_heads, _sm_count(device))
        self.part_o = torch.empty(batch, num_q_heads, self.splits, head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(batch, num_q_heads, self.splits, dtype=torch.float32, device=device)
        attention.remember_graph_plan(self)


@functools.cache
def _other_backend():
    """Where the batches these kernels do not take go: FlashInfer's decode where it loaded."""
    backends = attention.paged_attention_decode.backends
    fi = backends.get("flashinfer")
    return fi if fi is not None and fi.is_available() else backends["reference"]


def decode_graph_plan(device, batch: int, max_pages: int, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                      page_size: int, dtype: torch.dtype, scale: float):
    """The plan of `batch` rows: this module's where the kernels take the shape, else the other
    backend's (FlashInfer's recognises its own buffers the same way)."""
    kw = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
              dtype=dtype, scale=scale)
    if takes(batch, num_q_heads, num_kv_heads, head_dim, dtype):
        return TritonDecodePlan(device, batch, max_pages, **kw)
    other = attention.decode_plan_class(_other_backend().name)
    return other(device, batch, max_pages, **kw)


@functools.cache
def _sm_count(device: torch.device) -> int:
    # off CUDA (Triton's interpreter in the tests) an H100's count
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


class _EagerTable(attention.StepMemo):
    """An eager step's page table on the device, made once for the step's layers, and the slices'
    scratch, grown to the largest batch seen (at most MAX_ROWS rows)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.indptr = torch.zeros(MAX_ROWS + 1, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(MAX_ROWS, dtype=torch.int32, device=device)
        self.indices = self.indptr[:0]
        self.scratch = torch.empty(0, dtype=torch.float32, device=device)

    def load(self, indptr, indices, last_page_len) -> None:
        b = indptr.shape[0] - 1
        self.indptr[:b + 1].copy_(indptr, non_blocking=True)
        self.last_page_len[:b].copy_(last_page_len, non_blocking=True)
        self.indices = indices if indices.device == self.indptr.device else indices.to(self.indptr.device)

    def slices(self, b: int, hq: int, splits: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """part_o [b, hq, splits, d] and part_lse [b, hq, splits] in one buffer."""
        n = b * hq * splits
        if self.scratch.numel() < n * (d + 1):
            self.scratch = torch.empty(n * (d + 1), dtype=torch.float32, device=self.scratch.device)
        return self.scratch[:n * d].view(b, hq, splits, d), self.scratch[n * d:n * (d + 1)].view(b, hq, splits)


_EAGER: dict[tuple, _EagerTable] = {}


def _eager_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, scale):
    b, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    # one table per page size: Whisper's layers alternate self-attention and cross-attention pages
    key = (q.device, page)
    table = _EAGER.get(key)
    if table is None:
        table = _EAGER[key] = _EagerTable(q.device)
    arrays = (id(kv_indices), id(kv_last_page_len))
    if table.stale(kv_indptr, arrays):
        table.load(kv_indptr, kv_indices, kv_last_page_len)
        table.mark(kv_indptr, arrays)
    splits = splits_for(b, hkv, _sm_count(q.device))
    part_o, part_lse = table.slices(b, hq, splits, d)
    return decode(q, k_cache, v_cache, table.indptr, table.indices, table.last_page_len, scale, part_o, part_lse,
                  splits)


def paged_attention_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, scale):
    plan = attention.graph_plan_of(kv_indptr, attention.StaticDecodePlan)  # any backend's graph plan
    same_dtype = q.dtype == k_cache.dtype
    if isinstance(plan, TritonDecodePlan) and q.shape[0] == plan.batch and same_dtype:
        return decode(q, k_cache, v_cache, plan.indptr, kv_indices, plan.last_page_len, scale, plan.part_o,
                      plan.part_lse, plan.splits)
    if (plan is None and q.is_cuda and same_dtype
            and takes(q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2], q.dtype)):
        return _eager_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, scale)
    return _other_backend().fn(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, scale)


register_backend(attention.paged_attention_decode, "triton", paged_attention_decode,
                 available=torch.cuda.is_available, priority=40,  # above FlashInfer's: the default
                 note=f"split + merge kernels for decode steps of up to {MAX_ROWS} rows, graph or eager; "
                      "FlashInfer for the rest")
attention.register_decode_plan("triton", decode_graph_plan)
