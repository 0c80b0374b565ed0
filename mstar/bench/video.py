"""`mstar bench video` / `mstar bench images`: Wan or Cosmos3 generation in process (no HTTP), a closed loop
of c requests per point, with diffusers' pipeline in the same run as the baseline.

    mstar bench video --model wan2.2-ti2v-5b --random-weights --size 832x480 --frames 33 --baseline diffusers
    mstar bench images --model wan2.2-ti2v-5b --random-weights --size 1280x704

Settings: the model's defaults unless given (Wan2.2 TI2V-5B: 50 steps, guidance 5.0, the
scheduler's flow shift 5.0); every request has a negative prompt (""), so guidance doubles the
transformer's rows, as in the release. `images` asks for one frame and gets a PNG-ready image.

Per point: N = max(--waves * c, --min-requests) requests after a warm-up of c requests of
--warmup-steps steps (the same shapes: the transformer's kernels chosen, the batch's buffers
made); c are in flight at all times. Reported per point: req/s, latency p50 / p90 (submission to
the decoded frames), and the time of each request's stages, p50: encode (the text encoder),
denoise (the loop: noise, every transformer step, the scheduler) and decode (the VAE); the
transformer step's time and its achieved TFLOP/s (dit_flops below, over the measured step) as a
fraction of --peak-tflops (the GPU's dense bf16 ceiling; H200: 989); on CUDA the peak memory
allocated during the point (the models' weights included). Stage times are GPU spans between
CUDA events (no added synchronisation), host clocks on the CPU.

Baseline (--baseline diffusers, before mstar's points, same process and GPU), one request at a
time (neither pipeline batches requests), output_type "np", its VAE in the dtype of mstar's
(MSTAR_VAE_DTYPE), with the same stage split:
- Wan: diffusers' WanPipeline (expand_timesteps as the TI2V release) over its own
  WanTransformer3DModel and AutoencoderKLWan with random weights of the same configs, sharing
  mstar's text encoder and tokenizer; encode = encode_prompt.
- Cosmos3 (diffusers >= 0.42): Cosmos3OmniPipeline over its own Cosmos3OmniTransformer and
  AutoencoderKLWan with random weights of the same configs, mstar's tokenizer, no safety checker,
  the model's fps; encode = tokenize_prompt (it runs the understanding tower inside every step).

Prints one line per point and appends one JSON record per point to --out
(default notes/results/video.jsonl).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import sys
import time

import numpy as np
import torch

from mstar import knobs
from mstar.bench import append_jsonl

PROMPT = ("A red fox trots along a snowy riverbank at dawn, steam rising from the water, "
          "the camera tracking it slowly from the side")
BF16_PEAK_TFLOPS_H200 = 989.0


# -- arithmetic ----------------------------------------------------------------------------------
def dit_flops(cfg, frames: int, height: int, width: int, text_len: int = 512, vae_spatial: int = 16,
              vae_temporal: int = 4, text_once: bool = True) -> float:
    """Floating-point operations of one transformer step for one row (multiply-add = 2): the
    patch embedding, per block the self-attention (q, k, v, o projections and the S x S scores and
    values), the cross-attention (q, o over S tokens, S x L scores) and the FFN, the output
    projection and the timestep embedding. The text embedder and the cross-attention's k, v over
    the text are counted only with text_once=False: the pipeline computes them once a request
    (WanTransformer.text_kv), not at every step. Norms, rotary and modulation are left out."""
    pt, ph, pw = cfg.patch_size
    f = ((frames - 1) // vae_temporal + 1) // pt
    h, w = height // vae_spatial // ph, width // vae_spatial // pw
    S, L, d = f * h * w, text_len, cfg.dim
    patch = pt * ph * pw
    per_block = (2 * S * 4 * d * d + 4 * S * S * d  # self-attention
                 + 2 * S * 2 * d * d + 4 * S * L * d  # cross-attention
                 + 2 * S * 2 * d * cfg.ffn_dim)  # FFN
    edges = 2 * S * cfg.in_channels * patch * d + 2 * S * d * cfg.out_channels * patch \
        + 2 * (cfg.freq_dim * d + d * d + d * 6 * d)
    text = cfg.num_layers * 2 * L * 2 * d * d + 2 * L * (cfg.text_dim * d + d * d)
    return float(cfg.num_layers * per_block + edges + (0 if text_once else text))


def cosmos3_step_flops(cfg, vision_tokens: int, prompt_len: int) -> float:
    """Floating-point operations of one Cosmos3 generation-tower forward for one row (multiply-add
    = 2): proj_in, per layer the fused q / k / v and the output projection, the scores and values
    of S vision queries over L + S keys, the ReLU^2 MLP, proj_out and the timestep embedding. The
    prompt's K/V are cached (computed once a request, not counted); norms and rotary are left out."""
    from mstar.models.cosmos3.transformer import TIME_FREQ_DIM
    S, d, q = vision_tokens, cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = (2 * S * d * (q + 2 * kv) + 2 * S * q * d  # projections
                 + 4 * S * (prompt_len + S) * q  # scores and values
                 + 2 * S * 2 * d * cfg.intermediate_size)  # MLP
    edges = 2 * S * cfg.patch_latent_dim * d * 2 + 2 * (TIME_FREQ_DIM * d + d * d)
    return float(cfg.num_hidden_layers * per_layer + edges)


