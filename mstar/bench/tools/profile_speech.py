"""Where a speech model's time goes (torch.profiler), on a preset with random weights.

    python -m mstar.bench.tools.profile_speech --model kokoro-82m --batch 32      # one Kokoro forward of a batch
    python -m mstar.bench.tools.profile_speech --model orpheus-3b --batch 1       # Orpheus engine steps
    python -m mstar.bench.tools.profile_speech --model qwen3-tts-1.7b --batch 32  # Qwen3-TTS engine steps

Kokoro: --batch requests of --seconds of audio (durations pinned as mstar bench speech pins
them) through the pipeline's stage, timed over --repeats forwards, then one profiled.
Orpheus: --batch streams decode through the engine; after --warm-steps, --steps engine steps are
timed (mean step, and the steps that ran the codec apart) and profiled. Qwen3-TTS: the same over
its stage, plus the frame alone (talker and code predictor) and the codec's decode of a chunk of
every stream, each timed on its own. Each prints the top ops by device time and by host time.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mstar import LLM
from mstar.bench import speech as B


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _table(prof, rows: int) -> None:
    dev = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=dev, row_limit=rows), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows // 2), flush=True)


def _activities():
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def kokoro(args) -> None:
    llm = LLM(args.model, random_weights=True, device=args.device, dtype=args.dtype, max_num_seqs=args.batch)
    ps = B.kokoro_phonemes(args.seconds, 13.0)
    dur = B.kokoro_durations(llm, ps, args.seconds)
    reqs = llm.speech_requests([{"phonemes": ps, "durations": dur}] * args.batch, seed=list(range(args.batch)))
    stage = llm.engine.stages[0]
    media = [r.media for r in reqs]
    for _ in range(2):
        stage.run(media)
    _sync()
    t = time.perf_counter()
    for _ in range(args.repeats):
        stage.run(media)
    _sync()
    ms = 1e3 * (time.perf_counter() - t) / args.repeats
    print(f"kokoro batch {args.batch} x {args.seconds} s ({len(ps)} phonemes, {dur} frames each): {ms:.1f} ms a "
          f"forward, {1e3 * args.batch / ms:.1f} req/s", flush=True)
    with profile(activities=_activities()) as prof:
        stage.run(media)
        _sync()
    _table(prof, args.rows)


def orpheus(args) -> None:
    n_tok = args.warm_steps + args.steps + 64
    llm = LLM(args.model, random_weights=True, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch, 8),
              max_model_len=n_tok + 512)
    reqs = llm.speech_requests([{"text": B.ORPHEUS_TEXT}] * args.batch, max_new_tokens=n_tok,
                               seed=list(range(args.batch)))
    eng = llm.engine
    for r in reqs:
        eng.add_request(r)
    for _ in range(args.warm_steps):
        eng.step()
    _sync()
    times, codec = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t)
        codec.append(any(o.media for o in outs))
    plain = [t for t, c in zip(times, codec) if not c]
    with_codec = [t for t, c in zip(times, codec) if c]
    print(f"orpheus batch {args.batch}: step mean {1e3 * sum(times) / len(times):.2f} ms; without audio "
          f"{1e3 * sum(plain) / max(1, len(plain)):.2f} ms ({len(plain)}), with audio "
          f"{1e3 * sum(with_codec) / max(1, len(with_codec)):.2f} ms ({len(with_codec)})", flush=True)
    with profile(activities=_activities()) as prof:
        for _ in range(min(args.steps, 28)):
            eng.step()
        _sync()
    _table(prof, args.rows)
    eng.abort([r.request_id for r in reqs])
    while eng.has_unfinished():
        eng.step()


def _ms(fn, n: int) -> float:
    _sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    _sync()
    return 1e3 * (time.perf_counter() - t) / n


def qwen3_tts(args) -> None:
    frames = args.warm_steps + 2 * args.steps + 64
    llm = LLM(args.model, random_weights=True, device=args.device, dtype=args.dtype, max_num_seqs=args.batch)
    reqs = llm.speech_requests([{"text": B.ORPHEUS_TEXT, "min_new_tokens": frames}] * args.batch,
                               max_new_tokens=frames, seed=list(range(args.batch)))
    eng = llm.engine
    for r in reqs:
        eng.add_request(r)
    for _ in range(args.warm_steps):
        eng.step()
    times, codec = [], []
    for _ in range(args.steps):
        _sync()
        t = time.perf_counter()
        outs = eng.step()
        _sync()
        times.append(time.perf_counter() - t)
        codec.append(any(o.media for o in outs))
    plain = [t for t, c in zip(times, codec) if not c]
    with_codec = [t for t, c in zip(times, codec) if c]
    synthesis = eng.stages[0].start.__self__
    (batch,) = [b.state for b in eng._running[0]]
    frame_ms = _ms(lambda: synthesis.generator.step(batch.gen), 10)
    pool = synthesis.streamer.pool
    chunk = synthesis.streamer.chunk_frames
    slots = [pool.acquire() for _ in range(args.batch)]
    codes = torch.zeros((args.batch, pool.decoder.config.num_quantizers, chunk), dtype=torch.long,
                        device=pool.decoder.device)
    codec_ms = _ms(lambda: pool.decode(slots, codes, [chunk] * args.batch), 5)
    for sl in slots:
        pool.release(sl)
    print(f"qwen3-tts batch {args.batch}: step mean {1e3 * sum(times) / len(times):.2f} ms; without audio "
          f"{1e3 * sum(plain) / max(1, len(plain)):.2f} ms ({len(plain)}), with audio "
          f"{1e3 * sum(with_codec) / max(1, len(with_codec)):.2f} ms ({len(with_codec)}); the frame alone "
          f"{frame_ms:.2f} ms; the codec's {chunk}-frame chunk of {args.batch} streams {codec_ms:.2f} ms "
          f"(realtime needs a step under 80 ms)", flush=True)
    with profile(activities=_activities()) as prof:
        for _ in range(min(args.steps, 16)):
            eng.step()
        _sync()
    _table(prof, args.rows)
    eng.abort([r.request_id for r in reqs])
    while eng.has_unfinished():
        eng.step()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m mstar.bench.tools.profile_speech", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kokoro-82m", help="a Kokoro, Orpheus or Qwen3-TTS preset (random weights)")
    p.add_argument("--batch", type=int, default=32, help="requests batched together")
    p.add_argument("--seconds", type=float, default=10.0, help="Kokoro: audio seconds per request")
    p.add_argument("--repeats", type=int, default=5, help="Kokoro: timed forwards")
    p.add_argument("--warm-steps", type=int, default=64, help="Orpheus, Qwen3-TTS: untimed engine steps first")
    p.add_argument("--steps", type=int, default=70, help="Orpheus, Qwen3-TTS: timed engine steps (28 / 16 of them profiled)")
    p.add_argument("--rows", type=int, default=30, help="rows of the op tables")
    p.add_argument("--dtype", default="auto", help="the engine's dtype")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    p.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True first")
    args = p.parse_args(argv)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from mstar.models import registry
    family = registry.family_of(args.model).name
    {"kokoro": kokoro, "orpheus": orpheus, "qwen3_tts": qwen3_tts}[family](args)


if __name__ == "__main__":
    main()
