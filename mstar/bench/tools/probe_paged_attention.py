"""FlashInfer's paged attention variants at the Qwen3.5 attention shapes, on one CUDA GPU:

    python -m mstar.bench.tools.probe_paged_attention [--decode-batch 1 8 64] [--context 300 2048]
        [--prefill-rows 1x4096 8x256 32x256]

Decode: `BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)` runs the rows through the
batch prefill kernel of FlashInfer's fa2 backend; `False` runs its decode kernel on CUDA cores;
"triton" is mstar's split + merge kernels (ops/backends/triton_paged_decode.py) in their default
configuration, and with --triton-sweep the best of its slice policies (waves of programs, the
fewest blocks a slice) and of its launch configurations (keys a block, warps, pipeline stages) is
printed beside it.
Prefill (causal, prompts from the start): the batch prefill wrapper on its fa2 backend against
fa3 (Hopper's), which is what "auto" picks on sm90. Each variant is a separately compiled module:
the first use of each is timed too, which on a host without it is FlashInfer's JIT build.

Times are microseconds of one run inside a CUDA graph of repeated runs, the KV pages of the rows
spread at random over a cache larger than L2; "max diff" is the largest difference between the variants' outputs.
Results: notes/llm-decode-step.md, notes/startup.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from mstar.bench.tools.graph_timer import graph_us

SHAPES = {"qwen3.5-0.8b": (8, 2, 256), "qwen3.5-4b": (16, 4, 256)}  # q heads, kv heads, head_dim


class Pages:
    """K / V caches of one model shape and the page tables of `rows` rows of `keys` keys each."""

    def __init__(self, model: str, page: int, cache_gib: float):
        self.hq, self.hkv, self.d = SHAPES[model]
        self.page = page
        self.num_pages = int(cache_gib * 2 ** 30 / (2 * page * self.hkv * self.d * 2))
        self.k = torch.randn(self.num_pages, page, self.hkv, self.d, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)

    def fits(self, rows: int, keys: int) -> bool:
        return rows * -(-keys // self.page) <= self.num_pages

    def table(self, rows: int, keys: int):
        per_row = -(-keys // self.page)
        indices = torch.randperm(self.num_pages, device="cuda")[:rows * per_row].to(torch.int32)
        indptr = torch.arange(0, rows + 1, dtype=torch.int32) * per_row
        last = torch.full((rows,), keys - (per_row - 1) * self.page, dtype=torch.int32)
        return indptr, indices, last


def _timed_first(first_use: dict, key: str, fn):
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first_use.setdefault(key, time.perf_counter() - t0)
    return out


TRITON_CONFIGS = [(16, 4, 2), (32, 4, 2), (32, 4, 3), (64, 4, 2), (32, 8, 3), (64, 8, 3)]
TRITON_WAVES = (1, 2, 4)
TRITON_MIN_SLICE_BLOCKS = (1, 2, 4, 8)


def probe_triton_decode(pages: Pages, q, indptr, indices, last, sweep: bool) -> tuple[float, torch.Tensor, str]:
    """(default us, its output, the sweep's best slice policy and launch configuration as text)."""
    from mstar.ops.backends import triton_paged_decode as tpd
    batch = q.shape[0]
    ptr, lst = indptr.to("cuda"), last.to("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run(cfg=None, waves=tpd.WAVES, min_blocks=tpd.MIN_SLICE_BLOCKS):
        sp = tpd.splits_for(batch, pages.hkv, sms, waves)
        part_o = torch.empty(batch, pages.hq, sp, pages.d, dtype=torch.float32, device="cuda")
        part_lse = torch.empty(batch, pages.hq, sp, dtype=torch.float32, device="cuda")
        out = torch.empty_like(q)
        block = cfg[0] if cfg else tpd.block_n(pages.d)

        def fn(_):
            tpd.decode(q, pages.k, pages.v, ptr, indices, lst, pages.d ** -0.5, part_o, part_lse, sp, out=out,
                       config=cfg, min_chunk=min_blocks * block)
        return graph_us(fn), out
    us, out = run()
    best = ""
    if sweep:
        # the slice policy at the default launch configuration, then every configuration at the best policy
        policy = min((run(None, w, m)[0], w, m) for w in TRITON_WAVES for m in TRITON_MIN_SLICE_BLOCKS)
        timed = []
        for cfg in TRITON_CONFIGS:
            try:
                timed.append((run(cfg, policy[1], policy[2])[0], str(cfg)))
            except Exception as e:  # a configuration that does not compile (shared memory)
                timed.append((float("inf"), f"{cfg} ({type(e).__name__})"))
        t, cfg = min(timed)
        best = (f"  best policy {policy[0]:.2f} ({policy[1]} waves, slices >= {policy[2]} blocks);"
                f" best launch {t:.2f} (block, warps, stages {cfg})")
    return us, out, best


def probe_decode(pages: Pages, batch: int, keys: int, first_use: dict, sweep: bool = False,
                 cuda_cores: bool = True) -> tuple[float, float | None, float, float, str]:
    import flashinfer
    indptr, indices, last = pages.table(batch, keys)
    q = torch.randn(batch, pages.hq, pages.d, device="cuda", dtype=torch.bfloat16)
    us, outs = [], []
    for tc in (True, False) if cuda_cores else (True,):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                          "NHD", use_tensor_cores=tc)

        def first(w=w):
            w.plan(indptr, indices, last, pages.hq, pages.hkv, pages.d, pages.page, q_data_type=torch.bfloat16,
                   kv_data_type=torch.bfloat16, sm_scale=pages.d ** -0.5)
            return w.run(q, (pages.k, pages.v))
        outs.append(_timed_first(first_use, f"decode, tensor cores {tc}", first))
        us.append(graph_us(lambda _, w=w: w.run(q, (pages.k, pages.v))))
    tr_us, tr_out, best = probe_triton_decode(pages, q, indptr, indices, last, sweep)
    diff = max((o.float() - outs[0].float()).abs().max().item() for o in outs[1:] + [tr_out])
    return us[0], us[1] if cuda_cores else None, tr_us, diff, best


def probe_prefill(pages: Pages, rows: int, tokens: int, first_use: dict) -> tuple[float, float, float]:
    import flashinfer
    indptr, indices, last = pages.table(rows, tokens)
    qo_indptr = torch.arange(0, rows + 1, dtype=torch.int32) * tokens
    q = torch.randn(rows * tokens, pages.hq, pages.d, device="cuda", dtype=torch.bfloat16)
    us, outs = [], []
    for backend in ("fa2", "fa3"):
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                           "NHD", backend=backend)

        def first(w=w):
            w.plan(qo_indptr, indptr, indices, last, pages.hq, pages.hkv, pages.d, pages.page, causal=True,
                   sm_scale=pages.d ** -0.5, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            return w.run(q, (pages.k, pages.v))
        outs.append(_timed_first(first_use, f"prefill, {backend}", first))
        us.append(graph_us(lambda _, w=w: w.run(q, (pages.k, pages.v)), reps=5))
    return us[0], us[1], (outs[0].float() - outs[1].float()).abs().max().item()


def _rows_x_tokens(s: str) -> tuple[int, int]:
    rows, _, tokens = s.partition("x")
    return int(rows), int(tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mstar.bench.tools.probe_paged_attention",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--decode-batch", type=int, nargs="*", default=[1, 8, 32, 128], help="Decode rows (none: skip).")
    p.add_argument("--context", type=int, nargs="+", default=[300, 2048], help="Keys per decode row.")
    p.add_argument("--prefill-rows", type=_rows_x_tokens, nargs="*", default=[(1, 4096), (8, 256), (32, 256)],
                   help="Prefill batches as ROWSxTOKENS (none: skip).")
    p.add_argument("--no-cuda-cores", action="store_true",
                   help="Skip FlashInfer's CUDA-core decode (its module's build takes ~17 s on a host without it).")
    p.add_argument("--triton-sweep", action="store_true",
                   help="Also time the Triton decode kernels' slice policies (waves of programs, fewest blocks "
                        "a slice) and launch configurations, and print the best.")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--cache-gib", type=float, default=2.0, help="Size of the K and V caches together.")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_paged_attention needs a CUDA GPU")
    import mstar.ops  # noqa: F401  (before FlashInfer: points its JIT cache into mstar's kernel cache)
    first_use: dict[str, float] = {}
    for model in args.models:
        pages = Pages(model, args.page_size, args.cache_gib)
        if args.decode_batch:
            print(f"{model} decode   rows  keys  tensor cores us  CUDA cores us  triton us  max diff")
            for keys in args.context:
                for b in args.decode_batch:
                    if pages.fits(b, keys):
                        tc, cc, tr, diff, best = probe_decode(pages, b, keys, first_use, args.triton_sweep,
                                                                 not args.no_cuda_cores)
                        cc = "-" if cc is None else f"{cc:.2f}"
                        print(f"{'':>{len(model)}}        {b:>4}  {keys:>4}  {tc:>15.2f}  {cc:>13}  {tr:>9.2f}"
                              f"  {diff:>8.2e}{best}", flush=True)
        if args.prefill_rows:
            print(f"{model} prefill  rows  tokens  fa2 us  fa3 us  max diff")
            for rows, tokens in args.prefill_rows:
                if pages.fits(rows, tokens):
                    fa2, fa3, diff = probe_prefill(pages, rows, tokens, first_use)
                    print(f"{'':>{len(model)}}         {rows:>4}  {tokens:>6}  {fa2:>6.1f}  {fa3:>6.1f}  {diff:>8.2e}",
                          flush=True)
        del pages
    for k, v in first_use.items():
        print(f"first use (build or load) of {k}: {v:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
