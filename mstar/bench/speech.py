"""`mstar bench speech`: speech synthesis in process (no HTTP), a closed loop of c requests per
point, against the reference packages in the same run.

    mstar bench speech --model kokoro-82m --random-weights --baseline kokoro
    mstar bench speech --model orpheus-3b --random-weights --baseline hf
    mstar bench speech --model qwen3-tts-1.7b --random-weights

Request length: random weights never end an utterance by themselves (an LM samples audio tokens
until max_new_tokens; Kokoro's duration predictor gives ~25 frames per phoneme), so every request
is pinned to --seconds of audio:
    Orpheus  max_new_tokens = 7 * ceil(seconds * 24000 / 2048): a SNAC frame is 7 tokens and
             2048 samples. (End of speech is still allowed at a frame boundary, so a stream may end
             early by chance: the audio seconds below are what came out.)
    Kokoro   a phoneme string of --phonemes-per-second * seconds symbols with every token's
             duration pinned (the pipeline's `durations` input) so that the frames make --seconds.
    Qwen3-TTS  min_new_tokens = max_new_tokens = ceil(seconds * 12.5) frames (80 ms each): end of
             speech is never drawn, so every request is exactly that long.

Per point: N = max(--waves * c, --min-requests) requests after a warm-up of c; c are in flight
at all times. Reported: req/s, audio seconds per wall second, first-audio latency p50 / p90 (from
submission to the first audio chunk), the real-time factor (a request's latency / its audio
seconds, mean), and `realtime`: the fraction of streams that never run dry (each chunk arrives
before the audio before it has played out, counting from the first chunk). For the models that
sample tokens (Orpheus, Qwen3-TTS) also the first token's latency p50 (the prefill) and the mean
time a token after it (a decode step as a stream sees it): first audio splits into those.

Baselines (--baseline, before mstar's engine is built, in the same process and GPU; qwen-tts in a
subprocess on the same GPU):
    kokoro   the kokoro package's KModel, eager, one request at a time as the package serves them
             (its text pipeline is not imported: misaki downloads a spaCy model); the same
             durations pinned through its duration projection; one point (c1: it does not batch).
    hf       transformers' LlamaForCausalLM.generate (sampling as the Orpheus release, the same
             audio-token ranges per frame position, exactly max_new_tokens) on a batch of c
             prompts, then the snac package decoding every window as the release's glue does
             (the last 28 tokens every 7, the middle 2048 samples); first audio = the 28th
             token's time plus one window's decode. Points: --baseline-concurrency.
    qwen-tts the qwen-tts package's Qwen3TTSModel.generate_custom_voice with random weights of the
             same shapes on a batch of c requests (end of speech masked: exactly the frames asked),
             then its speech tokenizer's decode; it does not stream, so first audio is the whole
             call. Points: --baseline-concurrency.

Prints one line per point and appends one JSON record per point to --out
(default notes/results/speech.jsonl).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile
import time
import types
import warnings

import numpy as np
import torch

from mstar import knobs
from mstar.bench import append_jsonl

SNAC_SAMPLES_PER_FRAME = 2048  # SNAC 24 kHz: one frame (7 Orpheus tokens) of the coarsest codebook
PHONEME_TEXT = ("ðə kwˈɪk bɹˈaʊn fˈɑks ʤˈʌmps ˈOvəɹ ðə lˈAzi dˈɔɡ, ænd ɪt kˈʌmz bˈæk əɡˈɛn. "
                "hˈæpi ˈiːvnɪŋ, ɛvɹiwˌʌn! ")
QWEN3_TTS_FRAME_S = 0.08  # one 12 Hz codec frame
ORPHEUS_TEXT = ("Hey there, my name is Tara, and I am here to read you a short story about a fox, "
                "a dog, and a very long afternoon by the river.")


# -- statistics --------------------------------------------------------------------------------
class Stream:
    """One request's timeline: submitted at t0, (time, seconds of audio) per chunk, done at t1;
    for the models that sample tokens, when the first came back and how many came after it."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.chunks: list[tuple[float, float]] = []
        self.t1 = t0
        self.first_token: float | None = None
        self.last_token = t0
        self.tokens = 0

    def got_tokens(self, now: float, n: int) -> None:
        if n <= 0:
            return
        if self.first_token is None:
            self.first_token, n = now, n - 1
        self.tokens += n
        self.last_token = now

    @property
    def audio_s(self) -> float:
        return sum(s for _, s in self.chunks)

    def realtime(self) -> bool:
        """No underrun: every chunk arrives before the audio before it has played (from the first)."""
        if not self.chunks:
            return False
        start, played = self.chunks[0][0], 0.0
        for t, s in self.chunks:
            if t - start > played + 1e-3:
                return False
            played += s
        return True


