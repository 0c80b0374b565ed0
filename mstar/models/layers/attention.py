"""Paged causal attention (decode rows, then prefill rows) and the QK-norm attention layer.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar import ops
from mstar.models import parallel
from mstar.models.context import AttentionLayerSpec, ForwardContext
from mstar.models.layers.linear import FusedLinear, RowParallelLinear, fusable_weight
from mstar.models.layers.norm import RMSNorm
from mstar.models.layers.rotary import RotaryCache


def paged_attention(ctx: ForwardContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend: [T, Hq, D] -> [T, Hq, D]."""
    ops.kv_append(k, v, k_cache, v_cache, ctx.attn.slot_mapping)
    return attend_paged(ctx, q, k_cache, v_cache, scale)


def attend_paged(ctx: ForwardContext, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the paged cache, which holds this step's K/V already."""
    md = ctx.attn
    nd = ctx.num_decode_tokens
    t = q.shape[0]
    parts = []
    if nd > 0:
        parts.append(ops.paged_attention_decode(q[:nd], k_cache, v_cache, md.decode_kv_indptr,
                                                md.decode_kv_indices, md.decode_kv_last_page_len, scale))
    if t > nd:
        parts.append(ops.paged_attention_prefill(q[nd:], k_cache, v_cache, md.prefill_qo_indptr,
                                                 md.prefill_kv_indptr, md.prefill_kv_indices,
                                                 md.prefill_kv_last_page_len, scale))
    if not parts:
        return q.new_empty(q.shape)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


class QKNormAttention(nn.Module):
    """Full causal attention with per-head q/k RMSNorm, (partial) NeoX RoPE and GQA over a
    paged KV cache (Qwen3, Qwen3.5). `output_gate`: q_proj also yields a per-head gate
    (checkpoint layout per head: [query D | gate D]) applied as sigmoid before o_proj."""

    def __init__(self, *, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 zero_centered_norm: bool, output_gate: bool, bias: bool = False):
        super().__init__()
        size, rank = parallel.tp_size(), parallel.tp_rank()
        # tensor parallel: this rank's query heads and the KV heads they read
        q_start, self.num_heads = parallel.block(num_heads, rank, size, "num_attention_heads")
        kv_start, self.num_kv_heads = parallel.kv_heads(num_kv_heads, rank, size)
        self.head_dim = head_dim
        self.output_gate = output_gate
        per_head = head_dim * (2 if output_gate else 1)
        q_rows = self.num_heads * per_head
        kv_rows = self.num_kv_heads * head_dim
        sources = None if size == 1 else ((q_start * per_head, num_heads * per_head),
                                          (kv_start * head_dim, num_kv_heads * head_dim),
                                          (kv_start * head_dim, num_kv_heads * head_dim))
        self.qkv_proj = FusedLinear(hidden, ("q_proj", "k_proj", "v_proj"), (q_rows, kv_rows, kv_rows), bias,
                                    sources=sources)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias)
        self.q_norm = RMSNorm(head_dim, eps, zero_centered_norm)
        self.k_norm = RMSNorm(head_dim, eps, zero_centered_norm)
        self.scale = head_dim ** -0.5
        self.attn_index = -1  # index among the model's attention layers (set by the model)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def spec(self) -> AttentionLayerSpec:
        return AttentionLayerSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, num_q_heads=self.num_heads,
                                  scale=self.scale)

    # The forward in three parts (runtime/graphs/prefill_graphs.py captures pre and post, row-wise, in
    # CUDA graphs at padded token counts and runs core, which reads the step's metadata, eagerly).
    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.split_projection(self.qkv_proj(x))

    def input_projection(self) -> FusedLinear:
        return self.qkv_proj

    def split_projection(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """pre's outputs from the input projection's."""
        return (qkv,)

    def _attend(self, ctx: ForwardContext, qkv: torch.Tensor, rope: RotaryCache) -> torch.Tensor:
        """The attention's output [T, Hq, D] before its output gate."""
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        # q/k head norms, rotary and the K/V append in one op (one Triton kernel on CUDA)
        q = ops.qk_norm_rope_append(qkv, ctx.positions, self.q_norm.weight, self.k_norm.weight, rope.cos_sin_cache,
                                    hq, hk, d, rope.rotary_dim, self.q_norm.eps, self.q_norm.zero_centered,
                                    self.output_gate, self.k_cache, self.v_cache, ctx.attn.slot_mapping)
        return attend_paged(ctx, q, self.k_cache, self.v_cache, self.scale)

    def _gate(self, qkv: torch.Tensor) -> torch.Tensor:
        """The output gate [T, Hq, D], read in place from the projection."""
        return ops.split_qkv_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim, True)[3]

    def core(self, ctx: ForwardContext, pre: tuple[torch.Tensor, ...], rope: RotaryCache) -> torch.Tensor:
        qkv, = pre
        o = self._attend(ctx, qkv, rope)
        if self.output_gate:
            o = ops.sigmoid_mul(o, self._gate(qkv))
        return o.reshape(qkv.shape[0], self.num_heads * self.head_dim)

    def post(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o)

    def core_post(self, ctx: ForwardContext, pre: tuple[torch.Tensor, ...], rope: RotaryCache) -> torch.Tensor:
        """post(core(...)), the output gate and o_proj one op where they can be."""
        weight = fusable_weight(self.o_proj)
        if not self.output_gate or weight is None:
            return self.post(self.core(ctx, pre, rope))
        qkv, = pre
        return ops.sigmoid_mul_linear(self._attend(ctx, qkv, rope), self._gate(qkv), weight)

    def output_projection(self) -> RowParallelLinear:
        return self.o_proj

    def core_width(self) -> int:
        """Features per token of core's output (what post reads)."""
        return self.num_heads * self.head_dim

    def forward(self, ctx: ForwardContext, x: torch.Tensor, rope: RotaryCache) -> torch.Tensor:
        return self.post(self.core(ctx, self.pre(x), rope))
