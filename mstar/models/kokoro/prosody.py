"""Kokoro's prosody predictor (StyleTTS2's): per token a duration, per frame an F0 and an energy
(N) curve, all conditioned on the predictor half of the voice row.

    DurationEncoder   n_layer x (bidirectional LSTM, AdaLayerNorm), the style appended to every
                      token's features before each LSTM
    lstm + duration_proj
                      max_dur logits per token; frames = round(sum(sigmoid(logits)) / speed), >= 1
    shared LSTM -> F0 / N branches
                      over the frame-aligned features: 3 AdainResBlk1d each (the middle one
                      upsamples 2x), then a 1x1 projection to one channel: F0 and N at twice the
                      frame rate

Parameter names follow the release's `predictor` state dict (text_encoder.lstms.<2i> LSTMs and
.<2i+1> AdaLayerNorms, lstm, duration_proj.linear_layer, shared, F0.<i>, N.<i>, F0_proj, N_proj).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.models.kokoro.blocks import AdaLayerNorm, AdainResBlk1d, lstm


class DurationEncoder(nn.Module):
    def __init__(self, style_dim: int, d_model: int, nlayers: int):
        super().__init__()
        self.lstms = nn.ModuleList()
        for _ in range(nlayers):
            self.lstms.append(nn.LSTM(d_model + style_dim, d_model // 2, 1, batch_first=True, bidirectional=True))
            self.lstms.append(AdaLayerNorm(style_dim, d_model))

    def forward(self, x: torch.Tensor, s: torch.Tensor, lengths: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """x [B, L, d_model], s [B, style], m [B, L, 1] -> [B, L, d_model + style], zeros past each row."""
        sx = s[:, None, :].expand(-1, x.shape[1], -1)
        x = torch.cat([x, sx], dim=-1) * m
        for block in self.lstms:
            if isinstance(block, AdaLayerNorm):
                x = torch.cat([block(x, s), sx], dim=-1) * m
            else:
                x = lstm(block, x, lengths)
        return x


class Projection(nn.Module):
    """The release's LinearNorm: a Linear under the name linear_layer."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear_layer = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_layer(x)


class ProsodyPredictor(nn.Module):
    def __init__(self, style_dim: int, d_hid: int, nlayers: int, max_dur: int):
        super().__init__()
        self.text_encoder = DurationEncoder(style_dim, d_hid, nlayers)
        self.lstm = nn.LSTM(d_hid + style_dim, d_hid // 2, 1, batch_first=True, bidirectional=True)
        self.duration_proj = Projection(d_hid, max_dur)
        self.shared = nn.LSTM(d_hid + style_dim, d_hid // 2, 1, batch_first=True, bidirectional=True)
        half = d_hid // 2
        for name in ("F0", "N"):
            setattr(self, name, nn.ModuleList([AdainResBlk1d(d_hid, d_hid, style_dim),
                                               AdainResBlk1d(d_hid, half, style_dim, upsample=True),
                                               AdainResBlk1d(half, half, style_dim)]))
        self.F0_proj = nn.Conv1d(half, 1, 1)
        self.N_proj = nn.Conv1d(half, 1, 1)

    def duration_logits(self, d: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """d [B, L, d_hid + style] (the duration encoder's) -> [B, L, max_dur]."""
        return self.duration_proj(lstm(self.lstm, d, lengths))

    def f0_n(self, en: torch.Tensor, s: torch.Tensor, frames: torch.Tensor,
             m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """en [B, d_hid + style, F] frame-aligned features, frames [B] (host), m [B, 1, F] ->
        (F0 [B, 2F], N [B, 2F], their mask [B, 1, 2F])."""
        x = lstm(self.shared, en.transpose(1, 2), frames).transpose(1, 2)
        out = []
        for blocks, proj in ((self.F0, self.F0_proj), (self.N, self.N_proj)):
            h, hm = x, m
            for block in blocks:
                h, hm = block(h, s, hm)
            out.append(proj(h).squeeze(1))
        return out[0], out[1], hm


__all__ = ["DurationEncoder", "ProsodyPredictor"]
