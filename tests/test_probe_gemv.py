"""The GEMV of `python -m mstar.bench.tools.probe_gemv` computes x @ w.T (Triton's CPU
interpreter): one row (the reduction path) and several rows (the tl.dot path), every
configuration the probe tries, against float64."""

from __future__ import annotations

from triton_interpreter import run_interpreted

_SCRIPT = r"""
import json, torch
from mstar.bench.tools import probe_gemv
g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
out = []
for m in (1, 5):
    x = torch.randn(m, 600, generator=g)
    w = torch.randn(70, 600, generator=g)
    want = x.double() @ w.double().T
    for cfg in probe_gemv.CONFIGS:
        if m > 1 and cfg[0] < 16:
            continue
        y = probe_gemv.triton_linear(x, w, cfg)
        out.append([m, list(y.shape), ((y.double() - want).abs().max() / want.abs().max()).item()])
print(json.dumps(out))
"""


def test_gemv_kernel_in_the_interpreter():
    got = run_interpreted(_SCRIPT)
    assert len(got) == 16 + 8
    for m, shape, err in got:
        assert shape == [m, 70] and err < 1e-5, (m, shape, err)
