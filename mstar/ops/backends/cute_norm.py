"""CuTe DSL kernels for the norm ops, compiled ahead of time (mstar/ops/cache/cute.py).

    rms_norm            y = x / rms(x) * w   (w -> 1 + w when zero_centered)
    fused_add_rms_norm  s = x + residual (rounded to the activation dtype), y = rms_norm(s)
    gated_rms_norm      y = (w * round(x / rms(x))) * silu(z)   (GDN output norm)

Rounding follows the references in mstar/ops/norm.py: float32 arithmetic, the plain form
rounds the normalised x to the activation dtype before the weight, the zero-centred form
rounds once at the end, the new residual is rounded before it is normalised.

Two shapes of launch, chosen per hidden size at build time:
    block  one CTA per row (hidden > 512): each thread keeps hidden/threads values in
           registers; warp shuffles, then one shared-memory step across warps
    warp   one warp per row, 4 rows per CTA (hidden <= 512: q/k norms, the GDN output norm):
           shuffles only
Every input is read once and every output written once. Rows are dynamic; the hidden size,
dtypes, zero_centered and the launch shape are compile-time (part of the cache key).

Registered as backend "cute" (CUDA only) below Triton's priority: select it with
MSTAR_BACKENDS=rms_norm=cute,... until the H200 bench shows it ahead. A specialization that is
neither cached nor buildable here runs on the next backend instead.
"""

import logging

import torch

from mstar.ops import norm
from mstar.ops.cache import cute as aot  # not cutlass.cute: the DSL is imported only inside builders
from mstar.ops.registry import get as _get_op
from mstar.ops.registry import register_backend

log = logging.getLogger("mstar.ops")

WARP_MAX_H = 512
ROWS_PER_CTA = 4  # warp mode


# --- the kernels (built only where the DSL is installed) ------------------------------------------
def _cutlass_type(name: str):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}[name]


