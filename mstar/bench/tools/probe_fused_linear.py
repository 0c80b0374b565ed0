"""The fused-linear kernel (ops/backends/triton_fused_linear.py) against the composed pair it
replaces (the elementwise op's kernel, then cuBLAS) at the Qwen3.5 0.8B / 4B decode products, on
one CUDA GPU, random bf16 weights:

    python -m mstar.bench.tools.probe_fused_linear [--rows 1 8] [--model 0.8b 4b] [--only down]

Per product and row count: the composed pair, cuBLAS alone on the op's output, the kernel with
the configuration the backend takes (its TUNED table; on sm_90 also with programmatic dependent
launch, MSTAR_PDL, which lets each launch prefetch its first weights while the one before it ends), and the best of a
sweep of configurations (output features and K a block, warps), microseconds a launch inside a CUDA
graph, cycling over enough copies of the weight to overrun L2. Each configuration's output is checked against the composed
pair's first. Results: notes/llm-decode-step.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mstar import knobs, ops
from mstar.bench.tools.graph_timer import graph_us
from mstar.ops.backends import pdl
from mstar.ops.backends import triton_fused_linear as fl

# label: (prologue, N out, K in, heads, head dim) -- heads only for the per-head prologues
PRODUCTS = {
    "0.8b": {"GDN in_proj": (fl.ADD_RMS, 8224, 1024, 0, 0), "attention qkv": (fl.ADD_RMS, 5120, 1024, 0, 0),
             "gate_up": (fl.ADD_RMS, 7168, 1024, 0, 0), "down": (fl.SILU_MUL, 1024, 3584, 0, 0),
             "GDN out_proj": (fl.GATED_RMS, 1024, 2048, 16, 128), "o_proj": (fl.SIGMOID_MUL, 1024, 2048, 8, 256)},
    "4b": {"GDN in_proj": (fl.ADD_RMS, 12352, 2560, 0, 0), "attention qkv": (fl.ADD_RMS, 10240, 2560, 0, 0),
           "gate_up": (fl.ADD_RMS, 18432, 2560, 0, 0), "down": (fl.SILU_MUL, 2560, 9216, 0, 0),
           "GDN out_proj": (fl.GATED_RMS, 2560, 4096, 32, 128), "o_proj": (fl.SIGMOID_MUL, 2560, 4096, 16, 256)},
}


def sweep(group: int):
    """Configurations tried (output features and K a block, warps)."""
    return [dict(BN=bn, BK=bk, num_warps=warps, num_stages=3) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024)
            for warps in (2, 4, 8) if bk >= group and bn * bk <= 16384]


def product_fns(pro: int, m: int, n: int, k: int, heads: int, d: int):
    """(composed(w), op output -> cuBLAS input builder, fused(w, config)) over fixed random inputs."""
    dev, dt = "cuda", torch.bfloat16
    if pro == fl.ADD_RMS:
        x, r = torch.randn(m, k, device=dev, dtype=dt), torch.randn(m, k, device=dev, dtype=dt)
        nw = torch.randn(k, device=dev, dtype=dt) * 0.1
        normed = ops.fused_add_rms_norm(x, r, nw, 1e-6, True)[0]
        return (lambda w: fl.composed_add_rms_norm_linear(x, r, nw, 1e-6, True, w)[0], normed,
                lambda w, c: fl.launch(pro, x, r, r.stride(0), 0, nw, w, 1e-6, True, config=c)[0])
    if pro == fl.SILU_MUL:
        gu = torch.randn(m, 2 * k, device=dev, dtype=dt)
        return (lambda w: fl.composed_silu_mul_linear(gu, w), ops.silu_and_mul(gu),
                lambda w, c: fl.launch(pro, gu[:, :k], gu[:, k:], gu.stride(0), 0, None, w, config=c)[0])
    o = torch.randn(m, heads, d, device=dev, dtype=dt)
    wide = torch.randn(m, heads, 2 * d, device=dev, dtype=dt)
    gate = wide[..., d:]  # a head-strided view, as the gates are read from their projections
    nw = torch.randn(d, device=dev, dtype=dt) * 0.1 + 1
    if pro == fl.GATED_RMS:
        return (lambda w: fl.composed_gated_rms_norm_linear(o, gate, nw, 1e-6, w),
                ops.gated_rms_norm(o, gate, nw, 1e-6).reshape(m, -1),
                lambda w, c: fl.launch(pro, o.view(m, -1), gate, gate.stride(0), gate.stride(1), nw, w, 1e-6,
                                       group=d, config=c)[0])
    return (lambda w: fl.composed_sigmoid_mul_linear(o, gate, w), ops.sigmoid_mul(o, gate).reshape(m, -1),
            lambda w, c: fl.launch(pro, o.view(m, -1), gate, gate.stride(0), gate.stride(1), None, w, group=d,
                                   config=c)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="rows of x (decode batch sizes)")
    ap.add_argument("--model", nargs="+", default=list(PRODUCTS), choices=list(PRODUCTS))
    ap.add_argument("--no-sweep", action="store_true", help="time the picked configuration only")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help="products whose label contains one of these (e.g. down out_proj o_proj); default: all")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "; us a launch")
    for model in args.model:
        for label, (pro, n, k, heads, d) in PRODUCTS[model].items():
            if args.only and not any(name in label for name in args.only):
                continue
            copies = min(16, max(2, int(200e6 // (n * k * 2))))  # > L2 together
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
            for m in args.rows:
                composed, op_out, fused = product_fns(pro, m, n, k, heads, d)
                ref = composed(weights[0]).float()
                t_comp = graph_us(composed, weights)
                t_blas = graph_us(lambda w: F.linear(op_out, w), weights)
                picked = fl.pick_config(pro, n, k)
                line = f"{model} {label:14s} M={m}: composed {t_comp:7.2f}  cuBLAS alone {t_blas:7.2f}"
                if picked is not None:
                    with knobs.override(MSTAR_PDL=False):
                        t_pick = graph_us(lambda w: fused(w, picked), weights)
                    line += f"  fused tuned {t_pick:7.2f} ({t_comp / t_pick:.2f}x)"
                    with knobs.override(MSTAR_PDL=True):
                        if pdl.enabled(weights[0]):
                            line += f"  with PDL {graph_us(lambda w: fused(w, picked), weights):7.2f}"
                if not args.no_sweep:
                    best, best_cfg, worst_err = float("inf"), None, 0.0
                    for cfg in sweep(max(d, 1)):
                        err = ((fused(weights[0], cfg).float() - ref).abs().max() / ref.abs().max()).item()
                        worst_err = max(worst_err, err)
                        if err > 0.02:
                            continue
                        t = graph_us(lambda w: fused(w, cfg), weights, reps=5)
                        if t < best:
                            best, best_cfg = t, cfg
                    short = {key: best_cfg[key] for key in ("BN", "BK", "num_warps")} if best_cfg else None
                    line += f"  best {best:7.2f} {short}  max rel err {worst_err:.1e}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
