"""The server path alone: the real server (`python -m mstar.runtime.serve`) with the synthetic
engine (mstar/runtime/engine/synthetic_engine.py: one token per running request per step at a fixed
step rate, no model), driven by the real benchmark client (mstar.bench.serve's closed loop:
streamed /v1/completions, token-id prompts, return_token_ids, include_usage) at each
concurrency. Reports tokens/s delivered to the clients and CPU time per delivered token in the
engine process, the API process and the client (this process), from /proc over the timed loop.

    python -m mstar.bench.tools.server_overhead                          # c 1 32 128, 200 steps/s
    python -m mstar.bench.tools.server_overhead --steps-per-s 0 -c 128   # steps as fast as they go
    python -m mstar.bench.tools.server_overhead --check                  # also check every token id
    python -m mstar.bench.tools.server_overhead --py-spy api -c 128      # profile a process over the loop

Engine CPU includes the pacing loop's own bookkeeping (it sleeps to the step rate; sleeping
costs no CPU). On a machine with fewer cores than busy processes the three share the cores, so
tokens/s is bounded by their sum of CPU per token, not by any one of them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

# the folder that holds the mstar package (a checkout, or site-packages): where --server-repo defaults to
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mstar.bench import serve as bench  # noqa: E402

_READY = re.compile(r"mstar is serving \S+ at (http://\S+) ")
_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return int(parts[11]) / _TICK, int(parts[12]) / _TICK


def proc_cpu_s(pid: int) -> float:
    return sum(proc_cpu(pid))


def self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def start_server(args) -> tuple[subprocess.Popen, str, object]:
    log = tempfile.NamedTemporaryFile("w+", prefix="mstar-overhead-", suffix=".log", delete=False)
    env = dict(os.environ, PYTHONPATH=args.server_repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SYNTH_STEPS_PER_S=str(args.steps_per_s))
    for kv in args.server_env:
        k, _, v = kv.partition("=")
        env[k] = v.replace("{PYTHONPATH}", env.get(k, "")) if k == "PYTHONPATH" else v
    cmd = [sys.executable, *args.python_arg, "-m", "mstar.runtime.serving.serve", "--model", args.model, "--port", "0", "--no-access-log",
           "--engine-factory", "mstar.runtime.engine.synthetic_engine:SyntheticEngine",
           "--max-num-seqs", str(args.max_num_seqs), "--max-pending", "100000", *args.server_arg]
    proc = subprocess.Popen(cmd, cwd=args.server_repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(log.name, errors="replace") as f:
            m = _READY.search(f.read())
        if m:
            return proc, m.group(1), log
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    with open(log.name, errors="replace") as f:
        raise SystemExit(f"server did not start:\n{f.read()}")


def engine_stat(url: str, name: str) -> float | None:
    text = bench._get_json(url, "/metrics", {})
    if not isinstance(text, str):
        return None
    for line in text.splitlines():
        if line.startswith((f'mstar_engine_stat{{name="{name}"}} ', f"mstar_{name} ")):
            return float(line.split()[-1])
    return None


def engine_steps(url: str) -> float | None:
    text = bench._get_json(url, "/metrics", {})
    if not isinstance(text, str):
        return None
    for line in text.splitlines():
        if line.startswith("mstar_engine_steps") or 'name="num_steps"' in line:
            return float(line.split()[-1])
    return None


def check_tokens(results_ids: list, prompts: list, vocab: int, output_len: int) -> int:
    from mstar.runtime.engine.synthetic_engine import synthetic_token
    bad = 0
    for ids, p in zip(results_ids, prompts):
        want = [synthetic_token(p, i, vocab) for i in range(output_len)]
        if ids != want:
            bad += 1
    return bad


class _IdTally(bench._Tally):
    """The benchmark's tally, also keeping the token ids in order (--check)."""

    __slots__ = ("ids",)

    def __init__(self):
        super().__init__(True)
        self.ids: list[int] = []

    def line(self, line: str) -> None:
        if not self.done and line.startswith("data:") and line[5:].strip() != "[DONE]":
            for ch in json.loads(line[5:]).get("choices") or []:
                self.ids.extend(ch.get("token_ids") or [])
        super().line(line)