def _build_norm(p: dict):
    """(jit function, compile args) for one specialization; see module doc for the params."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    kind = p["kind"]  # "rms" | "add_rms" | "gated"
    H, NT, mode = p["hidden"], p["threads"], p["mode"]
    dt, wdt = _cutlass_type(p["dtype"]), _cutlass_type(p["w_dtype"])
    zdt = _cutlass_type(p["z_dtype"]) if kind == "gated" else dt
    zero_centered = bool(p.get("zero_centered", False))
    has_res = kind == "add_rms"
    gated = kind == "gated"
    if mode == "warp":
        TPR, R = 32, NT // 32  # threads per row, rows per CTA
    else:
        TPR, R = NT, 1
    ITER = (H + TPR - 1) // TPR
    NW = NT // 32
    EXACT = H % TPR == 0

    @cute.kernel
    def kernel(x: cute.Tensor, r: cute.Tensor, w: cute.Tensor, out: cute.Tensor, rout: cute.Tensor,
               eps: Float32, n_rows: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        if const_expr(mode == "warp"):
            row = bid * R + warp
            t = lane
        else:
            row = bid
            t = tid
        vals = cute.make_rmem_tensor((ITER,), Float32)
        ss = Float32(0.0)
        if row < n_rows:
            for i in cutlass.range_constexpr(ITER):
                c = t + i * TPR
                v = Float32(0.0)
                if const_expr(EXACT):
                    v = Float32(x[row, c])
                    if const_expr(has_res):
                        s = dt(v + Float32(r[row, c]))
                        rout[row, c] = s
                        v = Float32(s)
                else:
                    if c < H:
                        v = Float32(x[row, c])
                        if const_expr(has_res):
                            s = dt(v + Float32(r[row, c]))
                            rout[row, c] = s
                            v = Float32(s)
                vals[i] = v
                ss = ss + v * v
            ss = cute.arch.warp_reduction_sum(ss)
        if const_expr(mode == "block" and NW > 1):
            red = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(NW), 16)
            if lane == 0:
                red[warp] = ss
            cute.arch.sync_threads()
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(NW):
                ss = ss + red[i]
        if row < n_rows:
            rinv = cute.math.rsqrt(ss / Float32(H) + eps)
            for i in cutlass.range_constexpr(ITER):
                c = t + i * TPR
                if c < H:
                    y = vals[i] * rinv
                    wf = Float32(w[c])
                    if const_expr(gated):
                        zf = Float32(r[row, c])
                        gate = zf / (Float32(1.0) + cute.math.exp(-zf))
                        out[row, c] = dt(wf * Float32(dt(y)) * gate)
                    elif const_expr(zero_centered):
                        out[row, c] = dt(y * (wf + Float32(1.0)))
                    else:
                        out[row, c] = dt(Float32(dt(y)) * wf)

    @cute.jit
    def launch(x: cute.Tensor, r: cute.Tensor, w: cute.Tensor, out: cute.Tensor, rout: cute.Tensor,
               eps: Float32, n_rows: Int32, stream):
        kernel(x, r, w, out, rout, eps, n_rows).launch(grid=((n_rows + R - 1) // R, 1, 1), block=(NT, 1, 1),
                                                       stream=stream)

    M = cute.sym_int()

    def rows(d):
        return make_fake_compact_tensor(d, (M, H), stride_order=(1, 0))

    args = (rows(dt), rows(zdt), make_fake_compact_tensor(wdt, (H,)), rows(dt), rows(dt), Float32(1e-6), Int32(1),
            make_fake_stream(use_tvm_ffi_env_stream=True))
    return launch, args


K_RMS = aot.define("rms_norm", source=__file__, builder=_build_norm)
K_ADD = aot.define("fused_add_rms_norm", source=__file__, builder=_build_norm)
K_GATED = aot.define("gated_rms_norm", source=__file__, builder=_build_norm)

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def launch_shape(hidden: int) -> dict:
    if hidden <= WARP_MAX_H:
        return {"mode": "warp", "threads": 32 * ROWS_PER_CTA}
    for nt in (256, 128, 64):
        if hidden % nt == 0 and hidden // nt >= 4:
            return {"mode": "block", "threads": nt}
    return {"mode": "block", "threads": 128}


def norm_params(kind: str, hidden: int, dtype: str, w_dtype: str, zero_centered: bool = False,
                z_dtype: str | None = None) -> dict:
    p = {"kind": kind, "hidden": int(hidden), "dtype": dtype, "w_dtype": w_dtype, **launch_shape(hidden)}
    if kind == "gated":
        p["z_dtype"] = z_dtype or dtype
    else:
        p["zero_centered"] = bool(zero_centered)
    return p


# --- the backend -------------------------------------------------------------------------------
def _fallback(op: str, *args):
    entry = _get_op(op)
    cands = [b for b in entry.backends.values() if b.name != "cute" and "cuda" in b.devices and b.is_available()]
    return max(cands, key=lambda b: b.priority).fn(*args)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _fn(k: aot.CuteKernel, params: dict, device: torch.device):
    if any(v is None for v in params.values()):
        return None
    return k.get(params, aot.arch_of_device(device))


def _run_rms(kind, x, residual, weight, eps, zero_centered):
    k = K_ADD if kind == "add_rms" else K_RMS
    params = norm_params(kind, x.shape[-1], _DTYPES.get(x.dtype), _DTYPES.get(weight.dtype), zero_centered)
    ok = residual is None or residual.dtype == x.dtype
    fn = _fn(k, params, x.device) if ok and params["dtype"] and params["w_dtype"] and weight.is_contiguous() else None
    if fn is None:
        return None
    x2 = _rows(x)
    out = torch.empty_like(x2)
    n = x2.shape[0]
    if residual is not None:
        r2 = _rows(residual)
        rout = torch.empty_like(x2)
    else:
        r2, rout = x2, out  # unused by the kernel
    if n:
        fn(x2, r2, weight, out, rout, float(eps), n)
    return out.view(x.shape), rout.view(x.shape)


def rms_norm(x, weight, eps, zero_centered):
    res = _run_rms("rms", x, None, weight, eps, zero_centered)
    return _fallback("rms_norm", x, weight, eps, zero_centered) if res is None else res[0]


def fused_add_rms_norm(x, residual, weight, eps, zero_centered):
    res = _run_rms("add_rms", x, residual, weight, eps, zero_centered)
    return _fallback("fused_add_rms_norm", x, residual, weight, eps, zero_centered) if res is None else res


def gated_rms_norm(x, z, weight, eps):
    params = norm_params("gated", x.shape[-1], _DTYPES.get(x.dtype), _DTYPES.get(weight.dtype),
                         z_dtype=_DTYPES.get(z.dtype))
    fn = _fn(K_GATED, params, x.device) if weight.is_contiguous() and z.shape == x.shape else None
    if fn is None:
        return _fallback("gated_rms_norm", x, z, weight, eps)
    x2, z2 = _rows(x), _rows(z)
    out = torch.empty_like(x2)
    if x2.shape[0]:
        fn(x2, z2, weight, out, out, float(eps), x2.shape[0])
    return out.view(x.shape)


# --- what a model needs (python -m mstar.ops.cache build) ----------------------------------------------
def preset_specs(config: dict, dtype: str = "bfloat16", w_dtype: str | None = None) -> list:
    """Every norm specialization a model with this (HF-style) config calls on CUDA."""
    w_dtype = w_dtype or dtype
    zc = config.get("model_type", "").startswith("qwen3_5") or "linear_num_value_heads" in config
    h = config["hidden_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    specs = [(K_RMS, norm_params("rms", h, dtype, w_dtype, zc)),
             (K_ADD, norm_params("add_rms", h, dtype, w_dtype, zc)),
             (K_RMS, norm_params("rms", hd, dtype, w_dtype, zc))]
    if "linear_value_head_dim" in config:
        specs.append((K_GATED, norm_params("gated", config["linear_value_head_dim"], dtype, w_dtype)))
    return specs


def _cuda_ok() -> bool:
    return torch.cuda.is_available()


for _op, _fnc, _k in ((norm.rms_norm, rms_norm, K_RMS), (norm.fused_add_rms_norm, fused_add_rms_norm, K_ADD),
                      (norm.gated_rms_norm, gated_rms_norm, K_GATED)):
    register_backend(_op, "cute", _fnc, devices=("cuda",),
                     available=(lambda k=_k: _cuda_ok() and k.available()), priority=15,
                     note="CuTe DSL, compiled ahead of time (kernel_cache/)")