class Span:
    """A timed region: CUDA events on a GPU (read when the work is done), else the host clock."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.a = time.perf_counter()

    def stop(self) -> "Span":
        if self.cuda:
            self.b.record()
        else:
            self.b = time.perf_counter()
        return self

    def seconds(self) -> float:
        return self.a.elapsed_time(self.b) / 1e3 if self.cuda else self.b - self.a


class StageClock:
    """Wraps a WanPipeline's three stages so each request collects its spans: encode (its batch's
    encoder call), denoise (start, every step, finish of its batch) and decode; and each denoise
    step's span with its batch's transformer rows."""

    def __init__(self, pipe, cuda: bool):
        import dataclasses
        self.cuda = cuda
        self.spans: dict[str, dict[str, list[Span]]] = {}
        self.steps: list[tuple[int, Span]] = []  # (transformer rows, span) of every denoise step
        self._batch: dict[int, list[str]] = {}  # id(loop state) -> its requests
        enc, loop, dec = pipe.stages
        continuous = {} if not loop.continuous else {"join": self._join(loop.join), "leave": self._leave(loop.leave)}
        pipe.stages = [dataclasses.replace(enc, run=self._one_shot("encode", enc.run)),
                       dataclasses.replace(loop, start=self._start(loop.start), step=self._step(loop.step),
                                           finish=self._finish(loop.finish), **continuous),
                       dataclasses.replace(dec, run=self._one_shot("decode", dec.run))]

    def _add(self, rids, stage: str, span: Span) -> None:
        for rid in rids:
            self.spans.setdefault(rid, {}).setdefault(stage, []).append(span)

    def _one_shot(self, stage: str, fn):
        def run(reqs):
            s = Span(self.cuda)
            out = fn(reqs)
            self._add([r.request_id for r in reqs], stage, s.stop())
            return out
        return run

    def _start(self, fn):
        def start(reqs):
            s = Span(self.cuda)
            state = fn(reqs)
            rids = [r.request_id for r in reqs]
            self._batch[id(state)] = rids
            self._add(rids, "denoise", s.stop())
            return state
        return start

    # a continuous loop's join / leave may hand back another state object: its requests move with it
    def _join(self, fn):
        def join(state, reqs):
            s = Span(self.cuda)
            out = fn(state, reqs)
            new = [r.request_id for r in reqs]
            self._batch[id(out)] = self._batch.pop(id(state)) + new
            self._add(new, "denoise", s.stop())
            return out
        return join

    def _leave(self, fn):
        def leave(state, rows):
            out, outputs = fn(state, rows)
            gone = set(rows)
            kept = [r for j, r in enumerate(self._batch.pop(id(state))) if j not in gone]
            if kept:
                self._batch[id(out)] = kept
            return out, outputs
        return leave

    def _step(self, fn):
        def step(state, i):
            s = Span(self.cuda)
            out = fn(state, i)
            s.stop()
            rids = self._batch[id(state)]
            self._add(rids, "denoise", s)
            self.steps.append((len(rids) * (2 if state.get("cfg") else 1), s))
            return out
        return step

    def _finish(self, fn):
        def finish(state):
            s = Span(self.cuda)
            out = fn(state)
            self._add(self._batch.pop(id(state)), "denoise", s.stop())
            return out
        return finish

    def request_seconds(self, rid: str) -> dict[str, float]:
        return {k: sum(s.seconds() for s in v) for k, v in self.spans.pop(rid, {}).items()}

    def take_steps(self) -> list[tuple[int, float]]:
        out = [(rows, s.seconds()) for rows, s in self.steps]
        self.steps.clear()
        return out


def _pct(xs, q):
    return round(float(np.percentile(xs, q)), 4) if len(xs) else None


def summarize(lat: list[float], stages: list[dict[str, float]], steps: list[tuple[int, float]], wall: float,
              flops_row: float, peak: float) -> dict:
    rec = {"requests": len(lat), "wall_s": round(wall, 3), "req_s": round(len(lat) / wall, 4) if wall > 0 else None,
           "latency_p50_s": _pct(lat, 50), "latency_p90_s": _pct(lat, 90)}
    for k in ("encode", "denoise", "decode"):
        rec[f"{k}_p50_s"] = _pct([s.get(k, 0.0) for s in stages], 50)
    if steps:
        rows = [r for r, _ in steps]
        secs = [t for _, t in steps]
        tflops = [r * flops_row / t / 1e12 for r, t in steps if t > 0 and flops_row]
        rec.update(step_rows=max(set(rows), key=rows.count), step_ms_p50=round(1e3 * float(np.median(secs)), 2),
                   dit_tflops=float(f"{np.median(tflops):.4g}") if tflops else None)
        rec["dit_peak_fraction"] = round(rec["dit_tflops"] / peak, 3) if rec["dit_tflops"] and peak else None
    return rec


# -- mstar ---------------------------------------------------------------------------------------
def request_inputs(args, i: int, steps: int | None = None) -> dict:
    w, h = (int(v) for v in args.size.split("x"))
    inputs = {"prompt": f"{PROMPT} ({i})", "negative_prompt": "", "width": w, "height": h,
              "num_inference_steps": steps or args.steps, "guidance_scale": args.guidance}
    if args.frames:
        inputs["num_frames"] = args.frames
    if args.flow_shift is not None:
        inputs["flow_shift"] = args.flow_shift
    return inputs


def closed_loop(engine, clock: StageClock, make_inputs, c: int, n: int, tag: str):
    """n requests through the stage engine, c in flight: latencies, stage seconds, wall seconds."""
    from mstar.models import interfaces as I
    from mstar.runtime.engine.request import EngineRequest, SamplingParams
    live: dict[str, float] = {}
    lat: list[float] = []
    stages: list[dict[str, float]] = []
    submitted = 0

    def submit():
        nonlocal submitted
        rid = f"{tag}-{submitted}"
        engine.add_request(EngineRequest(rid, [], SamplingParams(),
                                         media=I.MediaRequest(rid, make_inputs(submitted), seed=submitted)))
        live[rid] = time.perf_counter()
        submitted += 1

    t0 = time.perf_counter()
    while submitted < min(c, n):
        submit()
    while live:
        for o in engine.step():
            if o.request_id not in live or not o.finished:
                continue
            if o.finish_reason != "stop":
                raise RuntimeError(f"{o.request_id} ended with {o.finish_reason}: {getattr(o, 'error', '')}")
            lat.append(time.perf_counter() - live.pop(o.request_id))
            stages.append(clock.request_seconds(o.request_id))
            if submitted < n:
                submit()
    return lat, stages, time.perf_counter() - t0


def build_pipeline(args):
    from mstar.models import registry
    fam = registry.family_of(args.model)
    if fam.name not in ("wan", "cosmos3"):
        raise SystemExit(f"mstar bench video: {args.model!r} is a {fam.name} model, not a Wan or Cosmos3 model")
    return fam.pipeline(args.model, dtype=args.torch_dtype, device=args.device, random_weights=args.random_weights,
                        seed=0, max_batch=max(args.concurrency))


def run_mstar(args, pipe) -> list[dict]:
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.stage_engine import StageEngine
    cuda = args.device.startswith("cuda")
    clock = StageClock(pipe, cuda)
    engine = StageEngine(EngineConfig(model=args.model, device=args.device), pipeline=pipe)
    flops_row = _flops(args, pipe)
    records = []
    for c in args.concurrency:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        closed_loop(engine, clock, lambda i: request_inputs(args, i, args.warmup_steps), c, c, f"warm{c}")
        clock.take_steps()
        n = max(args.waves * c, args.min_requests)
        lat, stages, wall = closed_loop(engine, clock, lambda i: request_inputs(args, i), c, n, f"c{c}")
        rec = summarize(lat, stages, clock.take_steps(), wall, flops_row, args.peak_tflops)
        if cuda:
            rec["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        records.append(_record(args, "mstar", c, rec))
    engine.close()
    return records


def _flops(args, pipe, text_once: bool = True) -> float | None:
    """A Wan transformer row's step FLOPs (None for other models: step times only); text_once=False
    for diffusers, whose step recomputes the text's keys and values."""
    if not hasattr(pipe, "text_encoder"):
        return None
    w, h = (int(v) for v in args.size.split("x"))
    return dit_flops(pipe.transformer.config, args.frames or 1, h, w, pipe.text_encoder.max_sequence_length,
                     pipe.spatial, pipe.temporal, text_once=text_once)


