"""Positions and rotary tables of Cosmos3's joint sequence [prompt tokens ; vision tokens], as
diffusers' Cosmos3OmniPipeline lays it out (0.42, text-to-image and text-to-video):

    prompt   L tokens at (t, h, w) = (i, i, i), i = 0 .. L - 1 (float32 with fps modulation, else
             integers)
    vision   the latent grid (T, h, w) after the p x p patch, token (f, y, x) in (frame, row,
             column) order at t = offset + f, h = y, w = x, offset = L + the modality margin
             (15000); with fps modulation and T > 1 the temporal position is float32
             f / (fps / 4) * (base_fps / 4) + offset (an image, T = 1, keeps integers); h and w
             start at `offset` instead of 0 when reset_spatial_ids is false

Rotary (diffusers' Cosmos3VLTextRotaryEmbedding): inv_freq_i = 1 / theta ** (2i / head_dim), the
angle of pair i is inv_freq_i times the token's position on the axis that pair belongs to
(config.rope_axes: interleaved t, h, w, t, h, w, ... then t for the pairs left over), all in
float32 with diffusers' operations; the pairs are NeoX halves (x[i], x[i + head_dim / 2]).
inv_freq is float32 whatever the model dtype (a diffusers model cast with .to(bfloat16) rounds
its inv_freq buffer to bfloat16 too, which moves the angles at positions ~15000 visibly).
A table is [N, head_dim] float32: cos of the N x head_dim / 2 angles, then their sin, the layout
ops.rotary_embedding reads (row n for token n).
"""

from __future__ import annotations

import torch

from mstar.models.cosmos3.config import Cosmos3TransformerConfig


def text_positions(n: int, config: Cosmos3TransformerConfig) -> torch.Tensor:
    """[3, n]: the prompt's positions (float32 with fps modulation, else int64)."""
    if config.enable_fps_modulation:
        ids = torch.arange(n, dtype=torch.float32) + 0
    else:
        ids = torch.arange(n, dtype=torch.long)
    return ids.unsqueeze(0).expand(3, -1).contiguous()


def vision_offset(prompt_len: int, config: Cosmos3TransformerConfig) -> int:
    """Where the vision tokens' temporal positions start, after a prompt of `prompt_len` tokens."""
    return prompt_len + int(config.unified_3d_mrope_temporal_modality_margin)


def vision_positions(grid: tuple[int, int, int], offset: int, fps: float | None, temporal_factor: int,
                     config: Cosmos3TransformerConfig) -> torch.Tensor:
    """[3, T * h * w]: the vision tokens' positions; fps None (or modulation off): integers."""
    gt, gh, gw = grid
    modulated = config.enable_fps_modulation and fps is not None and gt > 1
    if modulated:
        tps = fps / temporal_factor
        base_tps = float(config.base_fps) / temporal_factor
        frames = torch.arange(gt, dtype=torch.float32)
        t = ((frames + 0) / tps * base_tps + offset).view(-1, 1).expand(-1, gh * gw).flatten()
    else:
        t = torch.arange(gt, dtype=torch.long).view(-1, 1).expand(-1, gh * gw).flatten() + int(offset)
    h = torch.arange(gh, dtype=torch.long).view(1, -1, 1).expand(gt, -1, gw).flatten()
    w = torch.arange(gw, dtype=torch.long).view(1, 1, -1).expand(gt, gh, -1).flatten()
    if not config.unified_3d_mrope_reset_spatial_ids:
        h, w = h + int(offset), w + int(offset)
    if modulated:
        return torch.stack([t, h.to(torch.float32), w.to(torch.float32)])
    return torch.stack([t, h, w])


def inv_freq(config: Cosmos3TransformerConfig) -> torch.Tensor:
    d = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def rope_table(positions: torch.Tensor, config: Cosmos3TransformerConfig) -> torch.Tensor:
    """[3, N] positions -> [N, head_dim] float32: cos | sin of the interleaved 3-axis angles (CPU)."""
    inv = inv_freq(config)
    # the angles as diffusers forms them: a [half, 1] x [1, N] product per axis, in float32
    freqs = inv[None, None, :, None].expand(3, 1, -1, 1) @ positions[:, None, None, :].float()
    freqs = freqs.transpose(2, 3)[:, 0]  # [3, N, half]
    out = freqs[0].clone()
    axes = config.rope_axes
    for axis, start in ((1, 1), (2, 2)):
        pick = slice(start, axes[axis] * 3, 3)
        out[:, pick] = freqs[axis][:, pick]
    return torch.cat([out.cos(), out.sin()], dim=-1)


__all__ = ["text_positions", "vision_offset", "vision_positions", "inv_freq", "rope_table"]