def summarize(streams: list[Stream], wall_s: float) -> dict:
    first = [1e3 * (s.chunks[0][0] - s.t0) for s in streams if s.chunks]
    audio = [s.audio_s for s in streams]
    rtf = [(s.t1 - s.t0) / s.audio_s for s in streams if s.audio_s > 0]
    first_tok = [1e3 * (s.first_token - s.t0) for s in streams if s.first_token is not None]
    per_tok = [1e3 * (s.last_token - s.first_token) / s.tokens for s in streams if s.tokens > 0]
    return {
        "requests": len(streams), "wall_s": round(wall_s, 3),
        "req_s": round(len(streams) / wall_s, 3) if wall_s > 0 else None,
        "audio_s_per_s": round(sum(audio) / wall_s, 2) if wall_s > 0 else None,
        "audio_s_mean": round(float(np.mean(audio)), 3) if audio else 0.0,
        "first_audio_p50_ms": round(float(np.percentile(first, 50)), 1) if first else None,
        "first_audio_p90_ms": round(float(np.percentile(first, 90)), 1) if first else None,
        "rtf_mean": round(float(np.mean(rtf)), 4) if rtf else None,
        # where first audio goes, for the token models: the prefill's first token, then each token after it
        "first_token_p50_ms": round(float(np.percentile(first_tok, 50)), 1) if first_tok else None,
        "token_ms_mean": round(float(np.mean(per_tok)), 3) if per_tok else None,
        "realtime": round(sum(s.realtime() for s in streams) / len(streams), 3) if streams else 0.0,
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- mstar -------------------------------------------------------------------------------------
def closed_loop(llm, make_items, c: int, n: int) -> tuple[list[Stream], float]:
    """n requests through llm.engine, c in flight: (their streams, wall seconds)."""
    from mstar.models import interfaces as I
    eng = llm.engine
    live: dict[str, Stream] = {}
    done: list[Stream] = []
    submitted = 0

    def submit():
        nonlocal submitted
        items, voice, kw = make_items(submitted)
        (req,) = llm.speech_requests(items, voice, seed=submitted, **kw)
        eng.add_request(req)
        live[req.request_id] = Stream(time.perf_counter())
        submitted += 1

    t_start = time.perf_counter()
    while submitted < min(c, n):
        submit()
    while live:
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            st = live.get(o.request_id)
            if st is None:
                continue
            st.got_tokens(now, len(o.new_token_ids or ()))
            for m in o.media or ():
                if isinstance(m, I.AudioChunk):
                    st.chunks.append((now, len(m.pcm) / m.sample_rate))
            if o.finished:
                if o.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"{o.request_id} ended with {o.finish_reason}: {getattr(o, 'error', '')}")
                st.t1 = now
                done.append(live.pop(o.request_id))
                if submitted < n:
                    submit()
    return done, time.perf_counter() - t_start


