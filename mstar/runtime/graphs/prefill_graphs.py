"""Piecewise CUDA graphs for the steps the decode graphs do not take (prefill and mixed steps).

The model gives its forward as segments around its L cores (`model.forward_segments()`,
mstar/models/segments.py): the cores (attention over the paged cache, or the conv and
recurrence over the state pools) read the step's metadata and cannot be replayed at another
step's layout; everything between them is row-wise, so it is the same computation whatever
rows surround it.

Each segment is captured once per padded token count n (a bucket, `prefill_sizes`). A segment
reads and writes fixed buffers: the token ids, the residual stream, and the pre / core outputs
(one set per layer kind, reused layer after layer). A step of T tokens takes the smallest bucket
n >= T: its ids go into the id buffer, then for every layer the segment's graph is replayed and
the core runs eagerly on the first T rows of the pre buffers, writing its output into the core
buffer the next segment reads. Rows T..n are padding: whatever they hold, they stay in their own
rows and are never read back.

"static" runs the same segments eagerly on the same buffers and padding (any device): how CPU
tests check the cut against the plain forward. Tensor parallel: every rank builds the runner (and
captures it at the same time: the row-parallel all-reduces inside the segments pair up) and runs
a step through it when rank 0 does (the same token count picks the same bucket everywhere).
A model whose forward_segments() is None runs its plain forward.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from mstar.models.shape_graphs import capture_after_first_use

log = logging.getLogger("mstar.runtime")

_SMALL = (16, 32, 64, 128, 256, 512)
_STEP = 512  # above 512 tokens the buckets are multiples of 512 (at most 512 rows of padding)


def prefill_sizes(max_tokens: int) -> list[int]:
    """The padded token counts: 16 .. 512 in powers of two, then multiples of 512, up to the
    step's token budget (rounded up to a multiple of 16)."""
    top = -(-max(1, max_tokens) // 16) * 16
    sizes = [s for s in _SMALL if s < top]
    sizes += list(range(1024, top, _STEP))
    return sorted(set(sizes + [top]))


def supported(model) -> str | None:
    """None if the model gives its forward as segments, else why not."""
    seg_of = getattr(model, "forward_segments", None)
    if seg_of is None or seg_of() is None:
        why = getattr(model, "segments_unsupported", None)
        return why() if why is not None else f"{type(model).__name__} does not give its forward as segments"
    return None


class PrefillGraphRunner:
    def __init__(self, model, *, device: torch.device, dtype: torch.dtype, max_tokens: int, capture: bool,
                 stream=None):
        """stream: where first uses and captures run (the decode graphs' capture stream, when there
        is one: a graph captured on any other stream went with every decode replay slowing down,
        notes/gpu-2026-11-30-idle-gather.md; unconfirmed as the cause); default a new one."""
        self.seg = seg = model.forward_segments()
        self.num_cores = seg.num_cores
        self.device = torch.device(device)
        self.sizes = prefill_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        n, hidden = self.max_tokens, seg.hidden_size
        self.ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.residual = torch.zeros(n, hidden, dtype=dtype, device=self.device)
        self.out = torch.zeros(n, hidden, dtype=dtype, device=self.device)
        # pre / core output buffers per layer, one set shared by the layers of one shape (from one row)
        pre_bufs: dict[tuple, tuple[torch.Tensor, ...]] = {}
        core_bufs: dict[int, torch.Tensor] = {}
        self.layer_pre: list[tuple[torch.Tensor, ...]] = []
        self.layer_core: list[torch.Tensor] = []
        probe = torch.zeros(1, hidden, dtype=dtype, device=self.device)
        with torch.inference_mode():
            for k in range(self.num_cores):
                key = tuple((tuple(t.shape[1:]), t.dtype) for t in seg.pre_outputs(k, probe))
                if key not in pre_bufs:
                    pre_bufs[key] = tuple(torch.zeros((n,) + shape, dtype=dt, device=self.device) for shape, dt in key)
                self.layer_pre.append(pre_bufs[key])
                w = seg.core_width(k)
                if w not in core_bufs:
                    core_bufs[w] = torch.zeros(n, w, dtype=dtype, device=self.device)
                self.layer_core.append(core_bufs[w])
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.stream = stream
        self.capture_s = 0.0
        self.graph_bytes = 0
        if capture:
            self._capture()

    # --- the segments ---------------------------------------------------------------------------
    def _segment(self, k: int, n: int) -> None:
        """Segment k (module docstring) over the first n rows of the buffers."""
        if k == 0:
            pre, residual = self.seg.segment(0, self.ids[:n], None, None)
        else:
            pre, residual = self.seg.segment(k, None, self.layer_core[k - 1][:n], self.residual[:n])
        if k == self.num_cores:
            self.out[:n].copy_(pre)
            return
        for buf, t in zip(self.layer_pre[k], pre):
            buf[:n].copy_(t)
        self.residual[:n].copy_(residual)

    def _capture(self) -> None:
        t0 = time.perf_counter()
        dev = self.device
        free0 = torch.cuda.mem_get_info(dev)[0]
        pool = None
        stream = self.stream if self.stream is not None else torch.cuda.Stream(dev)
        with torch.inference_mode():
            for n in reversed(self.sizes):  # largest first: the pool's blocks fit the smaller ones
                graphs = []
                for k in range(self.num_cores + 1):
                    g, _ = capture_after_first_use(lambda k=k, n=n: self._segment(k, n), stream, pool)
                    pool = g.pool() if pool is None else pool
                    graphs.append(g)
                self.graphs[n] = graphs
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        self.graph_bytes = max(0, free0 - torch.cuda.mem_get_info(dev)[0])
        log.info("prefill graphs: %d token counts (16..%d) x %d segments captured in %.2f s, %.1f MiB",
                 len(self.sizes), self.max_tokens, self.num_cores + 1, self.capture_s, self.graph_bytes / 2 ** 20)

    def release(self) -> None:
        """Destroy the captured graphs now. Tensor-parallel close needs it: NCCL's teardown
        (destroy and abort alike) waits until every graph that captured one of its collectives
        is gone. A graph still in flight is freed when it completes. Later steps run uncaptured."""
        for graphs in self.graphs.values():
            for g in graphs:
                g.reset()
        self.graphs.clear()

    # --- a step -------------------------------------------------------------------------------
    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def bucket(self, num_tokens: int) -> int:
        """The padded token count a step of num_tokens tokens runs at (as DecodeGraphRunner.bucket)."""
        if not self.fits(num_tokens):
            raise ValueError(f"prefill graphs: {num_tokens} tokens, the buckets hold 1..{self.max_tokens}")
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def run(self, ctx) -> torch.Tensor:
        """The forward of the step described by ctx: final-norm hidden states [T, hidden] (a view
        of a buffer the next step overwrites)."""
        t = int(ctx.input_ids.shape[0])
        n = self.bucket(t)
        self.ids[:t].copy_(ctx.input_ids)
        graphs = self.graphs.get(n)
        for k in range(self.num_cores):
            if graphs is None:
                self._segment(k, n)
            else:
                graphs[k].replay()
            pre = tuple(b[:t] for b in self.layer_pre[k])
            o = self.seg.core(k, ctx, pre)
            self.layer_core[k][:t].copy_(o)
        if graphs is None:
            self._segment(self.num_cores, n)
        else:
            graphs[-1].replay()
        return self.out[:t]
