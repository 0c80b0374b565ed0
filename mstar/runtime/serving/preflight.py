"""Argument mistakes found by the API process: each is one line naming the flag, given in about a
second, instead of a traceback from the engine process after the model began to load.

    check_name(model, random_weights), check_device(device, tp)
                                    before the engine starts (no model config read)
    check_tp(check_model(model, random_weights), tp)
                                    reads the config (transformers): the server runs it while the engine
                                    process starts, and stops the engine on a mistake
    check_serve(model, random_weights, device, tp)   all of them
Each raises ValueError with the line.
"""

from __future__ import annotations

import os


def check_name(model: str, random_weights: bool) -> None:
    """ValueError when `model` is neither a directory nor a preset, or a preset that needs
    --random-weights."""
    from mstar.models import presets
    if not os.path.isdir(model):
        p = presets.get(model)
        if p is None:
            hint = " (no such directory)" if os.sep in model or model.startswith(".") else ""
            raise ValueError(f"model: {model!r} is neither a model directory{hint} nor a preset; "
                             "`mstar models list` shows the presets")
        if not p.embedded and not random_weights:
            raise ValueError(f"model: the preset {model!r} has no weights here; pass its checkpoint directory, "
                             "or --random-weights to benchmark its shapes with random weights")


def check_model(model: str, random_weights: bool):
    """The model's config (check_name first); ValueError when it cannot be read."""
    from mstar.models.registry import resolve_config
    check_name(model, random_weights)
    try:
        return resolve_config(model)
    except Exception as e:  # noqa: BLE001 -- a directory without a readable config.json, and the like
        raise ValueError(f"model: cannot read the config of {model!r}: {e}") from None


def check_device(device: str, tp: int) -> None:
    """ValueError when --device asks for CUDA that is not there, or --tp for more GPUs than there are."""
    if device == "auto" or device == "cpu":
        return  # without importing torch: the API process need not load it
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device: {device!r} is not a device (auto, cpu, cuda or cuda:N)") from None
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asks for CUDA, but no CUDA device is visible here "
                         "(use --device cpu or auto)")
    n = torch.cuda.device_count()
    first = dev.index or 0
    if first + tp > n:
        raise ValueError(f"device: {device!r} with --tp {tp} needs {first + tp} GPU(s); {n} visible")


def check_tp(config, tp: int) -> None:
    """ValueError when --tp does not divide the model's head counts."""
    if tp == 1:
        return
    from mstar.models import parallel
    try:
        parallel.check_config(config, tp)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("tp:") else f"tp: {msg}") from None


def check_serve(model: str, random_weights: bool, device: str, tp: int) -> None:
    config = check_model(model, random_weights)
    check_device(device, tp)
    check_tp(config, tp)
