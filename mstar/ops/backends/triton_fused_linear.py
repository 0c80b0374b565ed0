"""The fused-linear ops (ops/fused_linear.py) for a one-row decode step: one Triton kernel that
computes the elementwise op as it loads the product's input, instead of a kernel that writes that
input and cuBLAS reading it back.

A decode step of one row is a chain of products a few microseconds each, with a norm or an
activation of ~1-2 us between every two; most of those kernels' time is their launch and ramp,
not their bytes. Here a program owns one row and BN output features and loops over K: it loads
its [BN, BK] weight tile and the matching BK inputs, applies the op to them in float32, rounds
the result to the weight dtype (as the op's own output is rounded), and accumulates the product
in float32 by FMA (a GEMV).

The residual add + RMSNorm needs the sum of squares of the whole row before any of it is
normalised; the kernel multiplies the unnormalised (x + residual) * w and scales the row's sums
by 1 / rms at the end (one pass over x, the rounding applied to (x + residual) * w instead of to
the normalised value). Gated DeltaNet's output norm is per head: a K block holds whole heads, so
it normalises each head as the block is loaded, rounding as the op does.

With MSTAR_PDL on (Hopper and newer; off by default: notes/llm-decode-step.md) the kernel is
launched with programmatic dependent launch (ops/backends/pdl.py): a program prefetches the first
weights it will read into L2, then waits for the kernel that writes its input, so that a product's
first weight bytes are on chip when the op before it ends.

Above MAX_ROWS rows, and at product shapes that TUNED does not list (unless
MSTAR_FUSED_LINEAR_SHAPES=any), the ops run composed: the elementwise op's kernel, then cuBLAS. At
two or more rows the kernel's re-reads of each weight tile, and at 4B its prologue, cost more than
the launch it saves (probe_fused_linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mstar import knobs, ops
from mstar.ops.backends import pdl
from mstar.ops.registry import register_backend

MAX_ROWS = 1

# prologues (the op folded into the product's loads); a jitted kernel reads module globals only as constexpr
ADD_RMS, SILU_MUL, GATED_RMS, SIGMOID_MUL = (tl.constexpr(i) for i in range(1, 5))


@triton.jit
def _prefetch_l2(ptrs):
    """A prefetch into L2 of the cache line at each pointer (nothing returned to the program)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _fused_linear_kernel(x_ptr, aux_ptr, nw_ptr, res_out_ptr, w_ptr, y_ptr, N, K, x_stride, aux_stride,
                         aux_group_stride, res_out_stride, y_stride, eps, PRO: tl.constexpr,
                         ZERO_CENTERED: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         PF: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    """y[row, block] = prologue(x, aux)[row] @ w[block].T for the program's row and BN output features.

    aux: ADD_RMS the residual; SILU_MUL the up half (x the gate half); GATED_RMS the gate z and
    SIGMOID_MUL the attention gate, both read per head (group of G features) through their head
    stride. nw: the norm's weight (per feature, or per group position for GATED_RMS).

    Under PDL the program first asks L2 for the weights of its first PF inputs (a prefetch a
    LINE-element cache line; no kernel writes them), then waits for the kernel that writes x: its
    first weight bytes come on chip while that kernel ends."""
    row = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    n_mask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    if PDL:
        lines = tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K + (tl.arange(0, PF // LINE) * LINE)[None, :]
        _prefetch_l2(w_ptr + lines)
        gdc_wait()
    x_row, aux_row = x_ptr + row * x_stride, aux_ptr + row * aux_stride
    acc = tl.zeros((BN,), dtype=tl.float32)
    sumsq = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_mask = rk < K
        x = tl.load(x_row + rk, mask=k_mask, other=0.0).to(tl.float32)
        if PRO == ADD_RMS:
            h = (x + tl.load(aux_row + rk, mask=k_mask, other=0.0).to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            if pid_n == 0:  # the new residual, as the op rounds it
                tl.store(res_out_ptr + row * res_out_stride + rk, h, mask=k_mask)
            hf = h.to(tl.float32)
            sumsq += hf * hf
            nw = tl.load(nw_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                nw = nw + 1.0
            xk = hf * nw
        elif PRO == SILU_MUL:
            u = tl.load(aux_row + rk, mask=k_mask, other=0.0).to(tl.float32)
            xk = x / (1.0 + tl.exp(-x)) * u
        elif PRO == GATED_RMS:
            heads = tl.reshape(x, (BK // G, G))
            rstd = tl.rsqrt(tl.sum(heads * heads, axis=1) / G + eps)
            normed = tl.reshape(heads * rstd[:, None], (BK,))
            normed = normed.to(w_ptr.dtype.element_ty).to(tl.float32)  # rounded before the weight, as the op
            z = tl.load(aux_row + (rk // G) * aux_group_stride + rk % G, mask=k_mask, other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + rk % G, mask=k_mask, other=0.0).to(tl.float32)
            xk = nw * normed * (z / (1.0 + tl.exp(-z)))
        else:  # SIGMOID_MUL
            g = tl.load(aux_row + (rk // G) * aux_group_stride + rk % G, mask=k_mask, other=0.0).to(tl.float32)
            sig = (1.0 / (1.0 + tl.exp(-g))).to(w_ptr.dtype.element_ty).to(tl.float32)  # torch rounds it first
            xk = x * sig
        xk = xk.to(w_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    if PRO == ADD_RMS:
        acc = acc * tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    if PDL:  # the next kernel may start loading its weights while this one stores and ends
        gdc_launch_dependents()
    tl.store(y_ptr + row * y_stride + rn, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


# (prologue, N, K) -> (BN, BK, warps): the best of `python -m mstar.bench.tools.probe_fused_linear`'s sweep
# at one row on an H100 (notes/llm-decode-step.md), the Qwen3.5 0.8B and 4B decode products. The best
# block shape differs by up to 1.5x from one product to the next, and a poor one loses to the composed
# pair, so a product whose shape is not here runs composed.
TUNED = {
    # Qwen3.5-0.8B: GDN in_proj, attention qkv, gate_up; down; GDN out_proj; o_proj
    (int(ADD_RMS), 8224, 1024): (4, 256, 4), (int(ADD_RMS), 5120, 1024): (4, 1024, 4),
    (int(ADD_RMS), 7168, 1024): (4, 256, 4), (int(SILU_MUL), 1024, 3584): (8, 1024, 8),
    (int(GATED_RMS), 1024, 2048): (4, 1024, 8), (int(SIGMOID_MUL), 1024, 2048): (8, 1024, 8),
    # Qwen3.5-4B: the same products
    (int(ADD_RMS), 12352, 2560): (4, 512, 2), (int(ADD_RMS), 10240, 2560): (4, 512, 2),
    (int(ADD_RMS), 18432, 2560): (8, 512, 2), (int(SILU_MUL), 2560, 9216): (8, 1024, 8),
    (int(GATED_RMS), 2560, 4096): (4, 1024, 4), (int(SIGMOID_MUL), 2560, 4096): (8, 1024, 8),
}


UNTUNED = (8, 512, 4)  # MSTAR_FUSED_LINEAR_SHAPES=any at a shape TUNED does not hold


def pick_config(pro: int, n: int, k: int) -> dict | None:
    """Launch parameters for a product of n output features over k, or None (composed): TUNED's,
    else (MSTAR_FUSED_LINEAR_SHAPES=any) UNTUNED."""
    tuned = TUNED.get((int(pro), n, k))
    if tuned is None:
        if knobs.value("MSTAR_FUSED_LINEAR_SHAPES") != "any":
            return None
        tuned = UNTUNED
    bn, bk, warps = tuned
    return dict(BN=bn, BK=bk, num_warps=warps, num_stages=3)


PREFETCH_ELEMENTS = 8192  # weight elements a program asks L2 for before its wait under PDL: 16 KB of bf16


def prefetch_width(k: int, bn: int) -> int:
    """The K width (a power of two) of the weights a program prefetches before its wait under PDL."""
    return min(1 << (k.bit_length() - 1), max(PREFETCH_ELEMENTS // bn, 64))


def launch(pro: int, x: torch.Tensor, aux: torch.Tensor, aux_stride: int, aux_group_stride: int,
           norm_weight: torch.Tensor | None, weight: torch.Tensor, eps: float = 0.0, zero_centered: bool = False,
           group: int = 1, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, the new residual for ADD_RMS else None) of the kernel over x [M, K] (unit feature stride)
    and weight [N, K] (contiguous), a program per row and BN output features (several rows: each
    weight tile's programs side by side, its re-reads from L2); `config` overrides pick_config (the
    probe's sweep)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if pro == ADD_RMS else y
    cfg = config or pick_config(pro, n, k)
    launch_pdl = pdl.launch_options(x)
    pf = prefetch_width(k, cfg["BN"]) if launch_pdl["PDL"] else 1  # read under PDL only: one compile for all K
    _fused_linear_kernel[(m, triton.cdiv(n, cfg["BN"]))](
        x, aux, norm_weight if norm_weight is not None else weight, res_out, weight, y, n, k, x.stride(0),
        aux_stride, aux_group_stride, res_out.stride(0), y.stride(0), eps, PRO=int(pro), ZERO_CENTERED=zero_centered,
        G=group, PF=pf, LINE=min(128 // weight.element_size(), pf), **cfg, **launch_pdl)
    return y, (res_out if pro == ADD_RMS else None)


def _config(pro: int, x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The kernel's launch parameters for x's rows with this weight, or None (composed): few rows, one
    dtype, a contiguous weight, a shape pick_config has blocks for."""
    if not (0 < x.shape[0] <= MAX_ROWS and weight.is_contiguous() and x.dtype == weight.dtype):
        return None
    return pick_config(pro, weight.shape[0], weight.shape[1])


def _flat_heads(x: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, D] as [T, H * D] rows with unit stride, or None where no view holds it."""
    if x.stride(-1) != 1 or x.stride(1) != x.shape[2]:
        return None
    return x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))


# --- composed: the elementwise op's selected backend, then cuBLAS (the path without this kernel) ----
def composed_add_rms_norm_linear(x, residual, norm_weight, eps, zero_centered, weight):
    normed, s = ops.fused_add_rms_norm(x, residual, norm_weight, eps, zero_centered)
    return F.linear(normed, weight), s


def composed_silu_mul_linear(x, weight):
    return F.linear(ops.silu_and_mul(x), weight)


def composed_gated_rms_norm_linear(x, z, norm_weight, eps, weight):
    return F.linear(ops.gated_rms_norm(x, z, norm_weight, eps).reshape(x.shape[0], -1), weight)


def composed_sigmoid_mul_linear(x, gate, weight):
    return F.linear(ops.sigmoid_mul(x, gate).reshape(x.shape[0], -1), weight)


# --- the kernel up to MAX_ROWS rows at a tuned shape, composed elsewhere -----------------------
def add_rms_norm_linear(x, residual, norm_weight, eps, zero_centered, weight):
    cfg = _config(ADD_RMS, x, weight)
    if cfg is None or x.dim() != 2 or x.stride(-1) != 1 or residual.stride(-1) != 1:
        return composed_add_rms_norm_linear(x, residual, norm_weight, eps, zero_centered, weight)
    return launch(ADD_RMS, x, residual, residual.stride(0), 0, norm_weight, weight, eps, zero_centered, config=cfg)


def silu_mul_linear(x, weight):
    k = weight.shape[1]
    cfg = _config(SILU_MUL, x, weight)
    if cfg is None or x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] != 2 * k:
        return composed_silu_mul_linear(x, weight)
    return launch(SILU_MUL, x[:, :k], x[:, k:], x.stride(0), 0, None, weight, config=cfg)[0]


def _per_head(pro: int, x, aux, norm_weight, eps, weight):
    """GATED_RMS / SIGMOID_MUL over x, aux [T, H, D]; None where the kernel cannot take them."""
    cfg = _config(pro, x, weight)
    if cfg is None or x.dim() != 3 or aux.dim() != 3 or aux.stride(-1) != 1:
        return None
    flat, d = _flat_heads(x), x.shape[-1]
    if flat is None or d & (d - 1) or cfg["BK"] % d:  # a K block holds whole heads
        return None
    return launch(pro, flat, aux, aux.stride(0), aux.stride(1), norm_weight, weight, eps, group=d, config=cfg)[0]


def gated_rms_norm_linear(x, z, norm_weight, eps, weight):
    y = _per_head(GATED_RMS, x, z, norm_weight, eps, weight)
    return composed_gated_rms_norm_linear(x, z, norm_weight, eps, weight) if y is None else y


def sigmoid_mul_linear(x, gate, weight):
    y = _per_head(SIGMOID_MUL, x, gate, None, 0.0, weight)
    return composed_sigmoid_mul_linear(x, gate, weight) if y is None else y


def _cuda() -> bool:
    return torch.cuda.is_available()


for _name in ("add_rms_norm_linear", "silu_mul_linear", "gated_rms_norm_linear", "sigmoid_mul_linear"):
    register_backend(_name, "composed", globals()["composed_" + _name], available=_cuda, priority=5,
                     note="the elementwise op's kernel, then cuBLAS")
    register_backend(_name, "triton", globals()[_name], available=_cuda, priority=10,
                     note=f"one kernel up to {MAX_ROWS} row(s) at the tuned shapes (the op folded into the product's "
                          "loads); composed elsewhere")
