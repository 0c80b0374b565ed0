"""Rotary position embedding: the config's settings and the cos / sin cache (default RoPE, or
Llama 3.1's frequency scaling of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mstar import ops


def _rope_parameters(config) -> dict:
    """The config's rope dict: transformers 5's rope_parameters, else an older config's rope_scaling."""
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rp if isinstance(rp, dict) else dict(rp)


def _rope_type(rp: dict):
    return rp.get("rope_type", rp.get("type", "default"))


def rope_settings(config, supported: tuple[str, ...] = ("default",)) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from a transformers config (v5 rope_parameters
    or the older top-level fields). `supported`: the rope types the caller computes (the
    scaling itself: rope_scaling)."""
    rp = _rope_parameters(config)
    theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rtype = _rope_type(rp)
    if rtype is not None and rtype not in supported:
        raise ValueError(f"rope_type {rtype!r} is not supported (only {', '.join(supported)} RoPE)")
    return float(theta), float(factor)


@dataclass(frozen=True)
class Llama3Scaling:
    """rope_type "llama3": frequencies whose wavelength is shorter than
    original_max_position_embeddings / high_freq_factor stay, those longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, and the band
    between blends the two linearly in original_max_position_embeddings / wavelength."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (float32 in, float32 out; the same fp32 arithmetic as
        transformers, so the frequencies agree bit for bit)."""
        old = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        # where low == high there is no middle band; the blend's nan there is never selected
        t = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - t) * inv_freq / self.factor + t * inv_freq
        out = torch.where(wavelen > old / self.low_freq_factor, inv_freq / self.factor, blended)
        return torch.where(wavelen < old / self.high_freq_factor, inv_freq, out)


def rope_scaling(config) -> Llama3Scaling | None:
    """The config's frequency scaling: None for default RoPE, Llama3Scaling for rope_type
    "llama3" (original_max_position_embeddings falls back to max_position_embeddings, as in
    transformers). Other types: ValueError."""
    rp = _rope_parameters(config)
    rtype = _rope_type(rp)
    if rtype in (None, "default"):
        return None
    if rtype != "llama3":
        raise ValueError(f"rope_type {rtype!r} is not supported (only default and llama3 RoPE)")
    old = (rp.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
           or config.max_position_embeddings)
    return Llama3Scaling(float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"]), int(old))


def scaled_cos_sin_cache(max_positions: int, rotary_dim: int, base: float, scaling: Llama3Scaling,
                         device=None) -> torch.Tensor:
    """ops.build_cos_sin_cache's table (same layout, same fp32 steps) with scaled frequencies."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    inv_freq = scaling.scale(inv_freq)
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


class RotaryCache(nn.Module):
    """Holds the [max_pos, rotary_dim] f32 cos|sin table as a non-persistent buffer;
    `scaling` (rope_scaling): the frequencies' scaling, None for default RoPE."""

    def __init__(self, max_positions: int, rotary_dim: int, base: float, scaling: Llama3Scaling | None = None):
        super().__init__()
        self.max_positions = int(max_positions)
        self.rotary_dim = int(rotary_dim)
        self.base = float(base)
        self.scaling = scaling
        self.register_buffer("cos_sin_cache", torch.empty(self.max_positions, self.rotary_dim,
                                                          dtype=torch.float32), persistent=False)

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() on the model must not round the table: rebuild it in float32
        super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            if self.cos_sin_cache.is_meta:
                self.cos_sin_cache = self.cos_sin_cache.to(torch.float32)
            else:
                self.rebuild()
        return self

    def rebuild(self, device: torch.device | str | None = None) -> None:
        dev = device if device is not None else self.cos_sin_cache.device
        if torch.device(dev).type == "meta":
            return
        if self.scaling is None:
            table = ops.build_cos_sin_cache(self.max_positions, self.rotary_dim, self.base, device=dev)
        else:
            table = scaled_cos_sin_cache(self.max_positions, self.rotary_dim, self.base, self.scaling, device=dev)
        self.cos_sin_cache = table.to(torch.float32)