# -- diffusers -----------------------------------------------------------------------------------
def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def _has_diffusers(name: str) -> bool:
    try:
        return hasattr(importlib.import_module("diffusers"), name)
    except ImportError:
        return False


def wan_diffusers_pipeline(args, pipe):
    """diffusers' WanPipeline with random weights of mstar's configs, mstar's text encoder shared."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from diffusers import WanPipeline as DiffusersWan
    from diffusers.pipelines.wan import pipeline_wan

    from mstar.models import registry

    cfg = registry.resolve_config(args.model)
    if not hasattr(pipeline_wan, "ftfy"):  # its prompt_clean needs ftfy; mstar's, without it, fixes nothing
        import types
        pipeline_wan.ftfy = types.SimpleNamespace(fix_text=lambda t: t)
    torch.manual_seed(0)
    with torch.device(args.device):
        transformer = WanTransformer3DModel(**_public(cfg.transformer)).to(args.torch_dtype).eval()
        vae = AutoencoderKLWan(**_public(cfg.vae)).to(pipe.vae.dtype).eval()  # mstar's VAE dtype
    sched = UniPCMultistepScheduler(**_public(cfg.scheduler))
    te = pipe.text_encoder
    out = DiffusersWan(tokenizer=te.tokenizer, text_encoder=te.model, vae=vae, scheduler=sched,
                       transformer=transformer, expand_timesteps=cfg.expand_timesteps)
    out.set_progress_bar_config(disable=True)
    return out


def cosmos3_diffusers_pipeline(args, pipe):
    """diffusers' Cosmos3OmniPipeline (diffusers >= 0.42) with random weights of mstar's configs and
    mstar's tokenizer, no safety checker; it runs both towers over the whole sequence every step."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

    from mstar.models import registry
    from mstar.models.wan.scheduler import FLOW_SIGMAS_NATIVE

    cfg = registry.resolve_config(args.model)
    tokenizer = pipe.prompter.tokenizer
    torch.manual_seed(0)
    with torch.device(args.device):
        transformer = Cosmos3OmniTransformer.from_config(_public(cfg.transformer)).to(args.torch_dtype).eval()
        vae = AutoencoderKLWan(**_public(cfg.vae)).to(pipe.vae.dtype).eval()  # mstar's VAE dtype
    sched = UniPCMultistepScheduler(**_public(cfg.scheduler))
    out = Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=tokenizer, vae=vae, scheduler=sched,
                              enable_safety_checker=False, default_use_system_prompt=cfg.use_system_prompt,
                              use_native_flow_schedule=cfg.flow_sigmas == FLOW_SIGMAS_NATIVE)
    out.set_progress_bar_config(disable=True)
    return out


