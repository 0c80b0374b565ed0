"""`python -m mstar.bench.serve`: the LLM serving benchmark (protocol: notes/benchmarks.md).

Closed loop against any OpenAI-compatible server (mstar, vLLM, SGLang):

    python -m mstar.bench.serve --base-url http://127.0.0.1:8000 --model qwen3.5-0.8b \\
        --concurrency 1 8 32 --input-len 256 --output-len 256

At each concurrency c, c workers each send one request at a time until N requests
(default max(4c, 64)) are done; a warm-up round of c requests runs first and is not
counted. Every request is a prompt of `--input-len` random token ids, sent as a token-id
prompt to /v1/completions with temperature 0, ignore_eos and max_tokens = `--output-len`,
streamed so that every token is timed (with `return_token_ids`, so tokens are counted
exactly even where a chunk carries no text or several tokens; `--no-token-ids` for servers
without it). The streams are read by a lean HTTP/1.1 client (`--http-client raw`, the default
for http:// URLs; ~4x less CPU per event than httpx, which by itself caps one client process
near 28k events/s) or by httpx (`--http-client httpx`).

The side-by-side baseline a researcher has, HF transformers `generate` at batch = c:

    python -m mstar.bench.serve --backend hf --model qwen3.5-0.8b --concurrency 8 32

(random weights from the preset's config, or the checkpoint of a directory; greedy,
min_new_tokens = max_new_tokens = output length). A request's TTFT there is the time to
the batch's first token; its inter-token latencies are the batch's step times.

Reported per concurrency: output tok/s (output tokens of the timed requests / wall time),
TTFT p50/p90 and inter-token latency p50/p90 (ms, over all tokens of all timed requests).
A table is printed and one JSON record per concurrency is appended to
notes/results/<bench>.jsonl (--results-dir, --bench-name) with the fields
bench, backend, model, tp, concurrency, num_prompts, input_len, output_len, output_tok_s,
ttft_p50_ms, ttft_p90_ms, itl_p50_ms, itl_p90_ms, failed, gpu, commit, date, and
peak_gpu_mem (GiB; from the server's /metrics or torch for hf) when known.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from mstar.bench import append_jsonl
from mstar.bench.http_stream import RawClient

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------
# numbers

def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None  # seconds
    itls: list[float] = field(default_factory=list)  # seconds, one per token after the first
    error: str | None = None
    chunks: int = 0  # SSE events that carried tokens (fewer than tokens where the server coalesces)


@dataclass
class LevelResult:
    concurrency: int
    num_prompts: int
    wall_s: float
    results: list[RequestResult]

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        toks = sum(r.output_tokens for r in ok)
        ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
        itls = [x * 1e3 for r in ok for x in r.itls]
        return {
            "concurrency": self.concurrency, "num_prompts": self.num_prompts,
            "output_tok_s": round(toks / self.wall_s, 2) if self.wall_s > 0 else float("nan"),
            "ttft_p50_ms": round(percentile(ttfts, 50), 3), "ttft_p90_ms": round(percentile(ttfts, 90), 3),
            "itl_p50_ms": round(percentile(itls, 50), 3), "itl_p90_ms": round(percentile(itls, 90), 3),
            "failed": len(self.results) - len(ok), "output_tokens": toks, "wall_s": round(self.wall_s, 3),
            # > 1 where the server sent several tokens in one event (it fell behind and coalesced)
            "tok_per_chunk": round(toks / sum(r.chunks for r in ok), 3) if any(r.chunks for r in ok) else None,
        }


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """n prompts of `length` ids, avoiding the top of the vocabulary (where the special tokens sit)."""
    hi = max(2, vocab_size - max(3, vocab_size // 100))
    rng = random.Random(seed)
    return [[rng.randrange(0, hi) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------------------------------
# the OpenAI-compatible backend

class _Tally:
    """Timing and token counting of one streamed completion, one SSE line at a time (shared by
    both HTTP clients): a chunk's tokens are its `token_ids` (or 1 per chunk with text, without
    them); a chunk of k tokens spreads its gap over k inter-token latencies (a server that
    coalesces tokens is timed as if they had arrived evenly); the final usage, when sent, is
    the token count."""

    __slots__ = ("counted", "done", "last", "res", "t0", "usage_tokens", "use_token_ids")

    def __init__(self, use_token_ids: bool):
        self.t0 = time.perf_counter()
        self.last = None
        self.res = RequestResult(ok=False)
        self.counted = 0
        self.usage_tokens = None
        self.use_token_ids = use_token_ids
        self.done = False  # [DONE] or an error event seen: later lines are ignored

    def line(self, line: str) -> None:
        if self.done or not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        now = time.perf_counter()
        obj = json.loads(data)
        if "error" in obj:
            self.res.error = json.dumps(obj["error"])[:300]
            self.done = True
            return
        if obj.get("usage"):
            self.usage_tokens = obj["usage"].get("completion_tokens")
        k = 0
        for ch in obj.get("choices") or []:
            if self.use_token_ids and ch.get("token_ids") is not None:
                k += len(ch["token_ids"])
            elif ch.get("text") or ch.get("finish_reason") is None:
                k += 1
        if k == 0:
            return
        res = self.res
        res.chunks += 1
        if self.last is None:
            res.ttft = now - self.t0
            if k > 1:
                res.itls.extend([0.0] * (k - 1))
        else:
            res.itls.extend([(now - self.last) / k] * k)
        self.last = now
        self.counted += k

    def result(self) -> RequestResult:
        res = self.res
        if res.error is not None:
            return res
        res.output_tokens = self.usage_tokens if self.usage_tokens is not None else self.counted
        res.ok = res.ttft is not None
        if not res.ok:
            res.error = "no tokens received"
        return res


async def _one_request(client, url: str, payload: dict, headers: dict, use_token_ids: bool,
                       tally: _Tally | None = None) -> RequestResult:
    """One streamed request through httpx (`--http-client httpx`)."""
    tally = tally or _Tally(use_token_ids)
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode("utf-8", "replace")
                tally.res.error = f"HTTP {r.status_code}: {body[:300]}"
                return tally.res
            async for line in r.aiter_lines():
                tally.line(line)
                if tally.done:
                    break
    except Exception as e:  # noqa: BLE001 -- a failed request is counted, not fatal
        tally.res.error = f"{type(e).__name__}: {e}"
        return tally.res
    return tally.result()


# ---------------------------------------------------------------------------------------
# a lean HTTP/1.1 client for the streamed requests (the default for http:// URLs)
#
async def _one_request_raw(conn_box: list, client: RawClient, path: str, payload: dict, headers: dict,
                           use_token_ids: bool, timeout: float, tally: _Tally | None = None) -> RequestResult:
    """One streamed request on the worker's connection (conn_box[0], reopened when needed)."""
    raw = client.raw_request(path, json.dumps(payload).encode(), headers)
    tally = tally or _Tally(use_token_ids)
    try:
        conn = conn_box[0]
        if conn is None or conn.closed:
            conn = conn_box[0] = await asyncio.wait_for(client.connect(), 30.0)
        tally.t0 = time.perf_counter()
        status, keep, err = await asyncio.wait_for(conn.request(raw, tally.line), timeout)
        if not keep:
            conn.transport.close()
            conn_box[0] = None
        if status != 200:
            tally.res.error = f"HTTP {status}: {(err or b'').decode('utf-8', 'replace')[:300]}"
            return tally.res
    except Exception as e:  # noqa: BLE001 -- a failed request is counted, not fatal
        conn = conn_box[0]
        if conn is not None:
            conn.transport.close()
            conn_box[0] = None
        tally.res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return tally.res
    return tally.result()


