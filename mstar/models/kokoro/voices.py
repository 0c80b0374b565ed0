"""Kokoro voices: one style table per voice, [510, 1, 2 * style_dim] (the release's voices/<name>.pt).
Row k is the style for an utterance of k + 1 phonemes; a row's first style_dim values condition
the decoder, the rest the prosody predictor. A voice name's first letter is its language
(a American English, b British English, e Spanish, f French, h Hindi, i Italian, j Japanese,
p Brazilian Portuguese, z Mandarin), the second the speaker's gender.
"""

from __future__ import annotations

import os

import torch

from mstar.models.kokoro.config import VOICE_ROWS


class VoiceBank:
    def __init__(self, tables: dict[str, torch.Tensor], style_dim: int):
        self.style_dim = style_dim
        self.tables: dict[str, torch.Tensor] = {}
        for name, t in tables.items():
            t = t.detach().float().cpu()
            if t.dim() == 3 and t.shape[1] == 1:
                t = t[:, 0]
            if t.dim() != 2 or t.shape[1] != 2 * style_dim or t.shape[0] < 1:
                raise ValueError(f"voice {name!r}: a table of shape [rows, 1, {2 * style_dim}] is expected, "
                                 f"got {tuple(tables[name].shape)}")
            self.tables[name] = t

    @property
    def names(self) -> list[str]:
        return list(self.tables)

    def __contains__(self, name: str) -> bool:
        return name in self.tables

    def style(self, name: str, n_phonemes: int) -> torch.Tensor:
        """The voice's row for an utterance of n_phonemes phonemes: [2 * style_dim]."""
        t = self.tables[name]
        return t[min(max(n_phonemes, 1), t.shape[0]) - 1]


def load_voices(path: str, style_dim: int) -> VoiceBank:
    """Every voices/<name>.pt under a checkpoint directory (none: an empty bank)."""
    d = os.path.join(path, "voices")
    tables = {}
    if os.path.isdir(d):
        for f in sorted(os.listdir(d)):
            if f.endswith(".pt"):
                tables[f[:-3]] = torch.load(os.path.join(d, f), map_location="cpu", weights_only=True)
    return VoiceBank(tables, style_dim)


def random_voices(names, style_dim: int, seed: int = 0) -> VoiceBank:
    """Random tables (benchmarks of random-weight presets), a function of (names, style_dim, seed)."""
    g = torch.Generator().manual_seed(int(seed) + 0x6B6F)
    return VoiceBank({n: 0.3 * torch.randn(VOICE_ROWS, 1, 2 * style_dim, generator=g) for n in names}, style_dim)


__all__ = ["VoiceBank", "load_voices", "random_voices"]