def kokoro_phonemes(seconds: float, per_second: float) -> str:
    n = max(1, round(seconds * per_second))
    text = PHONEME_TEXT * (n // len(PHONEME_TEXT) + 1)
    return text[:n].rstrip() or text[:n]


def kokoro_durations(llm, phonemes: str, seconds: float) -> int:
    """Frames per token that make `seconds` of audio (measured: one request at 1 frame a token)."""
    (sp,) = llm.synthesize({"phonemes": phonemes, "durations": 1})
    tokens = len(phonemes) + 2  # two boundary pads
    samples_per_frame = len(sp.samples) / tokens
    return max(1, round(seconds * sp.sample_rate / samples_per_frame / tokens))


def orpheus_tokens(seconds: float) -> int:
    return 7 * math.ceil(seconds * 24000 / SNAC_SAMPLES_PER_FRAME)


def run_mstar(args, family: str) -> list[dict]:
    from mstar import LLM
    kw = dict(random_weights=args.random_weights, dtype=args.dtype, device=args.device,
              max_num_seqs=max(args.concurrency))
    if args.no_overlap:
        kw["async_output"] = False
    if family == "orpheus":
        kw.update(max_model_len=orpheus_tokens(args.seconds) + 512, codec=args.codec)
    llm = LLM(args.model, **kw)
    extra: dict = {}
    try:
        if family == "kokoro":
            ps = kokoro_phonemes(args.seconds, args.phonemes_per_second)
            dur = kokoro_durations(llm, ps, args.seconds)
            voices = list(llm.engine.accepts.get("voices") or [None])
            extra = {"phonemes": len(ps), "durations": dur}

            def make(i):
                return [{"phonemes": ps, "durations": dur}], voices[i % len(voices)], {}
        elif family == "qwen3_tts":  # the package baseline's prompt: the same text, speaker and language
            from mstar.bench.speech_qwen3_tts import LANGUAGE, SPEAKER, TEXT
            frames = math.ceil(args.seconds / QWEN3_TTS_FRAME_S - 1e-9)
            extra = {"frames": frames}

            def make(i):
                return [{"text": TEXT, "language": LANGUAGE, "min_new_tokens": frames}], SPEAKER, \
                    {"max_new_tokens": frames}
        else:
            n_tok = orpheus_tokens(args.seconds)
            voices = list(llm.engine.accepts.get("voices") or [None])
            extra = {"max_new_tokens": n_tok}

            def make(i):
                return [{"text": ORPHEUS_TEXT}], voices[i % len(voices)], {"max_new_tokens": n_tok}
        records = []
        for c in args.concurrency:
            closed_loop(llm, make, c, c)  # warm-up: this batch size's graphs, compiles, buckets
            _sync()
            n = max(args.waves * c, args.min_requests)
            streams, wall = closed_loop(llm, make, c, n)
            records.append(_record(args, "mstar", family, c, streams, wall, extra))
        return records
    finally:
        llm.close()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- baselines ---------------------------------------------------------------------------------
def _kmodel(config: dict, device: str):
    """kokoro.model.KModel with random weights, without importing kokoro.pipeline (misaki)."""
    if "kokoro" not in sys.modules:
        try:
            import misaki  # noqa: F401
        except ImportError:
            sys.modules.setdefault("kokoro.pipeline", types.SimpleNamespace(KPipeline=None))
    from kokoro.model import KModel
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its LSTM dropout and the old weight_norm API
        empty = os.path.join(d, "empty.pth")
        torch.save({}, empty)  # no weights: the random init stays
        model = KModel(repo_id="hexgrad/Kokoro-82M", config=config, model=empty)
    return model.to(device).eval()


class _PinnedDurations(torch.nn.Module):
    """A duration projection whose sigmoids sum to `frames` for every token."""

    def __init__(self, frames: int, max_dur: int):
        super().__init__()
        p = frames / max_dur
        self.logit = math.log(p / (1 - p))
        self.max_dur = max_dur

    def forward(self, x):
        return torch.full((*x.shape[:-1], self.max_dur), self.logit, dtype=x.dtype, device=x.device)


def run_kokoro_baseline(args) -> list[dict]:
    """KModel at the published shape (it hard-codes most of it), durations pinned for --seconds."""
    from mstar.models.kokoro.presets import KOKORO_82M
    cfg = dict(KOKORO_82M)
    model = _kmodel(cfg, args.device)
    ist = cfg["istftnet"]
    samples_per_frame = 2 * math.prod(ist["upsample_rates"]) * ist["gen_istft_hop_size"]  # F0 runs at 2x frames
    ps = kokoro_phonemes(args.seconds, args.phonemes_per_second)
    dur = max(1, min(int(cfg["max_dur"]) - 1, round(args.seconds * 24000 / samples_per_frame / (len(ps) + 2))))
    model.predictor.duration_proj = _PinnedDurations(dur, int(cfg["max_dur"]))
    g = torch.Generator().manual_seed(0)
    voice = 0.2 * torch.randn(510, 1, 256, generator=g)
    ref_s = voice[len(ps) - 1].to(args.device)

    def one() -> Stream:
        st = Stream(time.perf_counter())
        audio = model(ps, ref_s, 1.0)
        _sync()
        st.t1 = time.perf_counter()
        st.chunks.append((st.t1, audio.numel() / 24000))
        return st

    with torch.no_grad():
        for _ in range(3):
            one()
        t = time.perf_counter()
        streams = [one() for _ in range(args.baseline_requests)]
        wall = time.perf_counter() - t
    extra = {"phonemes": len(ps), "durations": dur, "note": "one request at a time (KModel does not batch)"}
    return [_record(args, "kokoro-package", "kokoro", 1, streams, wall, extra)]


class _TokenClock:
    """A generate() streamer: the time of every sampled token (the prompt's put aside)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt = True

    def put(self, value):
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _audio_ranges_processor(prompt_len: int, vocab: int, device):
    from transformers import LogitsProcessor

    from mstar.models.orpheus import tokens as T
    v = torch.arange(vocab, device=device)[None, :]
    lo = (T.AUDIO_TOKEN_BASE + torch.arange(T.CODES_PER_FRAME, device=device) * T.CODEBOOK_SIZE)[:, None]
    keep = (v >= lo) & (v < lo + T.CODEBOOK_SIZE)
    bias = torch.zeros(keep.shape, device=device).masked_fill_(~keep, float("-inf"))

    class AudioRanges(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores + bias[(input_ids.shape[1] - prompt_len) % T.CODES_PER_FRAME].to(scores.dtype)

    return AudioRanges()


def _release_window_decode(snac_model, window: list[int]) -> np.ndarray:
    """The Orpheus release's convert_to_audio on one window of 28 audio token ids (from a frame
    boundary): 4 frames of codes (c0, c1, c2, c2, c1, c2, c2), decoded whole, the middle 2048
    samples kept."""
    from mstar.models.orpheus import tokens as T
    f = np.asarray([T.token_code(t, k) for k, t in enumerate(window)], dtype=np.int64).reshape(4, 7)
    dev = next(snac_model.parameters()).device
    codes = [torch.tensor(f[:, [0]].reshape(-1), device=dev)[None],
             torch.tensor(f[:, [1, 4]].reshape(-1), device=dev)[None],
             torch.tensor(f[:, [2, 3, 5, 6]].reshape(-1), device=dev)[None]]
    with torch.inference_mode():
        audio = snac_model.decode(codes)
    return audio[:, :, 2048:4096].detach().cpu().numpy()


def run_hf_baseline(args) -> list[dict]:
    import snac
    from transformers import LlamaConfig, LlamaForCausalLM

    from mstar.models import registry
    from mstar.models.orpheus import tokens as T
    from mstar.models.orpheus.presets import CODEC_PRESETS
    from mstar.models.snac.presets import PRESETS as SNAC_PRESETS
    from mstar.models.tokenizer import byte_tokenizer

    preset = registry.preset(args.model)
    if preset is None:
        raise SystemExit("mstar bench speech: --baseline hf runs the presets (random weights) only")
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    dtype = dtypes[args.dtype if args.dtype != "auto" else "bfloat16"]
    cfg = LlamaConfig(**preset.config)
    torch.manual_seed(0)
    with torch.device(args.device):
        lm = LlamaForCausalLM(cfg).to(dtype).eval()
    codec = snac.SNAC(**SNAC_PRESETS[args.codec or CODEC_PRESETS.get(args.model, "snac-24khz")]).to(args.device).eval()
    tok = byte_tokenizer()
    prompt = T.format_prompt(lambda s: tok.encode(s), ORPHEUS_TEXT, T.VOICES[0])
    n_tok = orpheus_tokens(args.seconds)
    records = []

    def batch(c: int, max_new: int) -> list[Stream]:
        ids = torch.tensor([prompt] * c, device=args.device)
        clock = _TokenClock()
        proc = _audio_ranges_processor(len(prompt), cfg.vocab_size, args.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = lm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              temperature=T.DEFAULT_SAMPLING["temperature"], top_p=T.DEFAULT_SAMPLING["top_p"],
                              repetition_penalty=T.DEFAULT_SAMPLING["repetition_penalty"], max_new_tokens=max_new,
                              min_new_tokens=max_new, eos_token_id=T.END_OF_SPEECH, pad_token_id=T.PAD,
                              logits_processor=[proc], streamer=clock)
        gen = out[:, len(prompt):].tolist()
        streams, window_s = [], None
        for row in gen:
            st = Stream(t0)
            stream = T.AudioTokenStream()
            for w in stream.push(row):  # every window, decoded one at a time as the release's glue
                t_w = time.perf_counter()
                pcm = _release_window_decode(codec, w)
                window_s = window_s or (time.perf_counter() - t_w)
                st.chunks.append((0.0, pcm.size / 24000))
            streams.append(st)
        t1 = time.perf_counter()
        first = clock.times[T.WINDOW_TOKENS - 1] + (window_s or 0.0) if len(clock.times) >= T.WINDOW_TOKENS else t1
        for st in streams:  # the glue would stream: first audio after the 28th token and a decode
            if st.chunks:
                st.chunks[0] = (first, st.chunks[0][1])
                st.chunks[1:] = [(t1, s) for _, s in st.chunks[1:]]
            st.t1 = t1
        return streams

    batch(1, 64)  # warm-up
    for c in args.baseline_concurrency:
        t = time.perf_counter()
        streams = batch(c, n_tok)
        wall = time.perf_counter() - t
        # not streamed (every window but the first is decoded after generate): realtime does not apply
        records.append(_record(args, "hf-generate+snac", "orpheus", c, streams, wall,
                               {"max_new_tokens": n_tok, "realtime": None,
                                "note": "one generate() batch of c; windows decoded after it"}))
    return records  # (lm and codec freed with this frame, before mstar's engine is built)


# -- records -----------------------------------------------------------------------------------
def _record(args, engine: str, family: str, c: int, streams: list[Stream], wall: float, extra: dict) -> dict:
    from mstar.bench.serve import git_commit
    rec = {"bench": "speech", "date": datetime.date.today().isoformat(), "commit": git_commit(),
           "model": args.model, "family": family, "engine": engine, "concurrency": c,
           "seconds_asked": args.seconds, "dtype": args.dtype, "backends": os.environ.get("MSTAR_BACKENDS", ""),
           "knobs": knobs.changed(),
           "overlap": not args.no_overlap,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           **summarize(streams, wall), **extra}
    print(f"{engine:>18} c={c:<3} {rec['req_s']:>8} req/s  {rec['audio_s_per_s']:>8} audio s/s  first audio "
          f"p50 {rec['first_audio_p50_ms']} p90 {rec['first_audio_p90_ms']} ms  RTF {rec['rtf_mean']}  "
          f"realtime {rec['realtime']}  ({rec['requests']} requests, {rec['audio_s_mean']} s each)"
          + (f"  first token p50 {rec['first_token_p50_ms']} ms, {rec['token_ms_mean']} ms a token after it"
             if rec.get("token_ms_mean") is not None else ""), flush=True)
    if args.out:
        append_jsonl(args.out, rec)
    return rec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mstar bench speech", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kokoro-82m", help="a speech preset or checkpoint directory (kokoro-82m, "
                                                         "orpheus-3b, qwen3-tts-1.7b, tiny-kokoro, tiny-orpheus, "
                                                         "tiny-qwen3-tts, DIR)")
    p.add_argument("--random-weights", action="store_true", help="random weights of the preset's or directory's shape")
    p.add_argument("--codec", default=None, help="Orpheus: the SNAC directory or preset (default: found as the "
                                                 "server finds it)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64], help="points: requests in flight")
    p.add_argument("--seconds", type=float, default=10.0, help="audio seconds per request (pinned; see above)")
    p.add_argument("--phonemes-per-second", type=float, default=13.0,
                   help="Kokoro: phoneme symbols per second of speech in the request's string")
    p.add_argument("--waves", type=int, default=4, help="requests per point: max(waves * c, --min-requests)")
    p.add_argument("--min-requests", type=int, default=16, help="see --waves")
    p.add_argument("--baseline", choices=["none", "kokoro", "hf", "qwen-tts"], default="none",
                   help="the reference package in the same run (kokoro: KModel; hf: transformers generate + snac; "
                        "qwen-tts: the qwen-tts package's generate_custom_voice, mstar/bench/speech_qwen3_tts.py)")
    p.add_argument("--qwen-tts-path", default=None,
                   help="qwen-tts baseline: a directory with qwen_tts and the transformers it pins (pip install "
                        "--no-deps --target DIR), put first on the baseline subprocess's path")
    p.add_argument("--qwen-tts-python", default=None,
                   help="qwen-tts baseline: the interpreter of its subprocess (default: this one)")
    p.add_argument("--baseline-concurrency", type=int, nargs="+", default=[1, 8],
                   help="hf and qwen-tts baselines: batch sizes (one generate() batch each)")
    p.add_argument("--baseline-requests", type=int, default=16, help="kokoro baseline: requests, one at a time")
    p.add_argument("--dtype", default="auto", help="auto (the engine's: bfloat16 on CUDA, float32 on CPU) | bfloat16 | "
                                                 "float16 | float32; the hf baseline takes bfloat16 for auto")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    p.add_argument("--no-overlap", action="store_true",
                   help="Orpheus: decode synchronously (async_output off), to measure what the overlap gives")
    p.add_argument("--out", default="notes/results/speech.jsonl", help="JSON lines appended here ('' for none)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from mstar.models import registry
    family = registry.family_of(args.model).name
    if family not in ("kokoro", "orpheus", "qwen3_tts"):
        print(f"mstar bench speech: {args.model!r} is a {family} model, not a speech model", file=sys.stderr)
        return 2
    wants = {"hf": "orpheus", "kokoro": "kokoro", "qwen-tts": "qwen3_tts"}
    if args.baseline in wants and wants[args.baseline] != family:
        print(f"mstar bench speech: --baseline {args.baseline} does not apply to {family}", file=sys.stderr)
        return 2
    if args.baseline in ("hf", "qwen-tts"):
        if args.baseline == "hf":
            run_hf_baseline(args)
        else:
            from mstar.bench.speech_qwen3_tts import run_qwen_tts_baseline
            run_qwen_tts_baseline(args)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    records = run_mstar(args, family)
    if args.baseline == "kokoro":
        base = run_kokoro_baseline(args)[0]
        for r in records:
            print(f"c={r['concurrency']}: {r['req_s'] / base['req_s']:.1f}x the kokoro package", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
