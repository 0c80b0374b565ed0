"""`python -m mstar.bench.whisper`: the Whisper serving benchmark (protocol: notes/benchmarks.md).

Protocol: 10-second 16 kHz clips, 32 output tokens (EOS ignored), 64 requests, closed loop
at concurrency 1 / 4 / 16; reported: requests per second and first-token p90.

    python -m mstar.bench.whisper --base-url http://127.0.0.1:8000 --model whisper-large-v3
    python -m mstar.bench.whisper --launch --model whisper-large-v3      # starts the server itself
                                                                          # (random weights unless a dir)

Every request is a distinct synthetic clip (tones + noise, seeded) sent as a 16-bit WAV to
POST /v1/audio/transcriptions with language=en, temperature 0, and the forced output length
as vLLM-style extra form fields (`max_tokens` = output length, `ignore_eos=true`). At each
concurrency c, c workers send one request at a time until N requests are done; a warm-up
round of c requests runs first and is not counted.

First token: the server's own figure (the `x-mstar-timing` header of mstar: from the request's
arrival to the first token of its window; the response is not streamed). Servers without
the header (vLLM) get the client-side latency in its place (an upper bound), flagged in
the record (`first_token_source`).

Phase breakdown per request (mstar only), means over the timed requests: `audio_ms` (upload
parse + decode + resample in the API process), `first_token_ms`, `after_first_token_ms`
(the remaining decode steps), and from the engine's counters (/metrics, deltas over the
level): `feature_ms` (log-mel on the device) and `encoder_ms` (encoder + cross-K/V write)
per request, `encoder_batch` (requests per encoder call). One JSON record per concurrency is
appended to notes/results/whisper.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import io
import json
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from mstar.bench.serve import (_local_gpu, add_record_flags, closed_loop, git_commit, percentile,
                               report_records, table_lines)

_ENGINE_KEYS = ("encoder_num_encoded", "encoder_num_calls", "encoder_feature_s", "encoder_time_s")


def make_clip(seconds: float, seed: int, sr: int = 16000) -> bytes:
    """A distinct 16-bit WAV clip: two tones with a slow envelope, plus noise."""
    import numpy as np
    import soundfile as sf
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0, f1 = g.uniform(90, 600), g.uniform(600, 3000)
    x = 0.25 * np.sin(2 * np.pi * f0 * t) * (1 + np.sin(2 * np.pi * g.uniform(0.3, 2) * t))
    x += 0.1 * np.sin(2 * np.pi * f1 * t) + 0.03 * g.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), sr, subtype="PCM_16", format="WAV")
    return buf.getvalue()


@dataclass
class Result:
    ok: bool
    latency: float = 0.0  # s, client side
    first_token: float | None = None  # s, server side (or client latency)
    timing: dict[str, Any] = field(default_factory=dict)
    tokens: int | None = None
    error: str | None = None


async def _one(client, url: str, clip: bytes, form: dict, headers: dict) -> Result:
    t0 = time.perf_counter()
    try:
        r = await client.post(url, files={"file": ("clip.wav", clip, "audio/wav")}, data=form, headers=headers)
    except Exception as e:  # noqa: BLE001
        return Result(False, error=f"{type(e).__name__}: {e}")
    lat = time.perf_counter() - t0
    if r.status_code != 200:
        return Result(False, latency=lat, error=f"HTTP {r.status_code}: {r.text[:200]}")
    timing = {}
    if "x-mstar-timing" in r.headers:
        try:
            timing = json.loads(r.headers["x-mstar-timing"])
        except ValueError:
            timing = {}
    ft = timing.get("first_token_ms")
    return Result(True, latency=lat, first_token=ft / 1e3 if ft is not None else None, timing=timing,
                  tokens=timing.get("completion_tokens"))


async def _closed_loop(base_url: str, clips: list[bytes], form: dict, concurrency: int, headers: dict,
                       timeout: float) -> tuple[float, list[Result]]:
    url = base_url.rstrip("/") + "/v1/audio/transcriptions"
    wall, results = await closed_loop(len(clips), concurrency,
                                      lambda client, i: _one(client, url, clips[i], form, headers), timeout)
    return wall, [r for r in results if r is not None]


def _engine_counters(base_url: str, headers: dict) -> dict[str, float]:
    import httpx
    out: dict[str, float] = {}
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
    except Exception:  # noqa: BLE001
        return out
    for line in text.splitlines():
        m = re.match(r'mstar_engine_stat\{name="([^"]+)"\} (\S+)', line)
        if m and m.group(1) in _ENGINE_KEYS:
            out[m.group(1)] = float(m.group(2))
        elif line.startswith("mstar_peak_gpu_memory_bytes "):
            out["peak_gpu_mem_bytes"] = float(line.split()[1])
    return out


def _wait_counters(base_url: str, headers: dict, want_encoded: float, timeout: float = 5.0) -> dict[str, float]:
    """Engine stats reach /metrics a little after the responses: wait until they count every request."""
    deadline = time.monotonic() + timeout
    c = _engine_counters(base_url, headers)
    while c.get("encoder_num_encoded", want_encoded) < want_encoded and time.monotonic() < deadline:
        time.sleep(0.1)
        c = _engine_counters(base_url, headers)
    return c


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 3) if xs else None


def run_level(args, c: int, headers: dict) -> dict[str, Any]:
    n = args.num_requests
    warm = args.num_warmup if args.num_warmup is not None else c
    form = {"model": args.model, "language": args.language, "temperature": "0", "response_format": "json",
            "max_tokens": str(args.output_len), "ignore_eos": "true"}
    base = 1_000_000 * c + args.seed
    if warm:
        wclips = [make_clip(args.clip_seconds, base + 500_000 + i) for i in range(warm)]
        asyncio.run(_closed_loop(args.base_url, wclips, form, c, headers, args.timeout))
    clips = [make_clip(args.clip_seconds, base + i) for i in range(n)]
    before = _engine_counters(args.base_url, headers)
    wall, res = asyncio.run(_closed_loop(args.base_url, clips, form, c, headers, args.timeout))
    ok = [r for r in res if r.ok]
    after = _wait_counters(args.base_url, headers, before.get("encoder_num_encoded", 0) + len(ok)) \
        if before else {}
    server_ft = bool(ok) and all(r.first_token is not None for r in ok)
    fts = [(r.first_token if server_ft else r.latency) * 1e3 for r in ok]
    lats = [r.latency * 1e3 for r in ok]
    rec: dict[str, Any] = {
        "bench": args.bench_name, "backend": "openai", "model": args.model, "tp": args.tp, "concurrency": c,
        "num_requests": n, "clip_seconds": args.clip_seconds, "output_len": args.output_len,
        "req_s": round(len(ok) / wall, 3) if wall > 0 else 0.0,
        "first_token_p50_ms": round(percentile(fts, 50), 2), "first_token_p90_ms": round(percentile(fts, 90), 2),
        "latency_p50_ms": round(percentile(lats, 50), 2), "latency_p90_ms": round(percentile(lats, 90), 2),
        "first_token_source": "server" if server_ft else "client_latency",
        "failed": len(res) - len(ok), "wall_s": round(wall, 3),
    }
    toks = [r.tokens for r in ok if r.tokens is not None]
    if toks:
        rec["output_len_ok"] = all(t == args.output_len for t in toks)
    phases: dict[str, Any] = {}
    if ok and ok[0].timing:
        phases["audio_ms"] = _mean([r.timing.get("audio_ms") for r in ok])
        phases["first_token_ms"] = _mean([r.timing.get("first_token_ms") for r in ok])
        phases["after_first_token_ms"] = _mean([r.timing["total_ms"] - r.timing["first_token_ms"] for r in ok
                                                if r.timing.get("first_token_ms") is not None])
        phases["server_total_ms"] = _mean([r.timing.get("total_ms") for r in ok])
    if before and after:
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _ENGINE_KEYS}
        if d["encoder_num_encoded"] > 0:
            phases["feature_ms"] = round(1e3 * d["encoder_feature_s"] / d["encoder_num_encoded"], 3)
            phases["encoder_ms"] = round(1e3 * d["encoder_time_s"] / d["encoder_num_encoded"], 3)
            phases["encoder_batch"] = round(d["encoder_num_encoded"] / max(1.0, d["encoder_num_calls"]), 2)
        if after.get("peak_gpu_mem_bytes"):
            rec["peak_gpu_mem"] = round(after["peak_gpu_mem_bytes"] / 2 ** 30, 3)
    if phases:
        rec["phases"] = phases
    if not ok and res:
        rec["error"] = res[0].error
    return rec


def _server_gpu(base_url: str, headers: dict) -> str | None:
    """The server's GPU as /health reports it (only to a caller with the API key), else None."""
    import httpx
    try:
        return httpx.get(base_url.rstrip("/") + "/health", headers=headers, timeout=10).json().get("gpu")
    except Exception:  # noqa: BLE001
        return None


