"""Per-sampler-row static masks of token ids that must never be drawn (suppression lists).

    masks = TokenMasks(max_rows, vocab, device)
    masks.set(row, suppress_ids)          # at admission (sampler row)
    masks.apply(logits, rows)             # every step, before sampling: one gather + masked_fill
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class TokenMasks:
    """Per-sampler-row static masks of token ids that must never be drawn
    ([rows, vocab] bool, allocated on first use). Rows without a mask cost nothing."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str):
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.mask: torch.Tensor | None = None
        self._uses = np.zeros(max_rows, dtype=bool)

    def set(self, row: int, ids: Sequence[int]) -> None:
        if row < 0:
            return
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        if not ids:
            self.clear(row)
            return
        if self.mask is None:  # a normal tensor (not an inference one): abort() clears rows outside the step
            with torch.inference_mode(False):
                self.mask = torch.zeros((self.max_rows, self.vocab_size), dtype=torch.bool, device=self.device)
        self.mask[row].zero_()
        t = torch.tensor(ids, dtype=torch.long)
        self.mask[row].index_fill_(0, t.to(self.device, non_blocking=True), True)
        self._uses[row] = True

    def clear(self, row: int) -> None:
        if row >= 0 and self._uses[row]:
            self._uses[row] = False
            self.mask[row].zero_()

    @property
    def active(self) -> bool:
        return bool(self._uses.any())

    def apply(self, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """In place: -inf at the masked ids of each logits row (rows[b]: its sampler row)."""
        r = np.asarray(rows, dtype=np.int64)
        if not len(r) or not self._uses[r].any():
            return logits
        idx = torch.from_numpy(r)
        if self.device.type != "cpu":
            idx = idx.to(self.device, non_blocking=True)
        logits.masked_fill_(self.mask.index_select(0, idx), float("-inf"))
        return logits
