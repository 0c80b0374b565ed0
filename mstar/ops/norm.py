"""Normalisation ops: RMSNorm (plain, zero-centred, and with the weight in float32), fused residual-add + RMSNorm,
gated RMSNorm, L2 norm. All compute in float32 and return the input dtype."""

from __future__ import annotations

import torch

from mstar.ops.registry import define_op


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """y = x / rms(x) * w  (w -> 1 + w when zero_centered, Qwen3.5's form).

    Rounding follows transformers so bf16 results match bit for bit: the plain form rounds
    the normalised x to the input dtype before the weight (Qwen3RMSNorm), the zero-centred
    form multiplies in float32 and rounds once (Qwen3_5RMSNorm)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (y * (1.0 + weight.float())).to(x.dtype)
    return (y.to(x.dtype).float() * weight.float()).to(x.dtype)


def _rms_norm_fake(x, weight, eps, zero_centered):
    return torch.empty_like(x)


rms_norm = define_op(
    "rms_norm", "(Tensor x, Tensor weight, float eps, bool zero_centered) -> Tensor",
    reference=_rms_norm_ref, fake=_rms_norm_fake)


def _rms_norm_fp32_weight_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * w with the weight multiplied in float32 and one rounding (the form of
    Nemotron's RMSNorm, which Cosmos3 uses): rms_norm's plain form rounds before the weight."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)


rms_norm_fp32_weight = define_op(
    "rms_norm_fp32_weight", "(Tensor x, Tensor weight, float eps) -> Tensor",
    reference=_rms_norm_fp32_weight_ref, fake=lambda x, weight, eps: torch.empty_like(x))


def _fused_add_rms_norm_fp32_weight_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_fp32_weight(x + residual), x + residual), the sum rounded to the activation dtype."""
    s = x + residual
    return _rms_norm_fp32_weight_ref(s, weight, eps), s


fused_add_rms_norm_fp32_weight = define_op(
    "fused_add_rms_norm_fp32_weight", "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    reference=_fused_add_rms_norm_fp32_weight_ref,
    fake=lambda x, residual, weight, eps: (torch.empty_like(x), torch.empty_like(x)))


def _fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm of the next sub-layer and the new residual."""
    s = x + residual
    return _rms_norm_ref(s, weight, eps, zero_centered), s


def _fused_add_rms_norm_fake(x, residual, weight, eps, zero_centered):
    return torch.empty_like(x), torch.empty_like(x)


fused_add_rms_norm = define_op(
    "fused_add_rms_norm",
    "(Tensor x, Tensor residual, Tensor weight, float eps, bool zero_centered) -> (Tensor, Tensor)",
    reference=_fused_add_rms_norm_ref, fake=_fused_add_rms_norm_fake)


def _gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * w * silu(z), over the last dim (Gated DeltaNet output norm)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight.float() * y.to(x.dtype).float()  # HF rounds to the input dtype before the weight
    return (y * torch.nn.functional.silu(z.float())).to(x.dtype)


gated_rms_norm = define_op(
    "gated_rms_norm", "(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor",
    reference=_gated_rms_norm_ref, fake=lambda x, z, weight, eps: torch.empty_like(x))


def _l2_norm_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


l2_norm = define_op("l2_norm", "(Tensor x, float eps) -> Tensor",
                    reference=_l2_norm_ref, fake=lambda x, eps: torch.empty_like(x))

__all__ = ["rms_norm", "rms_norm_fp32_weight", "fused_add_rms_norm", "fused_add_rms_norm_fp32_weight", "gated_rms_norm", "l2_norm"]
