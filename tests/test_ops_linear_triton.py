"""ops.linear and its Triton kernel for skinny inputs (triton_linear.py). The kernel runs here
in Triton's CPU interpreter (fp16 and fp32: the interpreter mishandles bf16), against a
float64 product; on the GPU host against F.linear at the decode shapes of the presets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar import ops
from triton_interpreter import run_interpreted

_SCRIPT = r"""
import json, torch
from mstar.ops.backends import triton_linear as tli
seed = %d
g = torch.Generator().manual_seed(seed)
out = {"err": 0.0, "batch_invariant": True}
for dtype in (torch.float16, torch.float32):
    for m, n, k, bias, cfg in [(1, 40, 96, False, dict(BLOCK_N=16, BLOCK_K=32)),
                               (8, 64, 128, True, dict(BLOCK_N=32, BLOCK_K=64)),
                               (16, 48, 200, True, dict(BLOCK_N=16, BLOCK_K=64)),
                               (5, 33, 64, False, dict(BLOCK_N=64, BLOCK_K=16))]:
        n += int(torch.randint(0, 9, (1,), generator=g))
        k += int(torch.randint(0, 5, (1,), generator=g))
        x = torch.randn(m, k + 3, generator=g)[:, :k].to(dtype)  # a row stride past K, as a view
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        y = tli.skinny_linear(x, w, b, cfg)
        ref = x.double() @ w.double().T + (b.double() if bias else 0)
        out["err"] = max(out["err"], float((y.double() - ref).abs().max() / ref.abs().max()))
        out["shape_ok"] = out.get("shape_ok", True) and tuple(y.shape) == (m, n) and y.dtype == dtype
        # each row alone gives the same bits as inside the batch (the tile is 16 rows either way)
        for i in range(m):
            one = tli.skinny_linear(x[i:i + 1], w, b, cfg)
            out["batch_invariant"] = out["batch_invariant"] and torch.equal(one[0], y[i])
print(json.dumps(out))
"""


def test_skinny_kernel_matches_float64_in_the_interpreter():
    seed = int(torch.randint(0, 2 ** 31 - 1, (1,)))
    got = run_interpreted(_SCRIPT % seed)
    assert got["shape_ok"], got
    assert got["err"] < 2e-3, f"seed {seed}: {got}"  # fp16 output rounding (2^-11) with headroom
    assert got["batch_invariant"], f"seed {seed}: {got}"


def test_op_reference_is_f_linear_bit_for_bit():
    x, w, b = torch.randn(7, 33), torch.randn(19, 33), torch.randn(19)
    assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(ops.linear(x, w, None), F.linear(x, w))
    assert ops.get("linear").selected("cpu") == "reference"


@pytest.mark.gpu
def test_skinny_kernel_on_gpu_against_cublas():
    from mstar.ops.backends import triton_linear as tli
    torch.manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,))))
    # 4B's decode shapes (N, K) and a ragged one; rows 1, 8 and 16
    for n, k in [(8192, 2560), (4160, 2560), (2560, 4096), (18432, 2560), (2560, 9216), (1000, 1000)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in (1, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for bias in (None, b):
                y = tli.linear(x, w, bias)
                ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
                err = (y.double() - ref).norm() / ref.norm()
                assert err < 5e-3, (n, k, m, float(err))
                assert torch.equal(tli.linear(x[:1], w, bias)[0], y[0])  # batch-invariant
    x = torch.randn(17, 256, device="cuda", dtype=torch.bfloat16)  # past SKINNY_ROWS: F.linear
    w = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(tli.linear(x, w, None), F.linear(x, w))
