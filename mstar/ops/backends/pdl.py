"""Programmatic dependent launch (PDL) for Triton kernels, on Hopper and newer.

A kernel launched with PDL may start while the kernel before it on the stream is still running:
as soon as every program of that kernel has signalled (`gdc_launch_dependents`) or exited. Until
it calls `gdc_wait` it must touch nothing the earlier kernels write (it may read weights), and it
must write nothing (its output buffer may be memory an earlier kernel is still reading). After
`gdc_wait` the kernel before it has completed and its writes are visible; that kernel waited for
its own predecessor the same way, so every earlier kernel has completed too.

A kernel taking part has a `PDL: tl.constexpr` parameter and, when it is set, waits before its
first access to what earlier kernels write, and lets its dependents launch once it has read and
computed everything, before its output's store: signalled at a program's start instead, a chain of
small kernels launched several ahead, and their early fetches competed with the running kernel's
(notes/llm-decode-step.md). `launch_options` gives the launch's keyword arguments. In a CUDA graph
the launches become programmatic edges. Triton's interpreter has
no such instructions: CPU tensors launch with PDL off.
"""

from __future__ import annotations

import functools

import torch

from mstar import knobs


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether a kernel over t launches with PDL: a CUDA tensor on sm_90 or newer, MSTAR_PDL on."""
    return t.is_cuda and knobs.value("MSTAR_PDL") and _supported(t.device.index or 0)


def launch_options(t: torch.Tensor) -> dict:
    """The launch keyword arguments of a PDL-aware kernel over t: its PDL constexpr, and Triton's
    launch attribute when it is on."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {"PDL": False}
