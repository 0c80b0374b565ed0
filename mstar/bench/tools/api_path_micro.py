"""The API process's Python cost per streamed token, without sockets, processes or noise from
other processes: the real app (api_server.build_app) driven in-process over ASGI by c streamed
/v1/completions requests, its engine a stub whose step messages are handed straight to the
Server's handler (as the reader thread does), the response bodies dropped by the ASGI `send`.
What it times is what the event loop does per token: output processing, metrics, the job
mailboxes, the SSE chunk and its JSON, the ASGI send chain (no socket write, no h11).

    python -m mstar.bench.tools.api_path_micro                 # c=128, 256 tokens each
    python -m mstar.bench.tools.api_path_micro -c 32 --profile # + cProfile of the loop, top 25
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time



class StubEngine:
    pid = 0

    def __init__(self, vocab: int = 248320):
        self.info = {"max_model_len": 4096, "eos_token_ids": (), "vocab_size": vocab}
        self.reqs: list = []
        self.on_message = None

    def start_reader(self, cb):
        self.on_message = cb

    def add(self, req):
        self.reqs.append(req)

    def abort(self, ids):
        pass

    def shutdown(self, timeout: float = 0):
        pass


async def run(c: int, out_len: int, tokenizer, model: str, return_token_ids: bool, profile: bool,
              gap_s: float = 0.0, freeze: bool = True) -> dict:
    from mstar.runtime.serving.api_server import ServerSettings, build_app
    from mstar.runtime.engine.request import CoreOutput

    eng = StubEngine()
    app = build_app(ServerSettings(model=model, served_model_names=[model]), eng, tokenizer)
    server = app.state.server
    server.attach(asyncio.get_running_loop())
    if freeze:
        import gc
        gc.collect()
        gc.freeze()  # what the app's start-up does (api_engine.freeze_heap)
    body = {"model": model, "prompt": list(range(1, 257)), "max_tokens": out_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if return_token_ids:
        body["return_token_ids"] = True
    raw = json.dumps(body).encode()
    sent = {"bytes": 0, "events": 0}
    forever = asyncio.Event()

    def client(i):
        got = {"body": False}

        async def receive():
            if not got["body"]:
                got["body"] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await forever.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.body":
                sent["bytes"] += len(msg.get("body", b""))
                sent["events"] += 1

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 1000 + i), "server": ("127.0.0.1", 8000), "state": {}, "app": app}
        return app(scope, receive, send)

    tasks = [asyncio.ensure_future(client(i)) for i in range(c)]
    while len(eng.reqs) < c:
        await asyncio.sleep(0)
    rids = [r.request_id for r in eng.reqs]
    if tokenizer is not None:  # text that detokenizes: the ids of a sentence, round and round
        ids = tokenizer.encode(" The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    else:
        ids = [1000 + k for k in range(out_len)]
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0, p0 = time.perf_counter(), time.process_time()
    for k in range(out_len):
        fin = "length" if k == out_len - 1 else None
        tid = ids[k % len(ids)]
        outs = [CoreOutput(rid, [tid], None, fin, None, 256, 0) for rid in rids]
        eng.on_message(("step", outs, [], None))
        for _ in range(4):  # the callback, then the woken pumps
            await asyncio.sleep(0)
        if gap_s:
            await asyncio.sleep(gap_s)  # idle between steps, as behind a paced engine
    await asyncio.gather(*tasks)
    wall, cpu = time.perf_counter() - t0, time.process_time() - p0
    if prof is not None:
        prof.disable()
    toks = c * out_len
    res = {"concurrency": c, "tokens": toks, "events": sent["events"], "us_per_token_cpu": round(cpu / toks * 1e6, 2),
           "us_per_token_wall": round(wall / toks * 1e6, 2), "bytes_per_token": round(sent["bytes"] / toks, 1)}
    if prof is not None:
        import pstats
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--concurrency", type=int, nargs="+", default=[128],
                   help="Concurrency levels (streamed requests at once).")
    p.add_argument("--output-len", type=int, default=256, help="Tokens per request.")
    p.add_argument("--model", default="qwen3.5-0.8b", help="tiny-qwen3.5: with the byte tokenizer (detokenization)")
    p.add_argument("--no-token-ids", action="store_true", help="Do not ask for return_token_ids.")
    p.add_argument("--repeat", type=int, default=3, help="Runs per level; the best is reported.")
    p.add_argument("--profile", action="store_true", help="cProfile the run; print the top 25 by own time.")
    p.add_argument("--no-freeze", action="store_true", help="Leave the start-up heap to the cyclic GC.")
    p.add_argument("--gap-ms", type=float, default=0.0, help="Idle time between steps (a paced engine).")
    args = p.parse_args(argv)
    import logging
    logging.disable(logging.WARNING)
    from mstar.runtime.serving.serve import load_tokenizer
    tok = load_tokenizer(args.model)
    for c in args.concurrency:
        best = None
        for _ in range(1 if args.profile else args.repeat):
            r = asyncio.run(run(c, args.output_len, tok, args.model, not args.no_token_ids, args.profile,
                                args.gap_ms / 1e3, not args.no_freeze))
            if best is None or r["us_per_token_cpu"] < best["us_per_token_cpu"]:
                best = r
        print(json.dumps(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
