"""Dense (non-paged) attention over ragged rows: the Whisper encoder's self-attention
(non-causal, every row 1500 frames) and any attention whose K/V are not in the page pool.

    dense_attention(q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, D],
                    q_indptr [R+1] int32, kv_indptr [R+1] int32, scale, causal) -> [Tq, Hq, D]

Row i's queries are q[q_indptr[i]:q_indptr[i+1]] and its keys/values k/v[kv_indptr[i]:
kv_indptr[i+1]]. causal=False: every query sees the whole row. causal=True: as in the
paged ops, a row's n queries are the last n positions of its kv sequence and query j
sees kv positions <= kv_len - n + j. GQA: query head h reads kv head h // (Hq // Hkv).
The indptr arrays may be host tensors while q/k/v are on CUDA (read without a sync).

Reference: plain torch, one batched matmul per row, scores and softmax in float32.
Backend "sdpa" (CUDA): torch's scaled_dot_product_attention in the input dtype, all rows
in one call when they have equal lengths (the encoder case), else one call per row; backend
"cudnn" (CUDA, sm90+, the default there): the same calls with cuDNN's attention kernel first.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mstar.ops.registry import define_op, register_backend

_CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_indptr: torch.Tensor,
           kv_indptr: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"dense_attention: want q [Tq, Hq, D], k = v [Tk, Hkv, D]; got q {tuple(q.shape)} "
                         f"k {tuple(k.shape)} v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"dense_attention: q heads/dim {tuple(q.shape[1:])} do not fit k heads/dim "
                         f"{tuple(k.shape[1:])} (Hq must be a multiple of Hkv)")
    if q_indptr.shape != kv_indptr.shape:
        raise ValueError(f"dense_attention: q_indptr {tuple(q_indptr.shape)} and kv_indptr "
                         f"{tuple(kv_indptr.shape)} must have one entry per row + 1")


def _row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One row in float32: q [n, Hq, D], k/v [L, Hkv, D] -> [n, Hq, D] float32."""
    n, hq, d = q.shape
    L, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    qh = q.float().reshape(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
    kh = k.float().transpose(0, 1)  # [Hkv, L, D]
    vh = v.float().transpose(0, 1)
    s = torch.bmm(qh, kh.transpose(1, 2)).mul_(scale)  # [Hkv, g * n, L]
    if causal:
        qpos = torch.arange(L - n, L, device=q.device)
        future = torch.arange(L, device=q.device)[None, :] > qpos[:, None]  # [n, L]
        s.view(hkv, g, n, L).masked_fill_(future, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.bmm(p, vh)  # [Hkv, g * n, D]
    return o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


def _dense_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_indptr: torch.Tensor,
                         kv_indptr: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Attention of ragged query rows over their own ragged K/V rows (causal or not)."""
    _check(q, k, v, q_indptr, kv_indptr)
    out = q.new_zeros(q.shape)
    qo, kvp = q_indptr.tolist(), kv_indptr.tolist()
    for i in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[i], qo[i + 1], kvp[i], kvp[i + 1]
        if q1 == q0:
            continue
        if k1 - k0 < (q1 - q0 if causal else 1):
            raise ValueError(f"dense_attention: row {i} has {q1 - q0} queries but {k1 - k0} keys")
        out[q0:q1] = _row(q[q0:q1], k[k0:k1], v[k0:k1], scale, causal).to(q.dtype)
    return out


def _dense_attention_fake(q, k, v, q_indptr, kv_indptr, scale, causal):
    return q.new_empty(q.shape)


dense_attention = define_op(
    "dense_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor q_indptr, Tensor kv_indptr, float scale, bool causal) -> Tensor",
    reference=_dense_attention_ref, fake=_dense_attention_fake)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q [B, n, Hq, D], k/v [B, L, Hkv, D] -> [B, n, Hq, D] in q's dtype.

    Causal with n == L (a prompt attending to itself) is SDPA's is_causal; causal with n < L (the
    queries are the last n of the L positions) needs the explicit bottom-right mask. Grouped heads
    (Hkv < Hq) without a mask go in as they are (enable_gqa: flash and the math kernel take them,
    cuDNN reads them natively), not repeated into a copy of the keys and values; with the mask
    they are repeated (flash takes no mask, and the efficient kernel no grouped heads)."""
    n, L = q.shape[1], k.shape[1]
    mask, is_causal = None, causal and n > 1 and n == L
    if causal and 1 < n < L:
        qpos = torch.arange(L - n, L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]
    g = q.shape[2] // k.shape[2]
    if g > 1 and mask is not None:
        k = k.repeat_interleave(g, dim=2)
        v = v.repeat_interleave(g, dim=2)
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    kw = dict(attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return F.scaled_dot_product_attention(*args, **kw).transpose(1, 2)


def dense_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_indptr: torch.Tensor,
                         kv_indptr: torch.Tensor, scale: float, causal: bool,
                         prefer_cudnn: bool = False) -> torch.Tensor:
    """The "sdpa" backend (any device; registered for CUDA); prefer_cudnn: the "cudnn" backend."""
    _check(q, k, v, q_indptr, kv_indptr)
    qo, kvp = q_indptr.tolist(), kv_indptr.tolist()
    rows = len(qo) - 1
    if rows <= 0 or q.shape[0] == 0:
        return q.new_zeros(q.shape)
    # runs of consecutive rows with the same query and key lengths: one batched call each (guided
    # rows of one prompt length, the same prompt in several requests)
    shape = [(qo[i + 1] - qo[i], kvp[i + 1] - kvp[i]) for i in range(rows)]
    runs, start = [], 0
    for i in range(1, rows + 1):
        if i == rows or shape[i] != shape[start]:
            runs.append((start, i))
            start = i
    outs = []
    with sdpa_kernel(_CUDNN_FIRST, set_priority=True) if prefer_cudnn else contextlib.nullcontext():
        for a, b in runs:  # (the backend choice entered once for all runs: it costs host time)
            n, L = shape[a]
            if n == 0:
                continue
            q0, q1, k0, k1 = qo[a], qo[b], kvp[a], kvp[b]
            outs.append((q0, q1, _sdpa(q[q0:q1].view(b - a, n, *q.shape[1:]), k[k0:k1].view(b - a, L, *k.shape[1:]),
                                       v[k0:k1].view(b - a, L, *v.shape[1:]), scale,
                                       causal).reshape(q1 - q0, *q.shape[1:])))
    return assemble_rows(q, qo, outs)


def assemble_rows(q: torch.Tensor, qo: list[int], outs: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """The op's output from (first, end, output) of each run of rows, in order. When the rows
    cover q from its first token to its last, the runs' outputs concatenated are the output (one
    copy); otherwise they go into a zeroed output at their rows."""
    if qo[0] == 0 and qo[-1] == q.shape[0] and outs:
        return outs[0][2] if len(outs) == 1 else torch.cat([o for _, _, o in outs])
    out = q.new_zeros(q.shape)
    for q0, q1, o in outs:
        out[q0:q1] = o
    return out


def dense_attention_cudnn(q, k, v, q_indptr, kv_indptr, scale: float, causal: bool) -> torch.Tensor:
    """The "cudnn" backend: "sdpa" with cuDNN's attention first (then flash, efficient, math)."""
    return dense_attention_sdpa(q, k, v, q_indptr, kv_indptr, scale, causal, prefer_cudnn=True)


def _cudnn_available() -> bool:
    return torch.cuda.is_available() and torch.backends.cudnn.is_available() \
        and torch.cuda.get_device_capability() >= (9, 0)


register_backend(dense_attention, "sdpa", dense_attention_sdpa, devices=("cuda",), priority=5,
                 note="torch scaled_dot_product_attention, input dtype (torch's choice of kernel: flash on Hopper)")
register_backend(dense_attention, "cudnn", dense_attention_cudnn, devices=("cuda",), available=_cudnn_available,
                 priority=6, note="scaled_dot_product_attention with cuDNN's kernel first (Hopper: ~1.6x flash at "
                                  "the Wan DiT's 3,510 and 27,280 tokens)")

__all__ = ["dense_attention", "assemble_rows"]
