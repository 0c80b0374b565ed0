"""Linear layers on the op layer: plain, fused (several checkpoint tensors in one matrix),
row-parallel, the LM head, and a holder for bare parameters.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models import parallel
from mstar.models.layers.weights import set_shard


def _part_source(src, rows: int) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """A FusedLinear part's source, (first, checkpoint rows) or (checkpoint rows, pieces), as the
    latter."""
    a, b = src
    if isinstance(b, (tuple, list)):
        return int(a), tuple((int(x), int(y), int(z)) for x, y, z in b)
    return int(b), ((int(a), 0, rows),)


class FusedLinear(nn.Module):
    """One matmul for several checkpoint projections of the same input.

    `shard_names` are the checkpoint modules fused here (relative to the parent module,
    e.g. ("q_proj", "k_proj", "v_proj")), `shard_sizes` their output features, stacked
    along the output dim in that order.
    """

    def __init__(self, in_features: int, shard_names: Sequence[str], shard_sizes: Sequence[int],
                 bias: bool = False, sources: Sequence | None = None):
        """`sources` (tensor parallel): per part, (first row taken, rows of the checkpoint
        tensor): the part holds checkpoint rows [first, first + shard_size); or (rows of the
        checkpoint tensor, pieces): ShardInfo pieces (source row, row in the part, rows), for a
        part gathered from several ranges. None: whole."""
        super().__init__()
        self.shard_names = tuple(shard_names)
        self.shard_sizes = tuple(int(s) for s in shard_sizes)
        # kept as (checkpoint rows, pieces) per part
        self.sources = None if sources is None else tuple(
            _part_source(src, n) for src, n in zip(sources, self.shard_sizes))
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, shards={dict(zip(self.shard_names, self.shard_sizes))}"


class Linear(nn.Module):
    """nn.Linear without the init (weights come from a checkpoint or `init_random`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """Linear whose input features are split over the tensor-parallel ranks: each rank
    multiplies its columns and the partial outputs are summed (one all-reduce), then the
    bias is added. tp = 1: exactly Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        size, rank = parallel.tp_size(), parallel.tp_rank()
        start, local = parallel.block(in_features, rank, size, "the input features of a row-parallel linear")
        super().__init__(local, out_features, bias)
        self.tp_size, self.tp_group = size, parallel.get_tp().group
        self.deferred = False  # defer_reduce()
        if size > 1:
            set_shard(self, "weight", (out_features, in_features), ((start, 0, local),), dim=1)

    def defer_reduce(self) -> None:
        """Return the rank's partial sum: the consumer (an RMSNorm after reduce_input()) sums it."""
        if self.bias is not None:
            raise ValueError("a row-parallel linear with a bias cannot leave its sum to the next norm")
        self.deferred = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        if self.deferred:
            return y
        y = parallel.all_reduce(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class ParallelLMHead(Linear):
    """The untied LM head, split by vocabulary rows like VocabParallelEmbedding (the
    model all-gathers the logits). tp = 1: exactly Linear(hidden, vocab)."""

    def __init__(self, hidden: int, vocab: int):
        size, rank = parallel.tp_size(), parallel.tp_rank()
        start, valid, per = parallel.vocab_block(vocab, rank, size)
        super().__init__(hidden, per if size > 1 else vocab)
        if size > 1:
            set_shard(self, "weight", (vocab, hidden), ((start, 0, valid),),
                      pad_from=valid if valid < per else None)


def fusable_weight(linear: nn.Module) -> torch.Tensor | None:
    """The weight of a product that a fused-linear op (ops/fused_linear.py) may compute in the
    layer's place: a FusedLinear or Linear without a bias (row-parallel: on one rank), else None."""
    if type(linear) not in (FusedLinear, Linear, RowParallelLinear) or linear.bias is not None:
        return None
    if isinstance(linear, RowParallelLinear) and linear.tp_size != 1:
        return None
    return linear.weight


class ParamHolder(nn.Module):
    """A module that only holds `weight` (e.g. a conv weight used through an op)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


