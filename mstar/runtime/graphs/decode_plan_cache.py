"""MSTAR_KV_PLAN_CACHE: the decode rows' page-table arrays advanced from the previous step's
instead of rebuilt from the page lists.

`decode_arrays(rows)` (step_inputs.py) flattens every decode row's page list into
(positions, kv indptr, kv page indices, last-page lengths, KV slot of the new token): O(total
pages) of Python per step. In steady decoding a step's rows are the previous step's rows,
each one token longer, and the arrays change only a little:

    positions          + 1
    last-page length   + 1, or 1 for a row whose previous last page was full (it crossed a
                       page boundary: its new page, the page list's next entry, is inserted at
                       the end of the row's indices and the indptr after it shifts by one)
    KV slot            + 1, or new page * page_size for a row that crossed

so the cache advances them in O(rows) (plus one page lookup per crossing row).

When it advances (otherwise it rebuilds with decode_arrays):
  * the rows carry the same cache-manager stream generation as the previous step's
    (`StepRows.generation`, cache_manager.stream_generation): nothing touched a stream other
    than by the normal per-token growth in between (admit, free, fork, rollback, offload,
    reload, reset_prefix_cache and copy-on-write all bump it; a new or finished request is
    always one of these);
  * the same number of rows, each exactly one token longer (a step skipped for a row, e.g.
    an eager mixed step in between, shows as two tokens), and the same state slots.

Mode 1 uses the advanced arrays. Mode 2 builds both every step where it can advance,
compares every one of the five arrays (dtype, shape, values), logs each difference on the
"mstar.runtime" logger at WARNING, and uses the rebuilt ones.

The returned arrays belong to the cache until the next call; callers copy out of them
within the step (DecodeGraphRunner._fill, StepInputBuilder.build) and must not write them.
"""

from __future__ import annotations

import logging

import numpy as np

from mstar import knobs
from mstar.runtime.engine.step_inputs import StepRows, decode_arrays

log = logging.getLogger("mstar.runtime")

ARRAY_NAMES = ("positions", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_slot")


class DecodeArrayCache:
    def __init__(self, page_size: int, has_attention: bool, mode: int = 1):
        if mode not in (1, 2):
            raise ValueError(f"DecodeArrayCache mode must be 1 or 2, got {mode!r}")
        self.page_size = page_size
        self.has_attention = has_attention
        self.mode = mode
        self._prev: tuple[np.ndarray, ...] | None = None  # the last step's five arrays
        self._gen = -1
        self._slots: list[int] = []  # the last step's state slots
        self.num_advanced = 0  # steps whose arrays were advanced (mode 2: and compared)
        self.num_rebuilt = 0  # steps that could not advance
        self.num_differences = 0  # mode 2: arrays that differed

    @classmethod
    def from_knobs(cls, page_size: int, has_attention: bool) -> DecodeArrayCache | None:
        """The cache MSTAR_KV_PLAN_CACHE asks for, or None (0: decode_arrays every step)."""
        mode = knobs.value("MSTAR_KV_PLAN_CACHE")
        return cls(page_size, has_attention, mode) if mode else None

    def invalidate(self) -> None:
        self._prev = None

    def arrays(self, rows: StepRows):
        """decode_arrays(rows, page_size, has_attention), advanced when it can be."""
        prev = self._prev if rows.generation == self._gen else None
        adv = self._advance(prev, rows) if prev is not None else None
        if adv is not None:
            self.num_advanced += 1
            if self.mode == 1:
                self._prev = adv
                self._slots = rows.decode_slots
                return adv
        else:
            self.num_rebuilt += 1
        fresh = decode_arrays(rows, self.page_size, self.has_attention)
        if adv is not None:
            self._compare(adv, fresh)
        self._prev = fresh if len(fresh[0]) else None
        self._gen = rows.generation
        self._slots = rows.decode_slots
        return fresh

    # ------------------------------------------------------------------------------------------
    def _advance(self, prev, rows: StepRows):
        """The previous arrays one token further for every row, or None when the rows are not
        the previous rows one token longer."""
        pos, indptr, indices, last, slot = prev
        n = len(pos)
        if len(rows.decode_lens) != n or rows.decode_slots != self._slots:
            return None
        new_pos = np.asarray(rows.decode_lens, dtype=np.int64)
        new_pos -= 1
        if not np.array_equal(new_pos, pos + 1):
            return None
        ps = self.page_size
        crossed = last == ps  # the previous last page was full: the new token opens a page
        new_last = last + 1
        new_last[crossed] = 1
        cross_rows = np.flatnonzero(crossed)
        if len(cross_rows):
            new_indptr = indptr.copy()
            new_indptr[1:] += np.cumsum(crossed)
        else:
            new_indptr = indptr
        if not self.has_attention:
            return new_pos, new_indptr, indices, new_last, new_pos
        new_slot = slot + 1
        new_indices = indices
        if len(cross_rows):
            counts = (indptr[1:] - indptr[:-1])[cross_rows]  # pages before the crossing
            pages = rows.decode_pages
            try:
                new_pages = np.fromiter((pages[i][c] for i, c in zip(cross_rows.tolist(), counts.tolist())),
                                        dtype=np.int64, count=len(cross_rows))
            except IndexError:  # a page list shorter than its length needs: let decode_arrays say
                return None
            new_indices = np.insert(indices, indptr[1:][cross_rows], new_pages)
            new_slot[cross_rows] = new_pages * ps
        return new_pos, new_indptr, new_indices, new_last, new_slot

    def _compare(self, adv, fresh) -> None:
        for name, a, b in zip(ARRAY_NAMES, adv, fresh):
            if a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b):
                continue
            self.num_differences += 1
            if a.shape != b.shape:
                what = f"shape {a.shape} vs {b.shape}"
            elif a.dtype != b.dtype:
                what = f"dtype {a.dtype} vs {b.dtype}"
            else:
                bad = np.flatnonzero(a != b)
                j = int(bad[0])
                what = f"{len(bad)} of {a.size} entries, first at [{j}]: {int(a[j])} vs {int(b[j])}"
            log.warning("MSTAR_KV_PLAN_CACHE=2: advanced %s differs from the rebuilt one (%s); advanced %s, "
                        "rebuilt %s", name, what, _short(a), _short(b))


def _short(a: np.ndarray, n: int = 16) -> str:
    s = a[:n].tolist()
    return f"{s}{'...' if a.size > n else ''}"
