"""The one-row SwiGLU MLP's persistent kernel (ops/backends/triton_swiglu_mlp.py) against the two
fused-linear kernels it replaces, at the Qwen3.5 0.8B / 4B MLPs, on one CUDA GPU, random bf16 weights:

    python -m mstar.bench.tools.probe_swiglu_mlp [--model 0.8b 4b] [--no-sweep]

Per model: the two kernels (add + RMSNorm + gate_up, then SiLU-and-mul + down), the persistent
kernel with the configuration the backend takes (its TUNED table), and the best of a sweep of
configurations (programs per SM, intermediate features and K a block in the first product, output
rows a block in the second, L2 prefetch of the second product's first weights before the
barrier), microseconds an MLP inside a CUDA graph cycling over enough copies of the weights to overrun
L2. Each configuration's output is checked against the two kernels'. The best is printed as a TUNED
entry. Results: notes/llm-decode-step.md.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from mstar.bench.tools.graph_timer import graph_us
from mstar.ops.backends import triton_fused_linear as fl
from mstar.ops.backends import triton_swiglu_mlp as mlp

MODELS = {"0.8b": (1024, 3584), "4b": (2560, 9216)}  # (hidden, intermediate)


def sweep(hidden: int, inter: int):
    for per_sm, bj, bk1, bn, warps, pf in itertools.product((1, 2), (4, 8), (512, 1024), (4, 8), (8,), (0, 1)):
        prefetch = min(inter // 2, max(64, 16384 // bn)) if pf else 0
        yield (per_sm, bj, min(bk1, hidden), bn, 1024, warps, 1 << (prefetch.bit_length() - 1) if prefetch else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--no-sweep", action="store_true", help="time the picked configuration only")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "; us an MLP")
    bf = torch.bfloat16
    for model in args.model:
        hidden, inter = MODELS[model]
        copies = max(3, int(200e6 // (6 * hidden * inter)) + 1)  # > L2 together
        layers = [(torch.randn(2 * inter, hidden, device="cuda", dtype=bf) * hidden ** -0.5,
                   torch.randn(hidden, inter, device="cuda", dtype=bf) * inter ** -0.5) for _ in range(copies)]
        x, res = torch.randn(1, hidden, device="cuda", dtype=bf), torch.randn(1, hidden, device="cuda", dtype=bf)
        nw = torch.randn(hidden, device="cuda", dtype=bf) * 0.1

        def two_kernels(w):
            gate_up, _ = fl.add_rms_norm_linear(x, res, nw, 1e-6, True, w[0])
            return fl.silu_mul_linear(gate_up, w[1])

        def persistent(w, cfg):
            return mlp.launch(x, res, nw, 1e-6, True, w[0], w[1], cfg)[0]

        ref = two_kernels(layers[0]).float()
        mb = 6 * hidden * inter / 1e6
        t_two = graph_us(two_kernels, layers)
        line = f"{model}: {mb:.1f} MB; two kernels {t_two:7.2f} ({mb / t_two:.2f} TB/s)"
        picked = mlp.pick_config(hidden, inter)
        if picked is not None:
            t = graph_us(lambda w: persistent(w, picked), layers)
            line += f"  persistent tuned {t:7.2f} ({mb / t:.2f} TB/s, {t_two / t:.2f}x)"
        print(line, flush=True)
        if args.no_sweep:
            continue
        rows = []
        for cfg in sweep(hidden, inter):
            err = ((persistent(layers[0], cfg).float() - ref).abs().max() / ref.abs().max()).item()
            if err > 0.02:
                print(f"  {cfg}: max rel err {err:.1e}, skipped", flush=True)
                continue
            rows.append((graph_us(lambda w: persistent(w, cfg), layers, reps=5), cfg, err))
        rows.sort()
        for t, cfg, err in rows[:6]:
            print(f"  {cfg}: {t:7.2f} ({mb / t:.2f} TB/s, {t_two / t:.2f}x)  max rel err {err:.1e}", flush=True)
        print(f"TUNED ({hidden}, {inter}): {rows[0][1]}", flush=True)


if __name__ == "__main__":
    main()
