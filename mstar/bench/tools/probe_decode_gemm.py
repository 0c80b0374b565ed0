"""Decode-size matrix products (M = rows of a decode step) at the Qwen3.5 projections, on one CUDA
GPU, random bf16 weights: cuBLAS as `F.linear` calls it, cuBLASLt (torch's preferred-BLAS switch),
PyTorch's TunableOp (every algorithm it registers, timed, the fastest kept) and a Triton kernel over
its configurations (tiles, split-K, plain loads or TMA):

    python -m mstar.bench.tools.probe_decode_gemm [--batch 8 128] [--model 4b]

Each product is timed inside a CUDA graph of repeated launches, cycling over enough copies of the
weight to overrun L2, so that a launch reads its weight from memory as a decode step does. TB/s
counts the weight bytes alone. Results: notes/llm-decode-step.md.

The Triton kernel computes y^T = W x^T (the weight's rows fill the MMA's M side, so a handful of
decode rows need no padding to 64), a [BN, BM] tile a program; with split-K > 1 each program sums
1/split of K into a float32 workspace and a second kernel adds the splits.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mstar.bench.tools.graph_timer import graph_us
from mstar.bench.tools.probe_gemv import SHAPES


@triton.jit
def _store_tile(y_ptr, acc, rn, rm, pid_k, M, N, SPLIT: tl.constexpr):
    """y[rm, rn] = acc^T (split 1), else split pid_k's float32 partial sums into the workspace."""
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    if SPLIT == 1:
        tl.store(y_ptr + rm[None, :] * N + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + pid_k * M * N + rm[None, :] * N + rn[:, None], acc, mask=mask)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, K_SPLIT, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, SPLIT: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(pid_k * K_SPLIT, pid_k * K_SPLIT + K_SPLIT, BK):
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=rn[:, None] < N, other=0.0)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    _store_tile(y_ptr, acc, rn, rm, pid_k, M, N, SPLIT)


@triton.jit
def _gemm_tma_kernel(x_desc, w_desc, y_ptr, M, N, K, K_SPLIT, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, SPLIT: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(pid_k * K_SPLIT, pid_k * K_SPLIT + K_SPLIT, BK):
        w = w_desc.load([pid_n * BN, k0])
        x = x_desc.load([pid_m * BM, k0])
        acc = tl.dot(w, tl.trans(x), acc)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    _store_tile(y_ptr, acc, rn, rm, pid_k, M, N, SPLIT)


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=offs < MN, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=offs < MN)


def configs(m: int, n: int, k: int, tma_ok: bool):
    """(BN, BK, stages, warps, split, tma) worth trying for an M x N x K product."""
    out = []
    bks = (128, 256) if m <= 32 else (64, 128)
    for bn, bk, stages, warps, split, tma in itertools.product((64, 128), bks, (3, 4), (4,), (1, 2, 4, 8),
                                                               (False, True) if tma_ok else (False,)):
        if k % (split * bk):
            continue
        tiles = triton.cdiv(n, bn) * triton.cdiv(m, block_m(m))
        if split > 1 and tiles * split > 4 * 132:  # already many programs: splitting only adds a pass
            continue
        out.append((bn, bk, stages, warps, split, tma))
    return out


def block_m(m: int) -> int:
    return min(128, max(16, triton.next_power_of_2(m)))


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg, y: torch.Tensor, part: torch.Tensor | None):
    m, k = x.shape
    n = w.shape[0]
    bn, bk, stages, warps, split, tma = cfg
    bm = block_m(m)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    out = y if split == 1 else part
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        xd, wd = TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk])
        _gemm_tma_kernel[grid](xd, wd, out, m, n, k, k // split, BM=bm, BN=bn, BK=bk, SPLIT=split,
                               num_stages=stages, num_warps=warps)
    else:
        _gemm_kernel[grid](x, w, out, m, n, k, k // split, BM=bm, BN=bn, BK=bk, SPLIT=split,
                           num_stages=stages, num_warps=warps)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](part, y, m * n, SPLIT=split, BLOCK=1024)
    return y


def _tunableop_us(x, weights) -> tuple[float, str]:
    """TunableOp's pick for this shape (tuned on the first call, outside the graph) and its time."""
    tunable = torch.cuda.tunable
    before = set(tunable.get_results())
    tunable.enable(True)
    tunable.tuning_enable(True)
    try:
        t = graph_us(lambda w: F.linear(x, w), weights)
    finally:
        tunable.tuning_enable(False)
        tunable.enable(False)
    new = [r for r in tunable.get_results() if r not in before]
    return t, " ".join(str(r[2])[:40] for r in new)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 128], help="rows of x (decode batch sizes)")
    ap.add_argument("--model", nargs="+", default=["4b"], help="which SHAPES prefixes (0.8b, 4b)")
    ap.add_argument("--no-tunableop", action="store_true", help="skip PyTorch's TunableOp column")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cap = torch.cuda.get_device_capability()
    tma_ok = cap[0] >= 9
    print(f"{torch.cuda.get_device_name()}; us a product (TB/s of weight)", flush=True)
    for label, (n, k) in SHAPES.items():
        if not any(label.startswith(p + " ") for p in args.model):
            continue
        copies = min(16, max(2, int(200e6 // (n * k * 2))))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        gb = n * k * 2 / 1e9
        for m in args.batch:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            pick = ""
            ref = F.linear(x, weights[0]).float()
            row = {"cuBLAS": graph_us(lambda w: F.linear(x, w), weights)}
            prev = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                row["cuBLASLt"] = graph_us(lambda w: F.linear(x, w), weights)
            finally:
                torch.backends.cuda.preferred_blas_library(prev)
            if not args.no_tunableop:
                row["TunableOp"], pick = _tunableop_us(x, weights)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            part = torch.empty(8, m, n, device="cuda", dtype=torch.float32)
            best, best_cfg = float("inf"), None
            for cfg in configs(m, n, k, tma_ok):
                try:
                    got = triton_linear(x, weights[0], cfg, y, part).float()
                except Exception as e:  # a configuration the compiler rejects (shared memory)
                    if "out of resource" in str(e).lower() or "shared memory" in str(e).lower():
                        continue
                    raise
                if (got - ref).abs().max() > 0.02 * ref.abs().max() + 1e-3:
                    print(f"  {label} M={m} {cfg}: wrong result", flush=True)
                    continue
                t = graph_us(lambda w: triton_linear(x, w, cfg, y, part), weights, reps=5)
                if t < best:
                    best, best_cfg = t, cfg
            row["Triton"] = best
            cols = "  ".join(f"{name} {t:7.2f} ({gb / t * 1e6 / 1e3:4.2f})" for name, t in row.items())
            print(f"{label:20s} M={m:<4d} {cols}  best Triton {best_cfg} {row['cuBLAS'] / best:.2f}x"
                  + (f"  TunableOp: {pick}" if pick else ""), flush=True)


if __name__ == "__main__":
    main()
