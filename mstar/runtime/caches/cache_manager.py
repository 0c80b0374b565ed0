"""The engine's KV and recurrent-state memory: one object that owns the cache tensors and
says, per request, which pages and which state slot hold its history.

Pieces (each in its own module):
    PagePool     (kv_pages.py)     free list and refcounts of KV pages
    SlotPool     (state_slots.py)  free lists of state slots: running requests, snapshots
    PrefixCache  (prefix_cache.py) chained page keys -> cached pages (+ state snapshots), LRU
    to_host / to_device (offload.py) host copies for offload / reload

Life of a request:
    n = admit(id, prompt)                 slot (+ cross slot) + cached prefix; n tokens already computed
    loop:
        ensure_capacity(id, end)          pages for positions < end (copy-on-write of shared ones)
        snapshot_slots(id, start, end, t) hybrid models: where to keep state snapshots
        ... forward writes KV (and snapshots) ...
        commit(id, t, end)                length = end; full pages enter the prefix cache
    free(id)

Invariants (checked by `check()`):
  * a page's refcount is the number of request page lists holding it;
  * every page is exactly one of: on the free list, idle in the prefix cache (refcount 0,
    evictable), or used (refcount > 0);
  * every snapshot slot is exactly one of: free, reserved by one request (handed out by
    snapshot_slots, not yet committed), or attached to one prefix-cache entry;
  * a request's pages cover at least its length; pages at index < length // page_size
    are never written again (writes go to positions >= length; a page that is shared or
    cached and would receive such a write is copied first).

Recurrent state cannot be rolled back: it is a running summary of every token seen, so
dropping tokens needs a checkpoint taken before them. `rollback` therefore refuses for
models with state unless the caller says it has restored the state itself
(`state_restored=True`, e.g. from a checkpoint slot kept by speculative decoding).

All bookkeeping is O(pages) Python per call; tensor work is one gather / scatter / copy
per layer.

Stream generation (`stream_generation()`): a process-wide counter bumped by every operation
that changes a request's KV stream other than the per-token decode growth (commit, and
ensure_capacity appending pages): admit (a stream reset), free (remove / release), fork,
rollback, offload, reload, reset_prefix_cache, and a copy-on-write in ensure_capacity. Who
keeps data derived from the page lists across steps (MSTAR_KV_PLAN_CACHE,
decode_plan_cache.py) compares it: unchanged means every running request's page list only
grew at its end since it was read.

MSTAR_KV_CHAIN_LAZY_STEPS = N > 1: pages filled by decode (beyond the pages fully inside the
prompt the request was admitted with) are registered in the prefix cache only on every N-th
commit of the request; the length is always updated at once. Pending registrations are done
before anything reads or releases the request's chain: free, offload, fork (of the source),
rollback, snapshot_slots, reset_prefix_cache, and `commit_pending()`. A commit that registers
prompt pages or hands over snapshot slots registers at once (no snapshot is held longer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mstar import knobs
from mstar.models.context import CacheSpec, ModelCaches
from mstar.runtime.caches.kv_pages import PagePool
from mstar.runtime.caches.offload import HostCopy, to_device, to_host
from mstar.runtime.caches.prefix_cache import PrefixCache, extend_keys, root_key
from mstar.runtime.caches.state_slots import SlotPool


class StateRollbackError(NotImplementedError):
    """Rollback asked of a model with recurrent state and no restored checkpoint."""


_generation = 0


def stream_generation() -> int:
    """The process-wide stream generation (module docstring): changes whenever any request's
    page list may have changed other than by growing at its end."""
    return _generation


def _bump_generation() -> None:
    global _generation
    _generation += 1


@dataclass
class CacheStats:
    total_pages: int
    free_pages: int  # free list + evictable (idle) cached pages
    used_pages: int  # referenced by at least one request
    cached_pages: int  # prefix-cache entries (busy or idle)
    total_slots: int  # running-request state slots
    free_slots: int
    snapshot_slots_total: int
    snapshot_slots_free: int  # free + attached to idle cached pages (evictable first)
    prefix_queries: int
    prefix_hit_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictable_pages: int = 0  # idle cached pages (part of free_pages)
    cached_snapshots: int = 0  # snapshot slots attached to cache entries
    reserved_snapshots: int = 0  # snapshot slots handed out and not yet committed
    offloaded_requests: int = 0
    cross_slots_total: int = 0  # per-request (cross) slots
    cross_slots_free: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass
class _Request:
    root: bytes  # prefix-key root (salt)
    pages: list[int] = field(default_factory=list)
    length: int = 0
    slot: int | None = None
    keys: list[bytes] = field(default_factory=list)  # chained keys of full pages (may run ahead of length)
    num_registered: int = 0  # leading full pages already offered to the prefix cache
    snaps: dict[int, int] = field(default_factory=dict)  # boundary position -> reserved snapshot slot
    host: HostCopy | None = None  # set while offloaded
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at admit
    cross: int | None = None  # its per-request (cross) slot
    # MSTAR_KV_CHAIN_LAZY_STEPS > 1
    prompt_pages: int = 0  # pages fully inside the prompt it was admitted with: registered at once
    num_commits: int = 0
    pending: Sequence[int] | None = None  # token ids of a deferred registration (up to length)


class CacheManager:
    def __init__(self, spec: CacheSpec, *, num_pages: int, page_size: int, num_slots: int,
                 dtype: torch.dtype, device, enable_prefix_cache: bool = True,
                 num_snapshot_slots: int = 0, num_cross_slots: int = 0, padding: bool = False):
        """padding: one more KV page, state row and cross slot than the pools hand out
        (`pad_page`, `pad_slot`, `pad_cross`), for the padding rows of graph-replayed decode
        steps to write into (and, cross slot, read from)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.device = torch.device(device)
        self.has_state = bool(spec.state)
        self.has_attention = bool(spec.attention)
        self.enable_prefix_cache = enable_prefix_cache
        if not self.has_state:
            num_slots, num_snapshot_slots = 0, 0
        self.num_slots = num_slots
        self.num_snapshot_slots = num_snapshot_slots
        # per-request slots (spec.cross): one per running request, filled by the family's
        # admission stage when the request is admitted (Whisper: the encoder's cross K/V). The
        # prefix cache is off for such models: their KV depends on the admission input, not only
        # on the tokens.
        self.has_cross = spec.cross is not None
        if self.has_cross and num_cross_slots < 1:
            raise ValueError("a model with cross-attention needs num_cross_slots >= 1")
        self.num_cross_slots = num_cross_slots if self.has_cross else 0

        # the padding page / state row sit past the last page / row the pools know
        self.pad_page = num_pages if padding else None
        self.pad_slot = (num_slots + num_snapshot_slots) if padding and self.has_state else None
        extra = 1 if padding else 0
        c = ModelCaches()
        for a in spec.attention:
            shape = (num_pages + extra, page_size, a.num_kv_heads, a.head_dim)
            c.k_caches.append(torch.zeros(shape, dtype=dtype, device=self.device))
            c.v_caches.append(torch.zeros(shape, dtype=dtype, device=self.device))
        rows = num_slots + num_snapshot_slots + (extra if self.has_state else 0)
        conv_shapes = [(rows, s.conv_dim, s.conv_kernel - 1) for s in spec.state]
        rec_shapes = [(rows, s.num_heads, s.key_dim, s.value_dim) for s in spec.state]
        if spec.state and len(set(conv_shapes)) == 1 and len(set(rec_shapes)) == 1:
            # one tensor per kind, layers first: admission zeroes a slot in every layer at once
            n = len(spec.state)
            conv = torch.zeros((n, *conv_shapes[0]), dtype=dtype, device=self.device)
            rec = torch.zeros((n, *rec_shapes[0]), dtype=spec.state_dtype, device=self.device)
            c.state_stacks = [conv, rec]
            c.conv_states, c.recurrent_states = list(conv.unbind(0)), list(rec.unbind(0))
        else:
            c.conv_states = [torch.zeros(sh, dtype=dtype, device=self.device) for sh in conv_shapes]
            c.recurrent_states = [torch.zeros(sh, dtype=spec.state_dtype, device=self.device) for sh in rec_shapes]
        self.pad_cross = self.num_cross_slots if padding and self.has_cross else None
        if self.has_cross:
            for a in spec.cross.layers:
                shape = (self.num_cross_slots + extra, spec.cross.max_source_len, a.num_kv_heads, a.head_dim)
                c.cross_k_caches.append(torch.zeros(shape, dtype=dtype, device=self.device))
                c.cross_v_caches.append(torch.zeros(shape, dtype=dtype, device=self.device))
        self.caches = c
        self._cross = SlotPool(0, self.num_cross_slots)

        self._pool = PagePool(num_pages)
        self._slots = SlotPool(0, num_slots)
        self._snap_slots = SlotPool(num_slots, num_snapshot_slots)
        self._prefix = PrefixCache(num_pages)
        self._reqs: dict[str, _Request] = {}
        # MSTAR_KV_CHAIN_LAZY_STEPS (module docstring); 1: every commit registers its full pages
        self.chain_lazy_steps = int(knobs.value("MSTAR_KV_CHAIN_LAZY_STEPS"))

    # ======================================================================================
    # page / slot plumbing
    # ======================================================================================
    def _available_pages(self) -> int:
        return self._pool.num_free + self._prefix.num_idle

    def _take_page(self) -> int:
        p = self._pool.take()
        if p is None:
            ev = self._prefix.evict_page()
            if ev is None:
                raise RuntimeError("out of pages (caller should have checked availability)")
            p, snap = ev
            if snap is not None:
                self._snap_slots.release(snap)
        self._pool.incref(p)
        return p

    def _incref(self, page: int) -> None:
        if self._pool.incref(page) == 1 and self._prefix.is_cached(page):
            self._prefix.mark_busy(page)

    def _decref(self, page: int) -> None:
        if self._pool.decref(page) == 0:
            if self._prefix.is_cached(page):
                self._prefix.mark_idle(page)
            else:
                self._pool.put(page)

    def _release_pages(self, pages: list[int]) -> None:
        # last page first: the tail of a prefix becomes least recently used, so it is
        # evicted before the pages its key chain depends on
        for p in reversed(pages):
            self._decref(p)

    def _shared(self, page: int) -> bool:
        return self._pool.refcount(page) > 1 or self._prefix.is_cached(page)

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        if not src or not self.has_attention:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for cache in (*self.caches.k_caches, *self.caches.v_caches):
            cache.index_copy_(0, d, cache.index_select(0, s))

    def _state_rows(self, slot: int) -> list[torch.Tensor]:
        """Views of a slot's state in every GDN layer: one per stack when the layers share a shape."""
        c = self.caches
        if c.state_stacks:
            return [stack[:, slot] for stack in c.state_stacks]
        return [cache[slot] for cache in (*c.conv_states, *c.recurrent_states)]

    def _copy_state(self, src: int, dst: int) -> None:
        for d, s in zip(self._state_rows(dst), self._state_rows(src)):
            d.copy_(s)

    # host copies: methods so that a tensor-parallel engine can mirror them on every rank
    def _to_host(self, pages: list[int], slot: int | None) -> HostCopy:
        return to_host(self.caches, pages, slot)

    def _to_device(self, host: HostCopy, dst: list[int], rows: list[int], slot: int | None) -> None:
        to_device(host, self.caches, dst, rows, slot)

    def _zero_state(self, slot: int) -> None:
        for rows in self._state_rows(slot):
            rows.zero_()

    def _take_snapshot_slot(self) -> int | None:
        s = self._snap_slots.allocate()
        if s is None:
            s = self._prefix.evict_snapshot()
        return s

    def _release_snaps(self, r: _Request, below: int | None = None, at_or_above: int | None = None) -> None:
        for p in [p for p in r.snaps if (below is None or p < below) and (at_or_above is None or p >= at_or_above)]:
            self._snap_slots.release(r.snaps.pop(p))

    def _get(self, req_id: str) -> _Request:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r}") from None

    def _active(self, req_id: str) -> _Request:
        r = self._get(req_id)
        if r.host is not None:
            raise RuntimeError(f"request {req_id!r} is offloaded; reload it first")
        return r

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _uses_prefix(self) -> bool:
        # a model with state can only resume from a snapshot: without snapshot slots the
        # prefix cache could never hit, so it is skipped (no hashing, no queries counted)
        return self.enable_prefix_cache and (not self.has_state or self.num_snapshot_slots > 0) \
            and not self.has_cross

    # ======================================================================================
    # the API
    # ======================================================================================
    def admit(self, req_id: str, prompt_ids: Sequence[int], *, cache_salt: bytes | str | None = None) -> int | None:
        """Give the request a state slot (if the model has state) and its cached prefix.

        Returns the number of prompt tokens already computed (a multiple of page_size, at
        most len(prompt) - 1), or None, holding nothing, when no slot is free or not even
        one page could be had for the rest of the prompt. On a hit the matched pages are
        shared and, for models with state, the snapshot at the hit boundary is copied into
        the request's slot; on a miss the slot is zeroed. For models with state only a
        boundary that has a snapshot can be a hit (the longest such prefix is taken).
        `cache_salt` separates prefixes whose token ids alone do not identify them.
        """
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} is already admitted")
        n = len(prompt_ids)
        if n < 1:
            raise ValueError("empty prompt")
        if self.has_state and self._slots.num_free == 0:
            return None
        if self.has_cross and self._cross.num_free == 0:
            return None
        r = _Request(root=root_key(cache_salt), prompt_pages=n // self.page_size)
        hit: list[int] = []  # pages
        if self._uses_prefix():
            ps = self.page_size
            # the keys of every full prompt page: commit needs them later anyway
            extend_keys(r.keys, r.root, prompt_ids, (n - 1) // ps, ps)
            get = self._prefix.get
            for key in r.keys:
                p = get(key)
                if p is None:
                    break
                hit.append(p)
            if self.has_state:
                while hit and self._prefix.snapshot_of(hit[-1]) is None:
                    hit.pop()
        # pages the hit takes out of the evictable set, and one page for the rest
        idle_hits = sum(1 for p in hit if self._prefix.is_idle(p))
        if self._available_pages() - idle_hits < 1:
            return None
        if self.has_state:
            r.slot = self._slots.allocate()
        if self.has_cross:
            r.cross = self._cross.allocate()
        for p in hit:
            self._incref(p)
        r.pages = hit
        r.num_registered = len(hit)
        r.length = r.cached_tokens = len(hit) * self.page_size
        if self.has_state:
            if hit:
                self._copy_state(self._prefix.snapshot_of(hit[-1]), r.slot)
            else:
                self._zero_state(r.slot)
        if self._uses_prefix():
            self._prefix.record_query(n, r.cached_tokens)
        self._reqs[req_id] = r
        _bump_generation()  # a stream (re)starts
        return r.cached_tokens

    def ensure_capacity(self, req_id: str, total_len: int) -> bool:
        """Make the request's pages cover total_len tokens; copy-on-write any shared or
        cached page that will receive tokens at positions >= length. False, with nothing
        changed, when pages ran out."""
        r = self._active(req_id)
        ps = self.page_size
        need = self._pages_for(total_len)
        have = len(r.pages)
        cow: list[int] = []
        if total_len > r.length:
            first, last = r.length // ps, min(have, need) - 1
            cow = [i for i in range(first, last + 1) if self._shared(r.pages[i])]
        new = max(0, need - have)
        if new + len(cow) > self._available_pages():
            return False
        if cow:
            _bump_generation()  # pages of the request are replaced, not appended
            old = [r.pages[i] for i in cow]
            fresh = [self._take_page() for _ in cow]
            self._copy_pages(old, fresh)
            for i, p in zip(cow, fresh):
                r.pages[i] = p
            self._release_pages(old)
        for _ in range(new):
            r.pages.append(self._take_page())
        return True

    def snapshot_slots(self, req_id: str, start: int, end: int, token_ids: Sequence[int],
                       every_page: bool = True) -> list[tuple[int, int]]:
        """Snapshot slots for the page boundaries p (p + 1 a multiple of page_size) in
        [start, end) whose page is not already cached with a snapshot: [(p, slot)]. The
        engine copies the state after token p into the slot; commit hands it to the cache.
        every_page=False: only the last boundary in [start, end)."""
        r = self._active(req_id)
        if not self.has_state or not self._uses_prefix() or self.num_snapshot_slots == 0:
            return []
        self._register_pending(r)
        ps = self.page_size
        out: list[tuple[int, int]] = []
        first = (start // ps + 1) * ps - 1
        if not every_page:
            first = max(first, (end // ps) * ps - 1)
        for p in range(first, end, ps):
            if p in r.snaps:
                out.append((p, r.snaps[p]))
                continue
            i = p // ps
            extend_keys(r.keys, r.root, token_ids, i + 1, ps)
            cached = self._prefix.get(r.keys[i])
            if cached is not None and self._prefix.snapshot_of(cached) is not None:
                continue
            s = self._take_snapshot_slot()
            if s is None:
                break
            r.snaps[p] = s
            out.append((p, s))
        return out

    def commit(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """token_ids[:num_computed] now have KV in the request's pages (and state snapshots
        where snapshot_slots handed out slots). Newly full pages enter the prefix cache.
        length(req_id) becomes num_computed."""
        r = self._active(req_id)
        if num_computed < r.length:
            raise ValueError(f"commit({num_computed}) below the length {r.length}; use rollback")
        if num_computed > len(r.pages) * self.page_size:
            raise ValueError(f"commit({num_computed}) beyond the request's pages "
                             f"({len(r.pages)} x {self.page_size}); call ensure_capacity first")
        r.length = num_computed
        ps = self.page_size
        full = num_computed // ps
        if self.chain_lazy_steps > 1:
            self._commit_lazy(r, token_ids, full)
        elif self._uses_prefix() and full > r.num_registered:
            self._register(r, token_ids, full)
        if r.snaps:
            self._release_snaps(r, below=num_computed)

    def _register(self, r: _Request, token_ids: Sequence[int], full: int) -> None:
        """Offer the request's pages [num_registered, full) to the prefix cache."""
        ps = self.page_size
        extend_keys(r.keys, r.root, token_ids, full, ps)
        for i in range(r.num_registered, full):
            key, page = r.keys[i], r.pages[i]
            snap = r.snaps.pop((i + 1) * ps - 1, None)
            cached = self._prefix.get(key)
            if cached is None:
                if not self._prefix.is_cached(page):  # (a page is cached under one key only)
                    self._prefix.insert(key, page, snap, idle=False)
                    snap = None
            elif snap is not None and self._prefix.snapshot_of(cached) is None:
                self._prefix.attach_snapshot(cached, snap)
                snap = None
            if snap is not None:
                self._snap_slots.release(snap)
        r.num_registered = full

    def _commit_lazy(self, r: _Request, token_ids: Sequence[int], full: int) -> None:
        """MSTAR_KV_CHAIN_LAZY_STEPS > 1: register on every N-th commit of the request, or at
        once for prompt pages and for pages with snapshot slots to hand over."""
        r.num_commits += 1
        if not self._uses_prefix() or full <= r.num_registered:
            return
        if (r.num_commits % self.chain_lazy_steps == 0 or r.num_registered < r.prompt_pages
                or (r.snaps and min(r.snaps) < r.length)):
            r.pending = None
            self._register(r, token_ids, full)
        else:
            r.pending = token_ids  # the tokens below length never change (rollback registers first)

    def _register_pending(self, r: _Request) -> None:
        """A deferred registration of r, if there is one (MSTAR_KV_CHAIN_LAZY_STEPS)."""
        toks, r.pending = r.pending, None
        if toks is not None and r.host is None:
            full = r.length // self.page_size
            if full > r.num_registered:
                self._register(r, toks, full)

    def commit_pending(self, req_id: str | None = None) -> None:
        """Do the prefix-cache registrations MSTAR_KV_CHAIN_LAZY_STEPS deferred: of one request,
        or (None) of every request. A no-op with the knob at 1."""
        reqs = self._reqs.values() if req_id is None else [self._get(req_id)]
        for r in reqs:
            self._register_pending(r)

    def length(self, req_id: str) -> int:
        return self._get(req_id).length

    def pages(self, req_id: str) -> list[int]:
        """A copy of the request's page list (empty while offloaded)."""
        return list(self._get(req_id).pages)

    def slot(self, req_id: str) -> int:
        """The request's state slot; -1 for models without state or while offloaded."""
        s = self._get(req_id).slot
        return -1 if s is None else s

    def cross_slot(self, req_id: str) -> int:
        """The request's cross-attention slot; -1 for models without cross-attention or
        while offloaded (its cross K/V is dropped then: the engine re-encodes on reload)."""
        s = self._get(req_id).cross
        return -1 if s is None else s

    def cached_tokens(self, req_id: str) -> int:
        """Prompt tokens the prefix cache served at admit."""
        return self._get(req_id).cached_tokens

    def has_request(self, req_id: str) -> bool:
        return req_id in self._reqs

    def free(self, req_id: str) -> None:
        """Release the request's pages (cached ones stay reusable until evicted), its slot
        and its unused snapshot reservations. Unknown ids are ignored."""
        r = self._reqs.pop(req_id, None)
        if r is None:
            return
        _bump_generation()
        self._register_pending(r)
        self._release_pages(r.pages)
        r.pages = []
        if r.slot is not None:
            self._slots.release(r.slot)
            r.slot = None
        if r.cross is not None:
            self._cross.release(r.cross)
            r.cross = None
        self._release_snaps(r)
        r.host = None

    def fork(self, src_id: str, dst_id: str) -> bool:
        """dst shares src's pages copy-on-write and gets a copy of src's state in a new
        slot. False (nothing changed) when no slot is free."""
        if dst_id in self._reqs:
            raise ValueError(f"request {dst_id!r} already exists")
        src = self._active(src_id)
        if self.has_cross and self._cross.num_free == 0:
            return False
        self._register_pending(src)
        slot = None
        if self.has_state:
            slot = self._slots.allocate()
            if slot is None:
                return False
            self._copy_state(src.slot, slot)
        cross = None
        if self.has_cross:
            cross = self._cross.allocate()
            for cache in (*self.caches.cross_k_caches, *self.caches.cross_v_caches):
                cache[cross].copy_(cache[src.cross])
        pages = src.pages[:self._pages_for(src.length)]
        for p in pages:
            self._incref(p)
        full = src.length // self.page_size
        self._reqs[dst_id] = _Request(root=src.root, pages=list(pages), length=src.length, slot=slot,
                                      keys=src.keys[:full], num_registered=src.num_registered,
                                      cached_tokens=src.cached_tokens, cross=cross,
                                      prompt_pages=src.prompt_pages)
        _bump_generation()
        return True

    def rollback(self, req_id: str, k: int, *, state_restored: bool = False) -> None:
        """Drop the last k tokens' KV: length -= k, pages past the new length are released,
        a cached page that becomes partly unused is left intact (the next write copies it).

        Recurrent state cannot roll back (it has absorbed the dropped tokens); for models
        with state this raises StateRollbackError unless the caller has restored the
        state of the request's slot from a checkpoint and passes state_restored=True."""
        r = self._active(req_id)
        if not 0 <= k <= r.length:
            raise ValueError(f"rollback({k}) of a request of length {r.length}")
        if self.has_state and not state_restored:
            raise StateRollbackError(
                "recurrent state cannot be rolled back without a checkpoint; restore the slot's "
                "state and pass state_restored=True")
        _bump_generation()
        self._register_pending(r)
        new_len = r.length - k
        keep = self._pages_for(new_len)
        dropped = r.pages[keep:]
        del r.pages[keep:]
        self._release_pages(dropped)
        r.length = new_len
        full = new_len // self.page_size
        r.num_registered = min(r.num_registered, full)
        del r.keys[full:]
        if r.snaps:
            self._release_snaps(r, at_or_above=new_len)

    def offload(self, req_id: str) -> None:
        """Copy the request's KV pages and state to (pinned, with CUDA) host memory and
        release its device pages, slot and snapshot reservations."""
        r = self._active(req_id)
        _bump_generation()
        self._register_pending(r)
        used = r.pages[:self._pages_for(r.length)]
        r.host = self._to_host(used, r.slot)
        self._release_pages(r.pages)
        r.pages = []
        if r.slot is not None:
            self._slots.release(r.slot)
            r.slot = None
        if r.cross is not None:  # dropped, not copied: re-encoding is cheaper than the copy
            self._cross.release(r.cross)
            r.cross = None
        self._release_snaps(r)

    def reload(self, req_id: str) -> bool:
        """Bring an offloaded request back: pages still in the prefix cache are shared
        again, the others are allocated and copied from host. False (nothing changed)
        when no slot or not enough pages are free."""
        r = self._get(req_id)
        if r.host is None:
            raise RuntimeError(f"request {req_id!r} is not offloaded")
        if self.has_state and self._slots.num_free == 0:
            return False
        if self.has_cross and self._cross.num_free == 0:
            return False
        n = r.host.num_pages
        reuse: list[int | None] = [None] * n  # pages still cached under the request's keys
        if self._uses_prefix():
            for i in range(min(r.num_registered, n)):
                reuse[i] = self._prefix.get(r.keys[i])
        fresh_needed = sum(1 for p in reuse if p is None)
        idle_reused = sum(1 for p in reuse if p is not None and self._prefix.is_idle(p))
        if fresh_needed > self._available_pages() - idle_reused:
            return False
        for p in reuse:  # take the cached pages first so that allocation cannot evict them
            if p is not None:
                self._incref(p)
        pages: list[int] = []
        dst, rows = [], []
        for i, cp in enumerate(reuse):
            if cp is not None:
                pages.append(cp)
            else:
                p = self._take_page()
                pages.append(p)
                dst.append(p)
                rows.append(i)
        if self.has_state:
            r.slot = self._slots.allocate()
        if self.has_cross:
            r.cross = self._cross.allocate()
        self._to_device(r.host, dst, rows, r.slot)
        if self._uses_prefix():  # registered pages that had been evicted are cached again
            for i in rows:
                if i < r.num_registered and self._prefix.get(r.keys[i]) is None:
                    self._prefix.insert(r.keys[i], pages[i], None, idle=False)
        r.pages = pages
        r.host = None
        _bump_generation()
        return True

    @property
    def num_free_pages(self) -> int:
        """Free list + evictable cached pages (O(1), unlike stats())."""
        return self._available_pages()

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    def is_offloaded(self, req_id: str) -> bool:
        return self._get(req_id).host is not None

    def stats(self) -> CacheStats:
        pf = self._prefix
        free_pages = self._available_pages()
        reserved = sum(len(r.snaps) for r in self._reqs.values())
        return CacheStats(
            total_pages=self.num_pages,
            free_pages=free_pages,
            used_pages=self.num_pages - free_pages,
            cached_pages=pf.num_entries,
            total_slots=self.num_slots,
            free_slots=self._slots.num_free,
            snapshot_slots_total=self.num_snapshot_slots,
            snapshot_slots_free=self._snap_slots.num_free + pf.num_idle_snapshots,
            prefix_queries=pf.queries,
            prefix_hit_queries=pf.hit_queries,
            prefix_query_tokens=pf.query_tokens,
            prefix_hit_tokens=pf.hit_tokens,
            evictable_pages=pf.num_idle,
            cached_snapshots=pf.num_snapshots,
            reserved_snapshots=reserved,
            offloaded_requests=sum(1 for r in self._reqs.values() if r.host is not None),
            cross_slots_total=self.num_cross_slots,
            cross_slots_free=self._cross.num_free,
        )

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: idle cached pages return to the free list, every
        snapshot slot attached to the cache is freed, and pages still used by requests stop
        being cached (they are freed normally when their requests end). Hit statistics
        are kept."""
        self.commit_pending()  # (MSTAR_KV_CHAIN_LAZY_STEPS) as if registered when committed
        _bump_generation()
        idle_pages, snaps = self._prefix.clear()
        for p in idle_pages:
            self._pool.put(p)
        for s in snaps:
            self._snap_slots.release(s)

    def can_admit(self, num_new_tokens: int) -> bool:
        """Enough free pages (counting evictable cached ones) for num_new_tokens and, for
        models with state, a free slot. Ignores possible prefix hits (conservative)."""
        if self.has_state and self._slots.num_free == 0:
            return False
        if self.has_cross and self._cross.num_free == 0:
            return False
        return self._pages_for(max(num_new_tokens, 1)) <= self._available_pages()

    # ======================================================================================
    # checks (tests, debugging)
    # ======================================================================================
    def check(self) -> None:
        """Assert every invariant of the bookkeeping (O(total pages + slots))."""
        pool, pf = self._pool, self._prefix
        pf.check()
        counts = [0] * self.num_pages
        for rid, r in self._reqs.items():
            for p in r.pages:
                counts[p] += 1
            if r.host is None:
                assert len(r.pages) >= self._pages_for(r.length), rid
                assert (r.slot is not None) == self.has_state, rid
                assert (r.cross is not None) == self.has_cross, rid
            else:
                assert not r.pages and r.slot is None and not r.snaps and r.cross is None, rid
            assert r.num_registered <= r.length // self.page_size or r.host is not None, rid
            assert len(r.keys) >= r.num_registered, rid
        free = set(pool.free_list())
        assert len(free) == pool.num_free
        idle = set(pf.idle_pages())
        for p in range(self.num_pages):
            assert pool.refcount(p) == counts[p], (p, pool.refcount(p), counts[p])
            states = (p in free) + (p in idle) + (counts[p] > 0)
            assert states == 1, (p, p in free, p in idle, counts[p])
            if p in idle:
                assert pf.is_cached(p)
            if p in free:
                assert not pf.is_cached(p)
        # state slots
        used_slots = [r.slot for r in self._reqs.values() if r.slot is not None]
        assert len(set(used_slots)) == len(used_slots)
        assert set(used_slots).isdisjoint(self._slots.free_list())
        assert len(used_slots) + self._slots.num_free == self.num_slots
        snaps = [s for r in self._reqs.values() for s in r.snaps.values()]
        snaps += pf.snapshot_slots()
        assert len(set(snaps)) == len(snaps)
        assert set(snaps).isdisjoint(self._snap_slots.free_list())
        assert len(snaps) + self._snap_slots.num_free == self.num_snapshot_slots
        assert all(s in self._snap_slots for s in snaps)
        # cross slots: one per request not offloaded, none leaked
        cross = [r.cross for r in self._reqs.values() if r.cross is not None]
        assert len(set(cross)) == len(cross)
        assert set(cross).isdisjoint(self._cross.free_list())
        assert len(cross) + self._cross.num_free == self.num_cross_slots
