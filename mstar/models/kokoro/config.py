"""Kokoro's configuration: the release's config.json read into one record, checked once.

The release's config.json (hexgrad/Kokoro-82M) has no `model_type`; the fields read here:

    vocab                      phoneme (one character) -> token id; id 0 pads and bounds a sequence
    n_token                    embedding rows of the PL-BERT and the text encoder (178)
    hidden_dim                 width of the text encoder, the prosody predictor and the decoder input
    style_dim                  half a voice row: ref_s[:style_dim] conditions the decoder,
                               ref_s[style_dim:] the prosody predictor
    n_layer                    CNN blocks of the text encoder, LSTM + AdaLayerNorm pairs of the
                               duration encoder
    max_dur                    duration logits per phoneme (frames = round(sum(sigmoid(logits))))
    text_encoder_kernel_size   the text encoder's conv kernel
    plbert                     ALBERT: hidden_size, num_attention_heads, intermediate_size,
                               max_position_embeddings, num_hidden_layers (+ AlbertConfig's
                               defaults: embedding_size 128, layer_norm_eps 1e-12, gelu_new)
    istftnet                   the generator: upsample_rates, upsample_kernel_sizes,
                               upsample_initial_channel, resblock_kernel_sizes,
                               resblock_dilation_sizes, gen_istft_n_fft, gen_istft_hop_size

Ignored (present in the release, unused at inference): dim_in, dropout, max_conv_dim,
multispeaker, n_mels. Two widths the release hard-codes in its decoder are fields here with the
release's values as defaults, so that a tiny test model can shrink them: decoder_dim (1024, the
decoder's AdaIN res-block width) and decoder_res_dim (64, the text features re-injected into it).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

MODEL_TYPE = "kokoro"
SAMPLE_RATE = 24000  # the release's generator builds its harmonic source at 24 kHz
VOICE_ROWS = 510  # a voice table has one style row per phoneme count 1..510

_PLBERT_DEFAULTS = {"embedding_size": 128, "layer_norm_eps": 1e-12, "type_vocab_size": 2, "hidden_act": "gelu_new",
                    "num_hidden_groups": 1, "inner_group_num": 1}
_PLBERT_REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "max_position_embeddings",
                    "num_hidden_layers")
_ISTFT_REQUIRED = ("upsample_rates", "upsample_kernel_sizes", "upsample_initial_channel", "resblock_kernel_sizes",
                   "resblock_dilation_sizes", "gen_istft_n_fft", "gen_istft_hop_size")
_REQUIRED = ("vocab", "n_token", "hidden_dim", "style_dim", "n_layer", "max_dur", "plbert", "istftnet")


@dataclass
class KokoroConfig:
    vocab: dict[str, int]
    n_token: int
    hidden_dim: int
    style_dim: int
    n_layer: int
    max_dur: int
    plbert: dict[str, Any]
    istftnet: dict[str, Any]
    text_encoder_kernel_size: int = 5
    decoder_dim: int = 1024
    decoder_res_dim: int = 64
    sample_rate: int = SAMPLE_RATE
    model_type: str = MODEL_TYPE
    extra: dict[str, Any] = field(default_factory=dict)  # the fields read and not used, kept for to_dict

    @classmethod
    def from_dict(cls, raw: dict) -> "KokoroConfig":
        raw = copy.deepcopy(dict(raw))
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ValueError(f"kokoro config: missing {', '.join(missing)} (the release's config.json has them all; "
                             "the vocab must be in it: the kokoro package ships none)")
        plbert = {**_PLBERT_DEFAULTS, **raw.pop("plbert")}
        istft = dict(raw.pop("istftnet"))
        for what, d, req in (("plbert", plbert, _PLBERT_REQUIRED), ("istftnet", istft, _ISTFT_REQUIRED)):
            lost = [k for k in req if k not in d]
            if lost:
                raise ValueError(f"kokoro config: {what} lacks {', '.join(lost)}")
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra", "plbert", "istftnet")}
        kw = {k: raw.pop(k) for k in list(raw) if k in known}
        cfg = cls(plbert=plbert, istftnet=istft, extra=raw, **kw)
        cfg.check()
        return cfg

    def to_dict(self) -> dict:
        """The release's layout (plus the mstar fields that differ from their defaults)."""
        d = {**copy.deepcopy(self.extra), "vocab": dict(self.vocab), "n_token": self.n_token,
             "hidden_dim": self.hidden_dim, "style_dim": self.style_dim, "n_layer": self.n_layer,
             "max_dur": self.max_dur, "text_encoder_kernel_size": self.text_encoder_kernel_size,
             "plbert": {k: v for k, v in self.plbert.items() if _PLBERT_DEFAULTS.get(k, object()) != v},
             "istftnet": copy.deepcopy(self.istftnet)}
        for k, default in (("decoder_dim", 1024), ("decoder_res_dim", 64), ("sample_rate", SAMPLE_RATE)):
            if getattr(self, k) != default:
                d[k] = getattr(self, k)
        return d

    def check(self) -> None:
        bad = [p for p, i in self.vocab.items() if len(p) != 1 or not 0 < int(i) < self.n_token]
        if bad:
            raise ValueError(f"kokoro config: vocab entries must be single characters with ids in [1, n_token): "
                             f"{bad[:8]}")
        if self.hidden_dim % 2:
            raise ValueError("kokoro config: hidden_dim must be even (bidirectional LSTMs of hidden_dim // 2)")
        pb = self.plbert
        if pb["hidden_size"] % pb["num_attention_heads"]:
            raise ValueError("kokoro config: plbert hidden_size must be a multiple of num_attention_heads")
        if pb["num_hidden_groups"] != 1 or pb["inner_group_num"] != 1:
            raise ValueError("kokoro config: only one shared ALBERT layer (num_hidden_groups = inner_group_num = 1)")
        if pb["hidden_act"] not in ("gelu_new", "gelu"):
            raise ValueError(f"kokoro config: plbert hidden_act {pb['hidden_act']!r} (gelu_new or gelu)")
        ist = self.istftnet
        if len(ist["upsample_rates"]) != len(ist["upsample_kernel_sizes"]) or not ist["upsample_rates"]:
            raise ValueError("kokoro config: istftnet upsample_rates and upsample_kernel_sizes must pair up")
        if len(ist["resblock_kernel_sizes"]) != len(ist["resblock_dilation_sizes"]):
            raise ValueError("kokoro config: istftnet resblock_kernel_sizes and resblock_dilation_sizes must pair up")
        if ist["gen_istft_n_fft"] % 2:
            raise ValueError("kokoro config: gen_istft_n_fft must be even")
        if self.upsample_initial_channel >> len(ist["upsample_rates"]) < 1:
            raise ValueError("kokoro config: upsample_initial_channel halves per upsampling; too small")

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def upsample_initial_channel(self) -> int:
        return int(self.istftnet["upsample_initial_channel"])

    @property
    def samples_per_frame(self) -> int:
        """Output samples per predicted duration frame: the F0 curve runs at twice the frame rate,
        the generator upsamples it by prod(upsample_rates) and the iSTFT by its hop."""
        return 2 * self.source_upsample

    @property
    def source_upsample(self) -> int:
        """Samples of the harmonic source per F0 value."""
        return math.prod(self.istftnet["upsample_rates"]) * int(self.istftnet["gen_istft_hop_size"])

    @property
    def context_length(self) -> int:
        """Token ids one forward takes (the two boundary pads included): ALBERT's positions."""
        return int(self.plbert["max_position_embeddings"])

    @property
    def max_phonemes(self) -> int:
        return min(self.context_length - 2, VOICE_ROWS)


__all__ = ["KokoroConfig", "MODEL_TYPE", "SAMPLE_RATE", "VOICE_ROWS"]
