"""`python -m mstar.bench.offline`: throughput of the offline engine (no HTTP), with the serving
benchmark's shape of request: random prompt token ids, a fixed number of output tokens (ignore_eos),
greedy. `--concurrency c` caps the running batch (max_num_seqs = c) and submits
N = max(4c, 64) requests at once, which the engine runs as a closed loop of c.

Prints one line per concurrency and appends a JSON record per line to --out (default
notes/results/offline.jsonl) with the fields of the serving benchmark where they apply.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import time

import torch

from mstar import LLM, SamplingParams, knobs
from mstar.bench import append_jsonl
from mstar.bench.serve import git_commit


def _build(args, max_num_seqs: int) -> LLM:
    return LLM(args.model, random_weights=args.random_weights, dtype=args.dtype, device=args.device,
               max_num_seqs=max_num_seqs, max_model_len=args.input_len + args.output_len + 16,
               enable_prefix_caching=not args.no_prefix_caching, tp=args.tp, decode_graphs=args.decode_graphs,
               prefill_graphs=args.prefill_graphs,
               compile=args.compile, max_num_batched_tokens=args.max_num_batched_tokens,
               async_output=args.async_output)


def _cap(llm: LLM, c: int) -> None:
    """One engine for every point (--one-engine): cap its running batch at c, with the admission
    batch the engine would pick for max_num_seqs = c."""
    core = llm.engine
    core.scheduler.max_num_seqs = c
    core.scheduler.admit_min_free = c // 4 if core.graphs is not None else 0




def run(args) -> list[dict]:
    records = []
    if (getattr(args, "tp", 1) > 1 and not args.one_engine and len(args.concurrency) > 1
            and knobs.value("MSTAR_TP_ALLREDUCE") != "nccl"):
        # notes/tp.md, "Limits": a second symmetric-memory rendezvous in one process did not finish
        logging.getLogger("mstar.bench").warning(
            "--tp %d with MSTAR_TP_ALLREDUCE=%s builds one engine per point; a later engine's symmetric-memory "
            "set-up may hang in this process: pass --one-engine", args.tp, knobs.value("MSTAR_TP_ALLREDUCE"))
    shared = _build(args, max(args.concurrency)) if args.one_engine else None
    try:
        for c in args.concurrency:
            t_start = time.perf_counter()
            llm = shared or _build(args, c)
            if shared is not None:
                _cap(llm, c)
            rec = _measure(args, llm, c, t_start)
            records.append(rec)
            if args.out:
                append_jsonl(args.out, rec)
            if shared is None:
                llm.close()  # tp > 1: stop the followers before the next engine
                del llm
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    finally:
        if shared is not None:
            shared.close()
    return records


def _measure(args, llm: LLM, c: int, t_start: float) -> dict:
    vocab = llm.engine.model.config.vocab_size
    n = args.num_prompts or max(4 * c, 64)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, min(vocab, 100_000), (n, args.input_len), generator=g).tolist()
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[: min(n, c)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = t_run = time.perf_counter()
    outs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out_tokens = sum(len(o.token_ids) for o in outs)
    assert all(len(o.token_ids) == args.output_len for o in outs), "fixed-length outputs expected"
    rec = {"bench": "offline", "model": args.model, "tp": args.tp, "concurrency": c, "num_prompts": n,
           "input_len": args.input_len, "output_len": args.output_len,
           "output_tok_s": out_tokens / dt, "elapsed_s": dt, "startup_s": round(t_run - t_start, 2),
           "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "decode_graphs": args.decode_graphs, "prefill_graphs": args.prefill_graphs, "compile": args.compile, "async_output": args.async_output,
           "one_engine": args.one_engine, "graph_capture_s": _capture_s(llm), "knobs": _set_knobs(),
           "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "backends": {e.name: e.selected(llm.engine.model.device.type) for e in __import__("mstar").ops.all_ops()}}
    print(f"c={c:4d} n={n:4d} output {rec['output_tok_s']:9.1f} tok/s  "
          f"({dt:.1f} s; start-up {t_run - t_start:.1f} s)", flush=True)
    return rec


def _set_knobs() -> dict:
    """The MSTAR_* knobs this run set away from their defaults (A/B runs of a knob)."""
    return {k.name: knobs.value(k.name) for k in knobs.KNOBS if knobs.value(k.name) != k.default}


def _capture_s(llm) -> float | None:
    g = llm.engine.graphs
    return None if g is None or not g.graphs else round(g.capture_s, 2)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mstar.bench.offline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-qwen3.5", help="preset name or HF model directory")
    ap.add_argument("--random-weights", action="store_true", help="random weights from the preset's config")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float32")
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8], help="running batch caps to measure")
    ap.add_argument("--num-prompts", type=int, default=0, help="requests per point (default max(4c, 64))")
    ap.add_argument("--input-len", type=int, default=256, help="prompt length in tokens")
    ap.add_argument("--output-len", type=int, default=256, help="output tokens per request (EOS ignored)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (GPUs)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    ap.add_argument("--decode-graphs", default="auto", choices=["auto", "off", "static"],
                    help="auto: decode steps replay CUDA graphs on CUDA; off: every step eager; static: the graphs' "
                         "fixed buffers without capturing (any device)")
    ap.add_argument("--prefill-graphs", default="auto", choices=["auto", "on", "off", "static"],
                    help="on: prefill / mixed steps replay piecewise CUDA graphs around the attention and GDN "
                         "cores (CUDA); auto: on at --tp 1 on CUDA; static: the same segments without capturing "
                         "(any device); off: the plain forward")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "decode", "off"],
                    help="torch.compile the forward: every step (on), inside the decode graphs only (decode)")
    ap.add_argument("--async-output", default="auto", choices=["auto", "on", "off"],
                    help="overlapped decode: launch step k before reading step k-1's tokens back (auto: on "
                         "where decode graphs are captured)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="token budget of a step (default: 8192 on CUDA, 2048 on CPU)")
    ap.add_argument("--one-engine", action="store_true",
                    help="build one engine (max_num_seqs = the largest concurrency) and cap its running batch per "
                         "point, instead of a fresh engine per point (saves the start-up of large / tp models)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--out", default="notes/results/offline.jsonl", help="JSONL file to append records to ('' = none)")
    # timestamped engine log lines (load, graph capture, compiles) show where start-up time goes
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
