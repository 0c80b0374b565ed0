"""FlashInfer's paged decode attention with and without tensor cores, at the Qwen3.5 attention
shapes, on one CUDA GPU:

    python -m mstar.bench.tools.probe_decode_attention [--batch 1 8 64] [--context 300 2048]

`BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)` runs the decode rows through the
batch prefill kernel (a separately compiled module); `False` runs FlashInfer's decode kernel on
CUDA cores. For each model shape, batch size and context length the table gives the
microseconds of one run (inside a CUDA graph of repeated runs, as a decode graph replays them;
the KV pages of the rows are spread over a cache larger than L2) and the two outputs' largest
difference. The first use of each variant is timed too: on a host without the compiled
module it is FlashInfer's JIT build. Results: notes/llm-decode-step.md.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"qwen3.5-0.8b": (8, 2, 256), "qwen3.5-4b": (16, 4, 256)}  # q heads, kv heads, head_dim


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds a run: reps runs captured in one graph, best of 5 replays."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    best = float("inf")
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) * 1e3 / reps)
    return best


def probe(model: str, batch: int, context: int, page: int, cache_pages: int, first_use: dict) -> dict:
    import mstar.ops  # noqa: F401  (before FlashInfer: points its JIT cache into mstar's kernel cache)
    import flashinfer
    hq, hkv, d = SHAPES[model]
    dev = torch.device("cuda")
    k_cache = torch.randn(cache_pages, page, hkv, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    pages_per_row = -(-context // page)
    # each row's pages drawn at random from the whole cache, as a long-running server's are
    indices = torch.randperm(cache_pages, device=dev)[:batch * pages_per_row].to(torch.int32)
    indptr = torch.arange(0, batch + 1, dtype=torch.int32) * pages_per_row
    last = torch.full((batch,), context - (pages_per_row - 1) * page, dtype=torch.int32)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    row = {"model": model, "batch": batch, "context": context}
    outs = {}
    for tc in (True, False):
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
        t0 = time.perf_counter()
        w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
               sm_scale=d ** -0.5)
        outs[tc] = w.run(q, (k_cache, v_cache))
        torch.cuda.synchronize()
        first_use.setdefault(f"{model} tensor_cores={tc}", time.perf_counter() - t0)
        row[f"tc={tc} us"] = graph_us(lambda: w.run(q, (k_cache, v_cache)))
    row["max diff"] = (outs[True].float() - outs[False].float()).abs().max().item()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mstar.bench.tools.probe_decode_attention",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--context", type=int, nargs="+", default=[300, 2048], help="Keys per row.")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--cache-gib", type=float, default=2.0, help="Size of the K and V caches together.")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_decode_attention needs a CUDA GPU")
    first_use: dict[str, float] = {}
    print(f"{'model':>13} {'batch':>5} {'keys':>5} {'tensor cores us':>15} {'CUDA cores us':>13} {'max diff':>9}")
    for model in args.models:
        hq, hkv, d = SHAPES[model]
        cache_pages = int(args.cache_gib * 2 ** 30 / (2 * args.page_size * hkv * d * 2))
        for ctx in args.context:
            for b in args.batch:
                if b * -(-ctx // args.page_size) > cache_pages:
                    continue
                r = probe(model, b, ctx, args.page_size, cache_pages, first_use)
                print(f"{model:>13} {b:>5} {ctx:>5} {r['tc=True us']:>15.2f} {r['tc=False us']:>13.2f} "
                      f"{r['max diff']:>9.2e}", flush=True)
    for k, v in first_use.items():
        print(f"first use (build or load) {k}: {v:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
