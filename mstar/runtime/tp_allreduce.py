"""The knob MSTAR_TP_ALLREDUCE: the all-reduce of the row-parallel outputs at tp > 1.

"nccl" (the default) leaves `mstar.models.parallel.all_reduce` on torch.distributed.
"symm_mem" installs a one-shot all-reduce on PyTorch's symmetric memory: each rank copies
its tensor into a buffer that every rank can address, then one kernel per rank reads all
the peers' buffers over NVLink and sums them (in rank order, so every rank gets the same
bits). One launch and one peer read per element: for the small tensors of a decode step
this is the latency NCCL's ring cannot reach. Multicast (multimem) is never used: the GPU
hosts keep TORCH_SYMM_MEM_DISABLE_MULTICAST=1.

Every rank must call `setup` at the same point (the rendezvous is collective), after
init_process_group and before the first forward, so that the graphs capture it.
"""

from __future__ import annotations

import logging

import torch

from mstar import knobs
from mstar.models import parallel
from mstar.models.context import dtype_name

log = logging.getLogger("mstar.runtime.tp")

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


def setup(device: torch.device, dtype: torch.dtype, want: str | None = None) -> str:
    """Install the all-reduce `want` names (default: the knob's) on this rank; returns what is
    in use. Every rank must pass the same `want` (rank 0 sends its own to the followers)."""
    if want is None:
        want = knobs.value("MSTAR_TP_ALLREDUCE")
    parallel.install_all_reduce(None)
    if want == "nccl":
        return "nccl"
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        log.warning("MSTAR_TP_ALLREDUCE=symm_mem has no effect on %s / %s (CUDA, bf16 or fp16 only)",
                    device.type, dtype_name(dtype))
        return "nccl"
    parallel.install_all_reduce(SymmMemAllReduce(device, dtype))
    log.info("tp all-reduce: one-shot on symmetric memory up to %d MiB, NCCL above", MAX_BYTES >> 20)
    return "symm_mem"


def teardown() -> None:
    parallel.install_all_reduce(None)