def run_diffusers(args, pipe) -> list[dict]:
    """One request at a time; the same stage split through wrappers of encode_prompt and vae.decode."""
    cuda = args.device.startswith("cuda")
    cosmos3 = hasattr(pipe, "prompter")
    ref = (cosmos3_diffusers_pipeline if cosmos3 else wan_diffusers_pipeline)(args, pipe)
    flops_row = _flops(args, pipe, text_once=False)
    w, h = (int(v) for v in args.size.split("x"))
    spans: dict[str, list[Span]] = {}
    # encode: Wan's text encoder; Cosmos3's prompt tokens (its understanding tower runs in every step)
    encode_name = "tokenize_prompt" if cosmos3 else "encode_prompt"
    enc, dec = getattr(ref, encode_name), ref.vae.decode

    def timed(name, fn):
        def run(*a, **kw):
            s = Span(cuda)
            out = fn(*a, **kw)
            spans.setdefault(name, []).append(s.stop())
            return out
        return run
    setattr(ref, encode_name, timed("encode", enc))
    ref.vae.decode = timed("decode", dec)
    extra = {"fps": pipe.fps, "enable_safety_check": False} if cosmos3 else {}

    def one(i: int, steps: int) -> tuple[float, dict[str, float], float]:
        spans.clear()
        t0 = time.perf_counter()
        total = Span(cuda)
        kw = {"num_frames": args.frames or 1, **extra}
        if args.flow_shift is not None:
            ref.scheduler = type(ref.scheduler).from_config(ref.scheduler.config, flow_shift=args.flow_shift)
        with torch.inference_mode():
            ref(prompt=f"{PROMPT} ({i})", negative_prompt="", height=h, width=w, num_inference_steps=steps,
                guidance_scale=args.guidance, generator=torch.Generator().manual_seed(i), output_type="np", **kw)
        total.stop()
        lat = time.perf_counter() - t0
        st = {k: sum(s.seconds() for s in v) for k, v in spans.items()}
        st["denoise"] = total.seconds() - st.get("encode", 0.0) - st.get("decode", 0.0)
        return lat, st, st["denoise"] / steps

    one(0, args.warmup_steps)
    lat, stages, steps = [], [], []
    t = time.perf_counter()
    for i in range(args.baseline_requests):
        a, b, step_s = one(i + 1, args.steps)
        lat.append(a)
        stages.append(b)
        steps += [(2 if args.guidance > 1 else 1, step_s)]
    rec = summarize(lat, stages, steps, time.perf_counter() - t, flops_row, args.peak_tflops)
    if cuda:
        rec["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    rec["note"] = "one request at a time; step = the denoise span / steps (scheduler included)"
    records = [_record(args, "diffusers", 1, rec)]
    return records  # (the diffusers pipeline freed with this frame, before mstar's points)


# -- records -------------------------------------------------------------------------------------
def _record(args, engine: str, c: int, summary: dict) -> dict:
    from mstar.bench.serve import git_commit
    rec = {"bench": args.kind, "date": datetime.date.today().isoformat(), "commit": git_commit(),
           "model": args.model, "engine": engine, "concurrency": c, "size": args.size, "frames": args.frames or 1,
           "steps": args.steps, "guidance": args.guidance, "flow_shift": args.flow_shift, "dtype": args.dtype,
           "backends": os.environ.get("MSTAR_BACKENDS", ""),
           "knobs": knobs.changed(),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", **summary}
    frac = rec.get("dit_peak_fraction")
    print(f"{engine:>10} c={c:<2} {rec['req_s']} req/s  latency p50 {rec['latency_p50_s']} p90 {rec['latency_p90_s']} s"
          f"  (encode {rec['encode_p50_s']} / denoise {rec['denoise_p50_s']} / decode {rec['decode_p50_s']} s)  step "
          f"{rec.get('step_ms_p50')} ms x{rec.get('step_rows')} rows, {rec.get('dit_tflops')} TFLOP/s"
          f"{'' if frac is None else f' ({100 * frac:.0f}% of peak)'}  [{rec['requests']} requests]", flush=True)
    if args.out:
        append_jsonl(args.out, rec)
    return rec


def build_parser(kind: str = "video") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"mstar bench {kind}", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wan2.2-ti2v-5b",
                   help="a Wan or Cosmos3 preset (wan2.2-ti2v-5b, cosmos3-edge, tiny-wan, tiny-cosmos3) or a diffusers "
                        "pipeline directory")
    p.add_argument("--random-weights", action="store_true", help="random weights of the preset's or directory's shape")
    p.add_argument("--size", default="832x480" if kind == "video" else "1280x704", help="WxH, one the model takes")
    p.add_argument("--frames", type=int, default=33 if kind == "video" else 0,
                   help="frames per video (0: an image, one frame)")
    p.add_argument("--steps", type=int, default=50, help="denoising steps (the release's: 50)")
    p.add_argument("--guidance", type=float, default=5.0, help="guidance scale (the release's: 5.0; > 1 doubles rows)")
    p.add_argument("--flow-shift", type=float, default=None, help="the scheduler's shift (default: its config's)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4], help="points: requests in flight")
    p.add_argument("--waves", type=int, default=2, help="requests per point: max(waves * c, --min-requests)")
    p.add_argument("--min-requests", type=int, default=2, help="see --waves")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps of each point's warm-up requests")
    p.add_argument("--baseline", choices=["none", "diffusers"], default="none",
                   help="diffusers' pipeline in the same run (random weights, same configs): WanPipeline, or "
                        "Cosmos3OmniPipeline (diffusers >= 0.42)")
    p.add_argument("--baseline-requests", type=int, default=2, help="diffusers: requests, one at a time")
    p.add_argument("--peak-tflops", type=float, default=BF16_PEAK_TFLOPS_H200,
                   help="the dense bf16 ceiling the transformer step is compared with (H200: 989)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float32")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    p.add_argument("--only-baseline", action="store_true", help="run the baseline alone")
    p.add_argument("--out", default=f"notes/results/{'video' if kind == 'video' else 'images'}.jsonl",
                   help="JSON lines appended here ('' for none)")
    return p


def main(argv=None, kind: str = "video") -> int:
    args = build_parser(kind).parse_args(argv)
    args.kind = kind
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if args.dtype == "auto":
        args.torch_dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    elif args.dtype in dtypes:
        args.torch_dtype = dtypes[args.dtype]
    else:
        print(f"mstar bench {kind}: --dtype {args.dtype!r} is not one of auto, {', '.join(dtypes)}", file=sys.stderr)
        return 2
    if args.frames < 0 or not args.steps >= 1 or not math.isfinite(args.guidance):
        print(f"mstar bench {kind}: --frames must be >= 0 and --steps >= 1", file=sys.stderr)
        return 2
    pipe = build_pipeline(args)
    if f"{args.size}" not in pipe.sizes:
        print(f"mstar bench {kind}: {args.size} is not a size of {args.model} ({', '.join(pipe.sizes)})",
              file=sys.stderr)
        return 2
    if args.baseline == "diffusers" and hasattr(pipe, "prompter") and not _has_diffusers("Cosmos3OmniPipeline"):
        print(f"mstar bench {kind}: the Cosmos3 baseline needs diffusers >= 0.42 (Cosmos3OmniPipeline)",
              file=sys.stderr)
        return 2
    base = run_diffusers(args, pipe) if args.baseline == "diffusers" else []
    if base and args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    if args.only_baseline:
        return 0
    records = run_mstar(args, pipe)
    if base and base[0]["req_s"]:
        for r in records:
            print(f"c={r['concurrency']}: {r['req_s'] / base[0]['req_s']:.2f}x diffusers", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
