"""A Triton matmul for skinny inputs (at most SKINNY_ROWS rows: the decode step's batch), the
rest through F.linear.

At a decode batch of 8 the matmul reads the whole weight to produce 8 rows: it is bound by
the weight's bytes, and cuBLAS's kernels for it reached about 3 TB/s of the H200's 4.8 in
session 8's 9B TP2 profile. This kernel gives each program BLOCK_N output columns and the
whole K loop (no split-K: no workspace, no second launch, a deterministic sum), pipelines
the weight's tiles through shared memory, and pads the rows to 16 for tl.dot. Its tile
shapes are tuned per (N, K) by Triton's autotuner on first use (the engine's warm-up, never
inside a graph capture), and the results persist in the Triton cache. Then, per (rows, N, K),
the tuned kernel races F.linear once and the faster one takes that shape from then on (a
shape first met inside a capture goes to F.linear, undecided).

Priority -1 until a measurement says it wins: MSTAR_BACKENDS=linear=triton selects it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mstar.ops import matmul
from mstar.ops.registry import register_backend

SKINNY_ROWS = 16  # rows padded to 16 for tl.dot: more rows would need a bigger tile

_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 6), (32, 256, 4, 4),
                                 (32, 256, 8, 4), (32, 512, 8, 3), (64, 128, 4, 5), (64, 256, 8, 3),
                                 (128, 128, 8, 3), (128, 64, 4, 6))]


@triton.jit
def skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                          HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, 16)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    x_ptrs = x_ptr + rows[:, None] * x_stride + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_stride + ks[None, :]
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks)[None, :] < K
        x = tl.load(x_ptrs, mask=row_ok & k_ok, other=0.0)
        w = tl.load(w_ptrs, mask=col_ok & k_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * y_stride + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < N))


# tuned per (N, K) on first use; tests and notes/tools/gemm_bench.py launch the plain kernel at given tiles
_tuned_kernel = triton.autotune(configs=_CONFIGS, key=["N", "K"], cache_results=True, warmup=5, rep=20
                                )(skinny_linear_kernel)
RACE_REPS = 10
_choice: dict[tuple[int, int, int], bool] = {}  # (rows, N, K) -> the kernel won its race against F.linear


def takes(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this matmul (else F.linear does)."""
    return (x2.shape[0] <= SKINNY_ROWS and x2.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x2.dtype and weight.stride(1) == 1 and x2.stride(-1) == 1)


def skinny_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict | None = None
                  ) -> torch.Tensor:
    """x2 [M <= 16, K] @ weight[N, K]^T (+ bias) through the kernel; config (BLOCK_N, BLOCK_K,
    num_warps, num_stages) launches it at those tiles instead of the tuned ones."""
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    kernel, meta = (_tuned_kernel, {}) if config is None else (skinny_linear_kernel, config)
    kernel[grid](x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0),
                 y.stride(0), HAS_BIAS=bias is not None, **meta)
    return y


def _time(fn) -> float:
    """Device time of RACE_REPS calls (ms). The device sleeps first, so the launches queue up
    behind it and their host cost stays out, as in a graph replay."""
    fn()  # first use: the autotuner's tuning, cuBLAS's heuristics
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(2_000_000)  # ~1 ms of clock cycles
    start.record()
    for _ in range(RACE_REPS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _kernel_wins(x2, weight, bias) -> bool | None:
    key = (x2.shape[0], weight.shape[0], weight.shape[1])
    won = _choice.get(key)
    if won is None and not torch.cuda.is_current_stream_capturing():
        won = _choice[key] = _time(lambda: skinny_linear(x2, weight, bias)) < _time(lambda: F.linear(x2, weight, bias))
    return won


def linear(x, weight, bias):
    x2 = x.reshape(-1, x.shape[-1])
    if not takes(x2, weight) or not _kernel_wins(x2, weight, bias):
        return F.linear(x, weight, bias)
    return skinny_linear(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])


register_backend(matmul.linear, "triton", linear, devices=("cuda",), available=torch.cuda.is_available,
                 priority=-1, note="skinny rows (decode); F.linear otherwise")
