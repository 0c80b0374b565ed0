"""Reading a Qwen3-TTS 12 Hz model directory, as the release publishes it, into a Talker.

    <dir>/config.json                        Qwen3TTSConfig (config.py)
    <dir>/generation_config.json             the sampling defaults (generate.GenerationParams)
    <dir>/model.safetensors                  the weights, or sharded with model.safetensors.index.json
    <dir>/tokenizer files                    the text tokenizer (a Qwen2 BPE tokenizer)
    <dir>/speech_tokenizer/                  the codec (codec*.py), not read here

Tensor names are the checkpoint's under `talker.`; the code predictor's per-codebook tables
(`code_predictor.model.codec_embedding.{i}`, `code_predictor.lm_head.{i}`) fill the rows of its
stacked parameters. `speaker_encoder.*` (the Base models' x-vector encoder for voice cloning) is not
read. Every parameter must be there with its shape, and a tensor that fits none is an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

from mstar.models.base import allocate_meta
from mstar.models.layers import RMSNorm, WeightSlot, weight_map
from mstar.models.loader import iter_checkpoint
from mstar.models.qwen3_tts.config import Qwen3TTSConfig, read_config, read_generation_config
from mstar.models.qwen3_tts.talker import Talker

SKIPPED_PREFIXES = ("speaker_encoder.",)
_TABLE = re.compile(r"code_predictor\.(model\.codec_embedding|lm_head)\.(\d+)\.weight$")


@dataclass
class Qwen3TTSLanguageModel:
    """A loaded model directory: its config, the talker (with its code predictor), the sampling
    defaults of generation_config.json, and the directory (for the tokenizer and the codec)."""
    config: Qwen3TTSConfig
    talker: Talker
    generation_config: dict = field(default_factory=dict)
    path: str | None = None


def expected_weights(talker: Talker) -> dict[str, WeightSlot]:
    """{checkpoint name: where it goes} for every tensor the checkpoint must hold."""
    out = {f"talker.{k}": v for k, v in weight_map(talker).items()
           if not k.startswith("code_predictor.codec_embeddings") and not k.startswith("code_predictor.lm_heads")}
    cp = talker.code_predictor
    for i in range(cp.num_code_groups - 1):
        out[f"talker.code_predictor.model.codec_embedding.{i}.weight"] = WeightSlot(cp.codec_embeddings, i, 1)
        out[f"talker.code_predictor.lm_head.{i}.weight"] = WeightSlot(cp.lm_heads, i, 1)
    return out


def _source(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The checkpoint tensor in its slot's layout (a stacked table's row i takes [1, ...])."""
    return tensor.unsqueeze(0) if _TABLE.search(name) else tensor


def load_state(talker: Talker, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy the checkpoint's tensors into `talker` (converted to its dtype and device), checked
    name by name and shape by shape."""
    expected = expected_weights(talker)
    loaded: set[str] = set()
    unexpected = []
    with torch.no_grad():
        for name, t in tensors:
            if name.startswith(SKIPPED_PREFIXES):
                continue
            slot = expected.get(name)
            if slot is None:
                unexpected.append(name)
                continue
            src = _source(name, t)
            if tuple(src.shape) != tuple(slot.shape):
                raise ValueError(f"qwen3-tts checkpoint: {name} is {tuple(t.shape)}, the config makes "
                                 f"{tuple(slot.shape)}")
            slot.load(src)
            loaded.add(name)
    if unexpected:
        raise ValueError(f"qwen3-tts checkpoint: {len(unexpected)} tensors no parameter takes: {unexpected[:6]}")
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"qwen3-tts checkpoint: lacks {len(missing)} tensors: {missing[:6]}")


def build_talker(config: Qwen3TTSConfig, device="cpu", dtype: torch.dtype = torch.float32) -> Talker:
    """The talker and its code predictor with uninitialised storage on `device` in `dtype`."""
    with torch.device("meta"):
        talker = Talker(config.talker).to(dtype)
    allocate_meta(talker, device)
    talker.rope.rebuild(device)
    talker.code_predictor.rope.rebuild(device)
    return talker.eval()


def init_random(talker: Talker, seed: int = 0, std: float = 0.02) -> None:
    """Random weights (benchmarks, tests): norms at one, biases zero, the rest N(0, std)."""
    gen = torch.Generator(device=talker.codec_head.weight.device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for module in talker.modules():
            for pname, p in module.named_parameters(recurse=False):
                if isinstance(module, RMSNorm):
                    p.fill_(1.0)
                elif pname.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)


def load_model(path: str, device="cpu", dtype: torch.dtype = torch.float32) -> Qwen3TTSLanguageModel:
    """A model directory -> its config, talker (weights loaded) and sampling defaults."""
    config = read_config(path)
    talker = build_talker(config, device, dtype)
    load_state(talker, iter_checkpoint(path, device=device, progress=False, skip_prefixes=SKIPPED_PREFIXES))
    return Qwen3TTSLanguageModel(config, talker, read_generation_config(path), path)
