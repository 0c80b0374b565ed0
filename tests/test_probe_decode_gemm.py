"""The Triton product of `python -m mstar.bench.tools.probe_decode_gemm` computes x @ w.T (Triton's
CPU interpreter), with and without split-K, at a few rows and at a full 128-row block, against
float64. (Its TMA form needs a Hopper GPU; the probe checks every configuration against cuBLAS.)"""

from __future__ import annotations

from triton_interpreter import run_interpreted

_SCRIPT = r"""
import json, torch
from mstar.bench.tools import probe_decode_gemm as probe
g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
out = []
for m in (3, 128):
    x = torch.randn(m, 512, generator=g)
    w = torch.randn(200, 512, generator=g)
    want = x.double() @ w.double().T
    y = torch.empty(m, 200)
    part = torch.empty(8, m, 200)
    for split in (1, 2, 4):
        y.fill_(float("nan"))
        probe.triton_linear(x, w, (64, 128, 3, 4, split, False), y, part)
        out.append([m, split, ((y.double() - want).abs().max() / want.abs().max()).item()])
print(json.dumps(out))
"""


def test_decode_gemm_kernel_in_the_interpreter():
    got = run_interpreted(_SCRIPT)
    assert len(got) == 6
    for m, split, err in got:
        assert err < 1e-5, (m, split, err)
