"""Host tensors onto the device without a host sync.

A copy from pageable host memory to a CUDA device makes the host wait until the device has drained
its queue; between denoising steps that leaves the device idle while the host prepares the next
step. `to_device` stages the tensor in pinned memory (torch's caching host allocator, which keeps
the block until the copy is done) and copies it asynchronously."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """t (on the CPU) on `device`: through pinned memory and an asynchronous copy on a CUDA device,
    a plain `.to` elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


__all__ = ["to_device"]
