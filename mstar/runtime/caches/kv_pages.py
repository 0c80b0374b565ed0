"""The KV page pool: which page ids are free and how many holders each used page has.

A page is one row of every attention layer's k/v cache ([num_pages, page_size, Hkv, D]);
this module only deals in page ids, never in tensors. A page is in one of three states:

    free      on the free list, refcount 0
    used      refcount > 0 (one count per request whose page list holds it)
    idle      refcount 0 but still holding KV that the prefix cache can hand out again;
              not on the free list (the prefix cache keeps it, in LRU order, and gives it
              up when the pool runs dry)

The pool tracks the first two; the prefix cache tracks the third. `CacheManager`
coordinates them: a page whose count drops to 0 goes back to the free list unless it
is cached. Every operation is O(1) per page.
"""

from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        # pop() hands out the lowest ids first (handy when reading test failures)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages
        self._ref: list[int] = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A page from the free list (refcount still 0), or None when the list is empty."""
        if not self._free:
            return None
        p = self._free.pop()
        self._is_free[p] = 0
        return p

    def put(self, page: int) -> None:
        """Return an unreferenced page to the free list."""
        if self._is_free[page]:
            raise RuntimeError(f"page {page} freed twice")
        if self._ref[page]:
            raise RuntimeError(f"page {page} returned to the free list with refcount {self._ref[page]}")
        self._is_free[page] = 1
        self._free.append(page)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def incref(self, page: int) -> int:
        if self._is_free[page]:
            raise RuntimeError(f"page {page} referenced while on the free list")
        self._ref[page] += 1
        return self._ref[page]

    def decref(self, page: int) -> int:
        c = self._ref[page] - 1
        if c < 0:
            raise RuntimeError(f"page {page} released more often than it was referenced")
        self._ref[page] = c
        return c

    def free_list(self) -> list[int]:
        """A copy of the free list (tests and invariant checks)."""
        return list(self._free)
