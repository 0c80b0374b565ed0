"""RMSNorm (plain or zero-centred), with the fused residual add and the deferred tp sum.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar import ops
from mstar.models import parallel
from mstar.models.layers.linear import fusable_weight


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; zero_centered: weight w acts as (1 + w) (Qwen3.5)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = float(eps)
        self.zero_centered = bool(zero_centered)
        self.reduce_site: int | None = None  # reduce_input()

    def reduce_input(self, site: int, group=None) -> None:
        """At tp > 1: add_forward's x is a row-parallel partial sum (the producer deferred its
        all-reduce), summed here, fused with the add and the norm when the runtime installed a
        kernel for it. site: the sum's position in the forward."""
        self.reduce_site, self.reduce_group = site, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.zero_centered)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); residual None: (norm(x), x)."""
        if self.reduce_site is not None:
            fused = parallel.fused_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered,
                                                       self.reduce_site, self.reduce_group)
            if fused is not None:
                return fused
            x = parallel.all_reduce(x, self.reduce_group)
        if residual is None:
            return self.forward(x), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)

    def add_forward_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                           linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual): add_forward and the product that reads it, as
        one op where the product allows (ops.add_rms_norm_linear)."""
        weight = fusable_weight(linear)
        if residual is None or self.reduce_site is not None or weight is None:
            normed, residual = self.add_forward(x, residual)
            return linear(normed), residual
        return ops.add_rms_norm_linear(x, residual, self.weight, self.eps, self.zero_centered, weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered={self.zero_centered}"


