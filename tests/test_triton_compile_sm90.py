"""Triton kernels compiled for the H200 (sm_90) on this CPU machine: the interpreter runs a
kernel's Python, not Triton's compiler, so a kernel it passes can still fail to compile (a name
typed differently in two branches did: notes/gpu-2026-11-30-idle-gather.md). triton.compile needs no GPU."""

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


@pytest.mark.parametrize("world,rank", [(2, 1), (4, 3)])
def test_allreduce_norm_kernel_compiles_for_sm90_with_sys_scope_flags(world, rank):
    """The fused all-reduce + add + RMSNorm (MSTAR_TP_ALLREDUCE=symm_mem_norm): it compiles, its
    flags are system-scope release / acquire compare-and-swaps with a timed trap, and the peers'
    rows are read past L1 in 16-byte vectors (the buffers' addresses are 16-byte aligned)."""
    from mstar.ops.backends import triton_allreduce_norm
    sig = {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
    sig.update({"buf_addrs_ptr": "*i64", "flag_addrs_ptr": "*i64", "n_cols": "i32", "x_stride": "i64",
                "res_stride": "i64", "eps": "fp32", "RANK": "constexpr", "WORLD": "constexpr",
                "ZERO_CENTERED": "constexpr", "BLOCK": "constexpr", "TIMEOUT_NS": "constexpr"})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(10)}  # as a launch with aligned tensors specialises
    src = ASTSource(fn=triton_allreduce_norm._reduce_add_rms_norm_kernel, signature=sig, attrs=attrs,
                    constexprs={"RANK": rank, "WORLD": world, "ZERO_CENTERED": True, "BLOCK": 4096,
                                "TIMEOUT_NS": 600 * 10 ** 9})
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ptx = out.asm["ptx"]
    assert ptx.count("atom.global.release.sys.cas.b32") == world - 1
    assert ptx.count("atom.global.acquire.sys.cas.b32") == world - 1
    assert ptx.count("ld.global.cg.v4") == 2 * world  # 4096 bf16 over 256 threads: two vectors a rank
    assert ptx.count("trap;") == 2 * (world - 1) and "%globaltimer" in ptx  # a peer that never signals


@pytest.mark.parametrize("act", ["none", "gelu_tanh", "relu_square"])
def test_quantize_rows_kernel_compiles_for_sm90(act):
    """MSTAR_DIT_FP8's per-row quantize: it compiles and casts to e4m3 with the hardware's
    saturating conversion."""
    from mstar.ops.backends import triton_fp8
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "n_cols": "i32", "x_stride": "i32",
           "ACT": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(fn=triton_fp8._quantize_rows_kernel, signature=sig,
                    constexprs={"ACT": triton_fp8._ACT_CODE[act], "BLOCK": 16384})
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
    assert "cvt.rn.satfinite.e4m3x2.f32" in out.asm["ptx"]


def _kernels():
    import importlib
    import pkgutil

    import mstar.ops.backends as backends
    for info in pkgutil.iter_modules(backends.__path__):
        if not info.name.startswith("triton_"):
            continue
        module = importlib.import_module(f"mstar.ops.backends.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction) and obj.__module__ == module.__name__:
                yield pytest.param(module, obj, id=f"{info.name}.{name}")


@pytest.mark.parametrize("module,kernel", list(_kernels()))
def test_kernel_reads_no_plain_module_constant(module, kernel):
    """Triton's compiler refuses a module-level number read inside a kernel unless it is a
    tl.constexpr; the CPU interpreter accepts it, so only a GPU run would fail."""
    import triton.language as tl
    plain = [n for n in kernel.fn.__code__.co_names
             if isinstance(vars(module).get(n), (int, float)) and not isinstance(vars(module).get(n), bool)
             and not isinstance(vars(module).get(n), tl.constexpr)]
    assert not plain, f"{kernel.fn.__name__} reads {plain}: wrap them in tl.constexpr"


@pytest.mark.parametrize("gated,hq,hk", [(True, 8, 2), (True, 16, 4), (False, 16, 8)])  # Qwen3.5 0.8B, 4B; Qwen3
def test_attention_prologue_kernels_compile_for_sm90(gated, hq, hk):
    """qk_norm_rope_append's kernel (head_dim 256 with a 64-dim rotary, or 128 fully rotated) and
    sigmoid_mul's, at the Qwen shapes."""
    from mstar.ops.backends import triton_elementwise as te
    d, rd = (256, 64) if gated else (128, 128)
    sig = {n: "*bf16" for n in ("src_ptr", "qw_ptr", "kw_ptr", "q_ptr", "k_ptr", "v_ptr")}
    sig.update({"src_tok_stride": "i64", "pos_ptr": "*i64", "cache_ptr": "*fp32", "rows_ptr": "*i64", "eps": "fp32",
                "n_q": "i32", "n_kv": "i32", "D": "constexpr", "HALF": "constexpr", "BLOCK_Q": "constexpr",
                "BLOCK_KV": "constexpr", "BLOCK_R": "constexpr", "BLOCK_V": "constexpr", "NORM": "constexpr",
                "GATED": "constexpr"})
    src = ASTSource(fn=te._qkv_norm_rope_rows_kernel, signature=sig, constexprs={
        "D": d, "HALF": rd // 2, "BLOCK_Q": hq, "BLOCK_KV": hk, "BLOCK_R": triton.next_power_of_2(d - rd) if d > rd
        else 0, "BLOCK_V": hk * d, "NORM": 1 if gated else 0, "GATED": gated})
    assert len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]) > 0
    sig = {"x_ptr": "*bf16", "g_ptr": "*bf16", "out_ptr": "*bf16", "n_heads": "i32", "x_tok_stride": "i64",
           "x_head_stride": "i64", "g_tok_stride": "i64", "g_head_stride": "i64", "D": "constexpr",
           "BLOCK_H": "constexpr"}
    src = ASTSource(fn=te._sigmoid_mul_kernel, signature=sig, constexprs={"D": d, "BLOCK_H": hq})
    assert len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]) > 0


