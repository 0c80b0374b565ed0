"""A diffusers model directory's files (save_pretrained's layout), shared by the Wan loaders:

    <dir>/config.json
    <dir>/diffusion_pytorch_model.safetensors              the weights, or sharded:
    <dir>/diffusion_pytorch_model.safetensors.index.json   {"weight_map": {name: shard file}}
    <dir>/diffusion_pytorch_model-0000k-of-0000n.safetensors
"""

from __future__ import annotations

import json
import os

import torch

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"


def read_config_dict(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def weight_files(path: str) -> list[str]:
    """The safetensors files of a model directory (one, or the shards of the index)."""
    single = os.path.join(path, WEIGHTS)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
        lost = [s for s, p in zip(shards, files) if not os.path.isfile(p)]
        if lost:
            raise FileNotFoundError(f"{path!r}: the index names missing shards {lost[:4]}")
        return files
    raise FileNotFoundError(f"{path!r}: no {WEIGHTS} and no {INDEX}")


def read_tensors(path: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, under diffusers' names."""
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        out.update(load_file(file, device=str(device)))
    return out
