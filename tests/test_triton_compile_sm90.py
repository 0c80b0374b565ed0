"""Triton kernels compiled for the H200 (sm_90) on this CPU machine: the interpreter runs a
kernel's Python, not Triton's compiler, so a kernel it passes can still fail to compile (a name
typed differently in two branches did, in session 8). triton.compile needs no GPU."""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mstar.ops.backends import triton_gdn


@pytest.mark.parametrize("hk,hv", [(16, 16), (16, 32)])  # 0.8B; 4B / 9B
def test_gdn_prefill_prep_kernel_compiles_for_sm90(hk, hv):
    ptr = {n: "*bf16" for n in ("mixed_ptr", "a_ptr", "b_ptr", "alog_ptr", "dtb_ptr", "q_ptr", "k_ptr", "v_ptr",
                                 "beta_ptr")}
    sig = {**ptr, "g_ptr": "*fp32", "mixed_stride": "i64", "a_stride": "i64", "b_stride": "i64", "T": "i32",
           "eps": "fp32", "HK": "constexpr", "HV": "constexpr", "DK": "constexpr", "DV": "constexpr",
           "BLOCK_T": "constexpr"}
    src = ASTSource(fn=triton_gdn._gdn_prefill_prep_kernel, signature=sig,
                    constexprs={"HK": hk, "HV": hv, "DK": 128, "DV": 128,
                                "BLOCK_T": triton_gdn.PREP_BLOCK_T})
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert "cubin" in out.asm and len(out.asm["cubin"]) > 0
