"""Activation ops: the gated SiLU of SwiGLU MLPs and GELU. Both compute in float32 and
return the input dtype; outputs are always fresh contiguous tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.ops.registry import define_op


def _silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x of shape [..., 2d] (SwiGLU: gate first, up second)."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype).contiguous()


def _silu_and_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


silu_and_mul = define_op("silu_and_mul", "(Tensor x) -> Tensor",
                         reference=_silu_and_mul_ref, fake=_silu_and_mul_fake)


def _gelu_ref(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU; approximate is "none" (exact, erf) or "tanh"."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return F.gelu(x.float(), approximate=approximate).to(x.dtype).contiguous()


def _gelu_fake(x, approximate):
    return x.new_empty(x.shape)


gelu = define_op("gelu", "(Tensor x, str approximate) -> Tensor", reference=_gelu_ref, fake=_gelu_fake)

__all__ = ["silu_and_mul", "gelu"]
