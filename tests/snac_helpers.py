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
    """Replaces the package's NoiseBlock.forward: n from `generator` (None: zeros), or, after
    `seeded(seeds)`, mstar's counter-based noise of those row seeds (the decode's i-th noise
    block drawing stream i, as mstar's SNAC does); then the same maths (x + n * linear(x))."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator
        self.seeds: torch.Tensor | None = None
        self.calls = 0

    def seeded(self, seeds) -> "PackageNoise":
        """Counter-based noise for the next decode (noise block i: stream i)."""
        self.seeds = torch.as_tensor(seeds, dtype=torch.int64).reshape(-1)
        self.calls = 0
        return self

    def __call__(self, block, x):
        B, _, T = x.shape
        if self.seeds is not None:
            from mstar.ops.sampling import normal_noise
            n = normal_noise(self.seeds, self.calls, T).to(x.dtype).unsqueeze(1)
            self.calls += 1
        elif self.generator is None:
            n = torch.zeros((B, 1, T), dtype=x.dtype)
        else:
            n = torch.randn((B, 1, T), generator=self.generator, dtype=x.dtype)
        return x + n * block.linear(x)
