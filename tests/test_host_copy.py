"""models/host_copy.to_device: the same values on the device; on the CPU a plain copy (the pinned,
asynchronous path is CUDA's: tests/test_denoise_step_gpu.py runs it under sync debug mode)."""

import torch

from mstar.models.host_copy import to_device


def test_cpu_is_a_plain_move():
    t = torch.randn(5)
    assert to_device(t, "cpu") is t.to("cpu")  # .to to the same device returns the tensor itself


def test_values_reach_the_device_unchanged():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.randint(0, 1000, (7,))
    got = to_device(t, dev)
    assert got.device.type == dev and torch.equal(got.cpu(), t)
