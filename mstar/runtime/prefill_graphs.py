"""Piecewise CUDA graphs for the steps the decode graphs do not take (prefill and mixed steps).

A decoder layer is norm -> mixer -> norm -> MLP, and the mixer splits into `pre` (its input
projections), `core` (attention over the paged cache, or the conv and recurrence over the
state pools: what reads the step's metadata and cannot be replayed at another step's layout)
and `post` (its output projection). Everything outside the cores is row-wise, so it is the same
computation whatever rows surround it. The forward is cut into L + 1 segments around the L cores:

    segment 0:   embed, layer 0's input norm, layer 0's pre
    segment k:   layer k-1's post, its post-attention norm and MLP, layer k's input norm and pre
    segment L:   layer L-1's post, norm and MLP, the final norm

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
Encoder-decoder models are not supported.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from mstar.runtime.cuda_graphs import capture_after_first_use

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
    """None if the model can be cut into segments, else why not."""
    tm = getattr(model, "model", None)
    layers = getattr(tm, "layers", None)
    if layers is None or getattr(model, "rope", None) is None:
        return f"{type(model).__name__} is not a decoder-only LM"
    for layer in layers:
        m = layer.mixer
        if not all(hasattr(m, a) for a in ("pre", "core", "post", "core_width")):
            return f"{type(m).__name__} has no pre / core / post"
    return None


class PrefillGraphRunner:
    def __init__(self, model, *, device: torch.device, dtype: torch.dtype, max_tokens: int, capture: bool,
                 stream=None):
        """stream: where first uses and captures run (the decode graphs' capture stream, when there
        is one: session 7 saw every decode replay slow down once a graph was captured on any other
        stream, notes/gpu-2026-11-30-s7.md; unconfirmed as the cause); default a new one."""
        tm = model.model
        self.embed, self.norm, self.rope = tm.embed_tokens, tm.norm, model.rope
        self.layers = list(tm.layers)
        self.device = torch.device(device)
        self.sizes = prefill_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        n, hidden = self.max_tokens, int(tm.norm.weight.shape[0])
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
            for layer in self.layers:
                key = tuple((tuple(t.shape[1:]), t.dtype) for t in layer.mixer.pre(probe))
                if key not in pre_bufs:
                    pre_bufs[key] = tuple(torch.zeros((n,) + shape, dtype=dt, device=self.device) for shape, dt in key)
                self.layer_pre.append(pre_bufs[key])
                w = int(layer.mixer.core_width())
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
            h = self.embed(self.ids[:n])
            residual = None
        else:
            prev = self.layers[k - 1]
            h = prev.mixer.post(self.layer_core[k - 1][:n])
            x, residual = prev.post_attention_layernorm.add_forward(h, self.residual[:n])
            h = prev.mlp(x)
        if k == len(self.layers):
            out, _ = self.norm.add_forward(h, residual)
            self.out[:n].copy_(out)
            return
        layer = self.layers[k]
        x, residual = layer.input_layernorm.add_forward(h, residual)
        for buf, t in zip(self.layer_pre[k], layer.mixer.pre(x)):
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
                for k in range(len(self.layers) + 1):
                    g, _ = capture_after_first_use(lambda k=k, n=n: self._segment(k, n), stream, pool)
                    pool = g.pool() if pool is None else pool
                    graphs.append(g)
                self.graphs[n] = graphs
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        self.graph_bytes = max(0, free0 - torch.cuda.mem_get_info(dev)[0])
        log.info("prefill graphs: %d token counts (16..%d) x %d segments captured in %.2f s, %.1f MiB",
                 len(self.sizes), self.max_tokens, len(self.layers) + 1, self.capture_s, self.graph_bytes / 2 ** 20)

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
        rope = self.rope
        for k, layer in enumerate(self.layers):
            if graphs is None:
                self._segment(k, n)
            else:
                graphs[k].replay()
            pre = tuple(b[:t] for b in self.layer_pre[k])
            o = layer.mixer.core(ctx, pre, rope)  # (GDN's core takes the rope and ignores it)
            self.layer_core[k][:t].copy_(o)
        if graphs is None:
            self._segment(len(self.layers), n)
        else:
            graphs[-1].replay()
        return self.out[:t]
