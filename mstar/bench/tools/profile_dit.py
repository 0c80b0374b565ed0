"""Where a denoising transformer step's time goes (torch.profiler), on a preset's shape with random
weights: Wan (one forward of the DiT) or Cosmos3 (one generation-tower forward after cached prompt
keys and values, as the pipeline's step runs it).

    python -m mstar.bench.tools.profile_dit --model wan2.2-ti2v-5b --size 832x480 --frames 33 --rows 2
    python -m mstar.bench.tools.profile_dit --model cosmos3-edge --size 640x640 --frames 1 --rows 2 --graph

One forward over --rows rows (guidance's cond + uncond rows of one request: 2) of the given video
shape (--frames 1: an image), timed with CUDA events over --repeats forwards (with its achieved
TFLOP/s: mstar.bench.video.dit_flops / cosmos3_step_flops), then one profiled: the kernels by
device time, grouped into GEMMs, attention, normalisation / modulation, rotary and the remaining
elementwise kernels, and the top kernels by name. --graph replays the forward as a CUDA graph
(the pipelines' default: MSTAR_DIT_GRAPHS), so the launch gaps between its kernels go.
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
    ("float8 quantize", r"quantize_rows"),
)


def _group(name: str) -> str:
    for g, pat in GROUPS:
        if re.search(pat, name, re.IGNORECASE):
            return g
    return "other elementwise / copies"


def report(prof, cuda: bool, top: int) -> None:
    """Print a profile's kernels: total device time, the groups above, the `top` kernels."""
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
    for e in sorted(kernels, key=key, reverse=True)[:top]:
        print(f"  {key(e) / 1e3:8.2f} ms  x{e.count:<5} {e.key[:110]}", flush=True)


def _wan_step(args, dev, dtype):
    """(forward(), its FLOPs) of a Wan preset's DiT step at the shape (the text's keys / values made
    once before, as the pipeline does)."""
    from mstar.bench.video import dit_flops
    from mstar.models.layers.fp8 import apply_dit_fp8
    from mstar.models.wan.family import random_transformer
    from mstar.models.wan.presets import WanConfig, get
    from mstar.models.shape_graphs import ShapeGraphs
    cfg = WanConfig.from_dict(get(args.model).config)
    transformer = apply_dit_fp8(random_transformer(cfg.transformer, 0, dev, dtype))  # MSTAR_DIT_FP8
    c = transformer.config
    model = ShapeGraphs(transformer.forward_kv, max_graphs=1, enabled=args.graph, constant_from=2)
    w, h = (int(v) for v in args.size.split("x"))
    f = (args.frames - 1) // 4 + 1
    x = torch.randn(args.rows, c.in_channels, f, h // 16, w // 16, device=dev, dtype=dtype)
    t = torch.full((args.rows,), 500.0, device=dev)
    text_kv = transformer.text_kv(torch.randn(args.rows, args.text_len, c.text_dim, device=dev, dtype=dtype))
    return model, (lambda: model(x, t, *text_kv)), args.rows * dit_flops(c, args.frames, h, w, args.text_len)


def _cosmos3_step(args, dev, dtype):
    """(forward(), its FLOPs) of a Cosmos3 preset's generation tower at the shape, each row after
    a random prompt of --text-len tokens (its understanding K/V computed once, as the pipeline does)."""
    from mstar.bench.video import cosmos3_step_flops
    from mstar.models.cosmos3 import rope
    from mstar.models.cosmos3.family import _make_config, random_transformer
    from mstar.models.layers.fp8 import apply_dit_fp8
    from mstar.models.cosmos3.presets import get
    from mstar.models.cosmos3.transformer import JointKV
    from mstar.models.shape_graphs import ShapeGraphs
    cfg = _make_config(get(args.model))
    transformer = apply_dit_fp8(random_transformer(cfg.transformer, 0, dev, dtype))  # MSTAR_DIT_FP8
    c = transformer.config
    w, h = (int(v) for v in args.size.split("x"))
    T, pp = (args.frames - 1) // 4 + 1, c.latent_patch_size
    x = torch.randn(args.rows, c.latent_channel, T, h // 16, w // 16, device=dev, dtype=dtype)
    grid = (T, h // 16 // pp, w // 16 // pp)
    L = args.text_len
    ids = torch.randint(0, c.vocab_size, (L,)).tolist()
    und = transformer.understand([ids], [rope.rope_table(rope.text_positions(L, c), c)])[0]
    table = rope.rope_table(rope.vision_positions(grid, rope.vision_offset(L, c), 24.0, 4, c), c).to(dev)
    table = table.repeat(args.rows, 1)
    rows = torch.arange(args.rows, device=dev)
    t = torch.full((args.rows,), 500, device=dev, dtype=torch.long)
    if args.understand:  # the request's first stage: the understanding tower over its prompts (eager)
        prompts = [ids, ids[:max(1, L // 2)]]  # a guided request: the prompt and a shorter negative one
        tables = [rope.rope_table(rope.text_positions(len(q), c), c) for q in prompts]
        return _Eager(), (lambda: transformer.understand(prompts, tables)), 0.0
    joint = JointKV.of([und] * args.rows, grid[0] * grid[1] * grid[2])
    model = ShapeGraphs(transformer.generate_rows, max_graphs=1, enabled=args.graph, constant_from=2)
    flops = args.rows * cosmos3_step_flops(c, grid[0] * grid[1] * grid[2], L)
    return model, (lambda: model(x, t, rows, table, joint.kv_rows, joint.k, joint.v, joint.prompt_lens)), flops


class _Eager:
    captures = 0  # what main reads of a ShapeGraphs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mstar.bench.tools.profile_dit", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="wan2.2-ti2v-5b", help="a Wan or Cosmos3 preset")
    p.add_argument("--size", default="832x480", help="WxH of the video or image")
    p.add_argument("--frames", type=int, default=33, help="video frames (1: an image)")
    p.add_argument("--rows", type=int, default=2, help="transformer rows (2: one request with guidance)")
    p.add_argument("--text-len", type=int, default=None,
                   help="text tokens per row (Wan: the pipeline pads to 512; Cosmos3: the prompt's tokens, "
                        "default 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--graph", action="store_true", help="replay the forward as a CUDA graph (ShapeGraphs)")
    p.add_argument("--understand", action="store_true",
                   help="Cosmos3: profile the understanding tower over a guided request's two prompts (--text-len "
                        "and half of it) instead of the step")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    args = p.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    from mstar.models import registry
    try:
        family = registry.family_of(args.model).name
    except ValueError as e:
        p.error(str(e))
    if family not in ("wan", "cosmos3"):
        p.error(f"{args.model!r} is a {family} model, not a Wan or Cosmos3 preset")
    if args.text_len is None:
        args.text_len = 512 if family == "wan" else 256
    if args.understand and family != "cosmos3":
        p.error("--understand profiles Cosmos3's understanding tower")
    model, forward, flops = (_wan_step if family == "wan" else _cosmos3_step)(args, dev, dtype)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):  # a graph: eager, capture, replay
        forward()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        forward()
    sync()
    sec = (time.perf_counter() - t0) / args.repeats
    what = (f"understanding tower, prompts of {args.text_len} and {max(1, args.text_len // 2)} tokens"
            if args.understand else f"{args.size}x{args.frames} rows {args.rows}")
    print(f"{args.model} {what}{' (CUDA graph)' if model.captures else ''}: {1e3 * sec:.2f} ms a forward"
          + (f", {flops / sec / 1e12:.1f} TFLOP/s" if flops else ""), flush=True)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        forward()
        sync()
    report(prof, cuda, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
