"""Where a Wan transformer step's time goes (torch.profiler), on a preset's shape with random weights.

    python -m mstar.bench.tools.profile_dit --model wan2.2-ti2v-5b --size 832x480 --frames 33 --rows 2

One denoising forward over --rows rows (guidance's cond + uncond rows of one request: 2) of the
given video shape, timed with CUDA events over --repeats forwards (with its achieved TFLOP/s:
mstar.bench.video.dit_flops), then one profiled: the kernels by device time, grouped into GEMMs,
attention, normalisation / modulation, rotary and the remaining elementwise kernels, and the top
kernels by name. --graph replays the forward as a CUDA graph (the pipeline's default:
MSTAR_DIT_GRAPHS), so the launch gaps between its kernels go.
"""

from __future__ import annotations

import argparse
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

GROUPS = (  # (group, pattern over the kernel's name), first match wins
    ("attention", r"flash|fmha|attention|cudnn.*sdpa|sdpa|cudnn_generated_fort_native_sdpa"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|addmm|^aten::mm$|bmm"),
    ("norm / modulation", r"modulat|gated_residual|rms|layer_norm|LayerNorm"),
    ("rotary", r"rotary|rope"),
)


def _group(name: str) -> str:
    for g, pat in GROUPS:
        if re.search(pat, name, re.IGNORECASE):
            return g
    return "other elementwise / copies"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mstar.bench.tools.profile_dit", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="wan2.2-ti2v-5b", help="a Wan preset")
    p.add_argument("--size", default="832x480", help="WxH of the video")
    p.add_argument("--frames", type=int, default=33, help="video frames")
    p.add_argument("--rows", type=int, default=2, help="transformer rows (2: one request with guidance)")
    p.add_argument("--text-len", type=int, default=512, help="text tokens per row (the pipeline pads to 512)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--graph", action="store_true", help="replay the forward as a CUDA graph (ShapeGraphs)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    args = p.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    from mstar.bench.video import dit_flops
    from mstar.models.wan.family import random_transformer
    from mstar.models.wan.presets import WanConfig, get
    preset = get(args.model)
    if preset is None:
        p.error(f"{args.model!r} is not a Wan preset")
    cfg = WanConfig.from_dict(preset.config)
    from mstar.models.shape_graphs import ShapeGraphs
    transformer = random_transformer(cfg.transformer, 0, dev, dtype)
    c = transformer.config
    model = ShapeGraphs(transformer, max_graphs=1, enabled=args.graph)
    w, h = (int(v) for v in args.size.split("x"))
    f = (args.frames - 1) // 4 + 1
    x = torch.randn(args.rows, c.in_channels, f, h // 16, w // 16, device=dev, dtype=dtype)
    t = torch.full((args.rows,), 500.0, device=dev)
    text = torch.randn(args.rows, args.text_len, c.text_dim, device=dev, dtype=dtype)
    flops = args.rows * dit_flops(c, args.frames, h, w, args.text_len)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):  # a graph: eager, capture, replay
        model(x, t, text)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        model(x, t, text)
    sync()
    sec = (time.perf_counter() - t0) / args.repeats
    print(f"{args.model} {args.size}x{args.frames} rows {args.rows}{' (CUDA graph)' if model.captures else ''}: "
          f"{1e3 * sec:.1f} ms a forward, "
          f"{flops / sec / 1e12:.1f} TFLOP/s", flush=True)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        model(x, t, text)
        sync()
    kernels = [e for e in prof.key_averages() if (e.device_time_total if cuda else e.self_cpu_time_total) > 0
               and (not cuda or e.device_type.name == "CUDA")]
    key = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(key(e) for e in kernels) or 1.0
    groups: dict[str, float] = {}
    for e in kernels:
        groups[_group(e.key)] = groups.get(_group(e.key), 0.0) + key(e)
    print(f"device time {total / 1e3:.1f} ms in {sum(e.count for e in kernels)} kernels", flush=True)
    for g, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:<28} {us / 1e3:8.2f} ms  {100 * us / total:5.1f}%", flush=True)
    for e in sorted(kernels, key=key, reverse=True)[:args.top]:
        print(f"  {key(e) / 1e3:8.2f} ms  x{e.count:<5} {e.key[:110]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
