"""Qwen3 (dense) presets: the Qwen3 model cards' config.json (vocab 151936, head_dim 128,
rope_theta 1e6, max_position_embeddings 40960, <|endoftext|> 151643, <|im_end|> 151645), and a
tiny embedded model for tests.
"""

from __future__ import annotations

from typing import Any

from mstar.models.presets import TINY_ENDOFTEXT, TINY_IM_END, TINY_VOCAB, Preset

QWEN3_VOCAB = 151936
QWEN3_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>


def _qwen3(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, tied: bool) -> dict[str, Any]:
    return dict(
        vocab_size=QWEN3_VOCAB, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, hidden_act="silu",
        rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=tied, bos_token_id=151643, eos_token_id=list(QWEN3_EOS), attention_bias=False,
    )


PRESETS: tuple[Preset, ...] = (
    Preset("qwen3-0.6b", "qwen3", _qwen3(1024, 28, 3072, 16, 8, True)),
    Preset("qwen3-1.7b", "qwen3", _qwen3(2048, 28, 6144, 16, 8, True)),
    Preset("qwen3-4b", "qwen3", _qwen3(2560, 36, 9728, 32, 8, True)),
    Preset("qwen3-8b", "qwen3", _qwen3(4096, 36, 12288, 32, 8, False)),
    Preset("tiny-qwen3", "qwen3", dict(
        vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=[TINY_IM_END, TINY_ENDOFTEXT],
        pad_token_id=TINY_ENDOFTEXT, attention_bias=False, initializer_range=0.02),
        embedded=True, init_std=0.25, note="tiny random Qwen3 with a byte tokenizer (tests)"),
)
