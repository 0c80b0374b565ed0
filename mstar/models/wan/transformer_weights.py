"""Reading a diffusers transformer/ directory (WanTransformer3DModel.save_pretrained) into a WanTransformer.

    <dir>/config.json                                      WanTransformerConfig (transformer_config.py)
    <dir>/diffusion_pytorch_model.safetensors              the weights, or sharded:
    <dir>/diffusion_pytorch_model.safetensors.index.json   {"weight_map": {name: shard file}}
    <dir>/diffusion_pytorch_model-0000k-of-0000n.safetensors

Names are diffusers' except three renames (diffusers_name / mstar_name). Every parameter must be
there with its shape; a name that maps to no parameter is an error, except "norm_added_q" (diffusers
ignores it on load too). The tensors keep their stored dtype until `to_dtype`, which keeps
diffusers' float32 modules in float32.
"""

from __future__ import annotations

import re

import torch

from mstar.models.wan.diffusers_files import read_config_dict, read_tensors
from mstar.models.wan.transformer import WanTransformer
from mstar.models.wan.transformer_config import WanTransformerConfig

_IGNORED = ("norm_added_q",)

# (diffusers, mstar) name patterns; applied left to right, reversed by swapping the sides
_RENAMES = (
    (r"\.(attn[12])\.to_out\.0\.", r".\1.to_out."),
    (r"\.ffn\.net\.0\.proj\.", r".ffn.proj_in."),
    (r"\.ffn\.net\.2\.", r".ffn.proj_out."),
)
_REVERSE = (
    (r"\.(attn[12])\.to_out\.", r".\1.to_out.0."),
    (r"\.ffn\.proj_in\.", r".ffn.net.0.proj."),
    (r"\.ffn\.proj_out\.", r".ffn.net.2."),
)


def mstar_name(name: str) -> str:
    """A diffusers parameter name -> the WanTransformer name."""
    for pat, rep in _RENAMES:
        name = re.sub(pat, rep, name)
    return name


def diffusers_name(name: str) -> str:
    """A WanTransformer parameter name -> the diffusers name."""
    for pat, rep in _REVERSE:
        name = re.sub(pat, rep, name)
    return name


def read_config(path: str) -> WanTransformerConfig:
    return WanTransformerConfig.from_dict(read_config_dict(path))


def read_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, under the WanTransformer names."""
    return {mstar_name(k): v for k, v in read_tensors(path).items()
            if not any(part in k.split(".") for part in _IGNORED)}


def load_state(model: WanTransformer, sd: dict[str, torch.Tensor]) -> None:
    """Assign `sd` (WanTransformer names) to `model`'s parameters, checked name by name and shape by shape."""
    own = dict(model.named_parameters())
    extra = sorted(k for k in sd if k not in own)
    if extra:
        raise ValueError(f"wan transformer checkpoint: {len(extra)} tensors no parameter takes: "
                         f"{[diffusers_name(k) for k in extra[:6]]}")
    missing = sorted(k for k in own if k not in sd)
    if missing:
        raise ValueError(f"wan transformer checkpoint: lacks {len(missing)} tensors: "
                         f"{[diffusers_name(k) for k in missing[:6]]}")
    for k, p in own.items():
        if tuple(sd[k].shape) != tuple(p.shape):
            raise ValueError(f"wan transformer checkpoint: {diffusers_name(k)} is {tuple(sd[k].shape)}, the "
                             f"config makes {tuple(p.shape)}")
    model.load_state_dict(sd, strict=True, assign=True)


def build_meta(config: WanTransformerConfig) -> WanTransformer:
    """The model's structure with no storage (parameter counts, loading)."""
    with torch.device("meta"):
        return WanTransformer(config)


def load_transformer(path: str, device="cpu", dtype: torch.dtype | None = torch.float32) -> WanTransformer:
    """A diffusers transformer/ directory -> WanTransformer on `device` in `dtype` (float32 where
    diffusers keeps it; None: the stored dtypes as they are)."""
    model = build_meta(read_config(path))
    load_state(model, read_state(path))
    if dtype is not None:
        model.to_dtype(dtype)
    return model.to(device).eval()
