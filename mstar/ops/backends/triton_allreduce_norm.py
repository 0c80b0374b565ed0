"""All-reduce + residual add + RMSNorm in one Triton kernel, over buffers every rank can address
(PyTorch's symmetric memory, set up by mstar/runtime/tp_allreduce.py).

At tp > 1 every row-parallel output (GDN out_proj / attention o_proj, MLP down_proj) is summed over
the ranks and then, always, added to the residual and normalised by the next RMSNorm. Done apart,
a decode step pays three kernels per sum (copy into the shared buffer, the one-shot all-reduce, the
fused add + norm), 64 times a step for a 32-layer model. This kernel does all three, one program per
row:

  1. copy the row of this rank's partial sum into this rank's shared buffer;
  2. tell every peer the row is there (a flag in the peer's memory, 0 -> 1) and wait for each
     peer's flag in ours (1 -> 0); the flag's program is the row's, so only the programs handling
     the same row wait for each other;
  3. sum the row over all ranks' buffers in rank order (float32; every rank gets the same bits),
     round to the activation dtype (what the all-reduce would return), add the residual, round,
     normalise: triton_norm's add_residual and store_rms_norm, as its fused add + RMSNorm.

A flag is set only when it is 0 (the sender spins), so a fast rank cannot overwrite a signal its
peer has not consumed yet. A rank whose peer never signals (the peer died) traps after the
timeout (the tensor-parallel collective timeout): its CUDA context fails and the engine reports
an error instead of spinning for ever (NCCL's own timeout does the same for its collectives).
There is no closing barrier: the caller alternates between two buffers (even / odd sites of the
forward), and a rank reaches the site after next only after its peer has signalled the next one,
which it does after finishing its reads of this one.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mstar.ops.backends.triton_norm import add_residual, store_rms_norm

# Triton's CPU interpreter (the tests) has no inline assembly: no timer there
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cas_until(ptr, cmp, val, want, SEM: tl.constexpr, TIMEOUT_NS: tl.constexpr):
    """Compare-and-swap (system scope) until it returns `want`; trap after TIMEOUT_NS (0: never,
    and no timer: Triton's CPU interpreter has no inline assembly)."""
    if TIMEOUT_NS > 0:
        deadline = _now_ns() + TIMEOUT_NS
        while tl.atomic_cas(ptr, cmp, val, sem=SEM, scope="sys") != want:
            if _now_ns() > deadline:
                _trap()
    else:
        while tl.atomic_cas(ptr, cmp, val, sem=SEM, scope="sys") != want:
            pass


@triton.jit
def _reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buf_addrs_ptr, flag_addrs_ptr,
                                n_cols, x_stride, res_stride, eps, RANK: tl.constexpr, WORLD: tl.constexpr,
                                ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr, TIMEOUT_NS: tl.constexpr):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = x_ptr.dtype.element_ty
    # 1. this rank's partial row into its shared buffer (rows packed at n_cols)
    own = tl.multiple_of(tl.load(buf_addrs_ptr + RANK).to(tl.pointer_type(dt)), 16)  # buffers: 16-byte aligned
    tl.store(own + row64 * n_cols + cols, tl.load(x_ptr + row64 * x_stride + cols, mask=mask), mask=mask)
    tl.debug_barrier()  # every thread's store is issued before the release below
    # 2. signal each peer (flag [row, RANK] in its memory), then wait for theirs (flag [row, q] in ours)
    for q in tl.static_range(WORLD):
        if q != RANK:
            peer_flags = tl.load(flag_addrs_ptr + q).to(tl.pointer_type(tl.int32))
            _cas_until(peer_flags + row * WORLD + RANK, 0, 1, 0, "release", TIMEOUT_NS)
    own_flags = tl.load(flag_addrs_ptr + RANK).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(WORLD):
        if q != RANK:
            _cas_until(own_flags + row * WORLD + q, 1, 0, 1, "acquire", TIMEOUT_NS)
    tl.debug_barrier()
    # 3. the sum in rank order, read past the caches (a peer wrote it), then add + norm
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for q in tl.static_range(WORLD):
        src = tl.multiple_of(tl.load(buf_addrs_ptr + q).to(tl.pointer_type(dt)), 16)
        acc += tl.load(src + row64 * n_cols + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    s = add_residual(acc.to(dt).to(tl.float32), res_ptr, res_out_ptr, row64, cols, mask, res_stride, n_cols)
    store_rms_norm(s, w_ptr, out_ptr, row64, cols, mask, n_cols, n_cols, eps, ZERO_CENTERED, ZERO_CENTERED)


def reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        zero_centered: bool, buf_addrs: torch.Tensor, flag_addrs: torch.Tensor, rank: int,
                        world: int, timeout_s: float = 600.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum_ranks(x) + residual), sum_ranks(x) + residual) for x, residual [rows, hidden]
    (row stride may exceed hidden; last dim contiguous). buf_addrs / flag_addrs: int64 device
    tensors of every rank's buffer (room for rows x hidden of x's dtype) and flags (rows x world
    int32, zero between calls) addresses. Every rank must call it with the same rows. timeout_s:
    how long to wait for a peer before trapping (not under Triton's CPU interpreter)."""
    timeout_ns = 0 if _INTERPRETED else max(1, int(timeout_s * 1e9))
    n, h = x.shape
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out)
    if n:
        block = triton.next_power_of_2(h)
        _reduce_add_rms_norm_kernel[(n,)](x, residual, weight, out, res_out, buf_addrs, flag_addrs, h, x.stride(0),
                                          residual.stride(0), eps, RANK=rank, WORLD=world,
                                          ZERO_CENTERED=zero_centered, BLOCK=block, TIMEOUT_NS=timeout_ns,
                                          num_warps=min(max(block // 256, 1), 8))
    return out, res_out
