"""In-graph decode inputs (MSTAR_INGRAPH_DECODE_TOKENS, MSTAR_INGRAPH_DECODE_ROPE): per-request
master buffers on the device that the decode graphs read their input tokens (and positions)
from, instead of the host uploading them every step.

  tokens     [capacity + 1] int64: each running request's newest token (the input of its next
             decode step). The sampler scatters every sampled token into it (a device
             index_copy, no host sync); overlapped decode's launch does the same with its argmax.
  positions  [capacity + 1] int64 (ROPE only): each running request's next decode position
             (= its length - 1 at that step). A decode graph reads it and advances it by one on
             the device; the host writes it only when a request's length changes outside a
             graph (admission, an eager prefill / mixed step that sampled for it).

Slots: capacity = max_num_seqs, allocated once before the graphs are captured and never grown
or moved (a captured graph holds their addresses). A request holds a slot from admission to
finish, abort or preemption (re-admission takes a fresh one and rewrites it from the host).
Slot `pad` (= capacity) belongs to the padding rows: token 0 at position 0, never assigned;
every graph step resets its position to 0 after advancing.

The staged buffer of a graph step then carries each row's master slot where it carried the
token id; the first ops of the captured forward gather `tokens[slot]` (and `positions[slot]`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class MasterCapacityError(RuntimeError):
    """A request needs a decode master slot and all `capacity` of them are held."""


class DecodeMasters:
    def __init__(self, capacity: int, device: torch.device | str, *, positions: bool):
        if capacity < 1:
            raise ValueError(f"decode masters: capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.pad = self.capacity  # the padding rows' slot
        self.tokens = torch.zeros(self.capacity + 1, dtype=torch.int64, device=self.device)
        self.positions = (torch.zeros(self.capacity + 1, dtype=torch.int64, device=self.device)
                          if positions else None)
        # a fixed view of the padding slot's position (reset after every in-graph advance)
        self._pad_position = None if self.positions is None else self.positions[self.pad:self.pad + 1]
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() hands out the lowest slot
        self._slot_of: dict[str, int] = {}

    # --- slots ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_assigned(self) -> int:
        return len(self._slot_of)

    def has(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def slot(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def slots_of(self, seqs: Iterable) -> list[int]:
        """The master slot of each sequence (objects with a request_id), in order."""
        slot_of = self._slot_of
        return [slot_of[s.request_id] for s in seqs]

    def assign(self, request_id: str) -> int:
        """A slot for a request (its own if it holds one). MasterCapacityError when none is free."""
        slot = self._slot_of.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            raise MasterCapacityError(
                f"MSTAR_INGRAPH_DECODE_TOKENS: request {request_id!r} needs a decode master slot but all "
                f"{self.capacity} are held (the master buffers have a fixed capacity of {self.capacity} "
                f"slots = max_num_seqs, allocated before the decode graphs are captured and never grown); "
                f"raise max_num_seqs or turn MSTAR_INGRAPH_DECODE_TOKENS off")
        slot = self._free.pop()
        self._slot_of[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        """Give a request's slot back (nothing if it holds none)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check(self) -> None:
        """Every slot either free or held by exactly one request."""
        held = list(self._slot_of.values())
        every = sorted(held + self._free)
        if every != list(range(self.capacity)):
            raise AssertionError(f"decode masters: slots inconsistent (held {sorted(held)}, free {sorted(self._free)})")

    # --- host writes (admission, eager steps; not per graph step) ------------------------------
    def write(self, slots: list[int], tokens: list[int] | None = None, positions: list[int] | None = None) -> None:
        """Set the masters of `slots` from host values (one upload). positions are ignored
        without the position master."""
        if not slots:
            return
        pos = positions if self.positions is not None else None
        cols = [slots] + [v for v in (tokens, pos) if v is not None]
        if len(cols) == 1:
            return
        host = torch.tensor(cols, dtype=torch.int64)
        dev = host if self.device.type == "cpu" else host.to(self.device, non_blocking=True)
        idx, k = dev[0], 1
        if tokens is not None:
            self.tokens.index_copy_(0, idx, dev[k])
            k += 1
        if pos is not None:
            self.positions.index_copy_(0, idx, dev[k])

    # --- device side ---------------------------------------------------------------------------
    def scatter_tokens(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """tokens[b] -> master[slots[b]] (device tensors; no sync)."""
        if tokens.dtype != torch.int64:  # a backend's int32 ids
            tokens = tokens.to(torch.int64)
        self.tokens.index_copy_(0, slots, tokens)

    def read_inputs(self, slots: torch.Tensor, ids_out: torch.Tensor, pos_out: torch.Tensor | None = None,
                    pos_next: torch.Tensor | None = None) -> None:
        """The first ops of a captured decode forward: ids_out = tokens[slots]; with the
        position master also pos_out = positions[slots], then positions[slots] += 1 (the
        padding slot back to 0). Every tensor is a fixed buffer of the graph runner."""
        torch.index_select(self.tokens, 0, slots, out=ids_out)
        if self.positions is None:
            return
        torch.index_select(self.positions, 0, slots, out=pos_out)
        torch.add(pos_out, 1, out=pos_next)
        # real rows hold distinct slots; padding rows all write the same value into `pad`
        self.positions.index_copy_(0, slots, pos_next)
        self._pad_position.zero_()
