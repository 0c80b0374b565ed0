"""Full-graph decode: a decode-only step replayed from a CUDA graph captured per batch size.

A step whose rows are all decode rows (one token each) is padded to the next captured
batch size B and run as one graph replay: the model's whole forward (every layer, the
attention, GDN and KV ops included) was captured once at B, over fixed input buffers.
Per step the host only

  1. writes token ids, positions, KV slots and state slots of the rows into one pinned
     staging buffer and copies it to the device buffers the graph reads (one copy);
  2. refreshes the attention plan outside the graph: page indices go to a fixed device
     buffer, and the backend's decode plan (ops.decode_graph_plan) writes its schedule into
     the fixed buffers its captured kernels read (cross-attention: planned once, since
     every row reads one whole-source page; only the slots change);
  3. replays the graph; the hidden states of the real rows are a view of its output.

Padding rows (B - D of them) decode token 0 at position 0 over a page and a state slot
that the cache manager set aside for them (`CacheManager(padding=True)`), so they never
touch a request's KV or state; their outputs are dropped.

Mode "static" runs the very same buffers and padding eagerly, without capturing: how the
CPU tests check this path's inputs against the normal eager step, token for token.
Prefill and mixed steps run eagerly (build a ForwardContext per step).

In-graph inputs (MSTAR_INGRAPH_DECODE_TOKENS, decode_masters.py): the staged row of token ids
carries each row's master slot instead (padding rows: the masters' padding slot), and the
first op of the captured forward gathers the input ids from the device master buffer the
sampler writes; with MSTAR_INGRAPH_DECODE_ROPE the positions are gathered from (and advanced
in) the per-slot position master the same way, and the host does not stage them.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from mstar import ops
from mstar.models.context import (AttentionMetadata, CrossAttentionMetadata, ForwardContext, StateMetadata,
                                  cross_slot_pages)
from mstar.models.shape_graphs import capture_after_first_use, padded_sizes
from mstar.runtime.graphs.decode_plan_cache import DecodeArrayCache
from mstar.runtime.engine.step_inputs import StepRows, decode_arrays

log = logging.getLogger("mstar.runtime")


class DecodeGraphRunner:
    def __init__(self, model, forward, *, device: torch.device, page_size: int, max_batch: int, num_pages: int,
                 max_model_len: int, pad_page: int | None, pad_slot: int | None, capture: bool,
                 pad_cross: int | None = None, cross_source_len: int = 0, cross_page_size: int = 0,
                 masters=None):
        """num_pages: the KV pool's size; max_model_len bounds one row's pages.
        Models with per-request cross slots (cross_source_len > 0): each row also attends over its cross
        slot, a second decode plan per batch size (the slot's cross_source_len / cross_page_size
        pages per row, context.CrossAttentionMetadata).
        masters: the DecodeMasters the graphs read their inputs from (None: staged from the host)."""
        self.model = model
        self.forward = forward  # model.forward, or its compiled version
        self.device = torch.device(device)
        self.page_size = page_size
        # models without attention (or without state) have no padding page (or slot)
        self.pad_page, self.pad_slot, self.pad_cross = pad_page or 0, pad_slot or 0, pad_cross or 0
        self.cross_source_len = cross_source_len
        self.cross_page_size = cross_page_size or cross_source_len
        self._x_pages = cross_source_len // self.cross_page_size if cross_source_len else 0  # per slot
        self.capture_enabled = capture
        self.sizes = padded_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        spec = model.cache_spec()
        self.has_attention = bool(spec.attention)
        self.has_state = bool(spec.state)
        self._plan_cache = DecodeArrayCache.from_knobs(page_size, self.has_attention)  # MSTAR_KV_PLAN_CACHE
        pin = self.device.type == "cuda"
        B = self.max_batch
        per_seq = -(-max_model_len // page_size)
        cap = lambda b: min(num_pages, b * per_seq) + b  # noqa: E731 -- page indices of b rows (+ padding)
        max_pages = cap(B)
        # rows: token ids, positions, KV slot of the new token, state slot
        self._host = torch.zeros((4, B), dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros((4, B), dtype=torch.int64, device=self.device)
        # a padding row's column of the staged buffer (token 0, or the masters' padding slot)
        self._pad_col = np.array([[0 if masters is None else masters.pad], [0], [self.pad_page * page_size],
                                  [self.pad_slot]], dtype=np.int64)
        # in-graph inputs: fixed buffers the captured forward gathers the ids (and positions) into
        self.masters = masters
        self._rope = masters is not None and masters.positions is not None
        self._ids = torch.zeros(B, dtype=torch.int64, device=self.device) if masters is not None else None
        self._pos = torch.zeros(B, dtype=torch.int64, device=self.device) if self._rope else None
        self._pos_next = torch.zeros(B, dtype=torch.int64, device=self.device) if self._rope else None
        self._read_args: dict[int, tuple] = {}
        self._idx_host = torch.zeros(max_pages, dtype=torch.int32, pin_memory=pin)
        self._idx_dev = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        self._ptr_host = torch.zeros(B + 1, dtype=torch.int32)
        self._last_host = torch.ones(B, dtype=torch.int32)
        # cross-attention rows: the pages of the row's cross slot (indptr = arange * pages), the whole source
        self._xidx_host = torch.zeros(B * self._x_pages, dtype=torch.int32, pin_memory=pin)
        # the padding rows' pages (they read the padding cross slot)
        self._x_pad_pages = cross_slot_pages([self.pad_cross] * B, self._x_pages) if self._x_pages else None
        self.plans: dict[int, object] = {}
        self.cross_plans: dict[int, object] = {}
        self.contexts: dict[int, ForwardContext] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.stream = None  # the capture stream (capture() makes it; the prefill graphs capture on it too)
        self.pool = None  # the graphs' memory pool (capture() makes it; mstar/bench/tools/pg_decode_probe.py reads it)
        self.outputs: dict[int, torch.Tensor] = {}
        attn = spec.attention[0] if self.has_attention else None
        empty32 = torch.zeros(0, dtype=torch.int32, device=self.device)
        empty64 = torch.zeros(0, dtype=torch.int64, device=self.device)
        for b in self.sizes:
            md = None
            if attn is not None:
                plan = ops.decode_graph_plan(
                    self.device, batch=b, max_pages=cap(b),
                    num_q_heads=attn.num_q_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                    page_size=page_size, dtype=model.dtype, scale=attn.scale)
                self.plans[b] = plan
                zero1 = torch.zeros(1, dtype=torch.int32)
                md = AttentionMetadata(slot_mapping=self._dev[2, :b], decode_kv_indptr=plan.indptr,
                                       decode_kv_indices=plan.indices, decode_kv_last_page_len=plan.last_page_len,
                                       prefill_qo_indptr=zero1, prefill_kv_indptr=zero1,
                                       prefill_kv_indices=empty32, prefill_kv_last_page_len=empty32)
            st = None
            if self.has_state:
                st = StateMetadata(decode_slots=self._dev[3, :b], prefill_cu_seqlens=torch.zeros(1, dtype=torch.int32,
                                                                                                 device=self.device),
                                   prefill_slots=empty64, snap_token_idx=empty64, snap_slots=empty64)
            cross = None
            if cross_source_len:
                xa = spec.cross.layers[0]
                n = self._x_pages
                xp = ops.decode_graph_plan(
                    self.device, batch=b, max_pages=b * n, num_q_heads=xa.num_q_heads, num_kv_heads=xa.num_kv_heads,
                    head_dim=xa.head_dim, page_size=self.cross_page_size, dtype=model.dtype, scale=xa.scale)
                xp.plan(torch.arange(b + 1, dtype=torch.int32) * n,
                        torch.from_numpy(cross_slot_pages([self.pad_cross] * b, n)).to(self.device),
                        torch.full((b,), self.cross_page_size, dtype=torch.int32))
                self.cross_plans[b] = xp
                cross = CrossAttentionMetadata(kv_indptr=xp.indptr, kv_indices=xp.indices,
                                               kv_last_page_len=xp.last_page_len)
            ids, pos = self._dev[0, :b], self._dev[1, :b]
            if masters is not None:
                ids = self._ids[:b]
                if self._rope:
                    pos = self._pos[:b]
                self._read_args[b] = (self._dev[0, :b], ids, pos if self._rope else None,
                                      self._pos_next[:b] if self._rope else None)
            self.contexts[b] = ForwardContext(input_ids=ids, positions=pos,
                                              num_decode_tokens=b, attn=md, state=st, cross=cross)
        self.capture_s = 0.0
        self.graph_memory_bytes = 0
        # the host buffers above are rewritten every step; with overlapped decode the host runs
        # ahead of the device, so a step waits until the previous step's copies out of them
        # were done (recorded right after they were queued: in practice long finished)
        self._staged = torch.cuda.Event() if self.device.type == "cuda" else None
        self._staged_pending = False

    # --- capture --------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool. Logs time and memory."""
        if not self.capture_enabled:
            return
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free0 = torch.cuda.mem_get_info(self.device)[0]
        pool = self.pool = torch.cuda.graph_pool_handle()
        stream = self.stream = torch.cuda.Stream(self.device)
        for b in reversed(self.sizes):
            self._stage_padding(b)
            self.graphs[b], self.outputs[b] = capture_after_first_use(lambda b=b: self._forward_at(b), stream, pool)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        self.graph_memory_bytes = max(0, free0 - torch.cuda.mem_get_info(self.device)[0])
        log.info("decode graphs: %d batch sizes (1..%d) captured in %.2f s, %.1f MiB of graph memory",
                 len(self.sizes), self.max_batch, self.capture_s, self.graph_memory_bytes / 2**20)

    def _stage_padding(self, b: int) -> None:
        """Every row a padding row (capture and warm-up)."""
        self._fill(b, 0, StepRows([], [], [], [], [], [], [], [], [], [], []))

    # --- a step --------------------------------------------------------------------------------
    def bucket(self, num_rows: int) -> int | None:
        """The captured batch size a decode step of num_rows rows runs at (None: too many)."""
        if num_rows > self.max_batch or num_rows < 1:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_rows)]

    def run(self, rows: StepRows, loopback: torch.Tensor | None = None,
            slots: list[int] | None = None) -> torch.Tensor:
        """Hidden states [D, hidden] of a decode-only step (D = len(rows.decode_tokens)).
        loopback: the previous step's sampled tokens on the device, row for row the input
        ids of this step (decode_overlap.py), instead of rows.decode_tokens.
        slots: with masters (in-graph inputs), each row's master slot; required then, and
        rows.decode_tokens (and positions with ROPE) are not staged."""
        d = len(rows.decode_tokens)
        b = self.bucket(d)
        if self.masters is not None and slots is None and d:
            raise ValueError("decode graphs read their inputs from the decode masters: run() needs the rows' slots")
        self._fill(b, d, rows, slots)
        if loopback is not None:
            self._dev[0, :d].copy_(loopback[:d])
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][:d]
        return self._forward_at(b)[:d]

    def release(self) -> None:
        """Destroy the captured graphs now. Tensor-parallel close needs it: NCCL's teardown
        (destroy and abort alike) waits until every graph that captured one of its collectives
        is gone. A graph still in flight is freed when it completes. Later steps run uncaptured."""
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()

    def row_slots(self, d: int) -> torch.Tensor:
        """With masters: the device master slots of the last staged step's first d rows
        (valid until the next step is staged; stream-ordered)."""
        return self._dev[0, :d]

    def _forward_at(self, b: int) -> torch.Tensor:
        """What a graph of batch size b captures: with masters, the gathers of the inputs
        (and the position advance) first, then the forward."""
        if self.masters is not None:
            self.masters.read_inputs(*self._read_args[b])
        return self.forward(self.contexts[b])

    def _fill(self, b: int, d: int, rows: StepRows, slots: list[int] | None = None) -> None:
        if self._staged_pending:
            self._staged.synchronize()
        ps = self.page_size
        h = self._host_np
        h[:, d:b] = self._pad_col
        if d:
            pos, indptr, indices, last, slot = decode_arrays(rows, ps, self.has_attention) \
                if self._plan_cache is None else self._plan_cache.arrays(rows)
            h[0, :d] = rows.decode_tokens if slots is None else slots
            if not self._rope:
                h[1, :d] = pos
            if self.has_attention:
                h[2, :d] = slot
            if self.has_state:
                h[3, :d] = rows.decode_slots
        self._dev[:, :b].copy_(self._host[:, :b], non_blocking=True)
        if self.cross_source_len:
            # every row reads its slot's pages, the whole source: the plan (planned at
            # construction) never changes, only which slot's pages each row reads
            n = self._x_pages
            x = self._xidx_host.numpy()
            cross_slot_pages(rows.decode_cross or (), n, out=x[:d * n])
            x[d * n:b * n] = self._x_pad_pages[:(b - d) * n]
            self.cross_plans[b].indices[:b * n].copy_(self._xidx_host[:b * n], non_blocking=True)
        if not self.has_attention:
            self._mark_staged()
            return
        # page tables: real rows, then one page (the padding page, 1 token) per padding row
        n_real = int(indptr[-1]) if d else 0
        n = n_real + (b - d)
        ptr, last_h, idx = self._ptr_host.numpy(), self._last_host.numpy(), self._idx_host.numpy()
        if d:
            ptr[:d + 1] = indptr
            last_h[:d] = last
            idx[:n_real] = indices
        else:
            ptr[0] = 0
        ptr[d + 1:b + 1] = np.arange(n_real + 1, n + 1)
        last_h[d:b] = 1
        idx[n_real:n] = self.pad_page
        self._idx_dev[:n].copy_(self._idx_host[:n], non_blocking=True)
        self.plans[b].plan(self._ptr_host[:b + 1], self._idx_dev[:n], self._last_host[:b])
        self._mark_staged()

    def _mark_staged(self) -> None:
        if self._staged is not None:
            self._staged.record()
            self._staged_pending = True
