"""Matrix products with the elementwise op before them folded in: what a decoder layer runs
between its products (the residual add and RMSNorm, SwiGLU's gated SiLU, Gated DeltaNet's gated
output norm, an attention's sigmoid output gate), then `x @ weight.T`.

Each op computes exactly what the op it stands for computes, followed by `F.linear`; the
reference and the `composed` backend are that pair. A backend may fold the first op into the
product's loads (a decode step's few rows: one kernel instead of two), which changes where the
product's input is rounded but not what it is; tests/test_fused_linear.py states the tolerance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.ops.activation import _sigmoid_mul_ref, _silu_and_mul_ref
from mstar.ops.norm import _fused_add_rms_norm_ref, _gated_rms_norm_ref
from mstar.ops.registry import define_op


def _add_rms_norm_linear_ref(x, residual, norm_weight, eps, zero_centered, weight):
    """(rms_norm(x + residual) @ weight.T, x + residual)."""
    normed, s = _fused_add_rms_norm_ref(x, residual, norm_weight, eps, zero_centered)
    return F.linear(normed, weight), s


add_rms_norm_linear = define_op(
    "add_rms_norm_linear",
    "(Tensor x, Tensor residual, Tensor norm_weight, float eps, bool zero_centered, Tensor weight) -> (Tensor, Tensor)",
    reference=_add_rms_norm_linear_ref,
    fake=lambda x, residual, norm_weight, eps, zero_centered, weight: (
        x.new_empty((x.shape[0], weight.shape[0])), torch.empty_like(x)))


def _silu_mul_linear_ref(x, weight):
    """silu_and_mul(x) @ weight.T: x [T, 2K] (gate | up), weight [N, K]."""
    return F.linear(_silu_and_mul_ref(x), weight)


silu_mul_linear = define_op(
    "silu_mul_linear", "(Tensor x, Tensor weight) -> Tensor", reference=_silu_mul_linear_ref,
    fake=lambda x, weight: x.new_empty((x.shape[0], weight.shape[0])))


def _gated_rms_norm_linear_ref(x, z, norm_weight, eps, weight):
    """gated_rms_norm(x, z) (per head: x, z [T, H, D]) flattened to [T, H * D], @ weight.T."""
    t = x.shape[0]
    return F.linear(_gated_rms_norm_ref(x, z, norm_weight, eps).reshape(t, -1), weight)


gated_rms_norm_linear = define_op(
    "gated_rms_norm_linear", "(Tensor x, Tensor z, Tensor norm_weight, float eps, Tensor weight) -> Tensor",
    reference=_gated_rms_norm_linear_ref,
    fake=lambda x, z, norm_weight, eps, weight: x.new_empty((x.shape[0], weight.shape[0])))


def _sigmoid_mul_linear_ref(x, gate, weight):
    """sigmoid_mul(x, gate) (x, gate [T, H, D]) flattened to [T, H * D], @ weight.T."""
    t = x.shape[0]
    return F.linear(_sigmoid_mul_ref(x, gate).reshape(t, -1), weight)


sigmoid_mul_linear = define_op(
    "sigmoid_mul_linear", "(Tensor x, Tensor gate, Tensor weight) -> Tensor", reference=_sigmoid_mul_linear_ref,
    fake=lambda x, gate, weight: x.new_empty((x.shape[0], weight.shape[0])))

__all__ = ["add_rms_norm_linear", "silu_mul_linear", "gated_rms_norm_linear", "sigmoid_mul_linear"]
