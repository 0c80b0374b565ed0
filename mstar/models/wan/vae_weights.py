"""Reading a diffusers vae/ directory (AutoencoderKLWan.save_pretrained) into a WanVAE.

    <dir>/config.json                              WanVAEConfig (vae_config.py)
    <dir>/diffusion_pytorch_model.safetensors      the state dict (or a sharded *.safetensors.index.json)

`<dir>` may also be a pipeline directory with the VAE in vae/.

Names: WanVAE keeps diffusers' module paths except

    X.gamma  [C, 1, 1(, 1)]                   -> X.weight [C]         (channel RMS norms)
    X.downsampler.resample.1.*                -> X.downsampler.spatial.*  (diffusers' index 0 is the pad)
    X.upsampler.resample.1.*                  -> X.upsampler.spatial.*    (index 0 is the nearest 2x)
    X.attentions.0.to_qkv / proj.weight [., C, 1, 1] -> [., C]        (1x1 conv2d -> linear)

Every tensor of the checkpoint must land on a parameter of the model and every parameter must be
given: anything else is an error naming the keys.
"""

from __future__ import annotations

import json
import os
import re

import torch

from mstar.models.wan.diffusers_files import WEIGHTS, read_tensors
from mstar.models.wan.vae import WanVAE
from mstar.models.wan.vae_config import CLASS_NAME, WanVAEConfig


_RENAMES = ((re.compile(r"\.(down|up)sampler\.resample\.1\."), r".\1sampler.spatial."),
            (re.compile(r"\.gamma$"), ".weight"))
_LINEAR = re.compile(r"\.attentions\.\d+\.(to_qkv|proj)\.weight$")


def diffusers_key(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One diffusers AutoencoderKLWan (name, tensor) -> WanVAE's (a view or reshape, no copy)."""
    out = name
    for pat, rep in _RENAMES:
        out = pat.sub(rep, out)
    if name.endswith(".gamma"):
        tensor = tensor.reshape(tensor.shape[0])
    elif _LINEAR.search(name):
        tensor = tensor.reshape(tensor.shape[0], tensor.shape[1])
    return out, tensor


def convert_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        nk, nv = diffusers_key(k, v)
        if nk in out:
            raise ValueError(f"wan vae checkpoint: {k} and another key both map to {nk}")
        out[nk] = nv
    return out


def load_state(model: WanVAE, sd: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> None:
    """Load a diffusers-named state dict into `model` (which may be on the meta device)."""
    conv = convert_state_dict(sd)
    own = dict(model.named_parameters())
    extra = sorted(k for k in conv if k not in own)
    missing = sorted(k for k in own if k not in conv)
    if extra or missing:
        raise ValueError(f"wan vae checkpoint: {len(extra)} unknown keys {extra[:6]}, "
                         f"{len(missing)} missing {missing[:6]}")
    for k, p in own.items():
        if tuple(conv[k].shape) != tuple(p.shape):
            raise ValueError(f"wan vae checkpoint: {k} is {tuple(conv[k].shape)}, the config makes {tuple(p.shape)}")
    want = dtype or next(iter(conv.values())).dtype
    state = {k: v.to(device=device or v.device, dtype=want).contiguous() for k, v in conv.items()}
    model.load_state_dict(state, strict=True, assign=True)


def vae_dir(path: str) -> str:
    """`path` itself or its vae/ subdirectory, whichever holds the VAE's config.json."""
    for d in (path, os.path.join(path, "vae")):
        cfg = os.path.join(d, "config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                if json.load(f).get("_class_name", CLASS_NAME) == CLASS_NAME:
                    return d
    raise FileNotFoundError(f"{path!r}: no {CLASS_NAME} config.json in it or in its vae/")


def read_config(path: str) -> WanVAEConfig:
    with open(os.path.join(vae_dir(path), "config.json")) as f:
        return WanVAEConfig.from_dict(json.load(f))


def read_state_dict(path: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    return read_tensors(vae_dir(path), device)


def load_wan_vae(path: str, dtype: torch.dtype | None = torch.float32,
                 device: torch.device | str = "cpu") -> WanVAE:
    """A WanVAE from a diffusers vae/ directory (or a pipeline directory holding one), in eval mode.
    dtype None keeps the checkpoint's."""
    cfg = read_config(path)
    with torch.device("meta"):
        model = WanVAE(cfg)
    load_state(model, read_state_dict(path, device="cpu"), dtype=dtype, device=device)
    return model.eval().requires_grad_(False)


__all__ = ["WEIGHTS", "diffusers_key", "convert_state_dict", "load_state", "vae_dir", "read_config",
           "read_state_dict", "load_wan_vae"]
