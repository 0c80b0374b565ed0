"""The knob MSTAR_TP_ALLREDUCE: the all-reduce of the row-parallel outputs at tp > 1.

"nccl" (the default) leaves `mstar.models.parallel.all_reduce` on torch.distributed.
"symm_mem" installs a one-shot all-reduce on PyTorch's symmetric memory: each rank copies
its tensor into a buffer that every rank can address, then one kernel per rank reads all
the peers' buffers over NVLink and sums them (in rank order, so every rank gets the same
bits). One launch and one peer read per element: for the small tensors of a decode step
this is the latency NCCL's ring cannot reach. Multicast (multimem) is never used: the GPU
hosts keep TORCH_SYMM_MEM_DISABLE_MULTICAST=1.

"auto" is symm_mem_norm where the ranks' GPUs can address each other (CUDA peer access) and
the model is bf16 / fp16, nccl elsewhere.

"symm_mem_norm" is symm_mem plus, for the row-parallel outputs that a residual add + RMSNorm
follows (every one in Qwen3.5 / Qwen3: the model defers those sums to its norms), one Triton kernel
that sums, adds and norms (ops/backends/triton_allreduce_norm.py): one launch where symm_mem takes
three (copy in, all-reduce, norm), for tensors up to MAX_BYTES; larger ones go the plain way.

Every rank must call `setup` at the same point (the rendezvous is collective), after
init_process_group and before the first forward, so that the graphs capture it.
"""

from __future__ import annotations

import logging

import torch

from mstar import knobs
from mstar.models import parallel
from mstar.models.context import dtype_name

log = logging.getLogger("mstar.runtime.parallel.tp")

MAX_BYTES = 4 << 20  # decode steps (256 rows x 5120 x bf16 = 2.6 MiB); larger (prefill) tensors use NCCL
ALIGN_BYTES = 16  # the one-shot kernel moves 16-byte vectors


class SymmMemAllReduce:
    """One-shot all-reduce for tensors of the model's dtype (bf16 / fp16) of at most MAX_BYTES,
    on the default group."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm

        group = dist.group.WORLD
        self.group_name = group.group_name
        enable = getattr(symm, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before rendezvous by older torch; a no-op (with a warning) in newer
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.dtype = dtype
        self.buf = symm.empty(MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm.rendezvous(self.buf, self.group_name)
        self.op = torch.ops.symm_mem.one_shot_all_reduce_out

    def __call__(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        if (x.dtype != self.dtype or nbytes > MAX_BYTES or nbytes % ALIGN_BYTES or not x.is_contiguous()
                or x.data_ptr() % ALIGN_BYTES):
            return False
        flat = x.view(-1)
        b = self.buf[:flat.numel()]
        b.copy_(flat)
        self.op(b, "sum", self.group_name, flat)
        return True


FLAG_ROWS = 4096  # rows per call the fused kernel's flags have room for (a decode step has one per sequence)


class SymmMemReduceNorm:
    """The fused all-reduce + residual add + RMSNorm on the default group: two shared buffers
    (consecutive sites of a forward alternate, so no closing barrier is needed) and a flag per
    row and rank. Takes 2-D tensors of the model's dtype of at most MAX_BYTES; the decision
    depends only on shapes and dtypes, so every rank decides alike."""

    def __init__(self, device: torch.device, dtype: torch.dtype, timeout_s: float = 600.0):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm

        self.timeout_s = float(timeout_s)
        group_name = dist.group.WORLD.group_name
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dtype, self.capacity = dtype, MAX_BYTES // dtype.itemsize
        self.bufs = symm.empty(2 * self.capacity, dtype=dtype, device=device)
        self.flags = symm.empty(FLAG_ROWS * self.world, dtype=torch.int32, device=device)
        self.flags.zero_()
        hb = symm.rendezvous(self.bufs, group_name)
        hf = symm.rendezvous(self.flags, group_name)
        # each rank's copy at the same offset of its allocation
        b_off, f_off = self.bufs.data_ptr() - hb.buffer_ptrs[self.rank], self.flags.data_ptr() - hf.buffer_ptrs[self.rank]
        half = self.capacity * dtype.itemsize
        addrs = torch.tensor([[hb.buffer_ptrs[r] + b_off + p * half for r in range(self.world)] for p in range(2)],
                             dtype=torch.int64, device=device)
        self.buf_addrs = (addrs[0], addrs[1])  # by the site's parity; views made once, not per call
        self.flag_addrs = torch.tensor([hf.buffer_ptrs[r] + f_off for r in range(self.world)], dtype=torch.int64,
                                       device=device)
        # every rank's flags are zero before any rank can signal
        torch.cuda.synchronize(device)
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
        from mstar.ops.backends.triton_allreduce_norm import reduce_add_rms_norm
        self.kernel = reduce_add_rms_norm

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 zero_centered: bool, site: int):
        if (residual is None or x.dtype != self.dtype or x.dim() != 2 or residual.shape != x.shape
                or x.stride(-1) != 1 or residual.stride(-1) != 1 or x.numel() > self.capacity
                or x.shape[0] > FLAG_ROWS):
            return None
        return self.kernel(x, residual, weight, eps, zero_centered, self.buf_addrs[site % 2], self.flag_addrs,
                           self.rank, self.world, self.timeout_s)


def setup(device: torch.device, dtype: torch.dtype, want: str | None = None, timeout_s: float = 600.0) -> str:
    """Install the all-reduce `want` names (default: the knob's) on this rank; returns what is
    in use. Every rank must pass the same `want` (rank 0 sends its own to the followers).
    timeout_s: how long the fused kernel waits for a peer before it traps (the collective timeout)."""
    if want is None:
        want = knobs.value("MSTAR_TP_ALLREDUCE")
    teardown()
    if want == "auto":
        want = "symm_mem_norm" if _symmetric_memory_usable(device, dtype) else "nccl"
    if want == "nccl":
        return "nccl"
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        log.warning("MSTAR_TP_ALLREDUCE=%s has no effect on %s / %s (CUDA, bf16 or fp16 only)", want,
                    device.type, dtype_name(dtype))
        return "nccl"
    parallel.install_all_reduce(SymmMemAllReduce(device, dtype))
    if want == "symm_mem_norm":
        parallel.install_fused_reduce_norm(SymmMemReduceNorm(device, dtype, timeout_s))
    log.info("tp all-reduce: one-shot on symmetric memory up to %d MiB, NCCL above%s", MAX_BYTES >> 20,
             "; fused with the residual add + RMSNorm" if want == "symm_mem_norm" else "")
    return want


def _symmetric_memory_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA, a 16-bit model dtype, and this rank's GPU can address every other rank's (rank r
    runs on GPU base + r). The answer is the same on every rank of one host; if it were not, rank 0
    refuses to start (the ranks report what they installed)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    import torch.distributed as dist
    rank, size = dist.get_rank(), dist.get_world_size()
    base = device.index - rank
    return all(torch.cuda.can_device_access_peer(device.index, base + r) for r in range(size) if r != rank)


def teardown() -> None:
    parallel.install_all_reduce(None)
    parallel.install_fused_reduce_norm(None)
