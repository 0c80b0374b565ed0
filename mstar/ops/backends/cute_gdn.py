"""Gated DeltaNet recurrent decode step as a CuTe DSL kernel, in place over the state pool.

Same contract as the reference (mstar/ops/gdn.py, gdn_decode): per row b and head h, with
S = state_pool[slots[b], h] ([Dk, Dv], float32 arithmetic)

    S <- S * exp(g);  delta = beta * (v - S^T k);  S <- S + k delta^T;  o = S^T (scale q)

Grid (rows, heads, Dv / BV), BV threads per CTA: thread j owns column j of the state block, so
S^T k and S^T q are per-thread sums over Dk (no cross-thread reduction) and a warp's loads of
one state row are contiguous. The column is kept in registers between the two passes, so the
state is read once and written once, straight from and to its slot (no gather / scatter).
Dk, Dv, BV and every dtype are compile-time; rows, heads and the pool size are dynamic.

Registered as backend "cute" below Triton's priority (select with MSTAR_BACKENDS=gdn_decode=cute
until the H200 bench shows it ahead); a specialization that is neither cached nor buildable
here runs on the next backend.
"""

import torch

from mstar.ops import gdn
from mstar.ops.cache import cute as aot  # not cutlass.cute: the DSL is imported only inside builders
from mstar.ops.registry import get as _get_op
from mstar.ops.registry import register_backend

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
           torch.int64: "int64", torch.int32: "int32"}


def _cutlass_type(name: str):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32,
            "int64": cutlass.Int64, "int32": cutlass.Int32}[name]


def _build_gdn_decode(p: dict):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int64
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    DK, DV, BV = p["dk"], p["dv"], p["bv"]
    qdt, vdt = _cutlass_type(p["qk_dtype"]), _cutlass_type(p["v_dtype"])
    gdt, bdt = _cutlass_type(p["g_dtype"]), _cutlass_type(p["beta_dtype"])
    sdt, idt = _cutlass_type(p["state_dtype"]), _cutlass_type(p["slot_dtype"])

    @cute.kernel
    def kernel(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               state: cute.Tensor, slots: cute.Tensor, o: cute.Tensor, scale: Float32):
        tid, _, _ = cute.arch.thread_idx()
        b, h, vb = cute.arch.block_idx()
        col = vb * BV + tid
        slot = Int64(slots[b])
        decay = cute.math.exp(Float32(g[b, h]))
        bt = Float32(beta[b, h])
        s = cute.make_rmem_tensor((DK,), Float32)
        pred = Float32(0.0)
        for i in cutlass.range_constexpr(DK):
            si = Float32(state[slot, h, i, col]) * decay
            s[i] = si
            pred = pred + si * Float32(k[b, h, i])
        delta = bt * (Float32(v[b, h, col]) - pred)
        acc = Float32(0.0)
        for i in cutlass.range_constexpr(DK):
            si = s[i] + Float32(k[b, h, i]) * delta
            state[slot, h, i, col] = sdt(si)
            acc = acc + si * Float32(q[b, h, i])
        o[b, h, col] = vdt(acc * scale)

    @cute.jit
    def launch(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               state: cute.Tensor, slots: cute.Tensor, o: cute.Tensor, scale: Float32, stream):
        kernel(q, k, v, g, beta, state, slots, o, scale).launch(
            grid=(q.shape[0], q.shape[1], DV // BV), block=(BV, 1, 1), stream=stream)

    B, H, N = cute.sym_int(), cute.sym_int(), cute.sym_int()
    r3, r2 = (2, 1, 0), (1, 0)
    args = (make_fake_compact_tensor(qdt, (B, H, DK), stride_order=r3),
            make_fake_compact_tensor(qdt, (B, H, DK), stride_order=r3),
            make_fake_compact_tensor(vdt, (B, H, DV), stride_order=r3),
            make_fake_compact_tensor(gdt, (B, H), stride_order=r2),
            make_fake_compact_tensor(bdt, (B, H), stride_order=r2),
            make_fake_compact_tensor(sdt, (N, H, DK, DV), stride_order=(3, 2, 1, 0)),
            make_fake_compact_tensor(idt, (B,)),
            make_fake_compact_tensor(vdt, (B, H, DV), stride_order=r3),
            Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))
    return launch, args


K_DECODE = aot.define("gdn_decode", source=__file__, builder=_build_gdn_decode)


def decode_params(dk: int, dv: int, qk_dtype: str, v_dtype: str, g_dtype: str, beta_dtype: str,
                  state_dtype: str = "float32", slot_dtype: str = "int64") -> dict:
    bv = 32 if dv % 32 == 0 else None
    return {"dk": int(dk), "dv": int(dv), "bv": bv, "qk_dtype": qk_dtype, "v_dtype": v_dtype, "g_dtype": g_dtype,
            "beta_dtype": beta_dtype, "state_dtype": state_dtype, "slot_dtype": slot_dtype}


def _fallback(*args):
    entry = _get_op("gdn_decode")
    cands = [b for b in entry.backends.values() if b.name != "cute" and "cuda" in b.devices and b.is_available()]
    return max(cands, key=lambda b: b.priority).fn(*args)


def gdn_decode(q, k, v, g, beta, state_pool, slots, scale):
    b, h, dk = q.shape
    dv = v.shape[-1]
    p = decode_params(dk, dv, _DTYPES.get(q.dtype), _DTYPES.get(v.dtype), _DTYPES.get(g.dtype),
                      _DTYPES.get(beta.dtype), _DTYPES.get(state_pool.dtype), _DTYPES.get(slots.dtype))
    usable = (all(x is not None for x in p.values()) and k.dtype == q.dtype and state_pool.is_contiguous()
              and tuple(state_pool.shape[1:]) == (h, dk, dv) and dk <= 256)
    fn = K_DECODE.get(p, aot.arch_of_device(q.device)) if usable else None
    if fn is None:
        return _fallback(q, k, v, g, beta, state_pool, slots, scale)
    o = torch.empty((b, h, dv), dtype=v.dtype, device=v.device)
    if b:
        fn(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state_pool,
           slots.contiguous(), o, float(scale))
    return o


def preset_specs(config: dict, dtype: str = "bfloat16") -> list:
    """The decode specializations a Qwen3.5 model calls on CUDA (q/k/v and beta in the model dtype,
    g float32, state float32, slots int64; see mstar/models/qwen3_5.py)."""
    if "linear_key_head_dim" not in config:
        return []
    return [(K_DECODE, decode_params(config["linear_key_head_dim"], config["linear_value_head_dim"], dtype, dtype,
                                     "float32", dtype))]


register_backend(gdn.gdn_decode, "cute", gdn_decode, devices=("cuda",),
                 available=lambda: torch.cuda.is_available() and K_DECODE.available(), priority=25,
                 note="CuTe DSL, in place over the state pool, compiled ahead of time (kernel_cache/)")
