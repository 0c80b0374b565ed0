"""Loading the Qwen3-TTS 12 Hz codec's decoder from a `speech_tokenizer/` directory (config.json
and model.safetensors of the whole tokenizer, encoder and decoder; or a sharded
model.safetensors.index.json). Only the `decoder.*` tensors are read, and of those not the
quantizer's input projections (the encode side).

Tensors the decoder builds from the checkpoint's:
    quantizer.codebooks [Q, size, dim]   codebook k = embedding_sum / cluster_usage.clamp(min=1e-5)
                                         (the release's EuclideanCodebook.decode, computed once)
                                         of rvq_first's codebook 0, then rvq_rest's 0..Q-2
    quantizer.first_proj / rest_proj     rvq_first / rvq_rest.output_proj (1x1 convs -> linear)
    ...self_attn.qkv_proj                q_proj, k_proj, v_proj stacked (rows in that order)
    ...mlp.gate_up_proj                  gate_proj, up_proj stacked
Every other decoder tensor loads under its own name.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from mstar.models.qwen3_tts.codec import Qwen3TTSCodecDecoder
from mstar.models.qwen3_tts.codec_config import Qwen3TTSCodecConfig, read_codec_config

_PREFIX = "decoder."
_CLUSTER_EPS = 1e-5  # the release's EuclideanCodebook epsilon


def _pop(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise KeyError(f"Qwen3-TTS codec checkpoint: {_PREFIX}{key} missing")
    return state.pop(key)


def codec_state_dict(state: dict[str, torch.Tensor], config: Qwen3TTSCodecConfig) -> dict[str, torch.Tensor]:
    """The decoder's state dict from the checkpoint's tensors (names without the `decoder.`
    prefix; other keys are left out): codebooks divided out, projections squeezed, q/k/v and
    gate/up stacked. Raises on a missing tensor."""
    state = {k: v for k, v in state.items() if ".input_proj." not in k or not k.startswith("quantizer.")}
    books = []
    for rvq, idx in [("rvq_first", 0)] + [("rvq_rest", i) for i in range(config.num_quantizers - 1)]:
        base = f"quantizer.{rvq}.vq.layers.{idx}._codebook."
        usage = _pop(state, base + "cluster_usage")
        books.append(_pop(state, base + "embedding_sum") / usage.clamp(min=_CLUSTER_EPS)[:, None])
    out = {"quantizer.codebooks": torch.stack(books),
           "quantizer.first_proj.weight": _pop(state, "quantizer.rvq_first.output_proj.weight")[..., 0],
           "quantizer.rest_proj.weight": _pop(state, "quantizer.rvq_rest.output_proj.weight")[..., 0]}
    for i in range(config.num_hidden_layers):
        layer = f"pre_transformer.layers.{i}."
        attn = layer + "self_attn."
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            out[f"{attn}qkv_proj.{kind}"] = torch.cat([_pop(state, f"{attn}{p}_proj.{kind}") for p in "qkv"])
        out[f"{layer}mlp.gate_up_proj.weight"] = torch.cat([_pop(state, f"{layer}mlp.gate_proj.weight"),
                                                            _pop(state, f"{layer}mlp.up_proj.weight")])
    out.update(state)
    return out


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"Qwen3-TTS codec: no model.safetensors in {path!r}")
    return [single]


def read_decoder_tensors(path: str) -> dict[str, torch.Tensor]:
    """The `decoder.*` tensors of a speech_tokenizer directory, prefix removed, on the CPU (the
    encoder's tensors are not read)."""
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.startswith(_PREFIX):
                    state[key[len(_PREFIX):]] = f.get_tensor(key)
    return state


def load_codec_decoder(path: str, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> Qwen3TTSCodecDecoder:
    """The decoder of a speech_tokenizer directory (a Qwen3-TTS model's `speech_tokenizer/`) in
    eval mode. Every decoder parameter must be in the checkpoint, and every decoder tensor of
    the checkpoint must be used (the quantizer's input projections aside)."""
    config = read_codec_config(path)
    state = codec_state_dict(read_decoder_tensors(path), config)
    model = Qwen3TTSCodecDecoder(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"Qwen3-TTS codec checkpoint {path!r}: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    return model.to(device=device, dtype=dtype).eval()


def build_codec_decoder(config: Qwen3TTSCodecConfig | dict, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", seed: int | None = None) -> Qwen3TTSCodecDecoder:
    """A decoder of random weights (seeded when `seed` is given) in eval mode (benchmarks)."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = Qwen3TTSCodecDecoder(config)
    return model.to(device=device, dtype=dtype).eval()
