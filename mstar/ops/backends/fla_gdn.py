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

import weakref
from dataclasses import dataclass

import torch

from mstar.ops import gdn
from mstar.ops.backends.lean_import import import_lean
from mstar.ops.backends.triton_gdn import gdn_prefill_prep
from mstar.ops.backends.triton_rows import copy_rows
from mstar.ops.registry import register_backend

# fla.ops / fla.modules import all of fla, and fla's dispatcher torch._dynamo: seconds of every
# start for the two functions used here (lean_import.py)
_fla_gdr = import_lean("fla.ops.gated_delta_rule", bare=("fla.ops", "fla.modules", "fla.modules.norm"),
                       skip_compiler_disable=True)
chunk_gated_delta_rule = _fla_gdr.chunk_gated_delta_rule
fused_recurrent_gated_delta_rule = _fla_gdr.fused_recurrent_gated_delta_rule


def _run_chunk(q, k, v, g, beta, init, cu, cu_cpu, scale):
    """fla's chunked forward over ragged rows; q, k may have fewer heads than v (grouped: value
    head h reads key head h // (Hv // Hk), as fla's kernels index it)."""
    o, final = chunk_gated_delta_rule(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0).float(),
                                      beta.unsqueeze(0), scale=scale, initial_state=init, output_final_state=True,
                                      cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    return o[0], final


@dataclass
class _Round:
    """One fla call of a step with snapshots: the r-th piece of every row that has one."""
    tok: torch.Tensor | None  # device: the step's token indices of the pieces, row after row (None: all, in order)
    live: torch.Tensor  # device: which rows take part (index into the step's rows)
    cu: torch.Tensor  # device int64 cu_seqlens of the pieces
    cu_cpu: torch.Tensor
    snap_src: torch.Tensor | None  # device: pieces (index into live) whose end state is a snapshot...
    snap_dst: torch.Tensor | None  # ...and the pool slots it goes to


@dataclass
class _StepPlan:
    """Host-side plan of one step's prefill rows, built by the first GDN layer of the step and
    shared by the others: one device read per step instead of several per layer, and the same
    cu_seqlens tensor for every call (fla caches what it derives from it by identity)."""
    cu: torch.Tensor
    cu_cpu: torch.Tensor
    rounds: list[_Round] | None  # None: no snapshots, one call over all rows


# (weak references to the step's index tensors, their plan). The step's metadata tensors are new
# objects every step and the same objects for all of its layers, so identity is the key; a caller
# that rewrites one of them in place between calls must pass a new tensor instead.
_last_plan: list = [None]


def _step_plan(cu_seqlens: torch.Tensor, snap_token_idx: torch.Tensor, snap_slots: torch.Tensor) -> _StepPlan:
    keys = (cu_seqlens, snap_token_idx, snap_slots)
    held = _last_plan[0]
    if held is not None and all(r() is t for r, t in zip(held[0], keys)):
        return held[1]
    plan = _build_plan(cu_seqlens, snap_token_idx, snap_slots)
    _last_plan[0] = (tuple(weakref.ref(t) for t in keys), plan)
    return plan


def _build_plan(cu_seqlens, snap_token_idx, snap_slots) -> _StepPlan:
    dev = cu_seqlens.device
    cu_cpu = cu_seqlens.cpu().long()
    if snap_token_idx.numel() == 0:
        return _StepPlan(cu_seqlens.long(), cu_cpu, None)
    # cut rows at the snapshot positions; round r runs the r-th piece of every row, starting from
    # the state round r-1 ended in (a step with snapshots is not graph-captured)
    cu = cu_cpu.tolist()
    snaps = sorted(zip(snap_token_idx.tolist(), snap_slots.tolist()))
    rows = []  # per row: list of (start, end, slot to write the end state into)
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
    rounds = []
    for rnd in range(max(len(p) for p in rows)):
        live = [r for r, p in enumerate(rows) if rnd < len(p)]
        idx, cu_r = [], [0]
        for r in live:
            s, e, _ = rows[r][rnd]
            idx.append(torch.arange(s, e))
            cu_r.append(cu_r[-1] + e - s)
        rc = torch.tensor(cu_r, dtype=torch.long)
        dst = [(i, rows[r][rnd][2]) for i, r in enumerate(live) if rows[r][rnd][2] is not None]
        whole = len(live) == len(rows) and cu_r == cu  # every row whole: no gather / scatter
        rounds.append(_Round(None if whole else torch.cat(idx).to(dev), torch.tensor(live, device=dev), rc.to(dev), rc,
                             torch.tensor([i for i, _ in dst], device=dev) if dst else None,
                             torch.tensor([d for _, d in dst], device=dev) if dst else None))
    return _StepPlan(cu_seqlens.long(), cu_cpu, rounds)


