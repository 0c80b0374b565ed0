"""Gated DeltaNet through fla-core's Triton kernels (flash-linear-attention).

Prefill: fla's chunked kernel over ragged rows (cu_seqlens), starting from the rows' pool
slots and writing the final states back. Prefix-cache snapshots at arbitrary positions
are produced by cutting rows at the snapshot positions and running the pieces in rounds
(round r runs the r-th piece of every row, starting from the state round r-1 ended in):
one fla call per round, so a step with snapshots costs (pieces per row) calls.

Decode: fla's fused recurrent kernel takes a dense batch of states, so the pool rows are
gathered before and scattered after (our own Triton kernel updates the pool in place and
is preferred when both are available; MSTAR_BACKENDS picks either).
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

from mstar.ops import gdn
from mstar.ops.registry import register_backend


def _run_chunk(q, k, v, g, beta, init, cu, cu_cpu, scale):
    o, final = chunk_gated_delta_rule(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0).float(),
                                      beta.unsqueeze(0), scale=scale, initial_state=init, output_final_state=True,
                                      cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    return o[0], final


@torch.inference_mode()
def gdn_prefill(q, k, v, g, beta, state_pool, cu_seqlens, slots, snap_token_idx, snap_slots, scale):
    if q.shape[0] == 0:
        return torch.empty_like(v)
    slots_l = slots.long()
    if snap_token_idx.numel() == 0:
        cu_cpu = cu_seqlens.cpu().long()
        o, final = _run_chunk(q, k, v, g, beta, state_pool.index_select(0, slots_l).float(),
                              cu_seqlens.long(), cu_cpu, scale)
        state_pool.index_copy_(0, slots_l, final.to(state_pool.dtype))
        return o
    return _prefill_in_rounds(q, k, v, g, beta, state_pool, cu_seqlens, slots_l, snap_token_idx, snap_slots, scale)


def _prefill_in_rounds(q, k, v, g, beta, state_pool, cu_seqlens, slots_l, snap_token_idx, snap_slots, scale):
    # host-side plan of the pieces (a prefill step with snapshots is not graph-captured)
    cu = cu_seqlens.tolist()
    snaps = sorted(zip(snap_token_idx.tolist(), snap_slots.tolist()))
    rows = []  # per row: list of (start, end, slot to write the state into)
    si = 0
    for r in range(len(cu) - 1):
        start, end = cu[r], cu[r + 1]
        pieces = []
        while si < len(snaps) and snaps[si][0] < end:
            cut, dst = snaps[si]
            if cut + 1 > start:
                pieces.append((start, cut + 1, dst))
                start = cut + 1
            si += 1
        if start < end:
            pieces.append((start, end, None))
        rows.append(pieces)
    out = torch.empty_like(v)
    state = state_pool.index_select(0, slots_l).float()  # running state per row
    for rnd in range(max(len(p) for p in rows)):
        live = [r for r, p in enumerate(rows) if rnd < len(p)]
        idx, cu_r = [], [0]
        for r in live:
            s, e, _ = rows[r][rnd]
            idx.append(torch.arange(s, e))
            cu_r.append(cu_r[-1] + e - s)
        tok = torch.cat(idx).to(q.device)
        live_t = torch.tensor(live, device=q.device)
        cu_cpu = torch.tensor(cu_r, dtype=torch.long)
        o, final = _run_chunk(q[tok], k[tok], v[tok], g[tok], beta[tok], state.index_select(0, live_t),
                              cu_cpu.to(q.device), cu_cpu, scale)
        out[tok] = o
        state.index_copy_(0, live_t, final)
        dst = [(i, rows[r][rnd][2]) for i, r in enumerate(live) if rows[r][rnd][2] is not None]
        if dst:
            src_i = torch.tensor([i for i, _ in dst], device=q.device)
            state_pool.index_copy_(0, torch.tensor([d for _, d in dst], device=q.device),
                                   final.index_select(0, src_i).to(state_pool.dtype))
    state_pool.index_copy_(0, slots_l, state.to(state_pool.dtype))
    return out


@torch.inference_mode()
def gdn_decode(q, k, v, g, beta, state_pool, slots, scale):
    if q.shape[0] == 0:
        return torch.empty_like(v)
    slots_l = slots.long()
    init = state_pool.index_select(0, slots_l).float()
    o, final = fused_recurrent_gated_delta_rule(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1),
                                                g=g.unsqueeze(1).float(), beta=beta.unsqueeze(1), scale=scale,
                                                initial_state=init, output_final_state=True)
    state_pool.index_copy_(0, slots_l, final.to(state_pool.dtype))
    return o[:, 0]


register_backend(gdn.gdn_prefill, "fla", gdn_prefill, available=torch.cuda.is_available, priority=20,
                 note="fla chunk kernel; snapshots in rounds")
register_backend(gdn.gdn_decode, "fla", gdn_decode, available=torch.cuda.is_available, priority=10,
                 note="fla fused recurrent; gather/scatter of the pool rows")