async def closed_loop(n: int, concurrency: int, one, timeout) -> tuple[float, list]:
    """Run requests 0..n-1 with `concurrency` workers, each taking the next index as soon as
    its previous request ends; one(client, i) runs request i. Returns (wall seconds, results)."""
    import httpx
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    results: list = [None] * n
    it = iter(range(n))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker():
            for i in it:
                results[i] = await one(client, i)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return wall, results


async def closed_loop_raw(base_url: str, n: int, concurrency: int, one) -> tuple[float, list]:
    """closed_loop with the lean client: one(conn_box, client, i); each worker keeps its own
    connection in conn_box."""
    client = RawClient(base_url)
    results: list = [None] * n
    it = iter(range(n))
    boxes = [[None] for _ in range(concurrency)]

    async def worker(box):
        for i in it:
            results[i] = await one(box, client, i)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(b) for b in boxes))
    finally:
        for b in boxes:
            if b[0] is not None:
                b[0].transport.close()
    wall = time.perf_counter() - t0
    return wall, results


def _client_kind(http_client: str, base_url: str) -> str:
    return "raw" if http_client == "raw" or (http_client == "auto" and base_url.startswith("http://")) else "httpx"


async def _closed_loop(base_url: str, payloads: list[dict], concurrency: int, headers: dict, use_token_ids: bool,
                       timeout: float, http_client: str = "auto") -> tuple[float, list[RequestResult]]:
    import httpx
    if _client_kind(http_client, base_url) == "raw":
        return await closed_loop_raw(
            base_url, len(payloads), concurrency,
            lambda box, client, i: _one_request_raw(box, client, "/v1/completions", payloads[i], headers,
                                                    use_token_ids, timeout))
    url = base_url.rstrip("/") + "/v1/completions"
    return await closed_loop(len(payloads), concurrency,
                             lambda client, i: _one_request(client, url, payloads[i], headers, use_token_ids),
                             httpx.Timeout(timeout, connect=30.0))