@torch.inference_mode()
def gdn_prefill(q, k, v, g, beta, state_pool, cu_seqlens, slots, snap_token_idx, snap_slots, scale):
    if q.shape[0] == 0:
        return torch.empty_like(v)
    slots_l = slots.long()
    plan = _step_plan(cu_seqlens, snap_token_idx, snap_slots)
    # the rows' running states in float32, gathered out of the pool and cast up in one pass; the
    # snapshots and the final states go back cast down, one pass each (copy_rows)
    state = copy_rows(state_pool, slots_l, state_pool.new_empty((slots_l.shape[0], *state_pool.shape[1:]),
                                                                dtype=torch.float32), None)
    if plan.rounds is None:  # no snapshots: one call over whole rows
        out, state = _run_chunk(q, k, v, g, beta, state, plan.cu, plan.cu_cpu, scale)
    else:
        out = None
        for rd in plan.rounds:
            tok = rd.tok
            if tok is None:  # one round of whole rows (snapshots only at row ends: the common case)
                out, final = _run_chunk(q, k, v, g, beta, state, rd.cu, rd.cu_cpu, scale)
                state = final
            else:
                o, final = _run_chunk(q[tok], k[tok], v[tok], g[tok], beta[tok], state.index_select(0, rd.live),
                                      rd.cu, rd.cu_cpu, scale)
                if out is None:
                    out = torch.empty_like(v)
                out[tok] = o
                state.index_copy_(0, rd.live, final)
            if rd.snap_src is not None:
                copy_rows(final, rd.snap_src, state_pool, rd.snap_dst)
    copy_rows(state, None, state_pool, slots_l)
    return out


@torch.inference_mode()
def gdn_prefill_fused(mixed, a, b, A_log, dt_bias, state_pool, cu_seqlens, slots, snap_token_idx, snap_slots,
                      num_k_heads, scale, eps):
    """split_qkv + gdn_gates in one Triton launch (q, k left at the key heads: fla groups them),
    then the chunked recurrence as gdn_prefill."""
    hv, dk, dv = state_pool.shape[1:]
    prep = gdn_prefill_prep(mixed, a, b, A_log, dt_bias, num_k_heads, dk, hv, dv, eps)
    if prep is None:
        return gdn.gdn_prefill_fused.backends["composed"].fn(mixed, a, b, A_log, dt_bias, state_pool, cu_seqlens,
                                                             slots, snap_token_idx, snap_slots, num_k_heads, scale,
                                                             eps)
    return gdn_prefill(*prep, state_pool, cu_seqlens, slots, snap_token_idx, snap_slots, scale)


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
# preferred over the composed ops: q, k stay at the key heads (no repeat onto the value heads, no
# contiguous copies of the split), 4 % less device time a 4B prefill step of 8192 tokens on an H100
# (notes/llm-serving.md)
register_backend(gdn.gdn_prefill_fused, "fla", gdn_prefill_fused, available=torch.cuda.is_available, priority=20,
                 note="one Triton launch for the split, norms and gates; fla's chunk kernel with grouped q, k")
register_backend(gdn.gdn_decode, "fla", gdn_decode, available=torch.cuda.is_available, priority=10,
                 note="fla fused recurrent; gather/scatter of the pool rows")
