"""Reading Kokoro's release layout into a KokoroModel.

    <dir>/config.json        KokoroConfig (config.py)
    <dir>/kokoro-v1_0.pth    torch.save of {"bert": ..., "bert_encoder": ..., "predictor": ...,
                             "text_encoder": ..., "decoder": ...}, one state dict per module
                             (any single *.pth in the directory is taken when that name is absent)
    <dir>/voices/<name>.pt   voice tables (voices.py)

The release's state dicts were saved from DataParallel modules: their keys may start with
"module.", stripped here. Its convolutions are weight-normed (X.weight_g, X.weight_v): folded into
X.weight = g * v / ||v|| with torch's own weight-norm function in float32, the weight the release
computes on every forward. Its instance norms' affine parameters may be absent (modules built
without them): they stay 1 and 0. Keys no module here has are an error, except the ALBERT
position / token-type id buffers and its pooler, which Kokoro does not use.
"""

from __future__ import annotations

import glob
import json
import logging
import os

import torch

from mstar.models.kokoro.blocks import InstanceNorm
from mstar.models.kokoro.config import KokoroConfig
from mstar.models.kokoro.model import KokoroModel

logger = logging.getLogger("mstar.kokoro")

CHECKPOINT = "kokoro-v1_0.pth"
MODULES = ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")
_IGNORED = ("embeddings.position_ids", "embeddings.token_type_ids", "pooler.weight", "pooler.bias")
_OPTIONAL = (".norm.weight", ".norm.bias")  # AdaIN's instance-norm affine


def fold_weight_norm(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """X.weight_g + X.weight_v -> X.weight (weight norm over dim 0, torch's default)."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".weight_g"):
            continue
        if k.endswith(".weight_v"):
            base = k[:-len(".weight_v")]
            g = sd.get(base + ".weight_g")
            if g is None:
                raise ValueError(f"{k} has no {base}.weight_g")
            out[base + ".weight"] = torch._weight_norm(v.float(), g.float(), 0)
        else:
            out[k] = v
    return out


def _strip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in sd.items()}


def load_state(model: KokoroModel, checkpoint: dict) -> None:
    """Load the release's dict of module state dicts into `model` (see the module docstring)."""
    lost = [m for m in MODULES if m not in checkpoint]
    if lost:
        raise ValueError(f"kokoro checkpoint: no state dict for {', '.join(lost)} (has {', '.join(checkpoint)})")
    for name in MODULES:
        module = getattr(model, name)
        sd = fold_weight_norm(_strip(checkpoint[name]))
        own = module.state_dict()
        extra = [k for k in sd if k not in own and k not in _IGNORED]
        if extra:
            raise ValueError(f"kokoro checkpoint: {name} has {len(extra)} unknown keys: {extra[:6]}")
        missing = [k for k in own if k not in sd]
        hard = [k for k in missing if not k.endswith(_OPTIONAL)]
        if hard:
            raise ValueError(f"kokoro checkpoint: {name} lacks {len(hard)} keys: {hard[:6]}")
        if missing:
            logger.info("kokoro checkpoint: %s has no %d instance-norm affine tensors; they stay 1 / 0",
                        name, len(missing))
        for k, v in own.items():
            if k in sd and tuple(sd[k].shape) != tuple(v.shape):
                raise ValueError(f"kokoro checkpoint: {name}.{k} is {tuple(sd[k].shape)}, the config makes "
                                 f"{tuple(v.shape)}")
        module.load_state_dict({k: sd[k] for k in own if k in sd}, strict=False)


def read_config(path: str) -> KokoroConfig:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return KokoroConfig.from_dict(json.load(f))


def checkpoint_file(path: str) -> str:
    p = os.path.join(path, CHECKPOINT)
    if os.path.isfile(p):
        return p
    found = sorted(glob.glob(os.path.join(path, "*.pth")))
    if len(found) != 1:
        raise FileNotFoundError(f"{path!r}: no {CHECKPOINT}" + (f" and {len(found)} other .pth files" if found else ""))
    return found[0]


def load_model(path: str, device="cpu", dtype: torch.dtype = torch.float32) -> KokoroModel:
    config = read_config(path)
    with torch.device("meta"):
        model = KokoroModel(config)
    model.to_empty(device="cpu")
    _reset_buffers(model)
    load_state(model, torch.load(checkpoint_file(path), map_location="cpu", weights_only=True))
    return model.to_dtype(dtype).to(device).eval()


def random_model(config: KokoroConfig, seed: int = 0, device="cpu", dtype: torch.dtype = torch.float32) -> KokoroModel:
    """torch's default initialisation under a fixed seed (benchmarks, tests)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = KokoroModel(config)
    return model.to_dtype(dtype).to(device).eval()


def _reset_buffers(model: KokoroModel) -> None:
    """The non-persistent buffers and the optional parameters a checkpoint may not fill (to_empty
    leaves them uninitialised)."""
    for mod in model.modules():
        for name, buf in mod.named_buffers(recurse=False):
            if name == "_one":
                buf.fill_(1.0)
            elif name == "_zero":
                buf.zero_()
            elif name == "window":
                buf.copy_(torch.hann_window(buf.shape[0], periodic=True))
        if isinstance(mod, InstanceNorm):
            with torch.no_grad():
                mod.weight.fill_(1.0)
                mod.bias.zero_()


__all__ = ["CHECKPOINT", "MODULES", "fold_weight_norm", "load_state", "read_config", "checkpoint_file",
           "load_model", "random_model"]
