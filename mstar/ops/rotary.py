"""Rotary position embedding (NeoX / rotate-half layout), full or partial.

The cos/sin table is built once per model (`build_cos_sin_cache`) and indexed per token by
its position, so rows of a step may sit at any positions. Layout of the table:
[max_positions, rotary_dim] float32, cos(pos * inv_freq) in [:, :rotary_dim // 2] and
sin(pos * inv_freq) in [:, rotary_dim // 2:].

Within each head, the first `rotary_dim` dims are rotated: with r = rotary_dim // 2,
element i < r pairs with element i + r (x1 = x[:r], x2 = x[r:rotary_dim]):
    out1 = x1 * cos - x2 * sin,   out2 = x2 * cos + x1 * sin
and dims rotary_dim.. pass through unchanged (partial rotary, e.g. Qwen3.5 rotates the
first 64 of 256). This equals transformers' `apply_rotary_pos_emb` with default rope.
"""

from __future__ import annotations

import torch

from mstar.ops.attention import _kv_append_ref
from mstar.ops.norm import _rms_norm_fp32_weight_ref, _rms_norm_ref
from mstar.ops.registry import define_op


def build_cos_sin_cache(max_positions: int, rotary_dim: int, base: float, device=None) -> torch.Tensor:
    """The [max_positions, rotary_dim] float32 cos|sin table of default rope
    (inv_freq = 1 / base ** (arange(0, rotary_dim, 2) / rotary_dim), as transformers)."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    # Computed on the CPU (as transformers computes inv_freq) so every device gets the same table.
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]  # the same fp32 products as transformers
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, 1, rotary_dim // 2] float32. Fresh contiguous x.dtype tensor."""
    r = rotary_dim // 2
    xf = x.float()
    x1 = xf[..., :r]
    x2 = xf[..., r:rotary_dim]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rotary_dim < x.shape[-1]:
        parts.append(xf[..., rotary_dim:])
    return torch.cat(parts, dim=-1).to(x.dtype)


