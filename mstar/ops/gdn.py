"""Gated DeltaNet (Qwen3.5's linear-attention layers): chunked prefill and one-token decode.

Per value head, a state S of shape [Dk, Dv] evolves token by token:

    S     <- S * exp(g_t)                       (g_t <= 0: log decay)
    delta  = beta_t * (v_t - S^T k_t)           (the delta rule's correction)
    S     <- S + k_t delta^T
    o_t    = S^T (scale * q_t)

q and k arrive L2-normalised and already repeated onto the value heads (H = Hv). States
live in a pool [num_slots, H, Dk, Dv] (float32); each row of a step names its slot.

Prefill uses the chunked (WY / UT-transform) form, in float32, over chunks of 64 tokens.
Inside a chunk, with G_t the inclusive cumulative sum of g from the chunk start and S0 the
state entering the chunk, unrolling the recurrence gives

    S_t      = exp(G_t) S0 + sum_{j<=t} exp(G_t - G_j) k_j delta_j^T
    delta_t  = beta_t v_t - beta_t exp(G_t) k_t^T S0 - sum_{j<t} L_tj delta_j,
               L_tj = beta_t exp(G_t - G_j) k_t . k_j                       (j < t)

so (I + L) delta = beta v - (beta exp(G) k) S0, i.e. delta = U - W S0 with U, W from one
unit-lower-triangular solve per chunk (independent of S0, so done for all chunks at once).
Then o = (scale q exp(G)) S0 + (scale q k^T * D) delta with D_tj = exp(G_t - G_j) (j <= t),
and the state leaving the chunk is exp(G_C) S0 + (k exp(G_C - G))^T delta. Only that last
step is sequential over chunks; it runs for all rows together. A snapshot at position r
of a chunk is the same formula as the state leaving the chunk, cut at r.
"""

from __future__ import annotations

import torch

from mstar.ops.norm import _l2_norm_ref, l2_norm
from mstar.ops.registry import define_op, register_backend

CHUNK = 64


