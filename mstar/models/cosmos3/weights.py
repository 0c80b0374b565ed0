"""Reading a diffusers transformer/ directory (Cosmos3OmniTransformer.save_pretrained, the
nvidia/Cosmos3-Edge layout) into a Cosmos3Transformer.

    <dir>/config.json                                      Cosmos3TransformerConfig (config.py)
    <dir>/diffusion_pytorch_model.safetensors              the weights, or sharded (an index.json)

Names are diffusers' as they are. Every parameter must be there with its shape. Tensors of what
text-to-image and text-to-video do not run are read past: lm_head (the text head), norm (the
understanding tower's final norm, which only lm_head reads), the action heads (action_proj_in,
action_proj_out, action_modality_embed) and the sound heads (audio_*); any other name that maps
to no parameter is an error. The tensors keep their stored dtype until `to_dtype`, which keeps
time_embedder in float32 as diffusers does.
"""

from __future__ import annotations

import torch

from mstar.models.cosmos3.config import Cosmos3TransformerConfig
from mstar.models.cosmos3.transformer import Cosmos3Transformer
from mstar.models.wan.diffusers_files import read_config_dict, read_tensors

UNUSED_PREFIXES = ("lm_head.", "norm.", "action_proj_in.", "action_proj_out.", "action_modality_embed",
                   "audio_proj_in.", "audio_proj_out.", "audio_modality_embed")


def unused(name: str) -> bool:
    """A checkpoint tensor the generation of images and videos does not read."""
    return name.startswith(UNUSED_PREFIXES)


def read_config(path: str) -> Cosmos3TransformerConfig:
    return Cosmos3TransformerConfig.from_dict(read_config_dict(path))


def read_state(path: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in read_tensors(path).items() if not unused(k)}


def load_state(model: Cosmos3Transformer, sd: dict[str, torch.Tensor]) -> None:
    """Assign `sd` (diffusers' names, unused tensors left out) to `model`, checked name by name and shape by shape."""
    own = dict(model.named_parameters())
    extra = sorted(k for k in sd if k not in own)
    if extra:
        raise ValueError(f"cosmos3 transformer checkpoint: {len(extra)} tensors no parameter takes: {extra[:6]}")
    missing = sorted(k for k in own if k not in sd)
    if missing:
        raise ValueError(f"cosmos3 transformer checkpoint: lacks {len(missing)} tensors: {missing[:6]}")
    for k, p in own.items():
        if tuple(sd[k].shape) != tuple(p.shape):
            raise ValueError(f"cosmos3 transformer checkpoint: {k} is {tuple(sd[k].shape)}, the config makes "
                             f"{tuple(p.shape)}")
    model.load_state_dict(sd, strict=True, assign=True)


def build_meta(config: Cosmos3TransformerConfig) -> Cosmos3Transformer:
    """The model's structure with no storage (parameter counts, loading)."""
    with torch.device("meta"):
        return Cosmos3Transformer(config)


def load_transformer(path: str, device="cpu", dtype: torch.dtype | None = torch.float32) -> Cosmos3Transformer:
    """A diffusers transformer/ directory -> Cosmos3Transformer on `device` in `dtype` (time_embedder
    in float32; None: the stored dtypes as they are)."""
    model = build_meta(read_config(path))
    load_state(model, read_state(path))
    if dtype is not None:
        model.to_dtype(dtype)
    return model.to(device).eval().requires_grad_(False).fuse_projections()


__all__ = ["UNUSED_PREFIXES", "unused", "read_config", "read_state", "load_state", "build_meta", "load_transformer"]
