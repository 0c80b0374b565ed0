"""Resolve a model name or directory to a config, build the model, load its weights.

`name_or_dir` is a directory in Hugging Face format (config.json, model.safetensors or a
sharded model.safetensors.index.json) or a preset name (presets.py). A directory wins
over a preset of the same name. Qwen3.5 VL checkpoints (a top-level config with a
`text_config`) load as their text model: vision tensors are skipped, MTP tensors kept in
`model.mtp_weights`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Iterator

import torch

from mstar.models import parallel, presets, registry
from mstar.models.registry import resolve_config
from mstar.models.base import DecoderLM, WeightLoadError

log = logging.getLogger("mstar.models")

def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def model_class(config) -> type:
    """The class the config's family builds (registry.py)."""
    return registry.family_of_config(config).model_class(config)


def build_model(config, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "meta") -> DecoderLM:
    """The model with uninitialised weights (no allocation at all when device is meta)."""
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype)
    if torch.device(device).type != "meta":
        model.materialize(device)
    model.requires_grad_(False)
    model.eval()
    return model


# --- checkpoint files ---------------------------------------------------------------------------
def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are not there: {missing}")
        return files
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")


def iter_checkpoint(path: str, device: str | torch.device = "cpu", progress: bool = True,
                    skip_prefixes: tuple[str, ...] = DecoderLM._VISION_PREFIXES,
                    lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) from a directory's safetensors, one tensor at a time; tensors
    whose names start with `skip_prefixes` are not read (one log line counts them).
    lazy: yield safetensors slices instead (read on the CPU, only the part that is indexed:
    tensor-parallel ranks take their shard without reading the whole tensor)."""
    from safetensors import safe_open
    from tqdm.auto import tqdm
    files = checkpoint_files(path)
    dev = torch.device(device)
    open_dev = str(dev) if dev.type == "cuda" and not lazy else "cpu"
    names: list[tuple[str, list[str]]] = []
    for fpath in files:
        with safe_open(fpath, framework="pt", device="cpu") as f:
            names.append((fpath, list(f.keys())))
    total = sum(len(k) for _, k in names)
    skipped = 0
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False) as bar:
        for fpath, keys in names:
            with safe_open(fpath, framework="pt", device=open_dev) as f:
                for k in keys:
                    bar.update(1)
                    if k.startswith(skip_prefixes):
                        skipped += 1
                        continue
                    yield k, (f.get_slice(k) if lazy else f.get_tensor(k))
    if skipped:
        log.info("skipped %d vision tensors of %s (text model only)", skipped, path)


# --- entry points ---------------------------------------------------------------------------------
def load_model(name_or_dir: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               random_weights: bool = False, seed: int = 0, progress: bool = True, config=None) -> DecoderLM:
    """Build a model from a checkpoint directory or a preset.

    config: the resolved config of name_or_dir (resolve_config's result), if the caller has it.

    random_weights: skip the checkpoint and draw random weights on `device` in `dtype`
    (full size for the real presets). Tiny embedded presets always have random weights,
    drawn on the CPU in fp32 from `seed` so that every process builds the same model.
    """
    is_dir = os.path.isdir(name_or_dir)
    preset = None if is_dir else presets.get(name_or_dir)
    config = resolve_config(name_or_dir) if config is None else config
    device = torch.device(device)
    tp = parallel.tp_size()
    if tp > 1:
        parallel.check_config(config, tp)
    if tp > 1 and preset is not None and preset.embedded:
        # the same weights as tp = 1: draw the whole (tiny) model, then take this rank's shard
        with parallel.single_rank():
            full = build_model(config, dtype=torch.float32, device="cpu")
        full.init_random(seed, std=preset.init_std)
        model = build_model(config, dtype=dtype, device=device)
        model.load_weights((n, s.target()) for n, s in full.expected_weights().items())
        del full
    elif preset is not None and preset.embedded:
        model = build_model(config, dtype=torch.float32, device="cpu")
        model.init_random(seed, std=preset.init_std)
        model = model.to(device=device, dtype=dtype)
        model.rope.rebuild(device)
        model._weight_map = None
    else:
        model = build_model(config, dtype=dtype, device=device)
        if random_weights:  # tensor parallel: each rank draws its own shard (not tp = 1's weights)
            model.init_random(seed + 7919 * parallel.tp_rank(), std=preset.init_std if preset else None)
        elif is_dir:
            model.load_weights(iter_checkpoint(name_or_dir, device, progress, lazy=tp > 1))
        else:
            raise ValueError(f"preset {name_or_dir!r} has no weights here: pass the checkpoint directory, "
                             f"or random_weights=True")
    model.name_or_path = name_or_dir
    return model


def load_tokenizer(name_or_dir: str):
    from mstar.models.tokenizer import load_tokenizer as _load
    return _load(name_or_dir)


__all__ = ["load_model", "load_tokenizer", "resolve_config", "build_model", "iter_checkpoint",
           "checkpoint_files", "model_class", "WeightLoadError"]