# --- prefill -----------------------------------------------------------------------------------
def _gdn_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state_pool: torch.Tensor, cu_seqlens: torch.Tensor,
                     slots: torch.Tensor, snap_token_idx: torch.Tensor, snap_slots: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Chunked Gated DeltaNet over ragged rows; updates state_pool[slots], writes snapshots."""
    T, H, _ = q.shape
    Dv = v.shape[-1]
    dev = q.device
    f32 = torch.float32
    C = CHUNK
    out = torch.empty((T, H, Dv), dtype=v.dtype, device=dev)
    P = slots.numel()
    if P == 0:
        return out

    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    slots_l = slots.to(device=dev, dtype=torch.long)
    lens = cu[1:] - cu[:-1]  # [P]
    nch = (lens + C - 1) // C  # chunks per row
    nch_host = nch.tolist()
    N = sum(nch_host)
    # every row's state, in float32, rows ordered by decreasing chunk count so that the rows
    # still running at scan step c are a prefix
    order = torch.sort(nch, descending=True, stable=True).indices
    state = state_pool.index_select(0, slots_l.index_select(0, order)).to(f32)  # [P, H, Dk, Dv]
    if N == 0:
        return out

    rows = torch.arange(P, device=dev)
    first_chunk = torch.cumsum(nch, 0) - nch  # [P]: id of each row's first chunk
    tok_row = torch.repeat_interleave(rows, lens, output_size=T)
    pos = torch.arange(T, device=dev) - cu.index_select(0, tok_row)  # position in its row
    flat = (first_chunk.index_select(0, tok_row) + pos // C) * C + pos % C  # slot in [N*C]

    def padded(x: torch.Tensor) -> torch.Tensor:
        # [T, H, ...] -> [N, H, C, ...] float32, zeros in the tail of each row's last chunk
        buf = x.new_zeros((N * C,) + tuple(x.shape[1:]), dtype=f32)
        buf.index_copy_(0, flat, x.to(f32))
        buf = buf.view((N, C) + tuple(x.shape[1:]))
        return buf.transpose(1, 2).contiguous()

    # zero padding (k = v = beta = g = 0) leaves the state unchanged, so a row's state after its
    # last chunk is its state after its last token
    qc, kc, vc = padded(q), padded(k), padded(v)  # [N, H, C, D]
    gc, bc = padded(g), padded(beta)  # [N, H, C]

    G = gc.cumsum(-1)  # [N, H, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [N,H,C,C]
    kb = kc * bc.unsqueeze(-1)
    A = (kb @ kc.transpose(-1, -2)) * D  # strictly lower part is L (the diagonal is ignored)
    eG = G.exp()
    rhs = torch.cat([vc * bc.unsqueeze(-1), kb * eG.unsqueeze(-1)], dim=-1)
    UW = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :Dv], UW[..., Dv:]  # delta = U - W S0
    attn = (qc @ kc.transpose(-1, -2)) * D * scale  # [N, H, C, C]
    qg = qc * (eG * scale).unsqueeze(-1)  # reads S0
    GC = G[..., -1:]
    kdec = kc * (GC - G).exp().unsqueeze(-1)  # writes the chunk's deltas into the leaving state
    cdec = GC.exp().unsqueeze(-1)  # [N, H, 1, 1]
    del D, A, rhs, UW

    o = torch.empty((N, H, C, Dv), dtype=f32, device=dev)

    # snapshots, grouped by scan step (host lists: this is the CPU / reference path)
    n_snap = snap_token_idx.numel()
    snap_groups: dict[int, list[int]] = {}
    if n_snap:
        st = snap_token_idx.to(device=dev, dtype=torch.long)
        s_row = tok_row.index_select(0, st)
        s_pos = pos.index_select(0, st)
        s_step = s_pos // C
        s_chunk = first_chunk.index_select(0, s_row) + s_step
        s_off = s_pos % C
        rank = torch.empty_like(order)
        rank[order] = rows  # sorted position of each row
        s_rank = rank.index_select(0, s_row)
        s_slots = snap_slots.to(device=dev, dtype=torch.long)
        for j, c in enumerate(s_step.tolist()):
            snap_groups.setdefault(c, []).append(j)

    nch_sorted = sorted(nch_host, reverse=True)
    first_sorted = first_chunk.index_select(0, order)
    n_active = P
    for c in range(nch_sorted[0]):
        while nch_sorted[n_active - 1] <= c:
            n_active -= 1
        ids = first_sorted[:n_active] + c
        S0 = state[:n_active]
        dnew = U.index_select(0, ids) - W.index_select(0, ids) @ S0  # [n, H, C, Dv]
        o.index_copy_(0, ids, qg.index_select(0, ids) @ S0 + attn.index_select(0, ids) @ dnew)
        if c in snap_groups:
            js = torch.tensor(snap_groups[c], device=dev, dtype=torch.long)
            r = s_rank.index_select(0, js)
            ch = s_chunk.index_select(0, js)
            off = s_off.index_select(0, js)
            Gs = G.index_select(0, ch)  # [m, H, C]
            Gr = Gs.gather(-1, off.view(-1, 1, 1).expand(-1, H, 1))  # [m, H, 1]
            keep = torch.arange(C, device=dev).view(1, 1, C) <= off.view(-1, 1, 1)
            w = (Gr - Gs).masked_fill(~keep, float("-inf")).exp()  # [m, H, C]
            kw = kc.index_select(0, ch) * w.unsqueeze(-1)
            snap = Gr.exp().unsqueeze(-1) * S0.index_select(0, r) + kw.transpose(-1, -2) @ dnew.index_select(0, r)
            state_pool.index_copy_(0, s_slots.index_select(0, js), snap.to(state_pool.dtype))
        state[:n_active] = S0 * cdec.index_select(0, ids) + kdec.index_select(0, ids).transpose(-1, -2) @ dnew

    state_pool.index_copy_(0, slots_l.index_select(0, order), state.to(state_pool.dtype))
    out.copy_(o.transpose(1, 2).reshape(N * C, H, Dv).index_select(0, flat))
    return out


def _gdn_prefill_fake(q, k, v, g, beta, state_pool, cu_seqlens, slots, snap_token_idx, snap_slots, scale):
    return v.new_empty((q.shape[0], q.shape[1], v.shape[-1]))


gdn_prefill = define_op(
    "gdn_prefill",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state_pool, Tensor cu_seqlens, "
    "Tensor slots, Tensor snap_token_idx, Tensor snap_slots, float scale) -> Tensor",
    reference=_gdn_prefill_ref, fake=_gdn_prefill_fake)


# --- decode ------------------------------------------------------------------------------------
def _gdn_decode_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state_pool: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """One Gated DeltaNet step per row (float32); updates state_pool[slots] in place."""
    f32 = torch.float32
    slots_l = slots.to(device=q.device, dtype=torch.long)
    S = state_pool.index_select(0, slots_l).to(f32)  # [B, H, Dk, Dv]
    kf, qf = k.to(f32), q.to(f32) * scale
    S = S * g.to(f32).exp()[..., None, None]
    pred = torch.einsum("bhk,bhkv->bhv", kf, S)
    delta = beta.to(f32).unsqueeze(-1) * (v.to(f32) - pred)
    S = S + kf.unsqueeze(-1) * delta.unsqueeze(-2)
    o = torch.einsum("bhk,bhkv->bhv", qf, S)
    state_pool.index_copy_(0, slots_l, S.to(state_pool.dtype))
    return o.to(v.dtype)


def _gdn_decode_fake(q, k, v, g, beta, state_pool, slots, scale):
    return torch.empty_like(v)


gdn_decode = define_op(
    "gdn_decode",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state_pool, Tensor slots, "
    "float scale) -> Tensor",
    reference=_gdn_decode_ref, fake=_gdn_decode_fake)



# --- decode, fused from the conv output ---------------------------------------------------------
def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5's gates: g = -exp(A_log) * softplus(a + dt_bias) (float32), beta = sigmoid(b)
    (in b's dtype), per row and value head."""
    g = -torch.exp(A_log.float()) * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b).contiguous()