def format_table(recs: list[dict[str, Any]]) -> str:
    cols = [("c", "concurrency", "{}"), ("N", "num_requests", "{}"), ("req/s", "req_s", "{:.2f}"),
            ("first tok p50 ms", "first_token_p50_ms", "{:.1f}"), ("first tok p90 ms", "first_token_p90_ms", "{:.1f}"),
            ("latency p90 ms", "latency_p90_ms", "{:.1f}"), ("failed", "failed", "{}")]
    lines = table_lines(cols, recs)
    for r in recs:
        if r.get("phases"):
            lines.append(f"c={r['concurrency']} phases (ms/request): "
                         + ", ".join(f"{k}={v}" for k, v in r["phases"].items()))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mstar.bench.whisper", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server (ignored with --launch).")
    p.add_argument("--launch", action="store_true",
                   help="Start `python -m mstar.runtime.serve --model MODEL` here (random weights for a preset).")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="With --launch: the rest of the command line goes to the server.")
    p.add_argument("--server-log", default=None,
                   help="With --launch: keep the server's output in this file (default: a temporary file, removed).")
    p.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="With --launch: seconds to wait for the server to report ready (its start-up warm-up "
                        "runs the first-use kernel builds before it does).")
    p.add_argument("--model", default="whisper-large-v3", help="Served model name (or preset / dir with --launch).")
    p.add_argument("--api-key", default=None, help="Bearer token for a server started with --api-key.")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                   help="Closed-loop concurrency levels (the protocol's: 1 4 16).")
    p.add_argument("--num-requests", type=int, default=64, help="Timed requests per concurrency level.")
    p.add_argument("--num-warmup", type=int, default=None, help="Untimed requests first (default: c).")
    p.add_argument("--clip-seconds", type=float, default=10.0, help="Length of each synthetic 16 kHz clip.")
    p.add_argument("--output-len", type=int, default=32, help="Output tokens per request (EOS ignored).")
    p.add_argument("--language", default="en", help="The `language` field of every request.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the synthetic clips.")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout (s).")
    p.add_argument("--tp", type=int, default=1, help="Tensor-parallel size to record (with --launch pass --tp in --server-args).")
    p.add_argument("--gpu", default=None, help="GPU name to record (default: the server's /health).")
    add_record_flags(p, "whisper")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if any(c < 1 for c in args.concurrency) or args.num_requests < 1 or args.output_len < 1:
        raise SystemExit("--concurrency, --num-requests and --output-len must be >= 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    launched = None
    if args.launch:
        from mstar.bench.local_server import LocalServer
        try:
            launched = LocalServer(args.model, ["--max-num-seqs", str(max(args.concurrency)), *args.server_args],
                                   timeout=args.startup_timeout, log_path=args.server_log)
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        args.base_url = launched.url  # a directory is served under its path: --model works as the name
    try:
        gpu = args.gpu or _server_gpu(args.base_url, headers) or _local_gpu()
        date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        commit = git_commit()
        recs = []
        for c in args.concurrency:
            rec = run_level(args, c, headers)
            rec.update(gpu=gpu, commit=commit, date=date)
            if args.launch:
                rec["launched"] = True
            if args.label:
                rec["label"] = args.label
            recs.append(rec)
    finally:
        if launched is not None:
            launched.close()
    print(f"{args.model}  clip={args.clip_seconds:g}s out={args.output_len}  gpu={gpu}  commit={commit}")
    report_records(recs, format_table(recs), args)
    return 0 if all(r["failed"] == 0 for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
