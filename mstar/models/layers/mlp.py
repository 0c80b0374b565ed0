"""The gated (SwiGLU) MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar import ops
from mstar.models import parallel
from mstar.models.layers.linear import FusedLinear, RowParallelLinear, fusable_weight


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up are one fused matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        if act != "silu":
            raise ValueError(f"unsupported MLP activation {act!r} (only silu)")
        size, rank = parallel.tp_size(), parallel.tp_rank()
        start, local = parallel.block(intermediate, rank, size, "intermediate_size")
        sources = None if size == 1 else ((start, intermediate), (start, intermediate))
        self.gate_up_proj = FusedLinear(hidden, ("gate_proj", "up_proj"), (local, local), sources=sources)
        self.down_proj = RowParallelLinear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) from the gate_up projection's output, one op where it can be."""
        weight = fusable_weight(self.down_proj)
        if weight is None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        return ops.silu_mul_linear(gate_up, weight)


