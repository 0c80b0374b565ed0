"""cuBLAS (`F.linear`) against a plain Triton GEMV at decode batch sizes, at the Qwen3.5 0.8B / 4B
decode projections, on one CUDA GPU, random bf16 weights:

    python -m mstar.bench.tools.probe_gemv [--batch 1 8]

Each product is timed inside a CUDA graph of repeated launches (as a decode graph replays them),
cycling over enough copies of the weight to overrun L2 (as a decode step reads each weight once).
The Triton kernel takes a block of output rows per program and loops over K; the best of its
configurations per shape is shown, with its speed-up over cuBLAS. Results: notes/llm-decode-step.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mstar.bench.tools.graph_timer import graph_us

SHAPES = {  # label: (N out, K in)
    "0.8b GDN in_proj": (2 * 2048 + 2048 + 2048 + 32, 1024), "0.8b gate_up": (7168, 1024), "0.8b down": (1024, 3584),
    "0.8b GDN out_proj": (1024, 2048), "0.8b attention qkv": (8 * 256 * 2 + 2 * 2 * 256, 1024),
    "0.8b LM head": (248320, 1024),
    "4b GDN in_proj": (2 * 2048 + 4096 + 4096 + 64, 2560), "4b gate_up": (18432, 2560), "4b down": (2560, 9216),
    "4b GDN out_proj": (2560, 4096), "4b attention qkv": (16 * 256 * 2 + 2 * 4 * 256, 2560),
    "4b LM head": (248320, 2560),
}
CONFIGS = [(bn, bk, ns) for bn in (4, 8, 16, 32) for bk in (256, 512) for ns in (3, 4)]  # rows, K block, stages


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        if BM == 1:
            x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)[None, :]
        else:
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int]) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    bn, bk, stages = config
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, m, n, k, BM=1 if m == 1 else 16, BN=bn, BK=bk, num_warps=4,
                                        num_stages=stages)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="rows of x (decode batch sizes)")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    for label, (n, k) in SHAPES.items():
        copies = min(16, max(2, int(200e6 // (n * k * 2))))  # > L2 together
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        gb = n * k * 2 / 1e9
        for m in args.batch:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float()
            t_cublas = graph_us(lambda w: F.linear(x, w), weights)
            best, best_cfg = float("inf"), None
            for cfg in CONFIGS:
                if m > 1 and cfg[0] < 16:  # tl.dot needs 16-wide blocks
                    continue
                if (triton_linear(x, weights[0], cfg).float() - ref).abs().max() > 0.05 * ref.abs().max():
                    continue
                t = graph_us(lambda w: triton_linear(x, w, cfg), weights, reps=5)
                if t < best:
                    best, best_cfg = t, cfg
            print(f"{label:20s} M={m}: cuBLAS {t_cublas:7.2f} us ({gb / t_cublas * 1e6:5.0f} GB/s)  Triton {best:7.2f} us "
                  f"({gb / best * 1e6:5.0f} GB/s) {best_cfg}  {t_cublas / best:.2f}x", flush=True)


if __name__ == "__main__":
    main()
