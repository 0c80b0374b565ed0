"""The one-row decode MLP (residual add + RMSNorm, gate_up, SiLU-and-mul, down) as one persistent
Triton kernel: ops.add_rms_norm_swiglu on CUDA.

Run as two fused-linear kernels (triton_fused_linear), a 0.8B one-row MLP reads 22 MB in ~15 us:
each kernel spends microseconds ramping up and draining, latency a one-row product cannot hide.
Here one program per SM does both products with a grid-wide barrier between them:

  1. every program sums the squares of (x + residual) itself (the row is a few KB) and computes
     its share of the intermediate features: gate and up rows side by side, SiLU(gate) * up,
     stored to a small scratch vector (rounded where the two-kernel path rounds: gate and up to
     the weight dtype, then the product);
  2. before the barrier, each program asks L2 for the first weights of its down rows (no kernel
     writes them), so they arrive while the slowest program finishes step 1;
  3. after the barrier every program computes its down rows from the scratch vector (read past L1:
     other SMs wrote it).

The barrier is two int32 words per call site: an arrival count that the last arrival resets to 0,
and a generation it then bumps, which the others wait on. So the words are 0 / any at rest and need
no reset between launches or graph replays. Every program must be resident at once for the barrier
to complete: the grid is one program per SM and a program fits on any SM beside another, so even
two such kernels on two streams cannot starve each other. A program that waits longer than
TIMEOUT_NS traps (the CUDA context fails, the engine reports it) instead of hanging the GPU.

Triton's CPU interpreter runs programs one after another, so there the two steps run as two launches
of the same kernel (the tests); nothing else differs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mstar import knobs
from mstar.ops import fused_linear
from mstar.ops.backends import triton_fused_linear as tfl
from mstar.ops.registry import register_backend

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TIMEOUT_NS = tl.constexpr(10 * 10 ** 9)  # far beyond any MLP: a barrier not reached by then never will be


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _grid_barrier(words_ptr, n_programs, TIMEOUT: tl.constexpr):
    """Every program of the grid waits here until all n_programs have arrived; their stores before it
    are visible to the loads after it (release / acquire at GPU scope, one thread a program)."""
    tl.debug_barrier()  # the program's own stores are issued before its arrival
    gen = tl.atomic_add(words_ptr + 1, 0, sem="acquire", scope="gpu")
    arrived = tl.atomic_add(words_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == n_programs - 1:
        tl.atomic_xchg(words_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(words_ptr + 1, 1, sem="release", scope="gpu")
    else:
        deadline = _now_ns() + TIMEOUT
        while tl.atomic_add(words_ptr + 1, 0, sem="acquire", scope="gpu") == gen:
            if _now_ns() > deadline:
                _trap()
    tl.debug_barrier()


@triton.jit
def _swiglu_mlp_kernel(x_ptr, res_ptr, nw_ptr, wgu_ptr, wd_ptr, h_ptr, y_ptr, res_out_ptr, words_ptr, K, INTER, N,
                       eps, n_programs, ZERO_CENTERED: tl.constexpr, BJ: tl.constexpr, BK1: tl.constexpr,
                       BN: tl.constexpr, BK2: tl.constexpr, PF: tl.constexpr, STEPS: tl.constexpr):
    """STEPS: 3 both products with the barrier between; 1 or 2 only the first or second (the interpreter)."""
    pid = tl.program_id(0)
    if STEPS & 1:
        sumsq = tl.zeros((BK1,), dtype=tl.float32)
        for k0 in range(0, K, BK1):
            rk = k0 + tl.arange(0, BK1)
            km = rk < K
            s = (tl.load(x_ptr + rk, mask=km, other=0.0).to(tl.float32)
                 + tl.load(res_ptr + rk, mask=km, other=0.0).to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            if pid == 0:  # the new residual, as the op rounds it
                tl.store(res_out_ptr + rk, s, mask=km)
            sf = s.to(tl.float32)
            sumsq += sf * sf
        rstd = tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
        for j0 in range(pid * BJ, INTER, n_programs * BJ):
            rj = j0 + tl.arange(0, BJ)
            jm = rj < INTER
            gate_rows = wgu_ptr + rj.to(tl.int64)[:, None] * K
            up_rows = wgu_ptr + (rj + INTER).to(tl.int64)[:, None] * K
            acc_g = tl.zeros((BJ,), dtype=tl.float32)
            acc_u = tl.zeros((BJ,), dtype=tl.float32)
            for k0 in range(0, K, BK1):
                rk = k0 + tl.arange(0, BK1)
                km = rk < K
                s = (tl.load(x_ptr + rk, mask=km, other=0.0).to(tl.float32)
                     + tl.load(res_ptr + rk, mask=km, other=0.0).to(tl.float32)).to(res_out_ptr.dtype.element_ty)
                nw = tl.load(nw_ptr + rk, mask=km, other=0.0).to(tl.float32)
                if ZERO_CENTERED:
                    nw = nw + 1.0
                # what the fused add + RMSNorm kernel multiplies (1 / rms applied to the sums below)
                xk = (s.to(tl.float32) * nw).to(wgu_ptr.dtype.element_ty).to(tl.float32)
                wm = jm[:, None] & km[None, :]
                acc_g += tl.sum(tl.load(gate_rows + rk[None, :], mask=wm, other=0.0).to(tl.float32) * xk[None, :], 1)
                acc_u += tl.sum(tl.load(up_rows + rk[None, :], mask=wm, other=0.0).to(tl.float32) * xk[None, :], 1)
            g = (acc_g * rstd).to(wgu_ptr.dtype.element_ty).to(tl.float32)
            u = (acc_u * rstd).to(wgu_ptr.dtype.element_ty).to(tl.float32)
            tl.store(h_ptr + rj, (g / (1.0 + tl.exp(-g)) * u).to(h_ptr.dtype.element_ty), mask=jm)
    if STEPS == 3:
        if PF > 0:
            first = tl.minimum(pid * BN + tl.arange(0, BN), N - 1).to(tl.int64)
            _prefetch_l2(wd_ptr + first[:, None] * INTER + (tl.arange(0, PF // 64) * 64)[None, :])
        _grid_barrier(words_ptr, n_programs, TIMEOUT_NS)
    if STEPS & 2:
        for n0 in range(pid * BN, N, n_programs * BN):
            rn = n0 + tl.arange(0, BN)
            nm = rn < N
            down_rows = wd_ptr + rn.to(tl.int64)[:, None] * INTER
            acc = tl.zeros((BN,), dtype=tl.float32)
            for k0 in range(0, INTER, BK2):
                rk = k0 + tl.arange(0, BK2)
                km = rk < INTER
                hk = tl.load(h_ptr + rk, mask=km, other=0.0, cache_modifier=".cg").to(tl.float32)
                w = tl.load(down_rows + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
                acc += tl.sum(w.to(tl.float32) * hk[None, :], axis=1)
            tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=nm)


# (hidden, intermediate) -> (programs per SM, BJ, BK1, BN, BK2, warps, L2 prefetch width):
# the best of the probe's sweep at one row on an H100 (notes/llm-decode-step.md)
TUNED: dict[tuple[int, int], tuple[int, int, int, int, int, int, int]] = {
    (1024, 3584): (2, 4, 1024, 4, 1024, 8, 1024),
    (2560, 9216): (2, 4, 1024, 4, 1024, 8, 4096),
}
UNTUNED = (1, 4, 512, 4, 1024, 8, 0)  # MSTAR_FUSED_LINEAR_SHAPES=any at a size TUNED does not hold


def pick_config(hidden: int, inter: int) -> tuple | None:
    """The launch configuration for a (hidden, intermediate) MLP, or None (composed)."""
    tuned = TUNED.get((hidden, inter))
    if tuned is None and knobs.value("MSTAR_FUSED_LINEAR_SHAPES") == "any":
        return UNTUNED
    return tuned


_words: dict[tuple[torch.device, int], torch.Tensor] = {}


def barrier_words(down_weight: torch.Tensor) -> torch.Tensor:
    """The barrier's two words for the call site of this down projection (zeros, kept while the
    weight lives). Made on the site's first call, which runs before any capture of it (a decode graph
    is captured after a first eager run)."""
    key = (down_weight.device, down_weight.data_ptr())
    words = _words.get(key)
    if words is None:
        words = _words[key] = torch.zeros(2, dtype=torch.int32, device=down_weight.device)
    return words


_grids: dict = {}


def _grid(args: tuple, meta: dict, per_sm: int, device: torch.device) -> int:
    """Programs of the launch: per_sm a SM, fewer where the compiled kernel's registers, shared memory
    or threads would not let twice that many share an SM (so every program of this launch, and of one
    more such launch on another stream, is resident at once: the barrier never waits on a program
    that cannot be scheduled)."""
    key = (device, args[0].dtype, per_sm, tuple(sorted(meta.items())))
    n = _grids.get(key)
    if n is None:
        kernel = _swiglu_mlp_kernel.warmup(*args, grid=(1,), STEPS=3, **meta)
        kernel._init_handles()  # loads the binary: its register count
        props = torch.cuda.get_device_properties(device)
        warps = meta["num_warps"]
        regs_a_warp = -(-max(kernel.n_regs, 1) * 32 // 256) * 256  # allocated in units of 256 a warp
        fit = min(getattr(props, "regs_per_multiprocessor", 65536) // (regs_a_warp * warps),
                  getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps))
        if kernel.metadata.shared:
            fit = min(fit, getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // kernel.metadata.shared)
        n = _grids[key] = min(per_sm, max(1, fit // 2)) * props.multi_processor_count
    return n


def launch(x, residual, norm_weight, eps, zero_centered, gate_up_weight, down_weight, config, n_programs=None):
    """(y, x + residual) over one row, config (pick_config's tuple); n_programs sets the grid (the
    interpreter's tests)."""
    k, inter, n = x.shape[1], down_weight.shape[1], down_weight.shape[0]
    per_sm, bj, bk1, bn, bk2, warps, pf = config
    y = x.new_empty((1, n))
    res_out = torch.empty_like(x)
    h = x.new_empty((inter,))
    words = barrier_words(down_weight) if x.is_cuda else h
    meta = dict(ZERO_CENTERED=zero_centered, BJ=bj, BK1=bk1, BN=bn, BK2=bk2, PF=pf, num_warps=warps)
    args = [x, residual, norm_weight, gate_up_weight, down_weight, h, y, res_out, words, k, inter, n, eps,
            n_programs or 1]
    if _INTERPRETED:
        _swiglu_mlp_kernel[(args[-1],)](*args, STEPS=1, **meta)
        _swiglu_mlp_kernel[(args[-1],)](*args, STEPS=2, **meta)
    else:
        args[-1] = n_programs or _grid(tuple(args), meta, per_sm, x.device)
        _swiglu_mlp_kernel[(args[-1],)](*args, STEPS=3, **meta)
    return y, res_out


def composed_add_rms_norm_swiglu(x, residual, norm_weight, eps, zero_centered, gate_up_weight, down_weight):
    gate_up, s = fused_linear.add_rms_norm_linear(x, residual, norm_weight, eps, zero_centered, gate_up_weight)
    return fused_linear.silu_mul_linear(gate_up, down_weight), s


def add_rms_norm_swiglu(x, residual, norm_weight, eps, zero_centered, gate_up_weight, down_weight):
    config = pick_config(x.shape[-1], down_weight.shape[1]) if x.dim() == 2 and x.shape[0] == 1 else None
    if (config is None or x.dtype != gate_up_weight.dtype or x.stride(-1) != 1 or residual.stride(-1) != 1
            or not gate_up_weight.is_contiguous() or not down_weight.is_contiguous()
            or gate_up_weight.shape[0] != 2 * down_weight.shape[1]):
        return composed_add_rms_norm_swiglu(x, residual, norm_weight, eps, zero_centered, gate_up_weight,
                                            down_weight)
    return launch(x, residual, norm_weight, eps, zero_centered, gate_up_weight, down_weight, config)


register_backend(fused_linear.add_rms_norm_swiglu, "composed", composed_add_rms_norm_swiglu,
                 available=tfl._cuda, priority=5, note="add_rms_norm_linear, then silu_mul_linear, each on its backend")
register_backend(fused_linear.add_rms_norm_swiglu, "triton", add_rms_norm_swiglu, available=tfl._cuda, priority=10,
                 note="one row at the tuned shapes: both products in one persistent kernel with a grid barrier; "
                      "composed elsewhere")
