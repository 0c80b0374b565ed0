"""Build a step's ForwardContext from the scheduled rows.

Everything is computed on the host in numpy, packed into two flat buffers (one int64, one
int32) and moved to the device with one copy each; the context's tensors are views into
those two device buffers, except the attention indptrs and last-page lengths, which stay
on the host (one small host buffer) for the backends that plan from them. Per-row Python
work is limited to gathering each row's page list and token slice (which live in Python
lists in the cache manager and the sequence); positions, slot mapping, indptrs and
last-page lengths are vectorised.

Layout (see mstar/models/context.py): decode rows first (one token each, the sequence's
last token at position len-1), then prefill rows (tokens [start, end) at positions
start..end-1). After the step a row's KV holds `end` (prefill) or `len` (decode) tokens.

Knobs (read once, when the builder is made):
  MSTAR_KV_PLAN_CACHE      the decode rows' page-table arrays come from a DecodeArrayCache
                           (decode_plan_cache.py) instead of decode_arrays every step;
  MSTAR_KV_PINNED_INDPTRS  the two packed buffers go to the device through a PinnedRing: K
                           preallocated page-locked host buffers, each reused only once the
                           copy out of it has finished (an event per slot), instead of
                           pinning a fresh host tensor per buffer and step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mstar import knobs
from mstar.models.context import (AttentionMetadata, CrossAttentionMetadata, ForwardContext, StateMetadata,
                                  cross_slot_pages)
from mstar.runtime.caches.cache_manager import stream_generation


@dataclass
class StepRows:
    """Host-side description of one step, in token-layout order."""

    # decode rows
    decode_tokens: list[int]
    decode_lens: list[int]  # kv length after the step (= position + 1)
    decode_pages: list[list[int]]
    decode_slots: list[int]
    # prefill rows
    prefill_tokens: list[int]  # flattened chunks
    prefill_starts: list[int]
    prefill_ends: list[int]
    prefill_pages: list[list[int]]
    prefill_slots: list[int]
    prefill_samples: list[bool]
    # snapshots: (token index relative to the first prefill token, slot)
    snapshots: list[tuple[int, int]]
    # models with per-request slots (spec.cross): the slot of each row (decode rows, then prefill rows)
    decode_cross: list[int] | None = None
    prefill_cross: list[int] | None = None
    # the cache manager's stream generation when the rows were read (travels with the rows to
    # tensor-parallel followers): MSTAR_KV_PLAN_CACHE advances only within one generation
    generation: int = field(default_factory=stream_generation)


class StepInputBuilder:
    def __init__(self, *, page_size: int, device: torch.device, has_attention: bool, has_state: bool,
                 cross_source_len: int = 0, cross_page_size: int = 0):
        self.page_size = page_size
        self.cross_source_len = cross_source_len  # > 0: the model has cross-attention (Whisper: 1500)
        # a cross slot is read as pages (context.CrossAttentionMetadata); default: one page
        self.cross_page_size = cross_page_size or cross_source_len
        self._x_pages = cross_source_len // self.cross_page_size if cross_source_len else 0  # per slot
        self._x_indptr = np.zeros(0, dtype=np.int32)  # host indptr / last-page lengths, grown on demand
        self._x_last = np.zeros(0, dtype=np.int32)
        self.device = torch.device(device)
        self.has_attention = has_attention
        self.has_state = has_state
        self._pin = self.device.type == "cuda"
        from mstar.runtime.graphs.decode_plan_cache import DecodeArrayCache  # (it imports this module)
        self._plan_cache = DecodeArrayCache.from_knobs(page_size, has_attention)  # MSTAR_KV_PLAN_CACHE
        self._ring = PinnedRing(self.device) if knobs.value("MSTAR_KV_PINNED_INDPTRS") else None

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        if self._ring is not None:
            return self._ring.to_device(arr)
        t = torch.from_numpy(arr)
        if self.device.type == "cpu":
            return t
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def build(self, rows: StepRows) -> tuple[ForwardContext, int]:
        """(context, number of rows that sample). logits_indices lists the sampling rows:
        every decode row, then the prefill rows whose chunk ends the known tokens."""
        ps = self.page_size
        D = len(rows.decode_tokens)
        P = len(rows.prefill_starts)

        # ---- decode -------------------------------------------------------------------------
        d_pos, d_indptr, d_indices, d_last, d_slot = decode_arrays(rows, ps, self.has_attention) \
            if self._plan_cache is None else self._plan_cache.arrays(rows)

        # ---- prefill ------------------------------------------------------------------------
        p_start = np.asarray(rows.prefill_starts, dtype=np.int64)
        p_end = np.asarray(rows.prefill_ends, dtype=np.int64)
        p_qlen = p_end - p_start
        qo_indptr = np.zeros(P + 1, dtype=np.int64)
        np.cumsum(p_qlen, out=qo_indptr[1:])
        n_pref = int(qo_indptr[-1])
        rep_start = np.repeat(p_start - qo_indptr[:-1], p_qlen)
        p_pos = np.arange(n_pref, dtype=np.int64) + rep_start
        p_npages = (p_end + ps - 1) // ps
        p_pages_flat = [p for pages, n in zip(rows.prefill_pages, p_npages.tolist()) for p in pages[:n]] \
            if self.has_attention else []
        p_indices = np.asarray(p_pages_flat, dtype=np.int64)
        p_indptr = np.zeros(P + 1, dtype=np.int64)
        np.cumsum(p_npages, out=p_indptr[1:])
        p_last = p_end - (p_npages - 1) * ps

        # ---- token-level arrays ---------------------------------------------------------------
        T = D + n_pref
        input_ids = np.empty(T, dtype=np.int64)
        input_ids[:D] = rows.decode_tokens
        input_ids[D:] = rows.prefill_tokens
        positions = np.concatenate([d_pos, p_pos])

        if self.has_attention:
            if n_pref:
                pg = p_indices[np.repeat(p_indptr[:-1], p_qlen) + p_pos // ps]
                p_slot = pg * ps + p_pos % ps
            else:
                p_slot = p_pos
            slot_mapping = np.concatenate([d_slot, p_slot])
        else:
            slot_mapping = np.zeros(0, dtype=np.int64)

        samples = np.asarray(rows.prefill_samples, dtype=bool)
        logits_idx = np.concatenate([np.arange(D, dtype=np.int64), D + qo_indptr[1:][samples] - 1])
        n_sample = int(logits_idx.shape[0])

        # cross-attention: every token is its own row over its sequence's whole cross slot, the
        # slot's pages. Only the slots change with the batch; indptr (a multiple of arange) and
        # last-page lengths (a full page) stay on the host (context.py allows it), so a backend
        # plans from them without reading the device.
        if self.cross_source_len:
            slot = np.repeat(np.asarray(list(rows.decode_cross or []) + list(rows.prefill_cross or []),
                                        dtype=np.int64), np.concatenate([np.ones(D, dtype=np.int64), p_qlen]))
            n = self._x_pages
            x_idx = cross_slot_pages(slot, n)
            if len(self._x_indptr) < T + 1:
                m = max(T + 1, 2 * len(self._x_indptr))
                self._x_indptr = (np.arange(m) * n).astype(np.int32)
                self._x_last = np.full(m, self.cross_page_size, dtype=np.int32)
            h_xindptr = torch.from_numpy(self._x_indptr[:T + 1])
            h_xlast = torch.from_numpy(self._x_last[:T])
        else:
            x_idx = np.zeros(0, dtype=np.int64)

        snaps = rows.snapshots
        snap_idx = np.asarray([s[0] for s in snaps], dtype=np.int64)
        snap_slots = np.asarray([s[1] for s in snaps], dtype=np.int64)

        # ---- pack: one int64 and one int32 buffer for the device; the indptrs and last-page
        # lengths stay on the host (context.py allows it): attention backends plan from them
        # without reading the device ---------------------------------------------------------------
        i64_parts = [input_ids, positions, slot_mapping, logits_idx,
                     np.asarray(rows.decode_slots, dtype=np.int64),
                     np.asarray(rows.prefill_slots, dtype=np.int64), snap_idx, snap_slots]
        i32_parts = [d_indices, qo_indptr, p_indices, x_idx]  # qo_indptr: the GDN rows' cu_seqlens
        host_parts = [d_indptr, d_last, qo_indptr, p_indptr, p_last]
        flat64, at64 = _pack(i64_parts, np.int64)
        flat32, at32 = _pack(i32_parts, np.int32)
        b64, b32 = self._to_device(flat64), self._to_device(flat32)
        t_ids, t_pos, t_slotmap, t_logits, t_dslots, t_pslots, t_snapi, t_snaps = _split(b64, at64)
        t_dind, t_qo, t_pind, t_xidx = _split(b32, at32)

        attn = None
        if self.has_attention:
            flat_h, at_h = _pack(host_parts, np.int32)  # read by the host: the alignment only costs padding
            h = _split(torch.from_numpy(flat_h), at_h)
            h_dindptr, h_dlast, h_qo, h_pindptr, h_plast = h
            attn = AttentionMetadata(slot_mapping=t_slotmap, decode_kv_indptr=h_dindptr,
                                     decode_kv_indices=t_dind, decode_kv_last_page_len=h_dlast,
                                     prefill_qo_indptr=h_qo, prefill_kv_indptr=h_pindptr,
                                     prefill_kv_indices=t_pind, prefill_kv_last_page_len=h_plast)
        state = None
        if self.has_state:
            state = StateMetadata(decode_slots=t_dslots, prefill_cu_seqlens=t_qo, prefill_slots=t_pslots,
                                  snap_token_idx=t_snapi, snap_slots=t_snaps)
        cross = None
        if self.cross_source_len:
            cross = CrossAttentionMetadata(kv_indptr=h_xindptr, kv_indices=t_xidx, kv_last_page_len=h_xlast)
        ctx = ForwardContext(input_ids=t_ids, positions=t_pos, num_decode_tokens=D, attn=attn, state=state,
                             logits_indices=t_logits, cross=cross)
        return ctx, n_sample


def decode_arrays(rows: StepRows, page_size: int, has_attention: bool):
    """The decode rows' (positions, kv indptr, kv page indices, last-page lengths, KV slot
    of the new token), int64 numpy; the paged ones are empty without attention."""
    ps = page_size
    d_len = np.asarray(rows.decode_lens, dtype=np.int64)
    d_pos = d_len - 1
    d_npages = (d_len + ps - 1) // ps
    d_indptr = np.zeros(len(d_len) + 1, dtype=np.int64)
    np.cumsum(d_npages, out=d_indptr[1:])
    d_last = d_len - (d_npages - 1) * ps
    if not has_attention:
        return d_pos, d_indptr, np.zeros(0, dtype=np.int64), d_last, d_pos
    d_indices = np.asarray([p for pages, n in zip(rows.decode_pages, d_npages.tolist()) for p in pages[:n]],
                           dtype=np.int64)
    d_slot = d_indices[d_indptr[:-1] + d_pos // ps] * ps + d_pos % ps if len(d_len) else d_pos
    return d_pos, d_indptr, d_indices, d_last, d_slot


class PinnedRing:
    """MSTAR_KV_PINNED_INDPTRS: host staging buffers for host -> device copies, allocated once
    (page-locked on CUDA; plain tensors on CPU, where the same logic runs for the tests) and
    used in turn. A slot is handed out only when the copy out of it has finished: each copy
    records the slot's event, and `acquire` takes the next slot whose event has completed,
    waiting on the oldest one when none has. A slot grows (doubling) only when an array does
    not fit in it.

    to_device(arr): copy arr into a slot, then to the device (non-blocking); on CPU the
    "device" tensor is a copy of the slot (so no tensor handed out aliases a slot)."""

    def __init__(self, device, num_slots: int = 4, nbytes: int = 1 << 16, event_factory=None):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        if event_factory is None and self._cuda:
            event_factory = torch.cuda.Event
        self._bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda) for _ in range(num_slots)]
        self._events = [event_factory() if event_factory is not None else None for _ in range(num_slots)]
        self._recorded = [False] * num_slots  # an event not yet recorded has nothing to wait for
        self._next = 0
        self.num_copies = 0
        self.num_waits = 0  # acquisitions that had to wait for a copy to finish
        self.num_grows = 0

    def _ready(self, i: int) -> bool:
        ev = self._events[i]
        return ev is None or not self._recorded[i] or ev.query()

    def acquire(self) -> int:
        """The index of a slot whose last copy has finished (round-robin from the last one)."""
        k = len(self._bufs)
        for j in range(k):
            i = (self._next + j) % k
            if self._ready(i):
                break
        else:
            i = self._next  # every copy still running: wait for the oldest
            self._events[i].synchronize()
            self._recorded[i] = False
            self.num_waits += 1
        self._next = (i + 1) % k
        return i

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        src = torch.from_numpy(np.ascontiguousarray(arr))
        n = src.numel() * src.element_size()
        i = self.acquire()
        buf = self._bufs[i]
        if buf.numel() < n:
            buf = self._bufs[i] = torch.empty(max(n, 2 * buf.numel()), dtype=torch.uint8, pin_memory=self._cuda)
            self.num_grows += 1
        host = buf[:n].view(src.dtype).view(src.shape)
        host.copy_(src)
        self.num_copies += 1
        out = host.to(self.device, non_blocking=True) if self._cuda else host.clone()
        ev = self._events[i]
        if ev is not None:
            ev.record()
            self._recorded[i] = True
        return out


def _pack(parts: list[np.ndarray], dtype) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """parts in one flat array of dtype, each starting at a multiple of 16 bytes; with its
    (offset, length) per part. Triton specialises a kernel on whether each pointer argument is
    16-byte aligned: unaligned views (at offsets that change with the step's row counts) made
    steps compile variants the start-up warm-up never met (1.1 s, in a served c128 level)."""
    step = 16 // np.dtype(dtype).itemsize
    at, o = [], 0
    for a in parts:
        at.append((o, len(a)))
        o += -(-len(a) // step) * step
    flat = np.zeros(o, dtype=dtype)
    for (start, n), a in zip(at, parts):
        flat[start:start + n] = a
    return flat, at


def _split(buf: torch.Tensor, at: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [buf[o:o + n] for o, n in at]
