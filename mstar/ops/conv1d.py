"""Causal depthwise conv1d (Qwen3.5's short convolution over the q/k/v projections).

Channel c of token t: out[t, c] = sum_j weight[c, j] * xpad[t + j, c] (+ bias[c]), then SiLU
if asked, where xpad is the sequence's previous K-1 inputs followed by this step's tokens.
The conv state pool [num_slots, C, K-1] holds each sequence's last K-1 inputs, oldest first
(zeros for a new sequence). Computed in float32, returned in x.dtype; the pool keeps its
own dtype. transformers keeps K inputs in its conv state; only the last K-1 ever reach an
output, so the outputs are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.ops.registry import define_op


def _conv_prefill_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state_pool: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                      snap_token_idx: torch.Tensor, snap_slots: torch.Tensor, silu: bool) -> torch.Tensor:
    """Causal conv over ragged rows continuing their pooled history; updates the pool."""
    T, C = x.shape
    K = weight.shape[1]
    H = K - 1  # history length
    dev = x.device
    f32 = torch.float32
    P = slots.numel()
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    slots_l = slots.to(device=dev, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    rows = torch.arange(P, device=dev)

    # one buffer: every row's history (P*H entries), then the T tokens
    hist = conv_state_pool.index_select(0, slots_l)  # [P, C, H]
    buf = torch.cat([hist.transpose(1, 2).reshape(P * H, C).to(f32), x.to(f32)], dim=0)

    def at(row: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        # index in buf of entry m of row's xpad (m < H: history, else token cu[row] + m - H)
        return torch.where(m < H, row * H + m, P * H + cu.index_select(0, row.flatten()).view_as(row) + m - H)

    tok_row = torch.repeat_interleave(rows, lens, output_size=T)
    pos = torch.arange(T, device=dev) - cu.index_select(0, tok_row)
    w = weight.to(f32)
    out = torch.zeros((T, C), dtype=f32, device=dev) if bias is None else bias.to(f32).expand(T, C).clone()
    for j in range(K):
        out += buf.index_select(0, at(tok_row, pos + j)) * w[:, j]
    if silu:
        out = F.silu(out)

    def state_after(row: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        # the last H inputs once the token at position p of row is in: xpad[p+1 .. p+H]
        m = p.unsqueeze(1) + 1 + torch.arange(H, device=dev)
        idx = at(row.unsqueeze(1).expand_as(m), m)
        return buf.index_select(0, idx.flatten()).view(-1, H, C).transpose(1, 2).to(conv_state_pool.dtype)

    if snap_token_idx.numel():
        st = snap_token_idx.to(device=dev, dtype=torch.long)
        conv_state_pool.index_copy_(0, snap_slots.to(device=dev, dtype=torch.long),
                                    state_after(tok_row.index_select(0, st), pos.index_select(0, st)))
    if P:
        conv_state_pool.index_copy_(0, slots_l, state_after(rows, lens - 1))
    return out.to(x.dtype)


def _conv_prefill_fake(x, weight, bias, conv_state_pool, cu_seqlens, slots, snap_token_idx, snap_slots, silu):
    return torch.empty_like(x)


causal_conv1d_prefill = define_op(
    "causal_conv1d_prefill",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state_pool, Tensor cu_seqlens, Tensor slots, "
    "Tensor snap_token_idx, Tensor snap_slots, bool silu) -> Tensor",
    reference=_conv_prefill_ref, fake=_conv_prefill_fake)


def _conv_update_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     conv_state_pool: torch.Tensor, slots: torch.Tensor, silu: bool) -> torch.Tensor:
    """One token per row: conv over (pooled K-1 inputs, x); shifts x into the pool."""
    slots_l = slots.to(device=x.device, dtype=torch.long)
    hist = conv_state_pool.index_select(0, slots_l)  # [B, C, K-1]
    window = torch.cat([hist.to(torch.float32), x.to(torch.float32).unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (window * weight.to(torch.float32)).sum(-1)
    if bias is not None:
        out = out + bias.to(torch.float32)
    if silu:
        out = F.silu(out)
    conv_state_pool.index_copy_(0, slots_l, window[..., 1:].to(conv_state_pool.dtype))
    return out.to(x.dtype)


def _conv_update_fake(x, weight, bias, conv_state_pool, slots, silu):
    return torch.empty_like(x)


causal_conv1d_update = define_op(
    "causal_conv1d_update",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state_pool, Tensor slots, bool silu) -> Tensor",
    reference=_conv_update_ref, fake=_conv_update_fake)

__all__ = ["causal_conv1d_prefill", "causal_conv1d_update"]
