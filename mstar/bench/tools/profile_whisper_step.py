"""Where a Whisper admission step's time goes: log-mel, encoder, cross K/V, decoder prefill, sampling.

Builds the engine as the server does (Whisper preset, random weights) and admits requests as POST
/v1/audio/transcriptions does (language=en: the decoder prompt <|startoftranscript|> <|en|> <|transcribe|>
<|notimestamps|>, the model's default suppression, one 16 kHz window of --clip-seconds of random audio).
Warms up with the same shapes, then:

  1. no profiler: --timing-steps admission steps of 1 row each way, medians in ms, device-synced walls
       plain   the step as served; features / encoder from the engine's own counters (CUDA events: what
               /metrics reports as encoder_feature_s / encoder_time_s); rest = wall - both. The same
               steps' MSTAR_PHASE_TIMING records (runtime/engine/phase_timing.py: schedule holds the encoder's
               launch, forward waits for its kernels, plan = FlashInfer plan() host time; the timer's
               two syncs, after forward and logits, cost a few launches)
       synced  a device sync around each part: its cost with nothing in flight. encode = features +
               encoder_layers + cross_kv (+ stack / casts); other = wall - the top-level parts
  2. torch.profiler, one admission step of --rows rows: wall; phase ranges (whisper::*) and mstar ops
     (mstar::*) with calls, host ms, host self ms (Python and backends outside aten) and device ms; top ops
     by device time and by host self time; host calls that wait for the device (cudaStreamSynchronize,
     cudaMemcpy, cudaMemcpyAsync >= 20 us, .item(), ...) with the mstar lines that made them
  3. torch.profiler, --decode-steps decode steps of those rows (with graphs only replays show)

    python -m mstar.bench.tools.profile_whisper_step --model whisper-large-v3 --rows 1 --clip-seconds 10 --decode-steps 20
    python -m mstar.bench.tools.profile_whisper_step --model whisper-tiny --rows 4 --decode-steps 3 --timing-steps 3  # CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from mstar import LLM, ops
from mstar.models.whisper import audio as mstar_audio
from mstar.ops import phase_clock
from mstar.runtime.engine.phase_timing import PHASES, PhaseTimer
from mstar.runtime.engine.request import EngineRequest, SamplingParams
from mstar.models.whisper.transcription import whisper_tokens

TOP = ("schedule", "sampler_add", "mask_set", "encode", "prepare", "decoder_forward", "logits", "mask_apply", "sample")
SUB = ("features", "encoder_layers", "cross_kv")  # inside encode
BLOCKING = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMalloc",
            "cudaFree", "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost", "aten::_local_scalar_dense"}
SLOW_COPY_US = 20.0  # a cudaMemcpyAsync this long waited (pageable memory, or the stream)
_seeds = itertools.count(1)


class Hooks:
    """Wraps methods: each call runs in a profiler range `<prefix><label>` and, with `sync`, between two
    device syncs; its wall time is added to acc[label]. close() puts the originals back."""

    def __init__(self, targets, prefix: str, sync=None):
        self.acc: dict[str, float] = defaultdict(float)
        self._undo = []
        for obj, attr, label in targets:
            orig = getattr(obj, attr)
            self._undo.append((obj, attr, orig, attr in vars(obj)))
            setattr(obj, attr, self._wrap(orig, prefix + label, label, sync))

    def _wrap(self, orig, name, label, sync):
        def fn(*a, **k):
            if sync:
                sync()
            t = time.perf_counter()
            with record_function(name):
                out = orig(*a, **k)
            if sync:
                sync()
            self.acc[label] += time.perf_counter() - t
            return out
        return fn

    def close(self):
        for obj, attr, orig, own in reversed(self._undo):
            setattr(obj, attr, orig) if own else delattr(obj, attr)


def phase_targets(core):
    m = core.model
    return [(core.scheduler, "schedule", "schedule"), (core.sampler, "add", "sampler_add"),
            (core.token_masks, "set", "mask_set"), (core.admission, "run", "encode"),
            (mstar_audio, "log_mel_spectrogram", "features"), (m.model.encoder, "forward", "encoder_layers"),
            (core.inputs, "build", "prepare"), (core, "forward", "decoder_forward"), (m, "compute_logits", "logits"),
            (core.token_masks, "apply", "mask_apply"), (core.sampler, "sample", "sample")] + \
        [(x, "write_kv", "cross_kv") for x in m.cross_attention_layers]


def requests(core, args, tag: str, n: int) -> list[EngineRequest]:
    tok = whisper_tokens(core.vocab_size, core.tokenizer)
    prompt = tok.decoder_prompt("en" if tok.multilingual else None, "transcribe")
    g = np.random.default_rng(next(_seeds))
    params = SamplingParams(max_tokens=args.decode_steps + 2, temperature=0.0, ignore_eos=True)
    return [EngineRequest(f"{tag}{i}", list(prompt), params,
                          audio=(0.1 * g.standard_normal(int(args.clip_seconds * 16000))).astype(np.float32))
            for i in range(n)]


def admit(core, reqs, sync) -> float:
    """One step that admits reqs, between two device syncs: its wall seconds."""
    for r in reqs:
        core.add_request(r)
    sync()
    t = time.perf_counter()
    outs = core.step()
    sync()
    wall = time.perf_counter() - t
    if len({o.request_id for o in outs if o.new_token_ids}) != len(reqs):
        print(f"!! not all {len(reqs)} rows got their first token in one step")
    return wall


def finish(core, reqs) -> None:
    core.abort([r.request_id for r in reqs])
    while core.has_unfinished():
        core.step()


def one_row_steps(core, args, tag, sync, n=None):
    """n (--timing-steps) admission steps of 1 row, each aborted after it: yields a function running one."""
    for i in range(max(1, n or args.timing_steps)):
        reqs = requests(core, args, f"{tag}{i}-", 1)
        yield lambda r=reqs: admit(core, r, sync)
        finish(core, reqs)


def ranges_table(prof, cuda: bool) -> str:
    agg = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # calls, host, host self, device (us)
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name.startswith(("whisper::", "mstar::")):
            a = agg[e.name]
            a[0], a[1], a[2] = a[0] + 1, a[1] + e.cpu_time_total, a[2] + e.self_cpu_time_total
            a[3] += e.device_time_total if cuda else float("nan")
    order = [k for k in (f"whisper::{n}" for n in TOP[:4] + SUB + TOP[4:]) if k in agg]
    order += sorted((k for k in agg if k.startswith("mstar::")), key=lambda k: -agg[k][1])
    lines = [f"{'range':34s} {'calls':>6s} {'host ms':>9s} {'self ms':>9s} {'device ms':>10s}"]
    for k in order:
        c, host, own, dev = agg[k]
        name = ("  " if k[9:] in SUB else "") + k
        lines.append(f"{name:34s} {c:6d} {host / 1e3:9.2f} {own / 1e3:9.2f} {dev / 1e3:10.2f}")
    return "\n".join(lines)


def blocking_table(prof, depth: int, top: int) -> str:
    """Host calls that wait for the device, grouped by (call, phase, innermost op, innermost mstar frames):
    one sweep over the events in start order keeps the ranges open around each (Python frames included)."""
    evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CPU),
                 key=lambda e: (e.time_range.start, -e.time_range.end))
    groups = defaultdict(lambda: [0, 0.0, 0.0])
    open_: list = []
    for b in evs:
        while open_ and open_[-1].time_range.end < b.time_range.end:
            open_.pop()
        dur = b.time_range.end - b.time_range.start
        if b.name in BLOCKING or (b.name.startswith("cudaMemcpy") and dur >= SLOW_COPY_US):
            frames = [o.name for o in reversed(open_) if ".py(" in o.name]  # the profiler's Python tracer
            frames = frames or next((o.stack[::-1] for o in reversed(open_) if o.stack), [])  # older torch
            frames = [f for f in frames if "mstar/" in f and not f.startswith("mstar/ops/registry")][:depth]
            phase = next((o.name for o in reversed(open_) if o.name.startswith("whisper::")), "-")
            inner = next((o.name for o in reversed(open_) if ".py(" not in o.name and not o.name.startswith("<")), "-")
            g = groups[(b.name, phase, inner, " <- ".join(frames) or "(no mstar frame)")]
            g[0], g[1], g[2] = g[0] + 1, g[1] + dur, max(g[2], dur)
        open_.append(b)
    lines = [f"{'count':>5s} {'total us':>9s} {'max us':>8s}  call / phase / op, then where (innermost first)"]
    for (name, phase, inner, where), (c, tot, mx) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{c:5d} {tot:9.1f} {mx:8.1f}  {name} / {phase} / {inner}\n{'':26s}{where}")
    return "\n".join(lines) if groups else "(none)"


def safe(fn, *a, **k) -> None:
    """Print fn(...); a table that fails (a torch version's profiler API) must not cost the others."""
    try:
        print(fn(*a, **k))
    except Exception as e:  # noqa: BLE001
        print(f"({getattr(fn, '__name__', 'table')} failed: {type(e).__name__}: {e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="whisper-large-v3",
                    help="Whisper preset (mstar/models/whisper/presets.py; whisper-tiny on CPU); random weights")
    ap.add_argument("--rows", type=int, default=1, help="requests admitted together in the profiled admission step")
    ap.add_argument("--clip-seconds", type=float, default=10.0, help="length of each random 16 kHz clip (<= 30)")
    ap.add_argument("--decode-steps", type=int, default=20, help="decode steps profiled after the admission step")
    ap.add_argument("--timing-steps", type=int, default=10,
                    help="1-row admission steps timed without the profiler, per timing mode (medians)")
    ap.add_argument("--decode-graphs", default="auto", choices=["auto", "off"],
                    help="auto (the server's default): decode steps replay CUDA graphs on CUDA; off: eager, so "
                         "the decode ops show in the profile. Admission steps are eager either way")
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="engine rows (sizes the cross-K/V pool); 16: what `mstar.bench.whisper --launch` serves")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float16 | float32")
    ap.add_argument("--top", type=int, default=25, help="rows per table")
    ap.add_argument("--stack-depth", type=int, default=3, help="mstar frames shown per host-blocking call")
    args = ap.parse_args()

    llm = LLM(args.model, random_weights=True, max_num_seqs=max(args.rows, args.max_num_seqs),
              decode_graphs=args.decode_graphs, async_output="off", device=args.device, dtype=args.dtype)
    core = llm.engine
    if core.admission is None:
        sys.exit(f"{args.model} is not an encoder-decoder (Whisper) model")
    cuda = core.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(core.device)

    def onoff(x):
        return "on" if x is not None else "off"
    back = ", ".join(f"{n}={ops.get(n).selected(core.device.type)}" for n in (
        "dense_attention", "paged_attention_prefill", "paged_attention_decode", "kv_append", "fused_add_layer_norm"))
    print(f"== {args.model} on {core.device}/{str(core.dtype)[6:]}: max_num_seqs {core.config.max_num_seqs}, page "
          f"{core.page_size}, decode graphs {onoff(core.graphs)}, prefill graphs {onoff(core.prefill_graphs)}, "
          f"engine warm-up steps {core.warm_up_steps}\n   backends: {back}")
    # warm-up with the profiled shapes: --rows admitted together and decoded; 1-row admissions
    for r in requests(core, args, "warm", args.rows):
        core.add_request(r)
    while core.has_unfinished():
        core.step()
    for step in one_row_steps(core, args, "warm1-", sync, n=2):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts):  # the profiler's own first use stays out too
        reqs = requests(core, args, "warmp", args.rows)
        admit(core, reqs, sync)
    finish(core, reqs)

    # ---- 1. timing without the profiler -------------------------------------------------------------
    plain, synced = defaultdict(list), defaultdict(list)
    fd, path = tempfile.mkstemp(prefix="mstar-phases-", suffix=".jsonl")
    os.close(fd)
    core.phase_timer = PhaseTimer(path, core.device, {"model": args.model})
    for step in one_row_steps(core, args, "plain", sync):
        s0 = core.admission.stats()
        wall = step()
        s1 = core.admission.stats()
        f, e = s1["encoder_feature_s"] - s0["encoder_feature_s"], s1["encoder_time_s"] - s0["encoder_time_s"]
        for k, v in (("wall", wall), ("features", f), ("encoder", e), ("rest", wall - f - e)):
            plain[k].append(v)
    core.phase_timer.close()
    core.phase_timer, phase_clock.enabled = None, False
    with open(path) as fh:
        recs = [d for d in map(json.loads, fh) if d.get("prefill_rows")]
    os.unlink(path)
    hooks = Hooks(phase_targets(core), "whisper::", sync)
    for step in one_row_steps(core, args, "synced", sync):
        hooks.acc.clear()
        synced["wall"].append(step())
        for k in TOP + SUB:
            synced[k].append(hooks.acc[k])
        synced["other"].append(synced["wall"][-1] - sum(hooks.acc[k] for k in TOP))
    hooks.close()

    def med(xs):
        return f"{statistics.median(xs) * 1e3:.2f}"
    print(f"\n== admission step, 1 row x {args.clip_seconds:g} s clip, median of {len(plain['wall'])}, ms")
    print("plain  (as served):  " + "  ".join(f"{k} {med(v)}" for k, v in plain.items()))
    print("synced (parts between device syncs):  wall " + med(synced["wall"]) + " = " + "  ".join(
        f"{k} {med(synced[k])}" + (" [" + "  ".join(f"{s} {med(synced[s])}" for s in SUB) + "]" if k == "encode"
                                   else "") for k in TOP + ("other",)))
    print("  its MSTAR_PHASE_TIMING:  " + ("  ".join(
        f"{p} {statistics.median(r[p + '_us'] for r in recs) / 1e3:.2f}" for p in PHASES) if recs else "(none)"))

    # ---- 2. the profiled admission step of --rows rows ------------------------------------------------
    hooks = Hooks(phase_targets(core), "whisper::")
    op_hooks = Hooks([(op, "_impl", op.name) for op in ops.all_ops()], "mstar::")
    reqs = requests(core, args, "stack", args.rows)
    with profile(activities=acts, with_stack=True) as sprof:  # stacks: a pass of their own (they cost host time)
        admit(core, reqs, sync)
    finish(core, reqs)
    reqs = requests(core, args, "prof", args.rows)
    s0 = core.admission.stats()
    with profile(activities=acts) as prof:
        wall = admit(core, reqs, sync)
    s1 = core.admission.stats()
    hooks.close()
    op_hooks.close()
    print(f"\n== admission step: {args.rows} rows x {args.clip_seconds:g} s, {wall * 1e3:.1f} ms wall under the "
          f"profiler; engine counters: features {(s1['encoder_feature_s'] - s0['encoder_feature_s']) * 1e3:.2f} "
          f"ms, encoder + cross K/V {(s1['encoder_time_s'] - s0['encoder_time_s']) * 1e3:.2f} ms")
    safe(ranges_table, prof, cuda)
    sorts = (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]
    for key in sorts:
        print(f"-- top ops by {key}")
        safe(prof.key_averages().table, sort_by=key, row_limit=args.top, max_name_column_width=60)
    print("-- host calls that wait for the device (from the stack pass; on CPU only .item()-style reads)")
    safe(blocking_table, sprof, args.stack_depth, args.top)

    # ---- 3. decode steps of the same rows -------------------------------------------------------------
    with profile(activities=acts) as prof:
        sync()
        t = time.perf_counter()
        for _ in range(args.decode_steps):
            core.step()
        sync()
        wall = time.perf_counter() - t
    print(f"\n== {args.decode_steps} decode steps at batch {args.rows} (graphs {onoff(core.graphs)}): "
          f"{wall / max(1, args.decode_steps) * 1e3:.2f} ms per step")
    for key in sorts:
        safe(prof.key_averages().table, sort_by=key, row_limit=args.top, max_name_column_width=60)
    finish(core, reqs)
    llm.close()


if __name__ == "__main__":
    main()
