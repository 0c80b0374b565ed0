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
    """Append keys to `keys` (keys of pages 0..len(keys)-1 of token_ids) up to num_pages.
    One conversion of the new tokens to bytes, then one BLAKE2b call per page."""
    start = len(keys)
    if num_pages <= start:
        return
    buf = memoryview(_token_bytes(token_ids[start * page_size:num_pages * page_size]))
    step = 4 * page_size
    if len(buf) != (num_pages - start) * step:
        raise ValueError(f"token_ids has fewer than {num_pages * page_size} tokens")
    prev = keys[-1] if keys else root
    blake2b = hashlib.blake2b
    for j in range(0, len(buf), step):
        h = blake2b(prev, digest_size=16)
        h.update(buf[j:j + step])
        prev = h.digest()
        keys.append(prev)


class PrefixCache:
    """Entries are indexed by page (a page is cached under at most one key); no Python
    object is created per entry, so a large cache costs the garbage collector nothing."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._by_key: dict[bytes, int] = {}  # key -> page
        self._key: list[bytes | None] = [None] * num_pages  # page -> key
        self._snap: list[int] = [-1] * num_pages  # page -> snapshot slot, -1: none
        self._idle: OrderedDict[int, None] = OrderedDict()  # idle cached pages, LRU first
        self._idle_snaps: OrderedDict[int, None] = OrderedDict()  # idle pages with a snapshot
        self._busy_snaps: OrderedDict[int, None] = OrderedDict()  # busy pages with a snapshot
        # hit statistics (one query per admitted request)
        self.queries = 0
        self.hit_queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    # --- lookups ---------------------------------------------------------------------------
    def get(self, key: bytes) -> int | None:
        """The page cached under key, or None."""
        return self._by_key.get(key)

    def is_cached(self, page: int) -> bool:
        return self._key[page] is not None

    def key_of(self, page: int) -> bytes | None:
        return self._key[page]

    def snapshot_of(self, page: int) -> int | None:
        s = self._snap[page]
        return None if s < 0 else s

    def is_idle(self, page: int) -> bool:
        return page in self._idle

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
    def insert(self, key: bytes, page: int, snapshot: int | None, *, idle: bool) -> None:
        if key in self._by_key:
            raise KeyError("prefix key already cached")
        if self._key[page] is not None:
            raise KeyError(f"page {page} already cached under another key")
        self._by_key[key] = page
        self._key[page] = key
        if idle:
            self._idle[page] = None
        if snapshot is not None:
            self.attach_snapshot(page, snapshot)

    def attach_snapshot(self, page: int, slot: int) -> None:
        if self._key[page] is None:
            raise KeyError(f"page {page} is not cached")
        if self._snap[page] >= 0:
            raise RuntimeError(f"cached page {page} already has a snapshot")
        self._snap[page] = slot
        (self._idle_snaps if page in self._idle else self._busy_snaps)[page] = None

    def mark_busy(self, page: int) -> None:
        """The cached page's refcount went from 0 to 1."""
        if page not in self._idle:
            raise RuntimeError(f"cached page {page} is not idle")
        del self._idle[page]
        if self._snap[page] >= 0:
            del self._idle_snaps[page]
            self._busy_snaps[page] = None

    def mark_idle(self, page: int) -> None:
        """The cached page's refcount dropped to 0: it becomes the most recently used idle page."""
        if self._key[page] is None:
            raise KeyError(f"page {page} is not cached")
        if page in self._idle:
            raise RuntimeError(f"cached page {page} is already idle")
        self._idle[page] = None
        if self._snap[page] >= 0:
            del self._busy_snaps[page]
            self._idle_snaps[page] = None

    def evict_page(self) -> tuple[int, int | None] | None:
        """Drop the least recently used idle entry: (its page, its snapshot slot or None),
        both now unowned; None when no page is idle."""
        if not self._idle:
            return None
        page, _ = self._idle.popitem(last=False)
        del self._by_key[self._key[page]]
        self._key[page] = None
        snap = self._snap[page]
        if snap < 0:
            return page, None
        self._snap[page] = -1
        del self._idle_snaps[page]
        return page, snap

    def evict_snapshot(self) -> int | None:
        """Detach a snapshot (idle entries LRU first, then busy ones) and return its slot;
        the page stays cached."""
        for tier in (self._idle_snaps, self._busy_snaps):
            if tier:
                page, _ = tier.popitem(last=False)
                slot = self._snap[page]
                self._snap[page] = -1
                return slot
        return None

    def clear(self) -> tuple[list[int], list[int]]:
        """Forget every entry. Returns (idle pages, snapshot slots) that are now unowned;
        pages of busy entries stay with their requests and simply stop being cached."""
        idle_pages = list(self._idle)
        snaps = [self._snap[p] for p in (*self._idle_snaps, *self._busy_snaps)]
        for p in self._by_key.values():
            self._key[p] = None
            self._snap[p] = -1
        self._by_key.clear()
        self._idle.clear()
        self._idle_snaps.clear()
        self._busy_snaps.clear()
        return idle_pages, snaps

    # --- checks ----------------------------------------------------------------------------
    def idle_pages(self) -> list[int]:
        """Idle pages, least recently used first."""
        return list(self._idle)

    def snapshot_slots(self) -> list[int]:
        """Every snapshot slot held by an entry."""
        return [self._snap[p] for p in (*self._idle_snaps, *self._busy_snaps)]

    def check(self) -> None:
        assert sum(k is not None for k in self._key) == len(self._by_key)
        for key, page in self._by_key.items():
            assert self._key[page] == key
            idle = page in self._idle
            if self._snap[page] < 0:
                assert page not in self._idle_snaps and page not in self._busy_snaps
            else:
                assert (page in self._idle_snaps) == idle and (page in self._busy_snaps) != idle
        for p in range(self.num_pages):
            if self._key[p] is None:
                assert self._snap[p] < 0 and p not in self._idle
        assert len(self._idle_snaps) + len(self._busy_snaps) == sum(s >= 0 for s in self._snap)
