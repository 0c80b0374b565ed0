"""Rotary position embedding: the config's settings and the cos / sin cache.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar import ops


def rope_settings(config) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from a transformers config (v5 rope_parameters
    or the older top-level fields)."""
    rp = getattr(config, "rope_parameters", None) or {}
    if not isinstance(rp, dict):
        rp = dict(rp)
    theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype not in ("default", None):
        raise ValueError(f"rope_type {rtype!r} is not supported (only default RoPE)")
    return float(theta), float(factor)


class RotaryCache(nn.Module):
    """Holds the [max_pos, rotary_dim] f32 cos|sin table as a non-persistent buffer."""

    def __init__(self, max_positions: int, rotary_dim: int, base: float):
        super().__init__()
        self.max_positions = int(max_positions)
        self.rotary_dim = int(rotary_dim)
        self.base = float(base)
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
        self.cos_sin_cache = ops.build_cos_sin_cache(self.max_positions, self.rotary_dim, self.base,
                                                     device=dev).to(torch.float32)


