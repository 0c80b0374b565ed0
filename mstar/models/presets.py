"""Named model configurations: the published Qwen3.5 / Qwen3 text-model shapes, and two
tiny embedded models (random weights, built-in byte tokenizer) for tests and the server's
no-argument default.

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
  * Qwen3 (dense): the Qwen3 model cards' config.json (vocab 151936, head_dim 128,
    rope_theta 1e6, max_position_embeddings 40960, <|endoftext|> 151643, <|im_end|> 151645).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN3_5_VOCAB = 248320
QWEN3_5_EOS = [248046, 248044]  # <|im_end|>, <|endoftext|>
QWEN3_VOCAB = 151936
QWEN3_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>

# ids of the embedded byte tokenizer (tokenizer.py): 256 bytes, then the specials
TINY_VOCAB = 259
TINY_ENDOFTEXT, TINY_IM_START, TINY_IM_END = 256, 257, 258


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str  # "qwen3_5_text" | "qwen3"
    config: dict[str, Any]
    embedded: bool = False  # tiny built-in model: random weights + byte tokenizer
    init_std: float | None = None  # random-init std (None: config.initializer_range)
    note: str = ""


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


def _qwen3(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, tied: bool) -> dict[str, Any]:
    return dict(
        vocab_size=QWEN3_VOCAB, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, hidden_act="silu",
        rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=tied, bos_token_id=151643, eos_token_id=list(QWEN3_EOS), attention_bias=False,
    )


PRESETS: dict[str, Preset] = {p.name: p for p in [
    # hidden, layers, intermediate, q heads, kv heads, GDN key heads, GDN value heads, tied
    Preset("qwen3.5-0.8b", "qwen3_5_text", _qwen3_5(1024, 24, 3584, 8, 2, 16, 16, True)),
    Preset("qwen3.5-2b", "qwen3_5_text", _qwen3_5(2048, 24, 6144, 8, 2, 16, 16, True)),
    Preset("qwen3.5-4b", "qwen3_5_text", _qwen3_5(2560, 32, 9216, 16, 4, 16, 32, True)),
    Preset("qwen3.5-9b", "qwen3_5_text", _qwen3_5(4096, 32, 12288, 16, 4, 16, 32, False)),
    Preset("qwen3.5-27b", "qwen3_5_text", _qwen3_5(5120, 64, 17408, 24, 4, 16, 48, False)),
    Preset("qwen3-0.6b", "qwen3", _qwen3(1024, 28, 3072, 16, 8, True)),
    Preset("qwen3-1.7b", "qwen3", _qwen3(2048, 28, 6144, 16, 8, True)),
    Preset("qwen3-4b", "qwen3", _qwen3(2560, 36, 9728, 32, 8, True)),
    Preset("qwen3-8b", "qwen3", _qwen3(4096, 36, 12288, 32, 8, False)),
    # Tiny embedded models. head dims of 64 keep them inside GPU kernels' supported shapes.
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
    Preset("tiny-qwen3", "qwen3", dict(
        vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=[TINY_IM_END, TINY_ENDOFTEXT],
        pad_token_id=TINY_ENDOFTEXT, attention_bias=False, initializer_range=0.02),
        embedded=True, init_std=0.25, note="tiny random Qwen3 with a byte tokenizer (tests)"),
]}

DEFAULT_MODEL = "tiny-qwen3.5"


def get(name: str) -> Preset | None:
    return PRESETS.get(name.lower())


def names() -> list[str]:
    return list(PRESETS)


def make_config(preset: Preset):
    """The transformers text config of a preset."""
    if preset.model_type == "whisper":
        return _whisper_presets.make_config(preset)
    from transformers import Qwen3_5TextConfig, Qwen3Config
    cls = {"qwen3_5_text": Qwen3_5TextConfig, "qwen3": Qwen3Config}[preset.model_type]
    return cls(**preset.config)


# Whisper presets (whisper_presets.py): registered last (it imports Preset from here)
from mstar.models import whisper_presets as _whisper_presets  # noqa: E402

_whisper_presets.register(PRESETS)
