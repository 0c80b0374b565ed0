"""The Wan2.2 VAE's decode (Wan and Cosmos3 videos and images) in each dtype and layout, on the
published shape with random weights.

    python -m mstar.bench.tools.profile_vae --size 832x480 --frames 33 --dtypes float32 bfloat16 --channels-last 0 1

Every combination (the MSTAR_VAE_DTYPE and MSTAR_VAE_CHANNELS_LAST knobs) decodes the same random
latents: one decode to warm up, then --repeats timed ones. Each line gives the decode's seconds,
the convolutions' achieved TFLOP/s (2 x weight[0].numel() x output elements, counted on the
warm-up), the peak memory, and the video's difference from the first combination's (max abs over
[-1, 1], relative L2). The bfloat16 VAE has the float32 one's weights, rounded. --profile prints
the kernel groups of one decode of each combination; --out appends one JSON record per
combination.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.nn.functional as F


def count_conv_flops(fn) -> float:
    """fn() run with every F.conv3d counted: 2 x (inputs per output) x output elements."""
    plain, total = F.conv3d, [0.0]

    def counted(x, w, *args, **kwargs):
        out = plain(x, w, *args, **kwargs)
        total[0] += 2.0 * w[0].numel() * out.numel()
        return out

    F.conv3d = counted
    try:
        fn()
    finally:
        F.conv3d = plain
    return total[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mstar.bench.tools.profile_vae", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="832x480", help="WxH of the video")
    p.add_argument("--frames", type=int, default=33, help="video frames (1 + 4k; 1: an image)")
    p.add_argument("--batch", type=int, default=1, help="videos decoded together")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--channels-last", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    p.add_argument("--repeats", type=int, default=2, help="timed decodes per combination")
    p.add_argument("--profile", action="store_true", help="print the kernel groups of one decode of each")
    p.add_argument("--top", type=int, default=12, help="kernels listed with --profile")
    p.add_argument("--out", default=None, help="append one JSON record per combination here")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    p.add_argument("--tiny", action="store_true", help="the tiny test VAE (a CPU check of the tool)")
    args = p.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"

    from mstar.bench.serve import git_commit
    from mstar.bench.tools.profile_dit import report
    from mstar.models.wan.family import random_vae
    from mstar.models.wan.vae_config import TINY_WAN22_TI2V_VAE, WAN22_TI2V_5B_VAE
    raw = TINY_WAN22_TI2V_VAE if args.tiny else WAN22_TI2V_5B_VAE
    base = random_vae(raw, 0, dev, torch.float32)
    cfg = base.config
    w, h = (int(v) for v in args.size.split("x"))
    s = cfg.scale_factor_spatial
    if w % s or h % s or (args.frames - 1) % cfg.scale_factor_temporal:
        p.error(f"--size must be multiples of {s} and --frames 1 + {cfg.scale_factor_temporal}k")
    gen = torch.Generator(device="cpu").manual_seed(1)
    z = torch.randn(args.batch, cfg.z_dim, 1 + (args.frames - 1) // cfg.scale_factor_temporal, h // s, w // s,
                    generator=gen).to(dev)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    reference = None
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        vae = base if dtype == torch.float32 else random_vae(raw, 0, dev, torch.float32).to(dtype)
        for cl in args.channels_last:
            vae.set_channels_last(bool(cl))
            name = f"{dtype_name} channels_last={cl}"
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            with torch.inference_mode():
                flops = count_conv_flops(lambda: vae.decode(z.to(dtype)))
                sync()
                t0 = time.perf_counter()
                for _ in range(args.repeats):
                    video = vae.decode(z.to(dtype))
                sync()
            sec = (time.perf_counter() - t0) / args.repeats
            video = video.float()
            if reference is None:
                reference = video
            diff = (video - reference).abs().max().item()
            rel = ((video - reference).norm() / reference.norm().clamp_min(1e-30)).item()
            peak = torch.cuda.max_memory_allocated(dev) / 2 ** 30 if cuda else None
            print(f"{name}: {sec:.3f} s a decode, {flops / sec / 1e12:.1f} conv TFLOP/s"
                  f"{f', peak {peak:.1f} GiB' if peak is not None else ''}; vs first: max {diff:.3g}, rel {rel:.3g}",
                  flush=True)
            if args.profile:
                from torch.profiler import ProfilerActivity, profile
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with torch.inference_mode(), profile(activities=acts) as prof:
                    vae.decode(z.to(dtype))
                    sync()
                report(prof, cuda, args.top)
            if args.out:
                rec = {"bench": "vae_decode", "date": datetime.date.today().isoformat(), "commit": git_commit(),
                       "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "size": args.size,
                       "frames": args.frames, "batch": args.batch, "dtype": dtype_name, "channels_last": bool(cl),
                       "decode_s": round(sec, 4),
                       "conv_tflops": round(flops / sec / 1e12, 1), "conv_tflop": round(flops / 1e12, 2),
                       "peak_gib": round(peak, 2) if peak is not None else None,
                       "max_abs_vs_first": diff, "rel_vs_first": rel}
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
