"""Token embeddings (vocab-parallel at tp > 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models import parallel
from mstar.models.layers.weights import set_shard


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """Embedding split over the ranks by vocabulary rows (padded to a multiple of the world
    size): a rank looks up the ids it holds, zeros the others, and the ranks all-reduce.
    The weight doubles as the tied LM head's shard. tp = 1: exactly Embedding."""

    def __init__(self, num_embeddings: int, dim: int):
        size, rank = parallel.tp_size(), parallel.tp_rank()
        start, valid, per = parallel.vocab_block(num_embeddings, rank, size)
        super().__init__(per if size > 1 else num_embeddings, dim)
        self.tp_size, self.tp_group = size, parallel.get_tp().group
        self.vocab_size = num_embeddings
        self.vocab_start, self.vocab_valid = start, valid
        if size > 1:
            set_shard(self, "weight", (num_embeddings, dim), ((start, 0, valid),),
                      pad_from=valid if valid < per else None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_valid)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return parallel.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0), self.tp_group)
