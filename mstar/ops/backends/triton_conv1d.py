"""Causal depthwise conv1d in Triton over the conv-state pool.

Decode update: in place over the pool (one read of the K-1 history, the new input and the
weights; one write of the shifted history).

Prefill over ragged rows (cu_seqlens), without host syncs (P rows and T tokens come from
shapes): one launch, grid (token blocks + state blocks, channel blocks). A token program
finds each token's row by a binary search over cu_seqlens, takes the K-1 inputs before
the token from x (same row) or from the row's pooled history, and writes the output. A
state program builds one new K-1 state per snapshot and per row (the inputs ending at the
snapshot token / at the row's last token, reaching into the pooled history for a short
row or an early token) into a temporary buffer. The kernel only reads the pool; two
index_copy_ after it (snapshots, then rows, as the reference) write the states in, so no
program reads a slot that another has already overwritten.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mstar.ops import conv1d
from mstar.ops.backends import pdl
from mstar.ops.registry import register_backend


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, b_ptr, state_ptr, slot_ptr, out_ptr, C, x_stride,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    if PDL:  # ops/backends/pdl.py: nothing read or written before the wait
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    slot = tl.load(slot_ptr + row).to(tl.int64)
    base = state_ptr + (slot * C + cols) * (K - 1)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + cols * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    prev = tl.load(base, mask=mask, other=0.0)
    for j in tl.static_range(K - 1):
        acc += prev.to(tl.float32) * tl.load(w_ptr + cols * K + j, mask=mask, other=0.0).to(tl.float32)
        if j + 1 < K - 1:
            nxt = tl.load(base + j + 1, mask=mask, other=0.0)
            tl.store(base + j, nxt, mask=mask)
            prev = nxt
    tl.store(base + (K - 2), x.to(state_ptr.dtype.element_ty), mask=mask)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    if PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + row * C + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(x, weight, bias, conv_state_pool, slots, silu):
    b, c = x.shape
    k = weight.shape[1]
    out = torch.empty((b, c), dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    if k < 2 or not conv_state_pool.is_contiguous() or not weight.is_contiguous():
        return conv1d.causal_conv1d_update.backends["reference"].fn(x, weight, bias, conv_state_pool, slots, silu)
    if x.stride(-1) != 1:
        x = x.contiguous()
    block = 256
    _conv_update_kernel[(b, triton.cdiv(c, block))](x, weight, bias if bias is not None else weight,
                                                    conv_state_pool, slots, out, c, x.stride(0), K=k,
                                                    HAS_BIAS=bias is not None, SILU=silu, BLOCK=block,
                                                    **pdl.launch_options(x))
    return out


register_backend(conv1d.causal_conv1d_update, "triton", causal_conv1d_update, available=torch.cuda.is_available,
                 priority=20, note="in place over the conv-state pool")


@triton.jit
def _row_of(cu_ptr, t, P, N_STEPS: tl.constexpr):
    # the row r with cu[r] <= t < cu[r + 1] (binary search; rows of length 0 are skipped). Keeps
    # cu[lo] <= t < cu[hi]; N_STEPS >= log2(P) (more steps change nothing once hi = lo + 1)
    lo = tl.zeros_like(t)
    hi = lo + P
    for _ in tl.static_range(N_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(cu_ptr + mid).to(tl.int64) <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


# the token, row and snapshot counts change every step: specializing on them (== 1, % 16) would
# compile a new variant in the middle of serving (seen as 1-3 s TTFT tails on the H200)
@triton.jit(do_not_specialize=["T", "P", "S", "n_tok_blocks"])
def _conv_prefill_kernel(x_ptr, w_ptr, b_ptr, state_ptr, cu_ptr, slot_ptr, snap_tok_ptr, out_ptr, new_ptr,
                         T, C, P, S, n_tok_blocks, x_stride,
                         N_STEPS: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    H: tl.constexpr = K - 1
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    cols64 = cols.to(tl.int64)
    if pid < n_tok_blocks:
        # outputs of BLOCK_T tokens
        t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        row = _row_of(cu_ptr, t, P, N_STEPS)
        pos = t - tl.load(cu_ptr + row).to(tl.int64)
        slot = tl.load(slot_ptr + row, mask=tmask, other=0).to(tl.int64)
        mask = tmask[:, None] & cmask[None, :]
        hist = state_ptr + (slot[:, None] * C + cols64[None, :]) * H
        if HAS_BIAS:
            acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32) + \
                tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(K):
            w = tl.load(w_ptr + cols64 * K + j, mask=cmask, other=0.0).to(tl.float32)
            src = t + (j - H)  # the token j - H steps back; xpad entry pos + j of the row
            if j < H:
                m = pos + j
                in_hist = (m < H)[:, None]
                hv = tl.load(hist + m[:, None], mask=mask & in_hist, other=0.0).to(tl.float32)
                xv = tl.load(x_ptr + src[:, None] * x_stride + cols64[None, :], mask=mask & ~in_hist,
                             other=0.0).to(tl.float32)
                v = tl.where(in_hist, hv, xv)
            else:
                v = tl.load(x_ptr + src[:, None] * x_stride + cols64[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += v * w[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + t[:, None] * C + cols64[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # new states: entries [0, S) are the snapshots, [S, S + P) the rows (state after the last token)
        s = (pid - n_tok_blocks).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        smask = s < S + P
        is_snap = s < S
        tok = tl.load(snap_tok_ptr + s, mask=is_snap & smask, other=0).to(tl.int64)
        row = tl.where(is_snap, _row_of(cu_ptr, tok, P, N_STEPS), s - S)
        row = tl.where(smask, row, 0)
        start = tl.load(cu_ptr + row).to(tl.int64)
        end = tl.load(cu_ptr + row + 1).to(tl.int64)
        p = tl.where(is_snap, tok - start, end - start - 1)  # position of the state's last token (-1: none)
        slot = tl.load(slot_ptr + row, mask=smask, other=0).to(tl.int64)
        mask = smask[:, None] & cmask[None, :]
        hist = state_ptr + (slot[:, None] * C + cols64[None, :]) * H
        dst = new_ptr + (s[:, None] * C + cols64[None, :]) * H
        for i in tl.static_range(H):
            m = p + 1 + i  # xpad entry of the row
            in_hist = (m < H)[:, None]
            hv = tl.load(hist + m[:, None], mask=mask & in_hist, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + (start + m - H)[:, None] * x_stride + cols64[None, :], mask=mask & ~in_hist,
                         other=0.0).to(tl.float32)
            tl.store(dst + i, tl.where(in_hist, hv, xv).to(new_ptr.dtype.element_ty), mask=mask)


# token block x channel block of a prefill program (module level: tests shrink them to hit partial blocks)
_PREFILL_BLOCK_T = 16
_PREFILL_BLOCK_C = 128
_PREFILL_WARPS = 4


def _search_steps(p: int) -> int:
    # binary-search steps for p rows, bucketed so that one variant serves up to 256 rows
    need = max((p - 1).bit_length(), 1)
    return next(b for b in (8, 16, 32, 64) if b >= need)


def causal_conv1d_prefill(x, weight, bias, conv_state_pool, cu_seqlens, slots, snap_token_idx, snap_slots, silu):
    t, c = x.shape
    k = weight.shape[1]
    p = slots.numel()
    n_snap = snap_token_idx.numel()
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if t == 0 or p == 0:  # no token: every row's state stays as it is, no snapshot can name a token
        return out
    if k < 2 or not conv_state_pool.is_contiguous() or not weight.is_contiguous():
        return conv1d.causal_conv1d_prefill.backends["reference"].fn(x, weight, bias, conv_state_pool, cu_seqlens,
                                                                     slots, snap_token_idx, snap_slots, silu)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    dev = x.device
    cu = cu_seqlens.to(device=dev).contiguous()
    slots_d = slots.to(device=dev).contiguous()
    snap_tok = snap_token_idx.to(device=dev).contiguous() if n_snap else slots_d
    new = torch.empty((n_snap + p, c, k - 1), dtype=conv_state_pool.dtype, device=dev)
    bt, bc = _PREFILL_BLOCK_T, _PREFILL_BLOCK_C
    n_tok_blocks = triton.cdiv(t, bt)
    grid = (n_tok_blocks + triton.cdiv(n_snap + p, bt), triton.cdiv(c, bc))
    _conv_prefill_kernel[grid](x, weight, bias if bias is not None else weight, conv_state_pool, cu, slots_d, snap_tok,
                               out, new, t, c, p, n_snap, n_tok_blocks, x.stride(0), N_STEPS=_search_steps(p), K=k,
                               HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=bt, BLOCK_C=bc,
                               num_warps=_PREFILL_WARPS)
    # after the kernel (same stream): it read the old pool; snapshots first, then rows, as the reference
    if n_snap:
        conv_state_pool.index_copy_(0, snap_slots.to(device=dev, dtype=torch.long), new[:n_snap])
    conv_state_pool.index_copy_(0, slots_d.long(), new[n_snap:])
    return out


register_backend(conv1d.causal_conv1d_prefill, "triton", causal_conv1d_prefill, available=torch.cuda.is_available,
                 priority=20, note="ragged rows in one launch, no host sync; states via a buffer and index_copy_")
