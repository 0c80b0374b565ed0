"""Where one engine step's time goes, kernel by kernel (torch.profiler).

Builds an engine on a preset with random weights, warms it up, then profiles (a) one prefill
step of --rows prompts of --prompt-len tokens and (b) --decode-steps decode steps (timed once
without the profiler first), and prints for each the step's wall time and the top ops by device
time and by host time. Answers
"why does a 2048-token prefill step take 450 ms" without guessing.

    python -m mstar.bench.tools.profile_step --model qwen3.5-0.8b --rows 8 --prompt-len 256 [--decode-graphs off]
    python -m mstar.bench.tools.profile_step --model qwen3.5-9b --tp 2 --rows 8 --decode-graphs auto --async-output auto

With --tp N the profile is rank 0's (the followers run the same kernels). Each profile also
prints the device time by kind of kernel (GEMM, all-reduce / gather, GDN, attention, norm,
other) per step, and the device's busy time against the span from the first kernel to the
last: what a decode step at TP2 spends on its GEMMs, its collectives and its gaps.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mstar import LLM
from mstar.runtime.engine.request import EngineRequest, SamplingParams


def _requests(n: int, length: int, vocab: int, tag: str, max_tokens: int) -> list[EngineRequest]:
    rng = random.Random(len(tag))
    return [EngineRequest(f"{tag}{i}", [rng.randrange(vocab) for _ in range(length)],
                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for i in range(n)]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _table(prof, key: str, n: int) -> str:
    return prof.key_averages().table(sort_by=key, row_limit=n, max_name_column_width=70)


KINDS = (  # (kind, substrings of the kernel name, lower case), first match wins
    ("all-reduce / gather", ("nccl", "one_shot", "all_reduce", "allreduce", "allgather", "symm")),
    ("attention", ("flashinfer", "batchdecode", "batchprefill", "prefill_kernel", "decode_kernel")),
    ("GDN", ("gdn", "delta", "recurrent", "chunk", "conv1d", "solve_tril", "cumsum", "wy_")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul", "splitk")),
    ("norm", ("rms", "layer_norm", "norm")),
)


def _kinds(prof, steps: int) -> str:
    """Device time per step by kind of kernel, busy vs span (CUDA only)."""
    from torch.autograd import DeviceType
    ks = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not ks:
        return "(no device kernels seen)"
    by: dict[str, float] = {}
    for e in ks:
        name = e.name.lower()
        kind = next((k for k, subs in KINDS if any(s in name for s in subs)), "other")
        by[kind] = by.get(kind, 0.0) + e.time_range.elapsed_us()
    busy = sum(by.values())
    span = ks[-1].time_range.end - ks[0].time_range.start
    lines = [f"   device per step: busy {busy / steps:8.1f} us, span {span / steps:8.1f} us, "
             f"{len(ks) / steps:.0f} kernels"]
    for k, t in sorted(by.items(), key=lambda kv: -kv[1]):
        lines.append(f"   {k:<22} {t / steps:8.1f} us  {100 * t / busy:5.1f} %")
    return "\n".join(lines)


def _timed_prefill(core, args, vocab: int) -> None:
    """Prefill steps without the profiler: the step's wall time (synchronized), when step()
    returned, and the host time of the forward alone (its launches, as the forward is enqueued:
    near the wall time means the step is bound by the host)."""
    spent: list[float] = []

    def timed(fn):
        def run(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            spent.append(time.perf_counter() - t)
            return out
        return run
    pg = core.prefill_graphs
    saved = (core.forward, pg.run if pg is not None else None)
    core.forward = timed(core.forward)
    if pg is not None:
        pg.run = timed(pg.run)
    walls, hosts, fwds = [], [], []
    try:
        for i in range(args.timed):
            for r in _requests(args.rows, args.prompt_len, vocab, f"timed{i}-", 1):
                core.add_request(r)
            spent.clear()
            _sync()
            t0 = time.perf_counter()
            core.step()
            t1 = time.perf_counter()
            _sync()
            walls.append(time.perf_counter() - t0)
            hosts.append(t1 - t0)
            fwds.append(sum(spent))
            while core.has_unfinished():
                core.step()
    finally:
        core.forward = saved[0]
        if pg is not None:
            pg.run = saved[1]

    def med(xs):
        return sorted(xs)[len(xs) // 2] * 1e3
    print(f"== {args.timed} prefill steps unprofiled ({args.rows} rows x {args.prompt_len} tokens, prefill graphs "
          f"{'on' if pg is not None else 'off'}): wall {med(walls):.1f} ms, step() returned at {med(hosts):.1f} ms, "
          f"forward enqueued in {med(fwds):.1f} ms (medians)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--rows", type=int, default=8, help="prompts prefilled in the profiled step")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--decode-graphs", default="off", choices=["auto", "off"],
                    help="off (default): decode steps run eagerly, so their ops show in the profile")
    ap.add_argument("--async-output", default="off", choices=["auto", "off"],
                    help="auto: overlapped decode (with --decode-graphs auto), as served")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the profile is rank 0's)")
    ap.add_argument("--top", type=int, default=25, help="rows per table")
    ap.add_argument("--by-shape", action="store_true",
                    help="also list the prefill step's ops by input shape (which copy or cast costs what)")
    ap.add_argument("--timed", type=int, default=5,
                    help="unprofiled prefill steps of the same shape timed first (0: none)")
    args = ap.parse_args()

    llm = LLM(args.model, random_weights=True, max_num_seqs=max(args.rows, 8),
              max_model_len=args.prompt_len + 2 * args.decode_steps + 64, decode_graphs=args.decode_graphs,
              async_output=args.async_output, tp=args.tp)
    core = llm.engine
    vocab = core.vocab_size
    # warm-up: the same shapes once (first-use compiles and autotuning stay out of the profile)
    for r in _requests(args.rows, args.prompt_len, vocab, "warm", 4):
        core.add_request(r)
    while core.has_unfinished():
        core.step()
    _sync()

    if args.timed:
        _timed_prefill(core, args, vocab)

    for r in _requests(args.rows, args.prompt_len, vocab, "prof", 2 * args.decode_steps + 2):
        core.add_request(r)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    dev_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with profile(activities=acts, record_shapes=args.by_shape) as prof:
        t = time.perf_counter()
        core.step()  # the prefill step
        _sync()
        wall = time.perf_counter() - t
    print(f"== prefill step: {args.rows} rows x {args.prompt_len} tokens, {wall * 1e3:.1f} ms wall")
    print(_kinds(prof, 1))
    print(_table(prof, dev_key, args.top))
    print(_table(prof, "self_cpu_time_total", args.top))
    if args.by_shape:
        print(prof.key_averages(group_by_input_shape=True).table(sort_by=dev_key, row_limit=args.top,
                                                                 max_name_column_width=40, max_shapes_column_width=90))

    t = time.perf_counter()  # the same steps without the profiler first: its tracing moves the wall time
    for _ in range(args.decode_steps):
        core.step()
    _sync()
    print(f"== {args.decode_steps} decode steps at batch {args.rows}, not profiled: "
          f"{(time.perf_counter() - t) / args.decode_steps * 1e3:.3f} ms per step")
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(args.decode_steps):
            core.step()
        _sync()
        wall = time.perf_counter() - t
    print(f"== {args.decode_steps} decode steps at batch {args.rows} (graphs {args.decode_graphs}): "
          f"{wall / args.decode_steps * 1e3:.2f} ms per step")
    print(_kinds(prof, args.decode_steps))
    print(_table(prof, dev_key, args.top))
    print(_table(prof, "self_cpu_time_total", args.top))
    while core.has_unfinished():
        core.step()
    if hasattr(llm, "close"):
        llm.close()


if __name__ == "__main__":
    main()
