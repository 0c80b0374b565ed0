"""Does capturing the prefill graphs slow the decode graphs' replay? (GPU)

Served with --prefill-graphs auto, ITL p50 was 0.12-0.15 ms higher at every concurrency
(notes/gpu-2026-11-30-prefill-graphs.md). This times, on one engine, the replay of a captured decode graph
and the eager LM head + argmax of an overlapped decode step, before and after a
PrefillGraphRunner is captured beside it (and again after it is freed):

    python -m mstar.bench.tools.pg_decode_probe --model qwen3.5-0.8b --batch 8 32 128
    python -m mstar.bench.tools.pg_decode_probe --model whisper-large-v3 --batch 1 4 16 --decode-only

--decode-only times the decode graphs alone (any model, Whisper too): is a decode step's time
on the device (the replay) or on the host (the rest of the step)?

--burst runs 1.5 s of large bf16 GEMMs (no capture) between the first two measurements, then
captures the prefill graphs: does the slowdown come with heavy work (clocks) or with capture?
(Measured 2026-11-30, notes/gpu-2026-11-30-gate-knobs-whisper.md: not clocks; the replays stay ~124 us slower after capture, even once freed.)

--kernels N profiles 20 replays of the first batch size and prints the graph's kernels per
replay, their summed device time against the replay's span (idle gaps between kernels) and the
N most expensive: where a decode step's device time goes, and, measured again after the prefill
graphs are captured, whether kernels got slower or the gaps between them grew.

--pg-sizes K captures only the K smallest prefill graph sizes: does the slowdown grow with the
number of captured graphs? (Measured 2026-11-30: no. With one size, 25 graphs, the decode graph's kernels
took the same time and the gaps between them grew from 0.12 to 0.49 us per kernel.)

--recapture, after the prefill graphs: captures the decode graphs again and measures, then
captures one small unrelated graph and measures again. Fast again after recapture means the
capture order is the fix (decode graphs last); slow again after the small graph means the
most recently captured graph is the fast one.

--limits prints the context's CUDA limits (stack size, printf FIFO, malloc heap) before and
after the prefill graphs are captured, and if the stack size grew, sets it back and measures
again: is the slowdown the per-thread stack (local memory) the driver grew for some kernel?

--bisect captures, one at a time and measuring after each, graphs of growing scope: one bf16
GEMM of 16 rows, then prefill segments 0, 1 and 4 at 16 tokens (segment k: layer k-1's output
projection, norm and MLP, then layer k's norm and input projections): which capture flips it?
(Measured 2026-11-30, 5b190ae: the 16-row GEMM graph alone flips it, 1109 -> 1233 us. It was captured like the
prefill graphs: first use on one side stream, capture on torch.cuda.graph's default capture
stream; the decode graphs, which do not flip it, use one stream for both.)
--bisect-stream same|default: with `same`, the GEMM's first use and capture share one stream
(the decode graphs' way); run each in a fresh process (the slow state persists).

(Measured at b10741e, notes/gpu-2026-11-30-tp2-9b.md: `same` flips it as well, 1110 -> 1238 us: not the stream.)
--bisect-pool: a 16-row GEMM graph in the decode graphs' pool, then an elementwise graph and a
GEMM graph each in a pool of its own, measuring after each: is it the new memory pool?
(Measured at 0bee902: no. Each of the three flips it, the elementwise one included: 1108 -> 1231 us.)
--bisect-streams: an op on a fresh stream (no capture), a one-kernel graph captured on the decode
graphs' own stream, then one on a fresh stream: is it the streams? (The engine
captures its prefill graphs on the decode graphs' stream: --engine-pg measures that.)
--bisect-count N: N one-kernel graphs, one by one (the engine's max_num_seqs is the largest
--batch: few decode sizes with --batch 8): does the flip come at some total number of graphs?

--engine-pg builds the engine with its own prefill graphs (in the engine's capture order) and
times its decode graphs: the served configuration.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch

from mstar.runtime.engine.config import EngineConfig
from mstar.models.shape_graphs import capture_after_first_use
from mstar.runtime.engine.engine_core import EngineCore
from mstar.runtime.graphs.prefill_graphs import PrefillGraphRunner, prefill_sizes


_LIMITS = {"stack": 0, "printf_fifo": 1, "malloc_heap": 2}


def _cudart():
    """The CUDA runtime library (the primary context's limits are shared by every runtime in the process)."""
    import ctypes
    import glob
    import site
    roots = [os.path.dirname(torch.__file__)] + site.getsitepackages()
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True)):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return ctypes.CDLL("libcudart.so")


