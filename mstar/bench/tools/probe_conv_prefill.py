"""The causal conv1d prefill kernel (triton_conv1d.causal_conv1d_prefill) at the Qwen3.5 0.8B / 4B
prefill shapes, over its launch configurations (tokens and channels a program, warps):

    python -m mstar.bench.tools.probe_conv_prefill [--rows 32] [--prompt-len 256]

The step's input is a column view of the GDN input projection (as the model passes it); each
configuration is timed inside a CUDA graph. TB/s counts the input read and the output written once.
`*` marks the op's current choice. Results: notes/llm-serving.md.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from mstar.bench.tools.graph_timer import graph_us
from mstar.ops import conv1d
from mstar.ops.backends import triton_conv1d

SHAPES = {"0.8b": (6144, 8224), "4b": (8192, 12352)}  # conv channels, in_proj width (the row stride)


def inputs(rows: int, length: int, channels: int, width: int, dev: str, slots_n: int = 256):
    t = rows * length
    proj = torch.randn(t, width, device=dev, dtype=torch.bfloat16)
    x = proj[:, :channels]
    w = torch.randn(channels, 4, device=dev, dtype=torch.bfloat16) * 0.5
    pool = torch.randn(max(slots_n, rows), channels, 3, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(0, t + 1, length, device=dev, dtype=torch.int32)
    slots = torch.randperm(pool.shape[0], device=dev)[:rows].int()
    none = torch.empty(0, device=dev, dtype=torch.int32)
    return x, w, pool, cu, slots, none


def run_with(config, args):
    bt, bc, warps = config
    saved = triton_conv1d._PREFILL_BLOCK_T, triton_conv1d._PREFILL_BLOCK_C, triton_conv1d._PREFILL_WARPS
    triton_conv1d._PREFILL_BLOCK_T, triton_conv1d._PREFILL_BLOCK_C, triton_conv1d._PREFILL_WARPS = bt, bc, warps
    try:
        x, w, pool, cu, slots, none = args
        return triton_conv1d.causal_conv1d_prefill(x, w, None, pool, cu, slots, none, none, True)
    finally:
        triton_conv1d._PREFILL_BLOCK_T, triton_conv1d._PREFILL_BLOCK_C, triton_conv1d._PREFILL_WARPS = saved


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--block-t", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--block-c", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    a = p.parse_args(argv)
    current = (triton_conv1d._PREFILL_BLOCK_T, triton_conv1d._PREFILL_BLOCK_C, triton_conv1d._PREFILL_WARPS)
    print(f"{torch.cuda.get_device_name()}; {a.rows} rows x {a.prompt_len} tokens; us a launch (TB/s); * = current")
    for label, (channels, width) in SHAPES.items():
        x, w, pool, cu, slots, none = inputs(a.rows, a.prompt_len, channels, width, "cuda")
        timed = (x, w, pool.clone(), cu, slots, none)  # the timed launches rewrite their pool's history
        want = conv1d.causal_conv1d_prefill.backends["reference"].fn(x, w, None, pool.clone(), cu, slots, none, none,
                                                                     True).float()
        gb = 2 * x.numel() * x.element_size() / 1e9
        results = []
        for cfg in itertools.product(a.block_t, a.block_c, a.warps):
            got = run_with(cfg, (x, w, pool.clone(), cu, slots, none)).float()
            if (got - want).abs().max() > 0.02 * want.abs().max():
                print(f"  {label} {cfg}: wrong result")
                continue
            results.append((graph_us(lambda _: run_with(cfg, timed)), cfg))
        results.sort()
        line = "  ".join(f"{c}{'*' if c == current else ''} {t:.1f} ({gb / t * 1e6 / 1e3:.2f})" for t, c in results[:6])
        cur = next((f"{t:.1f}" for t, c in results if c == current), "-")
        print(f"{label}: current {cur} us; best: {line}", flush=True)


if __name__ == "__main__":
    main()
