"""Encoder-decoder support for the engine core (Whisper): the encoder run on admission,
static token-suppression masks, and the model's default suppression lists.

    runner = CrossEncoder(model, device)
    runner.encode(seqs, cross_slots)      # once per admitted sequence, batched per step
    masks = TokenMasks(max_rows, vocab, device)
    masks.set(row, suppress_ids)          # at admission (sampler row)
    masks.apply(logits, rows)             # every step, before sampling: one gather + masked_fill

A sequence's `audio` is one 16 kHz mono window (1-D, <= 30 s: its log-mel features are
computed here, on the engine's device, batched with the other admissions of the step) or
its log-mel features [n_mels, 3000] (2-D, used as they are). Encoding writes the cross
K/V of every decoder layer into the sequence's cross slot (CacheManager.cross_slot). A
preempted or offloaded sequence loses its cross slot and is encoded again when it is
admitted again (its audio stays on the Sequence).

Timing counters (`feature_s`, `encoder_s`, `num_encoded`) are cumulative; on CUDA they
come from CUDA events read back (without waiting) when `stats()` is called, so timing
adds no synchronisation to the step loop.
"""

from __future__ import annotations

import json
import os
import time
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


def whisper_suppress_defaults(model, name_or_dir: str | None) -> tuple[list[int], list[int]]:
    """(suppress at every step, suppress at the first generated token) for a Whisper model:
    the checkpoint's generation_config.json lists (else the config's), plus every
    timestamp token (no timestamps mode)."""
    from mstar.models.whisper_tokens import WhisperTokens, suppress_lists
    cfg = model.config
    sup = list(getattr(cfg, "suppress_tokens", None) or [])
    begin = list(getattr(cfg, "begin_suppress_tokens", None) or [])
    if name_or_dir and os.path.isdir(name_or_dir):
        gp = os.path.join(name_or_dir, "generation_config.json")
        if os.path.isfile(gp):
            with open(gp) as f:
                s2, b2 = suppress_lists(json.load(f))
            sup = s2 or sup
            begin = b2 or begin
    try:
        tok = WhisperTokens.from_vocab_size(int(cfg.vocab_size))
        sup = sorted(set(sup) | set(tok.timestamp_ids()))
    except ValueError:  # not the Whisper token layout (a toy vocabulary): lists as given
        pass
    return sup, begin


class CrossEncoder:
    """Runs the encoder for newly admitted sequences and fills their cross slots."""

    def __init__(self, model, device: torch.device):
        self.model = model
        self.device = torch.device(device)
        self.n_mels = int(getattr(model, "num_mel_bins", 0) or model.config.num_mel_bins)
        self._cuda = self.device.type == "cuda"
        self._pending: list[tuple] = []  # CUDA events of encodings not yet read back
        self.feature_s = 0.0
        self.encoder_s = 0.0
        self.num_encoded = 0
        self.num_calls = 0

    def check_audio(self, audio) -> str | None:
        """None if `audio` can be encoded, else what is wrong with it."""
        from mstar.models.audio import N_FRAMES, N_SAMPLES
        shape = tuple(getattr(audio, "shape", ()))
        if len(shape) == 1:
            if not 0 < shape[0] <= N_SAMPLES:
                return f"a window holds 1 to {N_SAMPLES} samples (30 s at 16 kHz), got {shape[0]}"
            return None
        if len(shape) == 2:
            if shape != (self.n_mels, N_FRAMES):
                return f"features must be [{self.n_mels}, {N_FRAMES}], got {list(shape)}"
            return None
        return "expected a 1-D 16 kHz waveform window or [n_mels, 3000] log-mel features"

    def _mark(self):
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def encode(self, audios: list, cross_slots: list[int]) -> None:
        from mstar.models.audio import log_mel_spectrogram
        if not audios:
            return
        t0 = self._mark()
        feats: list[torch.Tensor | None] = [None] * len(audios)
        waves = [i for i, a in enumerate(audios) if len(a.shape) == 1]
        if waves:
            mel = log_mel_spectrogram([torch.as_tensor(audios[i]) for i in waves], n_mels=self.n_mels,
                                      device=self.device)
            for j, i in enumerate(waves):
                feats[i] = mel[j]
        for i, a in enumerate(audios):
            if feats[i] is None:
                feats[i] = torch.as_tensor(a, dtype=torch.float32).to(self.device, non_blocking=True)
        x = torch.stack(feats).to(self.model.dtype)
        t1 = self._mark()
        slots = torch.tensor(cross_slots, dtype=torch.long)
        self.model.encode(x, cross_slots=slots.to(self.device, non_blocking=True))
        t2 = self._mark()
        if self._cuda:
            self._pending.append((t0, t1, t2))
        else:
            self.feature_s += t1 - t0
            self.encoder_s += t2 - t1
        self.num_encoded += len(audios)
        self.num_calls += 1

    def _collect(self) -> None:
        while self._pending and self._pending[0][2].query():
            e0, e1, e2 = self._pending.pop(0)
            self.feature_s += e0.elapsed_time(e1) / 1e3
            self.encoder_s += e1.elapsed_time(e2) / 1e3

    def stats(self) -> dict:
        self._collect()
        return {"encoder_num_encoded": self.num_encoded, "encoder_num_calls": self.num_calls,
                "encoder_feature_s": self.feature_s, "encoder_time_s": self.encoder_s}
