"""Timestep-modulated elementwise ops of a diffusion transformer block (Wan's adaLN-style
modulation), each with its per-token gather of the modulation vectors:

    modulated_layer_norm  y   = (LN(x) * (1 + scale[index]) + shift[index]).to(x.dtype)
    gated_residual        out = (x + y * gate[index]).to(x.dtype)

LN is a LayerNorm over the last dim without affine; all arithmetic is float32. x and y are
[B, S, dim]; the tables (shift, scale, gate) are float32 [U, dim], one row per distinct timestep
(views such as table[:, i] of a [U, n, dim] table are fine: rows may be strided, the last dim
must be contiguous); index [B, S] (each token's row) or [B, 1] (one row per batch row) is an
integer tensor. A backend gathers the rows itself, so the [B, S, dim] float32 gathers the
reference builds never exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.ops.registry import define_op


def check_modulation(op: str, x: torch.Tensor, tables: tuple[torch.Tensor, ...], index: torch.Tensor) -> None:
    """Raise ValueError (naming `op`) unless x [B, S, dim], tables float32 [U, dim], index [B, S | 1]."""
    ok = x.dim() == 3 and index.dim() == 2 and index.shape[0] == x.shape[0] \
        and index.shape[1] in (1, x.shape[1]) and not index.is_floating_point() \
        and all(t.dim() == 2 and t.shape[1] == x.shape[2] and t.dtype == torch.float32 for t in tables)
    if not ok:
        raise ValueError(f"{op}: x [B, S, dim], tables float32 [U, dim], index [B, S] or [B, 1] integer; got x "
                         f"{tuple(x.shape)}, tables {[(tuple(t.shape), t.dtype) for t in tables]}, index "
                         f"{tuple(index.shape)} {index.dtype}")


def _modulated_layer_norm_ref(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, index: torch.Tensor,
                              eps: float) -> torch.Tensor:
    """LayerNorm without affine (float32), * (1 + scale[index]) + shift[index], cast to x.dtype."""
    check_modulation("modulated_layer_norm", x, (shift, scale), index)
    n = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    return (n * (1 + scale[index]) + shift[index]).to(x.dtype)


modulated_layer_norm = define_op(
    "modulated_layer_norm", "(Tensor x, Tensor shift, Tensor scale, Tensor index, float eps) -> Tensor",
    reference=_modulated_layer_norm_ref, fake=lambda x, shift, scale, index, eps: torch.empty_like(x))


def _gated_residual_ref(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x + y * gate[index] in float32, cast to x.dtype."""
    check_modulation("gated_residual", x, (gate,), index)
    if y.shape != x.shape:
        raise ValueError(f"gated_residual: y must be shaped as x {tuple(x.shape)}, got {tuple(y.shape)}")
    return (x.float() + y.float() * gate[index]).to(x.dtype)


gated_residual = define_op(
    "gated_residual", "(Tensor x, Tensor y, Tensor gate, Tensor index) -> Tensor",
    reference=_gated_residual_ref, fake=lambda x, y, gate, index: torch.empty_like(x))

__all__ = ["modulated_layer_norm", "gated_residual"]
