"""copy_rows (the GDN state pool's gather / scatter with a cast): its Triton kernel in Triton's CPU
interpreter and its torch fallback, against index_select / index_copy_ and .to(), for each index
being given or the identity, float32 <-> bfloat16, rows larger than one program's block. Exact,
except where the interpreter rounds into bfloat16 (by truncation: within one bfloat16 step)."""

from __future__ import annotations

import torch
from triton_interpreter import run_interpreted

from mstar.ops.backends import triton_rows

_SCRIPT = r"""
import json, torch
from mstar.ops.backends import triton_rows
from test_copy_rows import expected, case
out = []
seed = int(torch.randint(1 << 30, ()))
for i, (src_dtype, dst_dtype, indexed) in enumerate(case.VARIANTS):
    src, si, dst, di = case(seed + i, src_dtype, dst_dtype, indexed)
    want = expected(src, si, dst.clone(), di)
    got = triton_rows.launch(src, si, dst.clone(), di, (si if si is not None else di if di is not None else src).shape[0])
    # the interpreter casts float32 -> bfloat16 by truncation (the GPU, as torch, to nearest even)
    rel = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)).max().item()
    out.append([i, str(dst.dtype), rel])
print(json.dumps(out))
"""


def case(seed, src_dtype, dst_dtype, indexed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(6, 3, 40, 50, generator=g).to(src_dtype)  # 6000 elements a row: two programs
    dst = torch.randn(9, 3, 40, 50, generator=g).to(dst_dtype)
    si = torch.randperm(6, generator=g)[:4] if indexed[0] else None
    di = torch.randperm(9, generator=g)[:4 if indexed[0] else 6] if indexed[1] else None
    return src, si, dst, di


case.VARIANTS = [(torch.bfloat16, torch.float32, (True, False)),  # the pool's rows gathered, cast up
                 (torch.float32, torch.bfloat16, (False, True)),  # final states scattered, cast down
                 (torch.float32, torch.bfloat16, (True, True)),  # snapshots: some final states
                 (torch.float32, torch.float32, (True, True))]


def expected(src, si, dst, di):
    rows = (src if si is None else src.index_select(0, si)).to(dst.dtype)
    if di is None:
        dst[:rows.shape[0]] = rows
    else:
        dst.index_copy_(0, di, rows)
    return dst


def test_copy_rows_kernel_in_the_interpreter():
    got = run_interpreted(_SCRIPT)
    assert len(got) == len(case.VARIANTS)
    for i, dtype, rel in got:
        assert rel == 0.0 if dtype == "torch.float32" else rel <= 2.0 ** -7, (i, dtype, rel)


def test_copy_rows_off_cuda_is_torch():
    for i, (src_dtype, dst_dtype, indexed) in enumerate(case.VARIANTS):
        src, si, dst, di = case(100 + i, src_dtype, dst_dtype, indexed)
        want = expected(src, si, dst.clone(), di)
        assert torch.equal(triton_rows.copy_rows(src, si, dst.clone(), di), want)
