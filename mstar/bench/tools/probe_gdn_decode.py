"""The fused GDN decode kernel (triton_gdn.gdn_decode_fused) at the Qwen3.5 0.8B / 4B shapes, over
its launch configurations: value columns a program (BV) and warps, float32 and bfloat16 state:

    python -m mstar.bench.tools.probe_gdn_decode [--rows 1 8 32 128]

Each configuration is timed inside a CUDA graph of repeated launches (as a decode graph replays
them), the rows' state slots spread over a pool larger than L2. TB/s counts the state read and
written once (the kernel's bytes, the inputs aside). `*` marks what the op picks
(`triton_gdn._launch_config`). Results: notes/llm-serving.md.
"""

from __future__ import annotations

import argparse

import torch
import triton

from mstar.bench.tools.graph_timer import graph_us
from mstar.ops.backends import triton_gdn

SHAPES = {"0.8b": (16, 16), "4b": (16, 32)}  # key heads, value heads (dk = dv = 128)
DK = DV = 128
POOL_BYTES = 512 * 2 ** 20


def _inputs(rows: int, hk: int, hv: int, dtype: torch.dtype, dev: str, pool_bytes: int = POOL_BYTES):
    width = 2 * hk * DK + hv * DV
    mixed = torch.randn(rows, width, device=dev, dtype=torch.bfloat16)
    zba = torch.randn(rows, 2 * hv, device=dev, dtype=torch.bfloat16)
    slots_n = max(rows, pool_bytes // (hv * DK * DV * dtype.itemsize))
    pool = (torch.randn(slots_n, hv, DK, DV, device=dev) * 0.1).to(dtype)
    slots = torch.randperm(slots_n, device=dev)[:rows]
    A_log = torch.rand(hv, device=dev).mul(15).add(0.01).log().to(torch.bfloat16)
    dt_bias = torch.randn(hv, device=dev, dtype=torch.bfloat16)
    return mixed, zba[:, :hv], zba[:, hv:], A_log, dt_bias, pool, slots


def _launch(args, hk: int, bv: int, warps: int):
    """A launch of the kernel at this configuration (run(_) for the timer) and its output tensor."""
    mixed, a, b, A_log, dt_bias, pool, slots = args
    rows, hv = mixed.shape[0], pool.shape[1]
    o = mixed.new_empty((rows, hv, DV))

    def run(_):
        triton_gdn._gdn_decode_fused_kernel[(rows, hv, triton.cdiv(DV, bv))](
            mixed, mixed.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, pool, slots, o, DK ** -0.5,
            1e-6, HK=hk, HV=hv, DK=DK, DV=DV, BV=bv, num_warps=warps, PDL=False)
    return run, o


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--block-v", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()}; us a launch (TB/s of state); * = the op's choice")
    for label in args.models:
        hk, hv = SHAPES[label]
        for dtype in (getattr(torch, d) for d in args.dtypes):
            for rows in args.rows:
                inp = _inputs(rows, hk, hv, dtype, dev)
                pick = triton_gdn._launch_config(DK, rows * hv, inp[5])
                state_bytes = 2 * rows * hv * DK * DV * dtype.itemsize
                cells = []
                for bv in args.block_v:
                    for w in args.warps:
                        us = graph_us(_launch(inp, hk, bv, w)[0])
                        mark = "*" if (bv, w) == pick else ""
                        cells.append(f"{bv}/{w}{mark} {us:6.1f} ({state_bytes / us / 1e6:.2f})")
                print(f"{label} {str(dtype)[6:]:8s} rows {rows:3d}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
