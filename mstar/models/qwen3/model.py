"""Qwen3 (dense): what transformers' `Qwen3ForCausalLM` computes, on mstar.ops.

Pre-norm decoder; plain RMSNorm (weight w); attention with per-head q/k RMSNorm, full
NeoX RoPE, GQA; SwiGLU MLP; tied or untied LM head. Sliding-window layers are not
supported (no released Qwen3 dense checkpoint uses them).
"""

from __future__ import annotations

from mstar.models.base import DecoderLayer, DecoderLM, TextModel
from mstar.models.layers import GatedMLP, QKNormAttention, rope_settings


class Qwen3ForCausalLM(DecoderLM):
    zero_centered_norm = False
    reads_device_loopback = True  # decode graphs may gather input ids / positions on the device

    def __init__(self, config):
        super().__init__(config)
        c = config
        if getattr(c, "use_sliding_window", False) and getattr(c, "sliding_window", None):
            raise ValueError("Qwen3 with sliding-window attention is not supported")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta, factor = rope_settings(c)
        layers = [
            DecoderLayer("self_attn", QKNormAttention(
                hidden=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                head_dim=head_dim, eps=c.rms_norm_eps, zero_centered_norm=False, output_gate=False,
                bias=bool(getattr(c, "attention_bias", False))),
                GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act),
                c.hidden_size, c.rms_norm_eps, zero_centered=False)
            for _ in range(c.num_hidden_layers)
        ]
        self.model = TextModel(c.vocab_size, c.hidden_size, layers, c.rms_norm_eps, zero_centered=False)
        self._finish_init(int(head_dim * factor), theta)