def split_qkv(mixed: torch.Tensor, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int, eps: float,
              l2norm=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv output [T, 2 Hk Dk + Hv Dv] -> L2-normalised q, k (repeated onto the value
    heads: key head i serves value heads i*r .. i*r+r-1) and v, each [T, Hv, D]."""
    l2norm = l2norm or l2_norm
    t, kd = mixed.shape[0], num_k_heads * head_k_dim
    q = l2norm(mixed[:, :kd].reshape(t, num_k_heads, head_k_dim).contiguous(), eps)
    k = l2norm(mixed[:, kd:2 * kd].reshape(t, num_k_heads, head_k_dim).contiguous(), eps)
    v = mixed[:, 2 * kd:].reshape(t, num_v_heads, head_v_dim).contiguous()
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    return q, k, v


def _gdn_decode_fused_ref(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                          dt_bias: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, num_k_heads: int,
                          scale: float, eps: float) -> torch.Tensor:
    """A decode step of Qwen3.5's Gated DeltaNet from the conv output: split and L2-normalise
    q, k, gates, recurrent update of state_pool[slots] in place -> o [B, Hv, Dv]."""
    hv, dk, dv = state_pool.shape[1:]
    q, k, v = split_qkv(mixed, num_k_heads, dk, hv, dv, eps, _l2_norm_ref)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return _gdn_decode_ref(q, k, v, g, beta, state_pool, slots, scale)


def _fused_fake(mixed, a, b, A_log, dt_bias, state_pool, *rest):
    """The fused ops' output (decode and prefill alike): [rows, Hv, Dv] in the conv output's dtype."""
    return mixed.new_empty((mixed.shape[0], state_pool.shape[1], state_pool.shape[3]))


gdn_decode_fused = define_op(
    "gdn_decode_fused",
    "(Tensor mixed, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, Tensor(a!) state_pool, Tensor slots, "
    "int num_k_heads, float scale, float eps) -> Tensor",
    reference=_gdn_decode_fused_ref, fake=_fused_fake)


# --- prefill, fused from the conv output ---------------------------------------------------------
def _gdn_prefill_fused_ref(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                           dt_bias: torch.Tensor, state_pool: torch.Tensor, cu_seqlens: torch.Tensor,
                           slots: torch.Tensor, snap_token_idx: torch.Tensor, snap_slots: torch.Tensor,
                           num_k_heads: int, scale: float, eps: float) -> torch.Tensor:
    """Prefill rows of Qwen3.5's Gated DeltaNet from the conv output: split and L2-normalise
    q, k, gates, chunked recurrence over state_pool[slots] (in place), snapshots -> o [T, Hv, Dv]."""
    hv, dk, dv = state_pool.shape[1:]
    q, k, v = split_qkv(mixed, num_k_heads, dk, hv, dv, eps, _l2_norm_ref)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return _gdn_prefill_ref(q, k, v, g, beta, state_pool, cu_seqlens, slots, snap_token_idx, snap_slots, scale)


gdn_prefill_fused = define_op(
    "gdn_prefill_fused",
    "(Tensor mixed, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, Tensor(a!) state_pool, Tensor cu_seqlens, "
    "Tensor slots, Tensor snap_token_idx, Tensor snap_slots, int num_k_heads, float scale, float eps) -> Tensor",
    reference=_gdn_prefill_fused_ref, fake=_fused_fake)


def _gdn_prefill_composed(mixed, a, b, A_log, dt_bias, state_pool, cu_seqlens, slots, snap_token_idx, snap_slots,
                          num_k_heads, scale, eps):
    """The reference's steps as separate ops, each through its own backend: the CUDA default,
    and what the model ran before the fused op existed."""
    hv, dk, dv = state_pool.shape[1:]
    q, k, v = split_qkv(mixed, num_k_heads, dk, hv, dv, eps)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return gdn_prefill(q, k, v, g, beta, state_pool, cu_seqlens, slots, snap_token_idx, snap_slots, scale)


register_backend(gdn_prefill_fused, "composed", _gdn_prefill_composed, devices=("cuda",), priority=10,
                 note="split_qkv, gdn_gates and gdn_prefill, each op on its own backend")

__all__ = ["gdn_prefill", "gdn_decode", "gdn_decode_fused", "gdn_prefill_fused", "gdn_gates", "split_qkv"]