def limits(rt) -> dict[str, int]:
    import ctypes
    out = {}
    for name, code in _LIMITS.items():
        v = ctypes.c_size_t(0)
        rc = rt.cudaDeviceGetLimit(ctypes.byref(v), code)
        out[name] = v.value if rc == 0 else -rc
    return out


def _capture(fn, keep: list, same_stream: bool = False, pool=None) -> None:
    """First use on a new side stream, then capture fn into a graph kept alive in `keep` (on that
    stream with same_stream, else on torch.cuda.graph's default capture stream)."""
    keep.append(capture_after_first_use(fn, torch.cuda.Stream(), pool, on_stream=same_stream)[0])
    torch.cuda.synchronize()


def bisect_captures(core, batches, same_stream: bool = False) -> None:
    keep: list = []
    w = core.model.lm_head_weight()
    x = torch.randn(16, w.shape[1], dtype=w.dtype, device=w.device)
    m = torch.randn(w.shape[1], 4096, dtype=w.dtype, device=w.device)
    with torch.inference_mode():
        _capture(lambda: x @ m, keep, same_stream)
        measure(core, batches, "after a 16-row GEMM graph")
        pg = PrefillGraphRunner(core.model, device=core.device, dtype=core.dtype, max_tokens=16, capture=False)
        for k in (0, 1, 4):
            _capture(lambda k=k: pg._segment(k, 16), keep, same_stream)
            measure(core, batches, f"after segment {k} captured")


def bisect_pools(core, batches) -> None:
    """The capture stream does not matter (same and default both flip it, b10741e). Is it
    the graph's own memory pool? A 16-row GEMM graph in the decode graphs' pool, then an
    elementwise-only graph in a pool of its own, then the GEMM in a pool of its own."""
    keep: list = []
    w = core.model.lm_head_weight()
    x = torch.randn(16, w.shape[1], dtype=w.dtype, device=w.device)
    m = torch.randn(w.shape[1], 4096, dtype=w.dtype, device=w.device)
    with torch.inference_mode():
        _capture(lambda: x @ m, keep, True, pool=core.graphs.pool)
        measure(core, batches, "GEMM graph, decode pool")
        _capture(lambda: x * 2 + 1, keep, True)
        measure(core, batches, "elementwise graph, own pool")
        _capture(lambda: x @ m, keep, True)
        measure(core, batches, "GEMM graph, own pool")


def bisect_streams(core, batches) -> None:
    """Is it the streams? An elementwise op on a fresh stream (no capture), then an elementwise
    graph captured on the decode graphs' own capture stream, then one on a fresh stream (the
    control that flipped it in --bisect-pool)."""
    keep: list = []
    x = torch.randn(16, 256, device=core.device)
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.mul_(1.0)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        measure(core, batches, "op on a fresh stream")
        own = core.graphs.stream
        own.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(own):
            x.mul_(1.0)
        torch.cuda.current_stream().wait_stream(own)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=own):
            x.mul_(1.0)
        keep.append(g)
        torch.cuda.synchronize()
        measure(core, batches, "graph on the decode stream")
        _capture(lambda: x.mul_(1.0), keep, True)
        measure(core, batches, "graph on a fresh stream")


def bisect_count(core, batches, n: int) -> None:
    """Any later graph flips it, whatever its stream, pool or kernels (0bee902). Is it how many
    graphs the process holds? Capture n one-kernel graphs one by one, measuring after each: with
    an engine of few decode sizes (--batch 8: 4 graphs), a flip only past some total count says
    count; a flip at the first says any graph captured apart from the decode runner's."""
    keep: list = []
    x = torch.randn(16, 256, device=core.device)
    with torch.inference_mode():
        for i in range(n):
            _capture(lambda: x.mul_(1.0), keep, True)
            measure(core, batches, f"+{i + 1} graphs ({len(core.graphs.graphs) + i + 1} in all)")


