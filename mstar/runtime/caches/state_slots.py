"""Slot pools for the recurrent state of Gated DeltaNet layers.

Every GDN layer has a conv state pool [S, conv_dim, K-1] and a recurrent state pool
[S, Hv, Dk, Dv]; slot s is row s of all of them at once. `CacheManager` splits the rows
into two pools of this class: slots [0, num_slots) for running requests (one each) and
slots [num_slots, num_slots + num_snapshot_slots) for prefix-cache snapshots of the state
at page boundaries. This module only deals in slot ids; the manager does the copies.
"""

from __future__ import annotations


class SlotPool:
    """A free list over the slot ids [first, first + count)."""

    def __init__(self, first: int, count: int):
        if count < 0:
            raise ValueError(f"slot count must be >= 0, got {count}")
        self.first = first
        self.count = count
        self._free: list[int] = list(range(first + count - 1, first - 1, -1))
        self._is_free = bytearray(b"\x01") * count

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, slot: int) -> bool:
        return self.first <= slot < self.first + self.count

    def allocate(self) -> int | None:
        if not self._free:
            return None
        s = self._free.pop()
        self._is_free[s - self.first] = 0
        return s

    def release(self, slot: int) -> None:
        if slot not in self:
            raise RuntimeError(f"slot {slot} does not belong to this pool [{self.first}, {self.first + self.count})")
        if self._is_free[slot - self.first]:
            raise RuntimeError(f"slot {slot} released twice")
        self._is_free[slot - self.first] = 1
        self._free.append(slot)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot - self.first])

    def free_list(self) -> list[int]:
        return list(self._free)
