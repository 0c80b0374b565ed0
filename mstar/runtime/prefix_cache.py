"""The prefix cache: full KV pages found again by the tokens that led to them.

Key of a page: a hash chained over the whole prefix, key_i = H(key_{i-1} || tokens of
page i) with key_{-1} a root derived from an optional salt (for inputs whose token ids
do not say everything, e.g. multimodal placeholders). The same page content after a
different prefix therefore has a different key. H is BLAKE2b (128-bit digest) over the
previous key and the page's token ids as int32 bytes: stable across processes and fast
(one C call per page).

An entry maps a key to the page holding that KV and, for models with recurrent state,
optionally to a snapshot slot holding the conv + recurrent state right after the page's
last token. A hybrid model can only resume from a boundary with a snapshot.

Entries are never referenced by themselves: the page's refcount (PagePool) counts the
requests using it. An entry whose page has refcount 0 is *idle* and evictable, in LRU
order (`evict_page`). Snapshots are evictable on their own, without the page
(`evict_snapshot`): first those of idle entries in LRU order, then, if none is left,
those of busy entries (least recently taken first). Dropping a page orphans the entries
chained after it; they stay valid (the key is a function of the content) and are
reachable again once the parent page is cached again, or age out through the LRU.

The caller (CacheManager) must tell the cache when a cached page's refcount goes 0 -> 1
(`mark_busy`) and 1 -> 0 (`mark_idle`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_INT32 = "i" if array("i").itemsize == 4 else "l"


def _token_bytes(tokens) -> bytes:
    if hasattr(tokens, "numpy"):  # torch tensor
        tokens = tokens.detach().cpu().numpy()
    if hasattr(tokens, "astype"):  # numpy array
        return tokens.astype("<i4", copy=False).tobytes()
    return array(_INT32, tokens).tobytes()


def root_key(salt: bytes | str | None = None) -> bytes:
    """The key before the first page; different salts give disjoint caches."""
    if salt is None:
        salt = b""
    elif isinstance(salt, str):
        salt = salt.encode()
    return hashlib.blake2b(b"mstar-prefix\x00" + salt, digest_size=16).digest()


def page_key(prev_key: bytes, page_tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(prev_key, digest_size=16)
    h.update(_token_bytes(page_tokens))
    return h.digest()


def extend_keys(keys: list[bytes], root: bytes, token_ids: Sequence[int], num_pages: int,
                page_size: int) -> None:
    """Append keys to `keys` (keys of pages 0..len(keys)-1 of token_ids) up to num_pages."""
    prev = keys[-1] if keys else root
    for i in range(len(keys), num_pages):
        prev = page_key(prev, token_ids[i * page_size:(i + 1) * page_size])
        keys.append(prev)


@dataclass(eq=False)
class CachedPage:
    key: bytes
    page: int
    snapshot: int | None = None  # state slot holding the state after this page's last token
    idle: bool = False  # page refcount is 0


class PrefixCache:
    def __init__(self) -> None:
        self._by_key: dict[bytes, CachedPage] = {}
        self._by_page: dict[int, CachedPage] = {}
        self._idle: OrderedDict[int, CachedPage] = OrderedDict()  # LRU first
        self._idle_snaps: OrderedDict[bytes, CachedPage] = OrderedDict()
        self._busy_snaps: OrderedDict[bytes, CachedPage] = OrderedDict()
        # hit statistics (one query per admitted request)
        self.queries = 0
        self.hit_queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    # --- lookups ---------------------------------------------------------------------------
    def get(self, key: bytes) -> CachedPage | None:
        return self._by_key.get(key)

    def entry_of_page(self, page: int) -> CachedPage | None:
        return self._by_page.get(page)

    def is_cached(self, page: int) -> bool:
        return page in self._by_page

    @property
    def num_entries(self) -> int:
        return len(self._by_key)

    @property
    def num_idle(self) -> int:
        """Cached pages nobody references: evictable, counted as free."""
        return len(self._idle)

    @property
    def num_snapshots(self) -> int:
        return len(self._idle_snaps) + len(self._busy_snaps)

    @property
    def num_idle_snapshots(self) -> int:
        return len(self._idle_snaps)

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        self.queries += 1
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens
        if hit_tokens:
            self.hit_queries += 1

    # --- changes ---------------------------------------------------------------------------
    def insert(self, key: bytes, page: int, snapshot: int | None, *, idle: bool) -> CachedPage:
        if key in self._by_key:
            raise KeyError("prefix key already cached")
        if page in self._by_page:
            raise KeyError(f"page {page} already cached under another key")
        e = CachedPage(key, page, None, idle)
        self._by_key[key] = e
        self._by_page[page] = e
        if idle:
            self._idle[page] = e
        if snapshot is not None:
            self.attach_snapshot(e, snapshot)
        return e

    def attach_snapshot(self, e: CachedPage, slot: int) -> None:
        if e.snapshot is not None:
            raise RuntimeError("entry already has a snapshot")
        e.snapshot = slot
        (self._idle_snaps if e.idle else self._busy_snaps)[e.key] = e

    def mark_busy(self, page: int) -> None:
        """The cached page's refcount went from 0 to 1."""
        e = self._by_page[page]
        if not e.idle:
            raise RuntimeError(f"cached page {page} is already busy")
        e.idle = False
        del self._idle[page]
        if e.snapshot is not None:
            del self._idle_snaps[e.key]
            self._busy_snaps[e.key] = e

    def mark_idle(self, page: int) -> None:
        """The cached page's refcount dropped to 0: it becomes the most recently used idle page."""
        e = self._by_page[page]
        if e.idle:
            raise RuntimeError(f"cached page {page} is already idle")
        e.idle = True
        self._idle[page] = e
        if e.snapshot is not None:
            del self._busy_snaps[e.key]
            self._idle_snaps[e.key] = e

    def _remove(self, e: CachedPage) -> int | None:
        del self._by_key[e.key]
        del self._by_page[e.page]
        if e.idle:
            del self._idle[e.page]
        snap = e.snapshot
        if snap is not None:
            del (self._idle_snaps if e.idle else self._busy_snaps)[e.key]
            e.snapshot = None
        return snap

    def evict_page(self) -> tuple[int, int | None] | None:
        """Drop the least recently used idle entry: (its page, its snapshot slot or None),
        both now unowned; None when no page is idle."""
        if not self._idle:
            return None
        e = next(iter(self._idle.values()))
        snap = self._remove(e)
        return e.page, snap

    def evict_snapshot(self) -> int | None:
        """Detach a snapshot (idle entries LRU first, then busy ones) and return its slot."""
        for tier in (self._idle_snaps, self._busy_snaps):
            if tier:
                _, e = tier.popitem(last=False)
                slot = e.snapshot
                e.snapshot = None
                return slot
        return None

    def clear(self) -> tuple[list[int], list[int]]:
        """Forget every entry. Returns (idle pages, snapshot slots) that are now unowned;
        pages of busy entries stay with their requests and simply stop being cached."""
        idle_pages = list(self._idle.keys())
        snaps = [e.snapshot for e in self._by_key.values() if e.snapshot is not None]
        for e in self._by_key.values():
            e.snapshot = None
        self._by_key.clear()
        self._by_page.clear()
        self._idle.clear()
        self._idle_snaps.clear()
        self._busy_snaps.clear()
        return idle_pages, snaps

    # --- checks ----------------------------------------------------------------------------
    def entries(self) -> list[CachedPage]:
        return list(self._by_key.values())

    def idle_pages(self) -> list[int]:
        """Idle pages, least recently used first."""
        return list(self._idle.keys())

    def check(self) -> None:
        assert len(self._by_key) == len(self._by_page)
        for k, e in self._by_key.items():
            assert e.key == k and self._by_page[e.page] is e
            assert (e.page in self._idle) == e.idle
            if e.snapshot is None:
                assert k not in self._idle_snaps and k not in self._busy_snaps
            else:
                assert (k in self._idle_snaps) == e.idle and (k in self._busy_snaps) != e.idle
        assert len(self._idle_snaps) + len(self._busy_snaps) == sum(
            e.snapshot is not None for e in self._by_key.values())
