"""LayerNorm ops (Whisper): plain, and fused residual-add + LayerNorm. Computed in float32,
returned in the input dtype (for float32 inputs: exactly torch's nn.LayerNorm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.ops.registry import define_op


def _layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * w + b over the last dim."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


layer_norm = define_op("layer_norm", "(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor",
                       reference=_layer_norm_ref, fake=lambda x, weight, bias, eps: torch.empty_like(x))


def _fused_add_layer_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual): the pre-norm of the next sub-layer and the new residual."""
    s = x + residual
    return _layer_norm_ref(s, weight, bias, eps), s


fused_add_layer_norm = define_op(
    "fused_add_layer_norm",
    "(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor)",
    reference=_fused_add_layer_norm_ref,
    fake=lambda x, residual, weight, bias, eps: (torch.empty_like(x), torch.empty_like(x)))

__all__ = ["layer_norm", "fused_add_layer_norm"]
