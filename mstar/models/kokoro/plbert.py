"""Kokoro's PL-BERT: an ALBERT encoder (one layer's weights shared by every layer), written on the
op layer over packed tokens: the rows' tokens are concatenated ([T, H], no padding anywhere) and
attention runs per row through ops.dense_attention (non-causal), so no row ever sees another's
tokens or padding.

Parameter names are transformers' AlbertModel's (the release's `bert` state dict), so its weights
load as they are: embeddings.{word,position,token_type}_embeddings, embeddings.LayerNorm,
encoder.embedding_hidden_mapping_in, encoder.albert_layer_groups.0.albert_layers.0.{attention.
{query,key,value,dense,LayerNorm}, ffn, ffn_output, full_layer_layer_norm}. The release's pooler is
not used by Kokoro and is not built.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar import ops


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class Embeddings(nn.Module):
    def __init__(self, vocab: int, dim: int, positions: int, types: int, eps: float):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, dim)
        self.position_embeddings = nn.Embedding(positions, dim)
        self.token_type_embeddings = nn.Embedding(types, dim)
        self.LayerNorm = LayerNorm(dim, eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # every token is of type 0, as the release runs it
        e = self.word_embeddings(ids) + self.token_type_embeddings.weight[0] + self.position_embeddings(positions)
        return self.LayerNorm(e)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.dense = nn.Linear(dim, dim)
        self.LayerNorm = LayerNorm(dim, eps)

    def forward(self, x: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
        T, D = x.shape
        hd = D // self.heads
        q = self.query(x).view(T, self.heads, hd)
        k = self.key(x).view(T, self.heads, hd)
        v = self.value(x).view(T, self.heads, hd)
        o = ops.dense_attention(q, k, v, indptr, indptr, hd ** -0.5, False)
        return self.LayerNorm(x + self.dense(o.reshape(T, D)))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, eps: float, approximate: str):
        super().__init__()
        self.approximate = approximate
        self.attention = Attention(dim, heads, eps)
        self.ffn = nn.Linear(dim, ffn)
        self.ffn_output = nn.Linear(ffn, dim)
        self.full_layer_layer_norm = LayerNorm(dim, eps)

    def forward(self, x: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
        a = self.attention(x, indptr)
        return self.full_layer_layer_norm(a + self.ffn_output(ops.gelu(self.ffn(a), self.approximate)))


class Group(nn.Module):
    def __init__(self, layer: Layer):
        super().__init__()
        self.albert_layers = nn.ModuleList([layer])


class Encoder(nn.Module):
    def __init__(self, emb: int, dim: int, layer: Layer, num_layers: int):
        super().__init__()
        self.num_layers = num_layers
        self.embedding_hidden_mapping_in = nn.Linear(emb, dim)
        self.albert_layer_groups = nn.ModuleList([Group(layer)])

    def forward(self, x: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
        x = self.embedding_hidden_mapping_in(x)
        layer = self.albert_layer_groups[0].albert_layers[0]
        for _ in range(self.num_layers):
            x = layer(x, indptr)
        return x


class PLBert(nn.Module):
    def __init__(self, vocab_size: int, plbert: dict):
        super().__init__()
        eps = float(plbert["layer_norm_eps"])
        dim, emb = int(plbert["hidden_size"]), int(plbert["embedding_size"])
        self.hidden_size = dim
        self.max_positions = int(plbert["max_position_embeddings"])
        self.embeddings = Embeddings(vocab_size, emb, self.max_positions, int(plbert["type_vocab_size"]), eps)
        approximate = "tanh" if plbert["hidden_act"] == "gelu_new" else "none"
        layer = Layer(dim, int(plbert["num_attention_heads"]), int(plbert["intermediate_size"]), eps, approximate)
        self.encoder = Encoder(emb, dim, layer, int(plbert["num_hidden_layers"]))

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """ids [T] (the rows' token ids back to back), lengths [B] (host) -> [T, hidden_size]."""
        if int(lengths.max()) > self.max_positions:
            raise ValueError(f"PL-BERT: a row of {int(lengths.max())} tokens is past its {self.max_positions} positions")
        starts = torch.cumsum(lengths, 0) - lengths
        positions = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
        indptr = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
        x = self.embeddings(ids, positions.to(ids.device))
        return self.encoder(x, indptr)


__all__ = ["PLBert"]
