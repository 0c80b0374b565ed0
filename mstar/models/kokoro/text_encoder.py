"""Kokoro's text encoder (StyleTTS2's): phoneme embedding -> n_layer x (conv, channel LayerNorm,
LeakyReLU(0.2)) -> bidirectional LSTM; the features the decoder reads, one per token.

Parameter names follow the release's `text_encoder` state dict: embedding, cnn.<i>.0 (the conv,
weight-normed in the release: folded at load), cnn.<i>.1.{gamma,beta}, lstm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar import ops
from mstar.models.kokoro.blocks import lstm


class ChannelLayerNorm(nn.Module):
    """Layer norm over the channels of [B, C, T]."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x.transpose(1, 2), self.gamma, self.beta, self.eps).transpose(1, 2)


class TextEncoder(nn.Module):
    def __init__(self, channels: int, kernel_size: int, depth: int, n_symbols: int):
        super().__init__()
        self.embedding = nn.Embedding(n_symbols, channels)
        pad = (kernel_size - 1) // 2
        self.cnn = nn.ModuleList([
            nn.ModuleList([nn.Conv1d(channels, channels, kernel_size, padding=pad), ChannelLayerNorm(channels)])
            for _ in range(depth)])
        self.lstm = nn.LSTM(channels, channels // 2, 1, batch_first=True, bidirectional=True)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """ids [B, L] (0-padded), lengths [B] (host), m [B, 1, L] -> [B, C, L], zeros past each row."""
        x = self.embedding(ids).transpose(1, 2) * m
        for conv, norm in self.cnn:
            x = F.leaky_relu(norm(conv(x)), 0.2) * m
        x = lstm(self.lstm, x.transpose(1, 2), lengths).transpose(1, 2)
        return x * m


__all__ = ["TextEncoder", "ChannelLayerNorm"]
