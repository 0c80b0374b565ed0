"""The fused all-reduce + add + RMSNorm (MSTAR_TP_ALLREDUCE=symm_mem_norm) against the three
kernels it replaces (copy into the symmetric buffer, PyTorch's one-shot all-reduce, the Triton
fused add + RMSNorm) and against NCCL + the norm, on N GPUs of one host: the results' bits, and the
time per site inside a CUDA graph of 64 consecutive sites (a 32-layer decode step has 64).

    python -m mstar.bench.tools.allreduce_norm_bench --world 2 --rows 8 32 128 --hidden 4096
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, args) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=args.world,
                            device_id=dev)
    from mstar import ops
    from mstar.models import parallel
    from mstar.runtime.parallel import tp_allreduce
    dt = torch.bfloat16
    assert tp_allreduce.setup(dev, dt, "symm_mem_norm") == "symm_mem_norm"
    one_shot, fused = parallel._FAST_ALL_REDUCE[0], parallel._FUSED_REDUCE_NORM[0]
    h = args.hidden
    w = (0.1 * torch.randn(h, generator=torch.Generator().manual_seed(1))).to(dt).to(dev)
    sites = 64
    for n in args.rows:
        g = torch.Generator().manual_seed(100 + rank)  # every rank its own partial sums
        xs = [(torch.randn(n, h, generator=g)).to(dt).to(dev) for _ in range(sites)]
        res0 = (torch.randn(n, h, generator=torch.Generator().manual_seed(7))).to(dt).to(dev)  # the same everywhere

        def chain(kind, inputs, inplace=False):
            r = res0
            for s, x in enumerate(inputs):
                if kind == "fused":
                    y, r = fused(x, r, w, 1e-6, True, s)
                else:
                    xc = x if inplace else x.clone()  # timed in place, as the model's GEMM output is
                    if kind == "symm_mem":
                        assert one_shot(xc)
                    else:
                        dist.all_reduce(xc)
                    y, r = ops.fused_add_rms_norm(xc, r, w, 1e-6, True)
            return y, r

        outs = {k: chain(k, xs) for k in ("nccl", "symm_mem", "fused")}
        same = {k: bool(torch.equal(outs[k][0], outs["nccl"][0]) and torch.equal(outs[k][1], outs["nccl"][1]))
                for k in outs}
        times = {}
        for kind in ("nccl", "symm_mem", "fused"):
            ins = [x.clone() for x in xs]  # the sums overflow over the replays: timing only
            s = torch.cuda.Stream(dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):
                chain(kind, ins, True)  # warm-up on the capture stream
            torch.cuda.current_stream(dev).wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(kind, ins, True)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize(dev)
            dist.barrier()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(args.iters):
                graph.replay()
            e1.record()
            torch.cuda.synchronize(dev)
            times[kind] = e0.elapsed_time(e1) * 1000 / args.iters / sites
            del graph
        if rank == 0:
            print(f"rows {n} x {h}: per site (us, in a graph of {sites}) nccl+norm {times['nccl']:.2f}, "
                  f"copy+one-shot+norm {times['symm_mem']:.2f}, fused {times['fused']:.2f}; "
                  f"bits equal to nccl+norm: {same}", flush=True)
    tp_allreduce.teardown()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    mp.spawn(_worker, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
