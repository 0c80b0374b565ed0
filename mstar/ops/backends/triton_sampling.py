"""Triton kernel for `sample`'s one-pass stage: the Gumbel-max winner over the whole vocabulary
of rows with temperature only (no top-k, top-p, min-p), the noise fused in.

One program per row reads the row's logits once, in blocks: scaled = logit / T (IEEE division,
as torch's), the counter hash of (seed, step, index) in uint32 (the same bits as the int64
torch hash, whose values stay below 2^32), u = (2m + 1) / 2^24, gumbel = -log(-log u) with
libdevice's logf (what torch.log calls on CUDA), and keeps the reference's winner: the largest
scaled + gumbel, ties to the larger scaled value, then the lower index.

Registered as the `sample` backend "triton": `sampling.sample_fast` with this kernel for the
one-pass rows, everything else as `torch_topk`. Off by default (priority below the reference):
its tokens are bit-identical only if Triton's libdevice log and division match torch's on the
device, which tests/test_gpu_sampling.py checks; select it with MSTAR_BACKENDS=sample=triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mstar.ops import sampling
from mstar.ops.registry import register_backend


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x045D9F3B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _log(x):
    return libdevice.log(x)  # logf, as torch.log on CUDA (tl.log may lower to an approximation)


@triton.jit
def _gumbel_argmax_kernel(lf_ptr, row_stride, t_ptr, a_ptr, b_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    a = tl.load(a_ptr + row).to(tl.uint32)
    b = tl.load(b_ptr + row).to(tl.uint32)
    best_z = tl.full([], float("-inf"), tl.float32)
    best_s = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(lf_ptr + row * row_stride + offs, mask=mask, other=float("-inf"))
        s = tl.math.div_rn(x, t)
        h = _mix32(_mix32(offs.to(tl.uint32) ^ a) ^ b)
        u = ((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
        z = s + (-_log(-_log(u)))
        z = tl.where(mask, z, float("-inf"))
        s = tl.where(mask, s, float("-inf"))
        m = tl.max(z, axis=0)
        tie = (z == m) & mask
        sm = tl.max(tl.where(tie, s, float("-inf")), axis=0)
        im = tl.min(tl.where(tie & (s == sm), offs, 2147483647), axis=0)
        take = (m > best_z) | ((m == best_z) & (sm > best_s))
        best_z = tl.where(take, m, best_z)
        best_s = tl.where(take, sm, best_s)
        best_i = tl.where(take, im, best_i)
    tl.store(out_ptr + row, best_i.to(tl.int64))


def gumbel_argmax(lf: torch.Tensor, t: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Winner per row of lf [R, V] float32 at temperature t [R] (> 0): the reference's token for a
    row without filters."""
    R, V = lf.shape
    if lf.stride(-1) != 1:
        lf = lf.contiguous()
    a, b = sampling._row_keys(seeds, steps)
    out = torch.empty((R,), dtype=torch.int64, device=lf.device)
    if R:
        _gumbel_argmax_kernel[(R,)](lf, lf.stride(0), t.to(torch.float32).contiguous(), a.contiguous(),
                                    b.contiguous(), out, V, BLOCK=4096, num_warps=8)
    return out


@triton.jit
def _mix32_i64(x):
    # sampling._mix32 as it is, in int64: every product stays below 2^63, the same bits as torch's
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x045D9F3B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _uniform_at_kernel(seeds_ptr, steps_ptr, idx_ptr, idx_row_stride, out_ptr, J, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(seeds_ptr + row).to(tl.int64)
    t = tl.load(steps_ptr + row).to(tl.int64)
    a = _mix32_i64(s & 0xFFFFFFFF)
    a = _mix32_i64(a ^ ((s >> 32) & 0xFFFFFFFF))
    a = _mix32_i64(a ^ (t & 0xFFFFFFFF))
    a = _mix32_i64(a ^ ((t >> 32) & 0xFFFFFFFF))
    b = _mix32_i64(a ^ 0x9E3779B9)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < J
    i = tl.load(idx_ptr + row * idx_row_stride + offs, mask=ok, other=0).to(tl.int64)
    h = _mix32_i64(_mix32_i64(i ^ a) ^ b)
    u = ((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
    tl.store(out_ptr + row * J + offs, u, mask=ok)


def uniform_at(seeds: torch.Tensor, steps: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """sampling._uniform_at in one launch (the torch version is ~50 small kernels): the same
    integer operations, so the same bits."""
    B = seeds.shape[0]
    J = idx.shape[1]
    out = torch.empty((B, J), dtype=torch.float32, device=idx.device)
    if B and J:
        idx = idx if idx.stride(-1) == 1 else idx.contiguous()
        row_stride = 0 if idx.shape[0] == 1 else idx.stride(0)
        block = min(1024, triton.next_power_of_2(J))
        _uniform_at_kernel[(B, triton.cdiv(J, block))](seeds.contiguous(), steps.contiguous(), idx, row_stride, out,
                                                       J, BLOCK=block)
    return out


def _sample_triton(logits, temperature, top_k, top_p, min_p, seeds, steps, num_logprobs):
    return sampling.sample_fast(logits, temperature, top_k, top_p, min_p, seeds, steps, num_logprobs,
                                full_impl=gumbel_argmax)


register_backend(sampling.sample, "triton", _sample_triton, devices=("cuda",), priority=-1,
                 available=torch.cuda.is_available,
                 note="torch_topk with a fused Triton Gumbel-max pass; opt-in (MSTAR_BACKENDS=sample=triton)")
sampling.PLANNED_BACKENDS["triton"] = gumbel_argmax
sampling.UNIFORM_AT_CUDA = uniform_at  # every backend's candidate noise on CUDA
