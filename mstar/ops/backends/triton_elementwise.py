"""Triton kernels for the element-wise ops: SiLU-and-mul, relu(x)^2, rotary embedding (NeoX,
partial), and the KV append into pages. Each moves its bytes once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.ops import activation, attention, rotary
from mstar.ops.registry import register_backend


def _cuda() -> bool:
    return torch.cuda.is_available()


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    a = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = a / (1.0 + tl.exp(-a)) * b
    tl.store(out_ptr + row * d + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x):
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(n, triton.cdiv(d, block))](x2, out, d, x2.stride(0), BLOCK=block)
    return out.view(*x.shape[:-1], d)


@triton.jit
def _relu_square_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.maximum(tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + i, (x * x).to(out_ptr.dtype.element_ty), mask=mask)


def relu_square(x):
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _relu_square_kernel[(triton.cdiv(n, 4096),)](x, out, n, BLOCK=4096)
    return out


@triton.jit
def _rotary_kernel(pos_ptr, src_ptr, dst_ptr, cache_ptr, n_heads, head_dim, src_tok_stride, src_head_stride,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per token: all heads of q (or k); rotated part [0, 2*HALF), the rest copied
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    hmask = heads < n_heads
    i = tl.arange(0, HALF)[None, :]
    cos = tl.load(cache_ptr + pos * (2 * HALF) + i)
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + i)
    base = src_ptr + tok * src_tok_stride + heads * src_head_stride
    x1 = tl.load(base + i, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i, mask=hmask, other=0.0).to(tl.float32)
    obase = dst_ptr + tok * n_heads * head_dim + heads * head_dim
    tl.store(obase + i, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=hmask)
    tl.store(obase + HALF + i, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=hmask)
    if 2 * HALF < BLOCK_D:  # pass-through part of a partial rotary
        j = 2 * HALF + tl.arange(0, BLOCK_D)[None, :]
        jm = hmask & (j < head_dim)
        tl.store(obase + j, tl.load(base + j, mask=jm, other=0.0), mask=jm)


def _rotate(positions, x, cache, rotary_dim):
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        if x.stride(-1) != 1:
            x = x.contiguous()
        _rotary_kernel[(t,)](positions, x, out, cache, h, d, x.stride(0), x.stride(1), HALF=rotary_dim // 2,
                             BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d))
    return out


@triton.jit
def _norm_rope_head(base, pos, w_ptr, cache_ptr, out, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    HALF: tl.constexpr, NORM: tl.constexpr):
    # one head at `base` -> `out`: RMSNorm (rounded as ops.rms_norm rounds: NORM 0 plain, 1
    # zero-centred; 2 as ops.rms_norm_fp32_weight), then rotary over its first 2 * HALF dims at
    # position `pos` (rounded as ops.rotary_embedding rounds)
    dd = tl.arange(0, BLOCK_D)
    m = dd < D
    x = tl.load(base + dd, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    i = tl.arange(0, HALF)
    x1 = tl.load(base + i).to(tl.float32) * inv
    x2 = tl.load(base + HALF + i).to(tl.float32) * inv
    w = tl.load(w_ptr + dd, mask=m, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + i).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + i).to(tl.float32)
    ty = out.dtype.element_ty
    if NORM == 0:  # rounded before the weight too
        y = ((x * inv).to(ty).to(tl.float32) * w).to(ty)
        y1 = (x1.to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
        y2 = (x2.to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)
    else:  # the weight (1 + w when zero-centred) in float32, one rounding
        if NORM == 1:
            w = 1.0 + w
            w1 = 1.0 + w1
            w2 = 1.0 + w2
        y = (x * inv * w).to(ty)
        y1 = (x1 * w1).to(ty).to(tl.float32)
        y2 = (x2 * w2).to(ty).to(tl.float32)
    cos = tl.load(cache_ptr + pos * (2 * HALF) + i)
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + i)
    tl.store(out + dd, y, mask=m & (dd >= 2 * HALF))  # the part rotary passes through
    tl.store(out + i, (y1 * cos - y2 * sin).to(ty))
    tl.store(out + HALF + i, (y2 * cos + y1 * sin).to(ty))


@triton.jit
def _norm_rope_kernel(src_ptr, src_tok_stride, src_head_stride, pos_ptr, w_ptr, cache_ptr, dst_ptr, eps, n_heads,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    # one program per (token, head)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    _norm_rope_head(src_ptr + t * src_tok_stride + h * src_head_stride, pos, w_ptr, cache_ptr,
                    dst_ptr + (t * n_heads + h) * D, eps, D, BLOCK_D, HALF, NORM)


@triton.jit
def _norm_rope_heads(base, n_heads, pos, w_ptr, cache_ptr, out, eps, D: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, NORM: tl.constexpr, HS: tl.constexpr):
    # all n_heads heads of one token at once (head h at base + h * HS -> out + h * D), each as
    # _norm_rope_head does it; dims [2 * HALF, D) (BLOCK_R > 0) pass the rotary through
    hh = tl.arange(0, BLOCK_H)[:, None]
    hm = hh < n_heads
    i = tl.arange(0, HALF)[None, :]
    x1 = tl.load(base + hh * HS + i, mask=hm, other=0.0).to(tl.float32)
    x2 = tl.load(base + hh * HS + HALF + i, mask=hm, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if BLOCK_R > 0:
        r = 2 * HALF + tl.arange(0, BLOCK_R)[None, :]
        rm = hm & (r < D)
        x3 = tl.load(base + hh * HS + r, mask=rm, other=0.0).to(tl.float32)
        ss += tl.sum(x3 * x3, axis=1)
    inv = (1.0 / tl.sqrt(ss / D + eps))[:, None]
    x1 = x1 * inv
    x2 = x2 * inv
    w1 = tl.load(w_ptr + i).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + i).to(tl.float32)
    ty = out.dtype.element_ty
    if NORM == 1:
        w1 = 1.0 + w1
        w2 = 1.0 + w2
    if NORM == 0:
        y1 = (x1.to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
        y2 = (x2.to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)
    else:
        y1 = (x1 * w1).to(ty).to(tl.float32)
        y2 = (x2 * w2).to(ty).to(tl.float32)
    cos = tl.load(cache_ptr + pos * (2 * HALF) + i)
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + i)
    tl.store(out + hh * D + i, (y1 * cos - y2 * sin).to(ty), mask=hm)
    tl.store(out + hh * D + HALF + i, (y2 * cos + y1 * sin).to(ty), mask=hm)
    if BLOCK_R > 0:
        w3 = tl.load(w_ptr + r, mask=r < D, other=0.0).to(tl.float32)
        if NORM == 1:
            w3 = 1.0 + w3
        if NORM == 0:
            y3 = ((x3 * inv).to(ty).to(tl.float32) * w3).to(ty)
        else:
            y3 = (x3 * inv * w3).to(ty)
        tl.store(out + hh * D + r, y3, mask=rm)


@triton.jit
def _qkv_norm_rope_rows_kernel(src_ptr, src_tok_stride, pos_ptr, qw_ptr, kw_ptr, cache_ptr, q_ptr, k_ptr, v_ptr,
                               rows_ptr, eps, n_q, n_kv, D: tl.constexpr, HALF: tl.constexpr, BLOCK_Q: tl.constexpr,
                               BLOCK_KV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                               NORM: tl.constexpr, GATED: tl.constexpr):
    # one program per token of the fused projection's row [q heads | k heads | v heads] (GATED:
    # each q head [query D | gate D], the gate left in place): the q heads normed and rotated
    # into q; the k heads normed and rotated, the v heads copied, into row rows[t] of k / v,
    # none where rows[t] < 0 (a padding token's KV slot)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    row = tl.load(rows_ptr + t).to(tl.int64)
    base = src_ptr + t * src_tok_stride
    QS: tl.constexpr = 2 * D if GATED else D
    _norm_rope_heads(base, n_q, pos, qw_ptr, cache_ptr, q_ptr + t * n_q * D, eps, D, HALF, BLOCK_Q, BLOCK_R, NORM, QS)
    if row >= 0:
        kv = base + n_q * QS
        _norm_rope_heads(kv, n_kv, pos, kw_ptr, cache_ptr, k_ptr + row * n_kv * D, eps, D, HALF, BLOCK_KV, BLOCK_R,
                         NORM, D)
        j = tl.arange(0, BLOCK_V)
        vm = j < n_kv * D
        x = tl.load(kv + n_kv * D + j, mask=vm, other=0.0)
        tl.store(v_ptr + row * n_kv * D + j, x.to(v_ptr.dtype.element_ty), mask=vm)


def _norm_rope(x, positions, weight, cache, eps, norm: int, rotary_dim):
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        _norm_rope_kernel[(t, h)](x, x.stride(0), x.stride(1), positions, weight, cache, out, eps, h, D=d,
                                  BLOCK_D=triton.next_power_of_2(d), HALF=rotary_dim // 2, NORM=norm)
    return out


def _qk_norm_rope(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
                  rotary_dim, eps, norm: int, gated: bool):
    cache = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
    q, k, v, _ = rotary.split_qkv_heads(qkv, num_q_heads, num_kv_heads, head_dim, gated)
    return (_norm_rope(q, positions, q_weight, cache, eps, norm, rotary_dim),
            _norm_rope(k, positions, k_weight, cache, eps, norm, rotary_dim),
            v.clone(memory_format=torch.contiguous_format))


def _kernel_takes(qkv, rotary_dim: int) -> bool:
    return rotary_dim // 2 == triton.next_power_of_2(rotary_dim // 2) and qkv.stride(-1) == 1


def qk_norm_rope(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
                 rotary_dim, eps, zero_centered, gated):
    args = (qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, rotary_dim, eps)
    if not _kernel_takes(qkv, rotary_dim):
        return rotary.qk_norm_rope.backends["reference"].fn(*args, zero_centered, gated)
    return _qk_norm_rope(*args, 1 if zero_centered else 0, gated)


def qk_norm_rope_fp32_weight(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
                             rotary_dim, eps):
    args = (qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, rotary_dim, eps)
    if not _kernel_takes(qkv, rotary_dim):
        return rotary.qk_norm_rope_fp32_weight.backends["reference"].fn(*args)
    return _qk_norm_rope(*args, 2, False)


def _qkv_rows(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, rotary_dim,
              eps, k_out, v_out, kv_rows, norm: int, gated: bool):
    """q [T, Hq, D] normed and rotated; token t's k (normed, rotated) and v written to row
    kv_rows[t] of k_out / v_out (contiguous, [N, Hkv, D] as rows), none where kv_rows[t] < 0."""
    cache = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
    t = qkv.shape[0]
    q = torch.empty((t, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t:
        rest = head_dim - rotary_dim
        _qkv_norm_rope_rows_kernel[(t,)](
            qkv, qkv.stride(0), positions, q_weight, k_weight, cache, q, k_out, v_out, kv_rows, eps, num_q_heads,
            num_kv_heads, D=head_dim, HALF=rotary_dim // 2, BLOCK_Q=triton.next_power_of_2(num_q_heads),
            BLOCK_KV=triton.next_power_of_2(num_kv_heads), BLOCK_R=triton.next_power_of_2(rest) if rest else 0,
            BLOCK_V=triton.next_power_of_2(num_kv_heads * head_dim), NORM=norm, GATED=gated)
    return q


def qk_norm_rope_kv_fp32_weight(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads,
                                head_dim, rotary_dim, eps, k_out, v_out, kv_rows):
    args = (qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, rotary_dim, eps,
            k_out, v_out, kv_rows)
    if not _kernel_takes(qkv, rotary_dim) or not (k_out.is_contiguous() and v_out.is_contiguous()):
        return rotary.qk_norm_rope_kv_fp32_weight.backends["reference"].fn(*args)
    return _qkv_rows(*args, 2, False)


def qk_norm_rope_append(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
                        rotary_dim, eps, zero_centered, gated, k_cache, v_cache, slot_mapping):
    args = (qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, rotary_dim, eps)
    # the kernel rounds k and v once, to the cache's dtype: it takes caches of the projection's dtype
    if (not _kernel_takes(qkv, rotary_dim) or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype):
        return rotary.qk_norm_rope_append.backends["reference"].fn(*args, zero_centered, gated, k_cache, v_cache,
                                                                   slot_mapping)
    return _qkv_rows(*args, k_cache, v_cache, slot_mapping, 1 if zero_centered else 0, gated)


@triton.jit
def _sigmoid_mul_kernel(x_ptr, g_ptr, out_ptr, n_heads, x_tok_stride, x_head_stride, g_tok_stride, g_head_stride,
                        D: tl.constexpr, BLOCK_H: tl.constexpr):
    # one program per token: out = x * sigmoid(g), sigmoid rounded to g's dtype first (as torch)
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)[:, None]
    dd = tl.arange(0, D)[None, :]
    m = hh < n_heads
    g = tl.load(g_ptr + t * g_tok_stride + hh * g_head_stride + dd, mask=m, other=0.0)
    s = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(g.dtype).to(tl.float32)
    x = tl.load(x_ptr + t * x_tok_stride + hh * x_head_stride + dd, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + (t * n_heads + hh) * D + dd, (x * s).to(out_ptr.dtype.element_ty), mask=m)


def sigmoid_mul(x, gate):
    t, h, d = x.shape
    if (d != triton.next_power_of_2(d) or x.stride(-1) != 1 or gate.stride(-1) != 1 or x.dtype != gate.dtype):
        return activation.sigmoid_mul.backends["reference"].fn(x, gate)
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        _sigmoid_mul_kernel[(t,)](x, gate, out, h, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), D=d,
                                  BLOCK_H=triton.next_power_of_2(h))
    return out


def rotary_embedding(positions, q, k, cos_sin_cache, rotary_dim):
    if rotary_dim // 2 != triton.next_power_of_2(rotary_dim // 2):  # tl.arange needs powers of two
        return rotary.rotary_embedding.backends["reference"].fn(positions, q, k, cos_sin_cache, rotary_dim)
    cache = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
    return _rotate(positions, q, cache, rotary_dim), _rotate(positions, k, cache, rotary_dim)


@triton.jit
def _kv_append_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, row_elems, k_stride, v_stride,
                      BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < row_elems
        k = tl.load(k_ptr + tok * k_stride + cols, mask=mask)
        v = tl.load(v_ptr + tok * v_stride + cols, mask=mask)
        tl.store(kc_ptr + slot * row_elems + cols, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + slot * row_elems + cols, v.to(vc_ptr.dtype.element_ty), mask=mask)


def kv_append(k, v, k_cache, v_cache, slot_mapping):
    t = k.shape[0]
    if t == 0:
        return
    row = k_cache.shape[-2] * k_cache.shape[-1]
    k2, v2 = k.reshape(t, -1), v.reshape(t, -1)
    if k2.stride(-1) != 1:
        k2 = k2.contiguous()
    if v2.stride(-1) != 1:
        v2 = v2.contiguous()
    block = min(1024, triton.next_power_of_2(row))
    _kv_append_kernel[(t, triton.cdiv(row, block))](k2, v2, k_cache, v_cache, slot_mapping, row, k2.stride(0),
                                                    v2.stride(0), BLOCK=block)


register_backend(activation.silu_and_mul, "triton", silu_and_mul, available=_cuda, priority=20)
register_backend(activation.relu_square, "triton", relu_square, available=_cuda, priority=20)
register_backend(rotary.rotary_embedding, "triton", rotary_embedding, available=_cuda, priority=20)
register_backend(attention.kv_append, "triton", kv_append, available=_cuda, priority=20)
register_backend(rotary.qk_norm_rope, "triton", qk_norm_rope, available=_cuda, priority=20,
                 note="norm + rotary of each q / k head in one kernel")
register_backend(rotary.qk_norm_rope_fp32_weight, "triton", qk_norm_rope_fp32_weight, available=_cuda, priority=20,
                 note="norm + rotary of each q / k head in one kernel")
register_backend(rotary.qk_norm_rope_kv_fp32_weight, "triton", qk_norm_rope_kv_fp32_weight, available=_cuda,
                 priority=20, note="q, k, v heads in one kernel, k and v written into their rows of the joint keys")
register_backend(rotary.qk_norm_rope_append, "triton", qk_norm_rope_append, available=_cuda, priority=20,
                 note="q, k, v heads in one kernel, k and v written into their KV-cache slots")
register_backend(activation.sigmoid_mul, "triton", sigmoid_mul, available=_cuda, priority=20)
