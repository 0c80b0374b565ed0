"""Llama 3.x: what transformers' `LlamaForCausalLM` computes, on mstar.ops.

Qwen3's decoder without the per-head q/k RMSNorm: pre-norm, plain RMSNorm (weight w), GQA
attention with full NeoX RoPE (default, or rope_type "llama3" frequency scaling), SwiGLU MLP,
tied or untied LM head; biases on the attention projections (attention_bias) and on the MLP
projections (mlp_bias) where the config asks for them.
"""

from __future__ import annotations

import torch

from mstar import ops
from mstar.models.base import DecoderLayer, DecoderLM, TextModel
from mstar.models.context import ForwardContext
from mstar.models.layers import (FusedLinear, GatedMLP, QKNormAttention, RotaryCache, RowParallelLinear,
                                 paged_attention, rope_settings)
from mstar.models.layers.rotary import rope_scaling


class RopeAttention(QKNormAttention):
    """QKNormAttention without the head norms: rotary straight on the fused projection's q and k.
    A subclass, so that the decoder, the cache binding and the prefill segments treat it as the
    attention layer it is (tensor-parallel head split, pre / core / post)."""

    def __init__(self, *, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool):
        super().__init__(hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         eps=0.0, zero_centered_norm=False, output_gate=False, bias=bias)
        del self.q_norm, self.k_norm  # not in the checkpoint: the loader must not expect them

    def core(self, ctx: ForwardContext, pre: tuple[torch.Tensor, ...], rope: RotaryCache) -> torch.Tensor:
        qkv, = pre
        t = qkv.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v, _ = ops.split_qkv_heads(qkv, hq, hk, d, False)
        q, k = ops.rotary_embedding(ctx.positions, q, k, rope.cos_sin_cache, rope.rotary_dim)
        o = paged_attention(ctx, q, k, v, self.k_cache, self.v_cache, self.scale)
        return o.reshape(t, hq * d)


def _mlp(c) -> GatedMLP:
    mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)
    if getattr(c, "mlp_bias", False):  # the same layers with a bias (same tensor-parallel split)
        g = mlp.gate_up_proj
        mlp.gate_up_proj = FusedLinear(c.hidden_size, g.shard_names, g.shard_sizes, True, sources=g.sources)
        mlp.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, True)
    return mlp


class LlamaForCausalLM(DecoderLM):
    zero_centered_norm = False
    reads_device_loopback = True  # decode graphs may gather input ids / positions on the device

    def __init__(self, config):
        super().__init__(config)
        c = config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta, factor = rope_settings(c, supported=("default", "llama3"))
        if factor != 1.0:  # transformers' Llama rotates whole heads
            raise ValueError(f"Llama with partial_rotary_factor {factor} is not supported")
        bias = bool(getattr(c, "attention_bias", False))
        layers = [
            DecoderLayer("self_attn", RopeAttention(
                hidden=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                head_dim=head_dim, bias=bias), _mlp(c), c.hidden_size, c.rms_norm_eps, zero_centered=False)
            for _ in range(c.num_hidden_layers)
        ]
        self.model = TextModel(c.vocab_size, c.hidden_size, layers, c.rms_norm_eps, zero_centered=False)
        self._finish_init(head_dim, theta)
        # the base class builds a default-rope table; llama3 checkpoints scale its frequencies
        self.rope = RotaryCache(c.max_position_embeddings, head_dim, theta, rope_scaling(c))
