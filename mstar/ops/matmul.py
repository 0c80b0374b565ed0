"""The linear layer as an op: y = x @ weight^T (+ bias), so that a kernel other than the BLAS
library's can take the decode step's skinny matmuls (a handful of rows against a weight that
is read once per step; memory-bound: the time is the weight's bytes over the bandwidth).

The reference is torch's own F.linear (cuBLAS on CUDA). Backends fall back to it for shapes
they do not take."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.ops.registry import define_op


def _linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N], in x's dtype."""
    return F.linear(x, weight, bias)


def _linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


linear = define_op("linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                   reference=_linear_ref, fake=_linear_fake)

__all__ = ["linear"]
