"""Whisper's admission stage: the audio encoder, run when a request is admitted.

    stage = CrossEncoder(model, device)
    stage.run(audios, cross_slots)        # once per admitted sequence, batched per step

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

import time

import torch

from mstar.models.interfaces import AdmissionStage


class CrossEncoder(AdmissionStage):
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

    def check(self, audio) -> str | None:
        """None if `audio` can be encoded, else what is wrong with it."""
        from mstar.models.whisper.audio import N_FRAMES, N_SAMPLES
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

    def run(self, audios: list, cross_slots: list[int]) -> None:
        from mstar.models.whisper.audio import log_mel_spectrogram
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