@pytest.mark.parametrize("pro,group", [(1, 1), (2, 1), (3, 128), (4, 256)])
def test_fused_linear_kernel_compiles_for_sm90(pro, group):
    """The fused-linear kernel, each prologue (the per-head norm reshapes a K block into heads)."""
    from mstar.ops.backends import triton_fused_linear as fl
    sig = {n: "*bf16" for n in ("x_ptr", "aux_ptr", "nw_ptr", "res_out_ptr", "w_ptr", "y_ptr")}
    sig.update({n: "i32" for n in ("N", "K", "x_stride", "aux_stride", "aux_group_stride", "res_out_stride",
                                   "y_stride")})
    consts = {"PRO": pro, "ZERO_CENTERED": True, "G": group, "BN": 8, "BK": max(512, group), "PF": 1024, "LINE": 64,
              "PDL": True}
    sig.update({"eps": "fp32", **{n: "constexpr" for n in consts}})
    src = ASTSource(fn=fl._fused_linear_kernel, signature=sig, constexprs=consts)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": 3, "launch_pdl": True})
    assert len(out.asm["cubin"]) > 0
    # programmatic dependent launch: the program asks L2 for its first weights (8 rows x 1024 inputs
    # of bf16: 128 lines over 128 threads) and only then waits for the kernel before it; it loads and
    # stores nothing before the wait, and lets its dependents launch once its sums are done
    ptx = out.asm["ptx"]
    wait, launch = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.wait") == 1 and ptx[:wait].count("prefetch.global.L2") == 1
    assert "ld.global" not in ptx[:wait] and "st.global" not in ptx[:wait]
    assert "ld.global" not in ptx[launch:] and ptx[launch:].count("st.global") == 1


@pytest.mark.parametrize("fused", [False, True])
def test_gdn_decode_and_conv_update_wait_first_under_pdl(fused):
    """Their first reads are of what the kernel before them writes: the wait comes before any load;
    their dependents may launch once all is read and computed, before the output's store."""
    from mstar.ops.backends import triton_conv1d
    ptr = ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr") if not fused else ("mixed_ptr", "a_ptr", "b_ptr",
                                                                              "alog_ptr", "dtb_ptr")
    sig = {**{n: "*bf16" for n in ptr}, "state_ptr": "*bf16", "slot_ptr": "*i32", "o_ptr": "*bf16", "scale": "fp32"}
    consts = {"DK": 128, "DV": 128, "BV": 32, "PDL": True}
    if fused:
        sig.update({"mixed_stride": "i64", "a_stride": "i64", "b_stride": "i64", "eps": "fp32"})
        consts.update({"HK": 16, "HV": 16})
    else:
        consts["H"] = 16
    sig.update({n: "constexpr" for n in consts})
    kernel = triton_gdn._gdn_decode_fused_kernel if fused else triton_gdn._gdn_decode_kernel
    sig = {n: sig[n] for n in kernel.arg_names}
    kernels = [(kernel, sig, consts)]
    conv_sig = {**{n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "state_ptr", "out_ptr")}, "slot_ptr": "*i32",
                "C": "i32", "x_stride": "i64"}
    conv_consts = {"K": 4, "HAS_BIAS": False, "SILU": True, "BLOCK": 256, "PDL": True}
    conv_sig.update({n: "constexpr" for n in conv_consts})
    kernels.append((triton_conv1d._conv_update_kernel,
                    {n: conv_sig[n] for n in triton_conv1d._conv_update_kernel.arg_names}, conv_consts))
    for fn, signature, constexprs in kernels:
        out = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True})
        ptx = out.asm["ptx"]
        wait, launch = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
        assert "ld.global" not in ptx[:wait] and wait < launch


@pytest.mark.parametrize("hq,hkv,block,warps,stages", [(8, 2, 32, 4, 2), (16, 4, 64, 8, 3), (32, 8, 16, 2, 1)])
def test_paged_decode_kernels_compile_for_sm90(hq, hkv, block, warps, stages):
    """The small-batch decode attention (head_dim 256): the split kernel's two products run on
    tensor cores (mma), and the merge kernel compiles for the slices of a one-row step."""
    from mstar.ops.backends import triton_paged_decode as tpd
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "indptr_ptr": "*i32", "indices_ptr": "*i32",
           "last_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "page_size": "i32",
           "min_chunk": "i32", "qk_scale": "fp32"}
    sig.update({n: "i64" for n in ("stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp",
                                   "stride_vt", "stride_vh")})
    sig.update({n: "constexpr" for n in ("HQ", "GROUP", "GROUP_PAD", "D", "BLOCK_N", "SPLITS")})
    src = ASTSource(fn=tpd._split_kernel, signature=sig,
                    constexprs={"HQ": hq, "GROUP": hq // hkv, "GROUP_PAD": 16, "D": 256, "BLOCK_N": block,
                                "SPLITS": 32})
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    assert "mma.sync" in out.asm["ptx"] or "wgmma" in out.asm["ptx"]
    sig = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16", "indptr_ptr": "*i32",
           "last_ptr": "*i32", "page_size": "i32", "min_chunk": "i32", "stride_ob": "i64", "stride_oh": "i64",
           "HQ": "constexpr", "D": "constexpr", "BLOCK_N": "constexpr", "SPLITS": "constexpr"}
    src = ASTSource(fn=tpd._merge_kernel, signature=sig,
                    constexprs={"HQ": hq, "D": 256, "BLOCK_N": block, "SPLITS": 64})
    assert len(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"]) > 0