def _get_json(base_url: str, path: str, headers: dict) -> Any:
    import httpx
    try:
        r = httpx.get(base_url.rstrip("/") + path, headers=headers, timeout=10)
        if r.status_code == 200:
            return r.json() if "json" in r.headers.get("content-type", "") else r.text
    except Exception:  # noqa: BLE001
        pass
    return None


def _server_peak_mem_gib(base_url: str, headers: dict) -> float | None:
    text = _get_json(base_url, "/metrics", headers)
    if not isinstance(text, str):
        return None
    for line in text.splitlines():
        if line.startswith("mstar_peak_gpu_memory_bytes "):
            v = float(line.split()[1])
            return round(v / 2 ** 30, 3) if v > 0 else None
    return None


def _progress(args, level: LevelResult) -> None:
    """One line per finished level on stderr, so a run cut short still shows what it measured."""
    if args.quiet:
        return
    s = level.summary()
    print(f"[{args.backend}] c={level.concurrency} N={level.num_prompts}: {s['output_tok_s']} tok/s, "
          f"TTFT p50 {s['ttft_p50_ms']} ms, ITL p50 {s['itl_p50_ms']} ms, failed {s['failed']}",
          file=sys.stderr, flush=True)


def run_openai(args) -> tuple[list[LevelResult], dict[str, Any]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    models = _get_json(args.base_url, "/v1/models", headers)
    if models is None:
        raise SystemExit(f"cannot reach {args.base_url}/v1/models")
    card = next((m for m in models.get("data", []) if m.get("id") == args.model), None)
    if card is None:
        names = [m.get("id") for m in models.get("data", [])]
        raise SystemExit(f"model {args.model!r} is not served at {args.base_url} (it serves {names})")
    vocab = args.vocab_size or card.get("vocab_size")
    if not vocab:
        raise SystemExit("the server does not report vocab_size; pass --vocab-size")
    health = _get_json(args.base_url, "/health", headers)
    meta = {"gpu": args.gpu or (health.get("gpu") if isinstance(health, dict) else None) or _local_gpu()}

    levels = []
    for li, c in enumerate(args.concurrency):
        n = args.num_prompts or max(4 * c, 64)
        n_warm = c if args.num_warmup is None else args.num_warmup
        prompts = random_prompts(n + n_warm, args.input_len, int(vocab), args.seed + 1000 * li)

        def payload(p):
            d = {"model": args.model, "prompt": p, "max_tokens": args.output_len, "temperature": 0.0,
                 "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if not args.no_token_ids:
                d["return_token_ids"] = True
            d.update(args.extra_body)
            return d

        use_ids = not args.no_token_ids
        if n_warm:
            _, warm = asyncio.run(_closed_loop(args.base_url, [payload(p) for p in prompts[:n_warm]], c, headers,
                                               use_ids, args.timeout, args.http_client))
            bad = [r for r in warm if not r.ok]
            if len(bad) == len(warm):
                raise SystemExit(f"every warm-up request failed, e.g. {bad[0].error}")
        wall, res = asyncio.run(_closed_loop(args.base_url, [payload(p) for p in prompts[n_warm:]], c, headers,
                                             use_ids, args.timeout, args.http_client))
        for r in res:
            if r.ok and r.output_tokens != args.output_len and not args.quiet:
                print(f"warning: a request returned {r.output_tokens} tokens, not {args.output_len}",
                      file=sys.stderr)
                break
        errs = [r.error for r in res if not r.ok]
        if errs and not args.quiet:
            print(f"c={c}: {len(errs)} failed request(s), e.g. {errs[0]}", file=sys.stderr)
        levels.append(LevelResult(c, n, wall, res))
        _progress(args, levels[-1])
        peak = _server_peak_mem_gib(args.base_url, headers)
        if peak is not None:
            meta.setdefault("peak", {})[c] = peak
    return levels, meta


# ---------------------------------------------------------------------------------------
# the HF transformers baseline

def run_hf(args) -> tuple[list[LevelResult], dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[args.dtype]
    torch.manual_seed(args.seed)
    if os.path.isdir(args.model) and not args.random_weights:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    else:
        from mstar.models import resolve_config
        cfg = resolve_config(args.model)
        with device:  # random init on the device itself (a 0.8B init on the host takes tens of seconds)
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model = model.to(device).eval()
    vocab = int(args.vocab_size or model.config.vocab_size)
    eos = model.config.eos_token_id
    pad = model.config.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)

    class Timer(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:  # the first call carries the prompt
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                self.times.append(time.perf_counter())

        def end(self):
            pass

    def run_batch(batch: list[list[int]], new_tokens: int = args.output_len) -> tuple[float, list[RequestResult]]:
        ids = torch.tensor(batch, dtype=torch.long, device=device)
        timer = Timer()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=pad, streamer=timer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        n_new = out.shape[1] - ids.shape[1]
        ts = timer.times
        ttft = (ts[0] - t0) if ts else wall
        itls = [b - a for a, b in itertools.pairwise(ts)]
        return wall, [RequestResult(True, n_new, ttft, list(itls)) for _ in batch]

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    levels = []
    for li, c in enumerate(args.concurrency):
        n = args.num_prompts or max(4 * c, 64)
        prompts = random_prompts(n + c, args.input_len, vocab, args.seed + 1000 * li)
        n_warm = c if args.num_warmup is None else args.num_warmup
        if n_warm:
            # one warm-up batch, not counted; a few tokens warm the same kernels as all of them
            run_batch(prompts[:c], min(args.output_len, 16))
        timed = prompts[c:]
        wall, res = 0.0, []
        for i in range(0, n, c):
            w, r = run_batch(timed[i:i + c])
            wall += w
            res += r
        levels.append(LevelResult(c, n, wall, res))
        _progress(args, levels[-1])
    meta = {"gpu": args.gpu or _local_gpu()}
    if device.type == "cuda":
        meta["peak_all"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 3)
    return levels, meta


# ---------------------------------------------------------------------------------------
# records

def _local_gpu() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    return "cpu"


def git_commit() -> str:
    """The commit measured: $GIT_COMMIT where the tree travels without .git (the GPU host),
    else `git rev-parse` (+ "-dirty" with uncommitted changes)."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO, capture_output=True, text=True,
                             timeout=10, check=False)
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def make_records(args, levels: list[LevelResult], meta: dict[str, Any]) -> list[dict[str, Any]]:
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    commit = git_commit()
    recs = []
    for lv in levels:
        s = lv.summary()
        rec = {"bench": args.bench_name, "backend": "hf" if args.backend == "hf" else "openai",
               "model": args.model, "tp": args.tp, "concurrency": lv.concurrency, "num_prompts": lv.num_prompts,
               "input_len": args.input_len, "output_len": args.output_len,
               "output_tok_s": s["output_tok_s"], "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p90_ms": s["ttft_p90_ms"],
               "itl_p50_ms": s["itl_p50_ms"], "itl_p90_ms": s["itl_p90_ms"], "failed": s["failed"],
               "gpu": meta.get("gpu") or "cpu", "commit": commit, "date": date}
        peak = (meta.get("peak") or {}).get(lv.concurrency, meta.get("peak_all"))
        if peak is not None:
            rec["peak_gpu_mem"] = peak
        if args.backend != "hf":
            rec["base_url"] = args.base_url
            rec["http_client"] = _client_kind(args.http_client, args.base_url)
            if s.get("tok_per_chunk") is not None:
                rec["tok_per_chunk"] = s["tok_per_chunk"]
        if args.label:
            rec["label"] = args.label
        recs.append(rec)
    return recs


def format_table(recs: list[dict[str, Any]]) -> str:
    cols = [("backend", "backend", "{}"), ("c", "concurrency", "{}"), ("N", "num_prompts", "{}"),
            ("out tok/s", "output_tok_s", "{:.1f}"), ("TTFT p50 ms", "ttft_p50_ms", "{:.1f}"),
            ("TTFT p90 ms", "ttft_p90_ms", "{:.1f}"), ("ITL p50 ms", "itl_p50_ms", "{:.2f}"),
            ("ITL p90 ms", "itl_p90_ms", "{:.2f}"), ("failed", "failed", "{}")]
    if any("peak_gpu_mem" in r for r in recs):
        cols.append(("peak GiB", "peak_gpu_mem", "{:.2f}"))
    if any("tok_per_chunk" in r for r in recs):
        cols.append(("tok/chunk", "tok_per_chunk", "{:.2f}"))
    return "\n".join(table_lines(cols, recs))


def table_lines(cols: list[tuple[str, str, str]], recs: list[dict[str, Any]]) -> list[str]:
    """A right-aligned text table: cols are (header, record key, format); missing values "-"."""
    rows = [[h for h, _, _ in cols]]
    for r in recs:
        rows.append([fmt.format(r[k]) if r.get(k) is not None else "-" for _, k, fmt in cols])
    w = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(row[i].rjust(w[i]) for i in range(len(cols))) for row in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    return lines


def add_record_flags(p: argparse.ArgumentParser, bench_name: str) -> None:
    """The flags of where a benchmark's records go (report_records reads them)."""
    p.add_argument("--label", default=None, help="Free-form label stored in the records.")
    p.add_argument("--bench-name", default=bench_name, help="Record field 'bench' and the results file name.")
    p.add_argument("--results-dir", default=os.path.join(_REPO, "notes", "results"),
                   help="Where <bench-name>.jsonl is appended.")
    p.add_argument("--no-record", action="store_true", help="Print the table only; append no record.")
    p.add_argument("--json", action="store_true", help="Also print the records as JSON lines.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mstar.bench.serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", default="openai", choices=["openai", "hf"],
                   help="openai: drive a running OpenAI-compatible server; hf: HF transformers generate in-process.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server (openai backend).")
    p.add_argument("--model", default="tiny-qwen3.5",
                   help="Served model name (openai) or preset / directory (hf).")
    p.add_argument("--api-key", default=None, help="Bearer key for the server.")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32],
                   help="Concurrency levels (hf: batch sizes).")
    p.add_argument("--num-prompts", type=int, default=None, help="Timed requests per level; default max(4c, 64).")
    p.add_argument("--num-warmup", type=int, default=None,
                   help="Warm-up requests per level, not timed (default c; hf: one batch; 0 disables).")
    p.add_argument("--input-len", type=int, default=256, help="Prompt length in tokens (random ids).")
    p.add_argument("--output-len", type=int, default=256, help="Output tokens per request (EOS ignored).")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="Vocabulary to draw prompt ids from (default: the server's /v1/models vocab_size, or the "
                        "model config for hf).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the random prompts.")
    p.add_argument("--timeout", type=float, default=1800.0, help="Per-request timeout (s).")
    p.add_argument("--http-client", default="auto", choices=["auto", "raw", "httpx"],
                   help="The streaming client: raw (a lean HTTP/1.1 client, ~4x less CPU per streamed event than "
                        "httpx, so the client is not what limits tokens/s), httpx, or auto (raw for http:// URLs, "
                        "httpx otherwise).")
    p.add_argument("--no-token-ids", action="store_true",
                   help="Do not ask for return_token_ids (servers without it: a chunk counts as one token).")
    p.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every request body.")
    p.add_argument("--tp", type=int, default=1, help="Tensor-parallel degree to record (the server's).")
    p.add_argument("--gpu", default=None, help="GPU name to record (default: the server's, else this machine's).")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="hf backend: dtype.")
    p.add_argument("--device", default="auto", help="hf backend: device (auto: cuda if available).")
    p.add_argument("--random-weights", action="store_true",
                   help="hf backend with a directory: random weights from its config instead of the checkpoint.")
    add_record_flags(p, "llm_serve")
    p.add_argument("--quiet", action="store_true", help="No warnings on stderr.")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for c in args.concurrency:
        if c < 1:
            raise SystemExit("--concurrency values must be >= 1")
    if args.input_len < 1 or args.output_len < 1:
        raise SystemExit("--input-len and --output-len must be >= 1")
    levels, meta = run_hf(args) if args.backend == "hf" else run_openai(args)
    recs = make_records(args, levels, meta)
    print(f"{args.model}  in={args.input_len} out={args.output_len}  gpu={recs[0]['gpu']}  commit={recs[0]['commit']}")
    report_records(recs, format_table(recs), args)
    return 0


def report_records(recs: list[dict], table: str, args) -> None:
    """Print the table (and the records with --json); append them to
    <results_dir>/<bench_name>.jsonl unless --no-record."""
    print(table)
    if args.json:
        for r in recs:
            print(json.dumps(r))
    if not args.no_record:
        path = os.path.join(args.results_dir, f"{args.bench_name}.jsonl")
        append_jsonl(path, *recs)
        print(f"appended {len(recs)} record(s) to {path}")


if __name__ == "__main__":
    sys.exit(main())
