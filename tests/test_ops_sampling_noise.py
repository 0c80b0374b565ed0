"""The sampler's counter-based noise on CUDA (mstar/ops/backends/triton_sampling.py uniform_at):
one Triton kernel that must give the bits of the torch hash (sampling._uniform_at) exactly, so
that a seeded request samples the same tokens on every backend. Checked in Triton's CPU
interpreter, and on a GPU with -m gpu."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_interpreted

_SCRIPT = r"""
import json
import torch
from mstar.ops import sampling
from mstar.ops.backends import triton_sampling
g = torch.Generator().manual_seed(5)
out = []
for B, J, shared in ((3, 1024, False), (2, 77, True), (1, 3000, False)):
    seeds = torch.randint(0, 2**62, (B,), generator=g) * 2 + torch.tensor([0, 1, 1][:B])
    seeds[0] = 2**63 - 1
    steps = torch.randint(0, 2**40, (B,), generator=g)
    idx = torch.randint(0, 156940, (1 if shared else B, J), generator=g)
    ref = sampling._uniform_at(seeds, steps, idx)  # (no CUDA: the torch hash)
    got = triton_sampling.uniform_at(seeds, steps, idx)
    out.append([B, J, bool(torch.equal(ref, got)), tuple(got.shape) == (B, J)])
print(json.dumps(out))
"""


def test_uniform_at_kernel_is_the_torch_hash_bit_for_bit():
    for B, J, equal, shape_ok in run_interpreted(_SCRIPT):
        assert equal and shape_ok, (B, J)


@pytest.mark.gpu
def test_uniform_at_kernel_on_gpu():
    from mstar.ops import sampling
    from mstar.ops.backends import triton_sampling
    seeds = torch.tensor([0, 1, 2**63 - 1, 12345678901234], device="cuda")
    steps = torch.tensor([0, 7, 2**40 + 3, 99], device="cuda")
    idx = torch.randint(0, 156940, (4, 1024), device="cuda")
    a, b = sampling._row_keys(seeds, steps)
    h = sampling._mix32(sampling._mix32(idx ^ a.unsqueeze(1)) ^ b.unsqueeze(1))
    ref = ((h >> 9) * 2 + 1).to(torch.float32) * (2.0 ** -24)
    assert torch.equal(triton_sampling.uniform_at(seeds, steps, idx), ref)