def _rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          cos_sin_cache: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated at `positions` over the first rotary_dim dims of each head (NeoX layout)."""
    cs = cos_sin_cache.index_select(0, positions.long()).float()  # [T, rotary_dim]
    r = rotary_dim // 2
    cos = cs[:, None, :r]
    sin = cs[:, None, r:rotary_dim]
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)


def _rotary_embedding_fake(positions, q, k, cos_sin_cache, rotary_dim):
    return q.new_empty(q.shape), k.new_empty(k.shape)


rotary_embedding = define_op(
    "rotary_embedding",
    "(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, int rotary_dim) -> (Tensor, Tensor)",
    reference=_rotary_embedding_ref, fake=_rotary_embedding_fake)



# --- q/k head norms + rotary, from the fused qkv projection ------------------------------------
def split_qkv_heads(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, gated: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Views of q [T, Hq, D], k, v [T, Hkv, D] and the output gate [T, Hq, D] (gated: each q
    head is [query D | gate D], Qwen3.5) in the rows of the fused projection."""
    t, d = qkv.shape[0], head_dim
    q_rows = num_q_heads * d * (2 if gated else 1)
    if gated:
        qg = qkv[:, :q_rows].view(t, num_q_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
    else:
        q, gate = qkv[:, :q_rows].view(t, num_q_heads, d), None
    k = qkv[:, q_rows:q_rows + num_kv_heads * d].view(t, num_kv_heads, d)
    v = qkv[:, q_rows + num_kv_heads * d:].view(t, num_kv_heads, d)
    return q, k, v, gate


def _qk_norm_rope_ref(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                      rotary_dim: int, eps: float, zero_centered: bool, gated: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then rotary at `positions` -> contiguous q, k, v."""
    q, k, v, _ = split_qkv_heads(qkv, num_q_heads, num_kv_heads, head_dim, gated)
    q = _rms_norm_ref(q.contiguous(), q_weight, eps, zero_centered)
    k = _rms_norm_ref(k.contiguous(), k_weight, eps, zero_centered)
    q, k = _rotary_embedding_ref(positions, q, k, cos_sin_cache, rotary_dim)
    return q, k, v.clone(memory_format=torch.contiguous_format)  # never a view of qkv (custom-op rule)


def _qk_norm_rope_fake(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
                       rotary_dim, eps, zero_centered, gated):
    t = qkv.shape[0]
    return (qkv.new_empty((t, num_q_heads, head_dim)), qkv.new_empty((t, num_kv_heads, head_dim)),
            qkv.new_empty((t, num_kv_heads, head_dim)))


qk_norm_rope = define_op(
    "qk_norm_rope",
    "(Tensor qkv, Tensor positions, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, int num_q_heads, "
    "int num_kv_heads, int head_dim, int rotary_dim, float eps, bool zero_centered, bool gated) "
    "-> (Tensor, Tensor, Tensor)",
    reference=_qk_norm_rope_ref, fake=_qk_norm_rope_fake)



def _qk_norm_rope_fp32_weight_ref(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor,
                                  k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, num_q_heads: int,
                                  num_kv_heads: int, head_dim: int, rotary_dim: int, eps: float
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qk_norm_rope with the head norms of rms_norm_fp32_weight (the weight in float32, one
    rounding: Nemotron's, Cosmos3's) -> contiguous q, k, v."""
    q, k, v, _ = split_qkv_heads(qkv, num_q_heads, num_kv_heads, head_dim, False)
    q = _rms_norm_fp32_weight_ref(q.contiguous(), q_weight, eps)
    k = _rms_norm_fp32_weight_ref(k.contiguous(), k_weight, eps)
    q, k = _rotary_embedding_ref(positions, q, k, cos_sin_cache, rotary_dim)
    return q, k, v.clone(memory_format=torch.contiguous_format)


def _qk_norm_rope_fp32_weight_fake(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads,
                                   head_dim, rotary_dim, eps):
    return _qk_norm_rope_fake(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
                              rotary_dim, eps, False, False)


qk_norm_rope_fp32_weight = define_op(
    "qk_norm_rope_fp32_weight",
    "(Tensor qkv, Tensor positions, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, int num_q_heads, "
    "int num_kv_heads, int head_dim, int rotary_dim, float eps) -> (Tensor, Tensor, Tensor)",
    reference=_qk_norm_rope_fp32_weight_ref, fake=_qk_norm_rope_fp32_weight_fake)



def _qk_norm_rope_kv_fp32_weight_ref(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor,
                                     k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, num_q_heads: int,
                                     num_kv_heads: int, head_dim: int, rotary_dim: int, eps: float,
                                     k_out: torch.Tensor, v_out: torch.Tensor, kv_rows: torch.Tensor) -> torch.Tensor:
    """qk_norm_rope_fp32_weight whose k and v go into rows of existing buffers: token t's k and v
    are written to k_out[kv_rows[t]] and v_out[kv_rows[t]] ([N, Hkv, D] each; an attention's joint
    keys, the other rows untouched) -> q [T, Hq, D]."""
    q, k, v = _qk_norm_rope_fp32_weight_ref(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads,
                                            num_kv_heads, head_dim, rotary_dim, eps)
    k_out.index_copy_(0, kv_rows, k.to(k_out.dtype))
    v_out.index_copy_(0, kv_rows, v.to(v_out.dtype))
    return q


def _qk_norm_rope_kv_fp32_weight_fake(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads,
                                      head_dim, rotary_dim, eps, k_out, v_out, kv_rows):
    return qkv.new_empty((qkv.shape[0], num_q_heads, head_dim))


qk_norm_rope_kv_fp32_weight = define_op(
    "qk_norm_rope_kv_fp32_weight",
    "(Tensor qkv, Tensor positions, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, int num_q_heads, "
    "int num_kv_heads, int head_dim, int rotary_dim, float eps, Tensor(a!) k_out, Tensor(b!) v_out, "
    "Tensor kv_rows) -> Tensor",
    reference=_qk_norm_rope_kv_fp32_weight_ref, fake=_qk_norm_rope_kv_fp32_weight_fake)


def _qk_norm_rope_append_ref(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor,
                             k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                             head_dim: int, rotary_dim: int, eps: float, zero_centered: bool, gated: bool,
                             k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """qk_norm_rope, then kv_append of its k and v into the paged cache at slot_mapping (padding
    tokens' negative slots skipped) -> q [T, Hq, D]: an attention layer's prologue in one op."""
    q, k, v = _qk_norm_rope_ref(qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads,
                                head_dim, rotary_dim, eps, zero_centered, gated)
    _kv_append_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


qk_norm_rope_append = define_op(
    "qk_norm_rope_append",
    "(Tensor qkv, Tensor positions, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, int num_q_heads, "
    "int num_kv_heads, int head_dim, int rotary_dim, float eps, bool zero_centered, bool gated, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor",
    reference=_qk_norm_rope_append_ref,
    fake=lambda qkv, positions, qw, kw, cache, hq, hkv, d, *rest: qkv.new_empty((qkv.shape[0], hq, d)))

__all__ = ["rotary_embedding", "build_cos_sin_cache", "qk_norm_rope", "qk_norm_rope_fp32_weight",
           "qk_norm_rope_kv_fp32_weight", "qk_norm_rope_append", "split_qkv_heads"]
