"""`python -m mstar.bench.startup`: server start-up, from launch to the first served token.

Each run launches `python -m mstar.runtime.serve MODEL` (random weights unless MODEL is a
directory), waits until it serves, asks one streamed completion for one token and stops the
server. The first token's time since launch is what a user waits after (re)starting a server;
the server log's start-up timeline splits it (notes/startup.md):

    api        launch -> the engine process is started (the API process's imports and checks)
    spawn      the engine process's interpreter start-up
    imports    its modules: torch, the op layer and its backends, the model families
    model / caches / graphs / warm-up   the engine's own start-up
    ready      launch -> the server listens;  first token   launch -> the first token

    python -m mstar.bench.startup qwen3.5-0.8b --runs 2 --cold     # a cold start, then a warm one
    python -m mstar.bench.startup qwen3.5-0.8b --runs 3 -- --max-num-seqs 64

--cold runs the first launch with an empty kernel cache (a new MSTAR_KERNEL_CACHE: temporary,
or --cache-root), which the later runs reuse, so they are warm; without it every run uses the
environment's cache. A table is printed and one record per run is appended to
notes/results/<bench-name>.jsonl.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from mstar.bench.local_server import SERVING, LocalServer
from mstar.bench.serve import add_record_flags, git_commit, report_records, table_lines


# the server log's start-up timeline: record key -> pattern (its first group is seconds)
TIMELINE = {
    "api_s": r"starting the engine process \(([\d.]+) s after launch\)",
    "spawn_s": r"engine process: up ([\d.]+) s after it was started",
    "imports_s": r"engine process: modules imported in ([\d.]+) s",
    "engine_s": r"engine start-up ([\d.]+) s:",
    "model_s": r"engine start-up [\d.]+ s: model ([\d.]+) s",
    "caches_s": r"tokenizer \+ caches ([\d.]+) s",
    "graphs_s": r"graphs ([\d.]+) s, warm-up",
    "warmup_s": r"warm-up ([\d.]+) s",
    "engine_ready_s": r"engine ready in ([\d.]+) s",
}
_TRITON = re.compile(r"start-up built (\d+) Triton kernel variants \(([\d.]+) s")


def parse_timeline(log: str) -> dict[str, float]:
    """The start-up figures a server log states (keys of TIMELINE, plus triton_variants /
    triton_s and ready_s); a line the log lacks leaves its key out."""
    out: dict[str, float] = {}
    for key, pat in TIMELINE.items():
        m = re.search(pat, log)
        if m:
            out[key] = float(m.group(1))
    m = _TRITON.search(log)
    if m:
        out["triton_variants"], out["triton_s"] = int(m.group(1)), float(m.group(2))
    m = SERVING.search(log)
    if m:
        out["ready_s"] = float(m.group(2))
    return out


def first_token_s(url: str, model: str, timeout: float) -> float:
    """Seconds until the first streamed token of a one-token completion."""
    import httpx
    t0 = time.perf_counter()
    # token ids: a preset served with random weights has no tokenizer
    body = {"model": model, "prompt": [11, 12, 13, 14], "max_tokens": 1, "stream": True}
    with httpx.stream("POST", url.rstrip("/") + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the first request got HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                if json.loads(line[5:]).get("choices"):
                    return time.perf_counter() - t0
    raise RuntimeError("the first request streamed no token")


def one_run(args, env: dict[str, str], log_path: str) -> dict[str, Any]:
    server = LocalServer(args.model, args.server_args, timeout=args.timeout, log_path=log_path, env=env)
    try:
        first = first_token_s(server.url, args.model, args.timeout)
        total = time.perf_counter() - server.launched_at
    finally:
        server.close()
    rec = parse_timeline(server.log())
    rec.update(seen_ready_s=round(server.ready_s, 2), first_request_s=round(first, 3), first_token_s=round(total, 2))
    return rec


def _gpu_name() -> str:
    # nvidia-smi, not torch: importing torch here would warm the page cache for the cold start
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False).stdout.strip().splitlines()
        return out[0] if out else "cpu"
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"


def format_table(recs: list[dict[str, Any]]) -> str:
    cols = [("run", "run", "{}"), ("cache", "cache", "{}"), ("api", "api_s", "{:.1f}"),
            ("spawn", "spawn_s", "{:.1f}"), ("imports", "imports_s", "{:.1f}"), ("model", "model_s", "{:.1f}"),
            ("caches", "caches_s", "{:.1f}"), ("graphs", "graphs_s", "{:.1f}"), ("warm-up", "warmup_s", "{:.1f}"),
            ("Triton built", "triton_variants", "{}"), ("ready s", "ready_s", "{:.1f}"),
            ("first token s", "first_token_s", "{:.2f}")]
    return "\n".join(table_lines(cols, recs))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mstar.bench.startup", description=__doc__.split("\n\n")[0],
                                epilog="Server flags go after `--`, e.g. `-- --max-num-seqs 64`.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", help="Preset name (served with --random-weights) or model directory.")
    p.add_argument("--runs", type=int, default=2, help="Launches, one after another.")
    p.add_argument("--cold", action="store_true",
                   help="Run the first launch on an empty kernel cache (a new temporary MSTAR_KERNEL_CACHE, "
                        "kept for the later runs and removed at the end).")
    p.add_argument("--cache-root", default=None,
                   help="With --cold: the kernel cache root to start empty (it must not exist or be empty) and to "
                        "keep afterwards, e.g. to export it (python -m mstar.ops.cache --root DIR export ...).")
    p.add_argument("--timeout", type=float, default=900.0, help="Seconds a launch may take to serve its first token.")
    p.add_argument("--log-dir", default=None,
                   help="Keep each launch's server log here as startup-<run>.log (default: a temporary folder).")
    add_record_flags(p, "startup")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])
    args.server_args = argv[cut + 1:]  # after `--`: server flags, passed on as they are
    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    env = dict(os.environ)
    cache_dir = None
    if args.cold and args.cache_root:
        if os.path.isdir(args.cache_root) and os.listdir(args.cache_root):
            raise SystemExit(f"--cache-root {args.cache_root} is not empty: a cold start needs an empty cache")
        cache_dir = os.path.abspath(args.cache_root)
        os.makedirs(cache_dir, exist_ok=True)
    elif args.cold:
        cache_dir = tempfile.mkdtemp(prefix="mstar-startup-cache-")
    elif args.cache_root:
        raise SystemExit("--cache-root goes with --cold")
    if cache_dir:
        env["MSTAR_KERNEL_CACHE"] = cache_dir
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="mstar-startup-logs-")
    os.makedirs(log_dir, exist_ok=True)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    base = {"bench": args.bench_name, "model": args.model, "server_args": " ".join(args.server_args),
            "gpu": _gpu_name(), "commit": git_commit(), "date": date}
    if args.label:
        base["label"] = args.label
    recs = []
    try:
        for i in range(args.runs):
            cache = "empty" if (cache_dir and i == 0) else ("warm" if cache_dir else "as set")
            rec = {**base, "run": i + 1, "cache": cache}
            rec.update(one_run(args, env, os.path.join(log_dir, f"startup-{i + 1}.log")))
            recs.append(rec)
            print(f"run {i + 1} ({cache} cache): first token {rec['first_token_s']:.2f} s after launch", flush=True)
    finally:
        if cache_dir and not args.cache_root:
            shutil.rmtree(cache_dir, ignore_errors=True)
        if not args.log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
    print(f"{args.model}  gpu={base['gpu']}  commit={base['commit']}")
    report_records(recs, format_table(recs), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
