"""The snac package's SNAC as the reference model: random weights in the published layout, and its
noise made deterministic (tests/test_snac.py, tests/test_orpheus.py)."""

from __future__ import annotations

import json
import os

import snac
import torch


def release_model(cfg: dict, seed: int):
    """The package's SNAC with random weights, g != ||v||, random alphas and biases."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = snac.SNAC(**cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("original0"):  # g
                    p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
                elif name.endswith("alpha"):
                    p.copy_(torch.empty_like(p).uniform_(0.3, 2.0))
                elif name.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p))
    return model


def save_release(model, cfg: dict, path) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    return str(path)


class PackageNoise:
    """Replaces the package's NoiseBlock.forward: n from `generator` (None: zeros), else the same
    maths (x + n * linear(x))."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator

    def __call__(self, block, x):
        B, _, T = x.shape
        if self.generator is None:
            n = torch.zeros((B, 1, T), dtype=x.dtype)
        else:
            n = torch.randn((B, 1, T), generator=self.generator, dtype=x.dtype)
        return x + n * block.linear(x)
