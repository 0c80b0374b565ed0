"""The decode step's matmuls, one by one: cuBLAS (F.linear) against the Triton skinny kernel
(mstar/ops/backends/triton_linear.py), tuned and at every tile of its list, at the shapes of a
preset (its weight shapes, sharded as tensor parallelism shards them) and a few row counts.

    python notes/tools/gemm_bench.py --model qwen3.5-4b --rows 1 8 16
    python notes/tools/gemm_bench.py --model qwen3.5-9b --tp 2 --rows 8

Each time is a CUDA-graph replay median (triton.testing.do_bench_cudagraph: no launch cost,
as in the decode graphs); TB/s is the weight's bytes over it. The last lines weigh each shape
by how often a decode step runs it: the step's matmul time under each."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ROW_PARALLEL = ("out_proj", "o_proj", "down_proj")  # input features split over the ranks


def decode_shapes(model: str, tp: int) -> Counter:
    """{(name, N, K): count per decode step} of the preset's linears and LM head, at tp."""
    from mstar.models import presets
    from mstar.models.layers import FusedLinear, Linear
    from mstar.models.qwen3_5 import Qwen3_5ForCausalLM
    c = presets.make_config(presets.get(model))
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    with torch.device("meta"):
        m = Qwen3_5ForCausalLM(c)
    out: Counter = Counter()
    for name, mod in m.named_modules():
        if isinstance(mod, (Linear, FusedLinear)) and not name.endswith("lm_head"):  # the head: below
            n, k = mod.weight.shape
            short = name.split(".")[-1]
            n, k = (n, k // tp) if short in ROW_PARALLEL else (n // tp, k)
            out[(short, n, k)] += 1
    v, h = m.lm_head_weight().shape
    out[("lm_head", -(-v // tp), h)] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-4b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--no-sweep", action="store_true", help="only cuBLAS and the tuned kernel")
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench_cudagraph

    from mstar.ops.backends import triton_linear as tli
    shapes = decode_shapes(args.model, args.tp)
    torch.manual_seed(0)
    dev = "cuda"
    totals: dict[tuple[int, str], float] = {}
    print(f"{args.model} tp={args.tp}: us (TB/s of the weight)")
    print(f"{'shape':<24}{'rows':>5}{'cuBLAS':>16}{'tuned':>16}{'best tile':>16}  best (BLOCK_N, BLOCK_K, warps, stages)")
    for (name, n, k), count in sorted(shapes.items()):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        gb = w.numel() * 2 / 1e9
        for rows in args.rows:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, w)
            t_blas = do_bench_cudagraph(lambda: F.linear(x, w)) * 1e3
            y = tli.linear(x, w, None)  # tunes on first use
            err = float((y.float() - ref.float()).norm() / ref.float().norm())
            t_tuned = do_bench_cudagraph(lambda: tli.linear(x, w, None)) * 1e3
            best = (float("inf"), None)
            if not args.no_sweep:
                for cfg in tli._CONFIGS:
                    meta = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                    try:
                        t = do_bench_cudagraph(lambda: tli.skinny_linear(x, w, None, meta)) * 1e3
                    except Exception as e:  # noqa: BLE001 -- a tile that does not fit: say so, go on
                        print(f"   {meta}: {type(e).__name__}")
                        continue
                    best = min(best, (t, (meta["BLOCK_N"], meta["BLOCK_K"], cfg.num_warps, cfg.num_stages)),
                               key=lambda b: b[0])
            for key, t in (("cuBLAS", t_blas), ("tuned", t_tuned), ("best", best[0])):
                totals[(rows, key)] = totals.get((rows, key), 0.0) + count * t

            def cell(t):
                return f"{t:7.1f} ({gb / t * 1e3:4.2f})" if t < float("inf") else "-"
            print(f"{name + f' {n}x{k}':<24}{rows:>5}{cell(t_blas):>16}{cell(t_tuned):>16}{cell(best[0]):>16}  "
                  f"{best[1]} x{count} err {err:.1e}")
    for rows in args.rows:
        b, t, s = totals[(rows, "cuBLAS")], totals[(rows, "tuned")], totals[(rows, "best")]
        print(f"step's matmuls at {rows} rows: cuBLAS {b:8.1f} us, tuned {t:8.1f} us ({b / t:.2f}x), "
              f"best tiles {s:8.1f} us ({b / s:.2f}x)")
    del triton


if __name__ == "__main__":
    main()
