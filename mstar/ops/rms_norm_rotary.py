"""RMSNorm over all heads together, then the interleaved-pair rotary of each head (Wan's self-attention
q and k: norm_q / norm_k over heads * head_dim before the head split, then the 3-D rotary):

    rms_norm_rotary(x, weight, cos, sin, heads, eps) -> y

    n      = rms_norm(x, weight, eps)                    as ops.rms_norm (zero_centered False): float32
                                                         math, the normalised x rounded to x's dtype
                                                         before the weight, the product rounded again
    y[2i]   = n[2i] c - n[2i+1] s                         per head, pair i of the head (c, s = cos, sin
    y[2i+1] = n[2i] s + n[2i+1] c                         of the token at pair i), float32, rounded to
                                                         x's dtype

x [B, S, heads * head_dim] (bfloat16 or float32); weight [heads * head_dim]; cos / sin float32
[S, head_dim // 2], the angles of token s (the same for every head and every batch row: token
(b, s) uses row s). The pairs are (x[2i], x[2i+1]) -- complex-number style, not the NeoX halves of
ops.rotary_embedding. A backend does both in one pass over x, with no intermediate in memory.
"""

from __future__ import annotations

import torch

from mstar.ops.norm import _rms_norm_ref
from mstar.ops.registry import define_op


def check_rms_norm_rotary(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          heads: int) -> None:
    """Raise ValueError (naming the op) unless x [B, S, heads * D], weight [heads * D], cos / sin
    float32 [S, D // 2] with D even."""
    ok = x.dim() == 3 and heads > 0 and x.shape[2] % heads == 0 and (x.shape[2] // heads) % 2 == 0 \
        and weight.shape == (x.shape[2],) \
        and all(t.dtype == torch.float32 and t.shape == (x.shape[1], x.shape[2] // heads // 2) for t in (cos, sin))
    if not ok:
        raise ValueError(f"rms_norm_rotary: x [B, S, heads * D] (D even), weight [heads * D], cos / sin float32 "
                         f"[S, D // 2]; got x {tuple(x.shape)}, heads {heads}, weight {tuple(weight.shape)}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}")


def _rms_norm_rotary_ref(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                         eps: float) -> torch.Tensor:
    """rms_norm(x, weight) in x's dtype, then each head's interleaved pairs rotated in float32, cast to x.dtype."""
    check_rms_norm_rotary(x, weight, cos, sin, heads)
    B, S, width = x.shape
    n = _rms_norm_ref(x, weight, eps, False).view(B, S, heads, width // heads)
    x0, x1 = n.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None], sin[:, None]  # [S, 1, D // 2]: broadcast over the heads
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.to(x.dtype).view(B, S, width)


rms_norm_rotary = define_op(
    "rms_norm_rotary", "(Tensor x, Tensor weight, Tensor cos, Tensor sin, int heads, float eps) -> Tensor",
    reference=_rms_norm_rotary_ref, fake=lambda x, weight, cos, sin, heads, eps: torch.empty_like(x))

__all__ = ["rms_norm_rotary"]
