"""Llama presets: the published config.json shapes of Llama 3.2 1B / 3B and Llama 3.1 8B
(vocab 128256, rms_norm_eps 1e-5, rope_theta 5e5 with llama3 scaling from an 8192-token
pretraining context, max_position_embeddings 131072, <|begin_of_text|> 128000; eos ids of the
Instruct cards: <|end_of_text|> 128001, <|eom_id|> 128008, <|eot_id|> 128009), and a tiny
embedded model for tests. (Orpheus TTS, a Llama 3.2 3B with audio tokens: mstar/models/orpheus.)
"""

from __future__ import annotations

from typing import Any

from mstar.models.presets import TINY_ENDOFTEXT, TINY_IM_END, TINY_VOCAB, Preset

LLAMA3_VOCAB = 128256
LLAMA3_BOS = 128000
LLAMA3_EOS = [128001, 128008, 128009]


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_config(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, tied: bool,
            rope_factor: float, vocab: int = LLAMA3_VOCAB, eos: list[int] = LLAMA3_EOS) -> dict[str, Any]:
    return dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_act="silu",
        rms_norm_eps=1e-5, max_position_embeddings=131072, rope_parameters=_llama3_rope(rope_factor),
        tie_word_embeddings=tied, bos_token_id=LLAMA3_BOS, eos_token_id=list(eos), attention_bias=False,
        mlp_bias=False,
    )


PRESETS: tuple[Preset, ...] = (
    Preset("llama-3.2-1b", "llama", llama3_config(2048, 16, 8192, 32, 8, 64, True, 32.0)),
    Preset("llama-3.2-3b", "llama", llama3_config(3072, 28, 8192, 24, 8, 128, True, 32.0)),
    Preset("llama-3.1-8b", "llama", llama3_config(4096, 32, 14336, 32, 8, 128, False, 8.0)),
    # llama3 scaling with a 64-token "pretraining context": at head_dim 16 its frequencies fall in
    # all three bands (kept, blended, divided), so the embedded model exercises the scaling
    Preset("tiny-llama", "llama", dict(
        vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu", rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=[TINY_IM_END, TINY_ENDOFTEXT],
        pad_token_id=TINY_ENDOFTEXT, attention_bias=False, mlp_bias=False, initializer_range=0.02),
        embedded=True, init_std=0.25,
        note="tiny random Llama (llama3 RoPE, untied head) with a byte tokenizer (tests)"),
)
