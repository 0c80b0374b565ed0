"""Qwen3.5 presets: the published text-model shapes, and a tiny embedded model (random
weights, the built-in byte tokenizer) for tests and the server's no-argument default.

Where the numbers come from:
  * Qwen3.5: vocab 248320, head_dim 256, 4 KV heads... are transformers'
    `Qwen3_5TextConfig` defaults, which the class documents as the Qwen3.5-9B shape
    (hidden 4096, 32 layers, intermediate 12288, 16 q heads, 4 KV heads, GDN 16 key / 32
    value heads of 128). The other sizes are the published model cards' config.json shapes
    as we know them; every Qwen3.5 model repeats [3 x linear_attention, full_attention]
    (full_attention_interval 4), uses partial_rotary_factor 0.25, rope_theta 1e7 and
    max_position_embeddings 262144. Check: qwen3.5-0.8b comes out at 0.752 B text
    parameters (tests/test_models_loading.py), the published figure.
    Special token ids: transformers' Qwen3_5Config puts vision_start at 248053 and the
    image pad at 248056; Qwen3's tokenizer has <|endoftext|> at vision_start - 9 and
    <|im_end|> at vision_start - 7, hence 248044 / 248046.
"""

from __future__ import annotations

from typing import Any

from mstar.models.presets import TINY_ENDOFTEXT, TINY_IM_END, TINY_VOCAB, Preset

QWEN3_5_VOCAB = 248320
QWEN3_5_EOS = [248046, 248044]  # <|im_end|>, <|endoftext|>


def _qwen3_5(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, lin_k_heads: int,
             lin_v_heads: int, tied: bool, **extra) -> dict[str, Any]:
    cfg = dict(
        vocab_size=QWEN3_5_VOCAB, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
        linear_num_key_heads=lin_k_heads, linear_num_value_heads=lin_v_heads,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        tie_word_embeddings=tied, eos_token_id=list(QWEN3_5_EOS), attention_bias=False,
    )
    cfg.update(extra)
    return cfg


PRESETS: tuple[Preset, ...] = (
    # hidden, layers, intermediate, q heads, kv heads, GDN key heads, GDN value heads, tied
    Preset("qwen3.5-0.8b", "qwen3_5_text", _qwen3_5(1024, 24, 3584, 8, 2, 16, 16, True)),
    Preset("qwen3.5-2b", "qwen3_5_text", _qwen3_5(2048, 24, 6144, 8, 2, 16, 16, True)),
    Preset("qwen3.5-4b", "qwen3_5_text", _qwen3_5(2560, 32, 9216, 16, 4, 16, 32, True)),
    Preset("qwen3.5-9b", "qwen3_5_text", _qwen3_5(4096, 32, 12288, 16, 4, 16, 32, False)),
    Preset("qwen3.5-27b", "qwen3_5_text", _qwen3_5(5120, 64, 17408, 24, 4, 16, 48, False)),
    Preset("tiny-qwen3.5", "qwen3_5_text", dict(
        vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=[TINY_IM_END, TINY_ENDOFTEXT],
        pad_token_id=TINY_ENDOFTEXT, attention_bias=False, initializer_range=0.02),
        embedded=True, init_std=0.25, note="tiny random Qwen3.5 with a byte tokenizer (tests, default)"),
)