def run_level(args, url: str, api_pid: int, engine_pid: int, c: int, li: int) -> dict:
    n = args.num_prompts or max(4 * c, 16)
    prompts = bench.random_prompts(n + c, args.input_len, args.vocab, args.seed + 1000 * li)
    base = url.rstrip("/") + "/v1/completions"
    import httpx

    def payload(p):
        return {"model": args.model, "prompt": p, "max_tokens": args.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}

    raw = args.http_client == "raw"
    timeout = 600.0
    warm = [payload(p) for p in prompts[:c]]
    timed = [payload(p) for p in prompts[c:]]
    sinks: list = [None] * n

    def loop(payloads, keep_ids):
        def tally(i):
            if not keep_ids:
                return None
            t = sinks[i] = _IdTally()
            return t

        if raw:
            return bench.closed_loop_raw(url, len(payloads), c, lambda box, cl, i: bench._one_request_raw(
                box, cl, "/v1/completions", payloads[i], {}, True, timeout, tally(i)))
        return bench.closed_loop(len(payloads), c, lambda cl, i: bench._one_request(
            cl, base, payloads[i], {}, True, tally(i)), httpx.Timeout(timeout, connect=30.0))

    asyncio.run(loop(warm, False))
    spy = None
    if args.py_spy:
        pid = {"api": api_pid, "engine": engine_pid, "client": os.getpid()}[args.py_spy]
        out = os.path.join(args.py_spy_dir, f"pyspy-{args.py_spy}-c{c}.txt")
        spy = subprocess.Popen(["py-spy", "record", "-p", str(pid), "-f", "raw", "-o", out, "-r", "200",
                                "--nonblocking", *(["--idle", "--threads"] if args.py_spy_idle else []),
                                *(["--gil"] if args.py_spy_gil else [])],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(1.0)
    perf = None
    if args.perf:
        pid = {"api": api_pid, "engine": engine_pid, "client": os.getpid()}[args.perf]
        out = os.path.join(args.py_spy_dir, f"perf-{args.perf}-c{c}.data")
        perf = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-p", str(pid), "-o", out],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(1.0)
    steps0 = engine_steps(url)
    busy0 = engine_stat(url, "synthetic_step_busy_s")
    e0, a0, c0, as0 = proc_cpu_s(engine_pid), proc_cpu_s(api_pid), self_cpu_s(), proc_cpu(api_pid)[1]
    wall, res = asyncio.run(loop(timed, args.check))
    e1, a1, c1, as1 = proc_cpu_s(engine_pid), proc_cpu_s(api_pid), self_cpu_s(), proc_cpu(api_pid)[1]
    for prof in (spy, perf):
        if prof is not None:
            prof.send_signal(signal.SIGINT)
            prof.wait(30)
    time.sleep(0.3)  # let the engine's last stats reach /metrics
    steps1 = engine_steps(url)
    busy1 = engine_stat(url, "synthetic_step_busy_s")
    lv = bench.LevelResult(c, n, wall, res)
    s = lv.summary()
    toks = s["output_tokens"]
    rec = {"concurrency": c, "num_prompts": n, "steps_per_s_target": args.steps_per_s,
           "output_tok_s": s["output_tok_s"], "target_tok_s": (args.steps_per_s * min(c, args.max_num_seqs)
                                                               if args.steps_per_s else None),
           "itl_p50_ms": s["itl_p50_ms"], "itl_p90_ms": s["itl_p90_ms"], "ttft_p50_ms": s["ttft_p50_ms"],
           "failed": s["failed"], "wall_s": s["wall_s"], "output_tokens": toks,
           "tokens_per_chunk": round(toks / max(1, sum(r.chunks for r in res if r is not None and r.ok)), 2),
           "engine_steps_per_s": round((steps1 - steps0) / wall, 1) if steps0 is not None and steps1 is not None
           else None,
           "engine_cpu_us_per_tok": round((e1 - e0) / toks * 1e6, 2) if toks else None,
           # of which the synthetic step itself (wall time in step() outside its pacing sleep); the rest
           # is the engine process's loop and the output transfer (packing, pickling, the pipe)
           "engine_step_us_per_tok": round((busy1 - busy0) / toks * 1e6, 2) if toks and busy0 is not None
           and busy1 is not None else None,
           "api_cpu_us_per_tok": round((a1 - a0) / toks * 1e6, 2) if toks else None,
           "api_sys_us_per_tok": round((as1 - as0) / toks * 1e6, 2) if toks else None,
           "client_cpu_us_per_tok": round((c1 - c0) / toks * 1e6, 2) if toks else None,
           "engine_cpu_util": round((e1 - e0) / wall, 2), "api_cpu_util": round((a1 - a0) / wall, 2),
           "client_cpu_util": round((c1 - c0) / wall, 2)}
    if args.check:
        rec["bad_sequences"] = check_tokens([t.ids for t in sinks], prompts[c:], args.vocab, args.output_len)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 32, 128],
                   help="Concurrency levels (streaming clients), one timed run each.")
    p.add_argument("--steps-per-s", type=float, default=200.0, help="Synthetic engine step rate (0: unpaced).")
    p.add_argument("--model", default="qwen3.5-0.8b",
                   help="Served name and tokenizer source: a preset without a built-in tokenizer serves token "
                        "ids only, as the headline benchmark does; tiny-qwen3.5 adds the byte tokenizer.")
    p.add_argument("--max-num-seqs", type=int, default=128, help="The server's --max-num-seqs.")
    p.add_argument("--num-prompts", type=int, default=None, help="Timed requests per level (default max(4c, 16); the benchmark's is max(4c, 64), "
                                                                     "which at c=1 is 80 s of steps).")
    p.add_argument("--input-len", type=int, default=256, help="Prompt length (random token ids).")
    p.add_argument("--output-len", type=int, default=256, help="Tokens per request (max_tokens, eos ignored).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the random prompts.")
    p.add_argument("--http-client", default="raw", choices=["raw", "httpx"],
                   help="The benchmark's streaming client (mstar.bench.serve --http-client).")
    p.add_argument("--check", action="store_true", help="Check every request's token ids (slightly more client CPU).")
    p.add_argument("--py-spy", choices=["api", "engine", "client"], default=None,
                   help="py-spy record that process (API server, engine, or this client) over the timed loop "
                        "(files in --py-spy-dir).")
    p.add_argument("--perf", choices=["api", "engine", "client"], default=None,
                   help="perf record -g a process over the timed loop (native frames: kernel, libpython, ...).")
    p.add_argument("--py-spy-dir", default="/tmp", help="Where the --py-spy / --perf files go.")
    p.add_argument("--py-spy-idle", action="store_true", help="py-spy: idle threads too, by thread.")
    p.add_argument("--py-spy-gil", action="store_true",
                   help="py-spy: only the thread holding the GIL (a thread waiting for it is not charged).")
    p.add_argument("--server-repo", default=REPO,
                   help="Run the server from this source tree (A/B: another checkout's server, this client).")
    p.add_argument("--server-arg", action="append", default=[], help="Extra server argument (repeatable).")
    p.add_argument("--server-env", action="append", default=[], metavar="K=V",
                   help="Environment of the server only (repeatable); in PYTHONPATH, {PYTHONPATH} is the "
                        "default value, e.g. PYTHONPATH=/tmp/uvsite:{PYTHONPATH} to try uvloop/httptools.")
    p.add_argument("--python-arg", action="append", default=[],
                   help="Interpreter argument before -m mstar.runtime.serving.serve (repeatable), e.g. "
                        "--python-arg=-m --python-arg=cProfile --python-arg=-o --python-arg=/tmp/api.prof")
    p.add_argument("--json", action="store_true", help="Print the records as JSON lines too.")
    p.add_argument("--label", default="", help="A label for the printed heading.")
    args = p.parse_args(argv)

    proc, url, _log = start_server(args)
    try:
        models = bench._get_json(url, "/v1/models", {})
        args.vocab = int(models["data"][0]["vocab_size"])
        health = bench._get_json(url, "/health", {})
        engine_pid = int(health["engine_pid"])
        recs = [run_level(args, url, proc.pid, engine_pid, c, li) for li, c in enumerate(args.concurrency)]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    load = os.getloadavg()[0]
    print(f"server path, synthetic engine at {args.steps_per_s:g} steps/s, model {args.model}, "
          f"in={args.input_len} out={args.output_len}, client {args.http_client}, {os.cpu_count()} CPUs (load {load:.1f}), commit {bench.git_commit()}, {date}"
          + (f", server from {args.server_repo}" if args.server_repo != REPO else "")
          + (f", {args.label}" if args.label else ""))
    cols = [("c", "concurrency", "{}"), ("N", "num_prompts", "{}"), ("tok/s", "output_tok_s", "{:.0f}"),
            ("target", "target_tok_s", "{:.0f}"), ("steps/s", "engine_steps_per_s", "{:.0f}"),
            ("tok/chunk", "tokens_per_chunk", "{:.2f}"), ("ITL p50", "itl_p50_ms", "{:.2f}"), ("ITL p90", "itl_p90_ms", "{:.2f}"),
            ("eng us/tok", "engine_cpu_us_per_tok", "{:.1f}"), ("(step)", "engine_step_us_per_tok", "{:.1f}"), ("api us/tok", "api_cpu_us_per_tok", "{:.1f}"),
            ("(sys)", "api_sys_us_per_tok", "{:.1f}"),
            ("cli us/tok", "client_cpu_us_per_tok", "{:.1f}"), ("eng cpu", "engine_cpu_util", "{:.2f}"),
            ("api cpu", "api_cpu_util", "{:.2f}"), ("cli cpu", "client_cpu_util", "{:.2f}"),
            ("failed", "failed", "{}")]
    if args.check:
        cols.append(("bad", "bad_sequences", "{}"))
    print("\n".join(bench.table_lines(cols, recs)))
    if args.json:
        for r in recs:
            print(json.dumps(r))
    return 0 if all(r["failed"] == 0 and not r.get("bad_sequences") for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