def kernels(core, b: int, label: str, top: int) -> None:
    """The decode graph's kernels for batch `b`, from the profiler (20 replays)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    g = core.graphs.graphs[core.graphs.bucket(b)]
    reps = 20
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
            torch.cuda.synchronize()  # replays apart: each one's span is its own
    ks = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not ks:
        print(f"{label}: the profiler saw no kernels", flush=True)
        return
    per = len(ks) // reps
    busy = sum(e.time_range.elapsed_us() for e in ks) / reps
    spans = [ks[i + per - 1].time_range.end - ks[i].time_range.start for i in range(0, per * reps, per)]
    span = sorted(spans)[len(spans) // 2]
    print(f"{label:<28} batch {b:>4}: {per} kernels per replay, busy {busy:8.1f} us, span {span:8.1f} us "
          f"(gaps {span - busy:7.1f} us, {(span - busy) / max(per, 1):.2f} us per kernel)", flush=True)
    by: dict[str, list[float]] = {}
    for e in ks:
        by.setdefault(e.name, []).append(e.time_range.elapsed_us())
    rows = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, ts in rows:
        print(f"    {sum(ts) / reps:8.1f} us/replay  {len(ts) / reps:5.1f}x  {sum(ts) / len(ts):7.2f} us each  "
              f"{name[:110]}", flush=True)
    # the idle gap before each kernel (its start - the previous kernel's end, within a replay), by
    # (previous kernel, kernel): are the gaps spread evenly or do some transitions carry them?
    gaps: dict[tuple[str, str], list[float]] = {}
    for i in range(0, per * reps, per):
        for a, b in zip(ks[i:i + per - 1], ks[i + 1:i + per]):
            gaps.setdefault((a.name[:50], b.name[:50]), []).append(b.time_range.start - a.time_range.end)
    print("    gaps by transition (us per replay, count per replay, mean us): previous kernel -> kernel", flush=True)
    for (a, b), g in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"    {sum(g) / reps:8.1f} {len(g) / reps:6.1f}x {sum(g) / len(g):6.2f}  {a} -> {b}", flush=True)


def _time(fn, iters: int) -> float:
    """Median of 5 runs of `iters` calls, in microseconds per call (CUDA events)."""
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / iters)
    return sorted(out)[2]


def measure(core, batches, label: str) -> None:
    w = core.model.lm_head_weight()
    hidden = {b: torch.randn(b, w.shape[1], dtype=w.dtype, device=w.device) for b in batches}
    for b in batches:
        g = core.graphs.graphs[core.graphs.bucket(b)]
        replay = _time(g.replay, 200)
        head = _time(lambda h=hidden[b]: torch.nn.functional.linear(h, w).argmax(dim=-1), 200)
        print(f"{label:<28} batch {b:>4}: decode graph replay {replay:8.1f} us   head + argmax {head:7.1f} us",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-0.8b", help="preset (random weights)")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32, 128], help="decode batch sizes to time")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the prefill graphs' largest bucket")
    p.add_argument("--decode-only", action="store_true", help="time the decode graphs only (no prefill graphs)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="profile the first batch size's decode graph: kernels, gaps and the N most expensive")
    p.add_argument("--pg-sizes", type=int, default=0, metavar="K",
                   help="capture only the K smallest prefill graph sizes (default: all)")
    p.add_argument("--bisect", action="store_true",
                   help="capture a 16-row GEMM, then prefill segments 0, 1, 4 one by one, measuring after each")
    p.add_argument("--bisect-stream", choices=["default", "same"], default="default",
                   help="--bisect: capture on torch's default capture stream, or on the first-use stream")
    p.add_argument("--bisect-pool", action="store_true",
                   help="a GEMM graph in the decode graphs' pool, an elementwise graph, a GEMM graph in its own pool")
    p.add_argument("--bisect-streams", action="store_true",
                   help="an op on a fresh stream, a graph on the decode graphs' stream, one on a fresh stream")
    p.add_argument("--bisect-count", type=int, default=0, metavar="N",
                   help="capture N one-kernel graphs one by one, measuring after each (graph count threshold?)")
    p.add_argument("--limits", action="store_true",
                   help="print CUDA limits before / after the prefill graphs; restore a grown stack size")
    p.add_argument("--engine-pg", action="store_true",
                   help="the engine captures its prefill graphs itself (its order); time its decode graphs")
    p.add_argument("--recapture", action="store_true",
                   help="after the prefill graphs: recapture the decode graphs, then one small graph; measure each")
    p.add_argument("--burst", action="store_true",
                   help="before capturing the prefill graphs, run 1.5 s of large GEMMs and measure again")
    a = p.parse_args()
    core = EngineCore(EngineConfig(model=a.model, random_weights=True, device="cuda", dtype="bfloat16",
                                   max_num_seqs=max(a.batch), warmup="off",
                                   prefill_graphs="auto" if a.engine_pg else "off"))
    if a.engine_pg:
        measure(core, a.batch, "engine with prefill graphs")
        if a.kernels:
            kernels(core, a.batch[0], "engine with prefill graphs", 5)
        return
    measure(core, a.batch, "decode graphs only")
    if a.kernels:
        kernels(core, a.batch[0], "decode graphs only", a.kernels)
    if a.decode_only:
        return
    if a.burst:
        x = torch.randn(8192, 4096, dtype=torch.bfloat16, device=core.device)
        w = torch.randn(4096, 4096, dtype=torch.bfloat16, device=core.device)
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        while True:
            for _ in range(20):
                x @ w
            ev1.record()
            ev1.synchronize()
            if ev0.elapsed_time(ev1) > 1500:
                break
        measure(core, a.batch, "after a GEMM burst")
    if a.bisect:
        bisect_captures(core, a.batch, a.bisect_stream == "same")
        return
    if a.bisect_pool:
        bisect_pools(core, a.batch)
        return
    if a.bisect_streams:
        bisect_streams(core, a.batch)
        return
    if a.bisect_count:
        bisect_count(core, a.batch, a.bisect_count)
        return
    rt = _cudart() if a.limits else None
    if rt is not None:
        before = limits(rt)
        print(f"limits before the prefill graphs: {before}", flush=True)
    sizes = prefill_sizes(a.max_num_batched_tokens)
    top = sizes[min(a.pg_sizes, len(sizes)) - 1] if a.pg_sizes > 0 else sizes[-1]
    pg = PrefillGraphRunner(core.model, device=core.device, dtype=core.dtype, max_tokens=top, capture=True)
    print(f"prefill graphs: {len(pg.sizes)} sizes x {len(pg.layers) + 1} segments, {pg.capture_s:.1f} s, "
          f"{pg.graph_bytes / 2 ** 20:.0f} MiB", flush=True)
    measure(core, a.batch, "with prefill graphs")
    if rt is not None:
        after = limits(rt)
        print(f"limits after the prefill graphs: {after}", flush=True)
        if after["stack"] > before["stack"] > 0:
            import ctypes
            rc = rt.cudaDeviceSetLimit(_LIMITS["stack"], ctypes.c_size_t(before["stack"]))
            print(f"stack size set back to {before['stack']} (rc {rc}): now {limits(rt)}", flush=True)
            measure(core, a.batch, "stack size set back")
    if a.kernels:
        kernels(core, a.batch[0], "with prefill graphs", a.kernels)
    if a.recapture:
        core.graphs.capture()
        measure(core, a.batch, "decode graphs recaptured")
        if a.kernels:
            kernels(core, a.batch[0], "decode graphs recaptured", 5)
        x = torch.zeros(1024, device=core.device)
        small = torch.cuda.CUDAGraph()
        with torch.cuda.graph(small):
            x.add_(1.0)
        small.replay()
        measure(core, a.batch, "then a small graph captured")
    del pg
    gc.collect()
    torch.cuda.synchronize()
    measure(core, a.batch, "prefill graphs freed")
    torch.cuda.empty_cache()  # their memory unmapped too (the caching allocator keeps it otherwise)
    measure(core, a.batch, "freed + empty_cache")


if __name__ == "__main__":
    main()
