"""Gated DeltaNet ops: the chunked prefill and the decode step against a naive per-token
loop in float64, against each other, and against transformers' Qwen3.5 reference functions.

Tolerance: the ops compute in float32; against the float64 loop we allow 2e-4 absolute +
2e-4 relative on outputs and states whose entries are O(1) (observed ~1e-6)."""

import inspect

import pytest
import torch

from gdn_helpers import gdn_inputs
from mstar import ops

ATOL = RTOL = 2e-4
POISON = 777.0


def _naive(q, k, v, g, beta, S, scale):
    """Per-token loop in float64: (outputs [L, H, Dv], states after each token [L, H, Dk, Dv])."""
    q, k, v, g, beta, S = (x.double() for x in (q, k, v, g, beta, S))
    outs, states = [], []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t] * scale, S))
        states.append(S)
    if not outs:
        return torch.zeros(0, *v.shape[1:], dtype=torch.float64), [S]
    return torch.stack(outs), states


def _close(a, b, what):
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a.double(), b.double(), atol=ATOL, rtol=RTOL), f"{what}: max abs err {err:.3g}"


@pytest.mark.parametrize("H,Dk,Dv", [(2, 16, 8), (2, 128, 128)])
def test_prefill_vs_naive_with_snapshots(H, Dk, Dv):
    gen = torch.Generator().manual_seed(H * 1000 + Dk + Dv)
    lens = [1, 5, 63, 0, 64, 65, 200]
    (q, k, v, g, beta), cu = gdn_inputs(lens, H, Dk, Dv, gen)
    T = sum(lens)
    num_slots = 20
    pool = torch.full((num_slots, H, Dk, Dv), POISON)
    slots = torch.tensor([3, 7, 1, 12, 9, 0, 5])
    init = torch.randn(len(lens), H, Dk, Dv, generator=gen) * 0.5
    pool[slots] = init
    # snapshot positions (token index into T): first token of a row, a 1-token row, mid-chunk,
    # last of a chunk, first of a chunk, end of rows
    starts = cu[:-1].tolist()
    snap_tok = [starts[0], starts[1] + 2, starts[2] + 62, starts[4] + 63, starts[5] + 64, starts[6] + 64,
                starts[6] + 100, starts[6] + 130, T - 1]
    snap_slots = [2, 4, 6, 8, 10, 11, 13, 14, 15]
    before = pool.clone()
    scale = Dk ** -0.5
    out = ops.gdn_prefill(q, k, v, g, beta, pool, cu, slots, torch.tensor(snap_tok), torch.tensor(snap_slots),
                          scale)
    assert out.shape == (T, H, Dv) and out.dtype == v.dtype

    ref_states = {}
    for i, L in enumerate(lens):
        a, b = cu[i].item(), cu[i + 1].item()
        o_ref, states = _naive(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], init[i], scale)
        _close(out[a:b], o_ref, f"output row {i} (len {L})")
        _close(pool[slots[i]], states[-1], f"final state row {i} (len {L})")
        for t in range(a, b):
            ref_states[t] = states[t - a]
    for t, s in zip(snap_tok, snap_slots):
        _close(pool[s], ref_states[t], f"snapshot after token {t}")
    touched = set(slots.tolist()) | set(snap_slots)
    for s in range(num_slots):
        if s not in touched:
            assert torch.equal(pool[s], before[s]), f"slot {s} was written"


def test_prefill_then_decode_equals_prefill_whole():
    gen = torch.Generator().manual_seed(1)
    H, Dk, Dv = 4, 32, 16
    n_pre, n_dec = [70, 3, 128], 9
    lens_whole = [n + n_dec for n in n_pre]
    (q, k, v, g, beta), cu = gdn_inputs(lens_whole, H, Dk, Dv, gen)
    scale = Dk ** -0.5
    slots = torch.tensor([4, 0, 2])
    init = torch.randn(3, H, Dk, Dv, generator=gen) * 0.3
    empty = torch.zeros(0, dtype=torch.long)

    pool_whole = torch.zeros(6, H, Dk, Dv)
    pool_whole[slots] = init
    out_whole = ops.gdn_prefill(q, k, v, g, beta, pool_whole, cu, slots, empty, empty, scale)

    # prefill the first n_pre tokens of each row, then decode the rest one token per row
    pool = torch.zeros(6, H, Dk, Dv)
    pool[slots] = init
    pre_idx = torch.cat([torch.arange(cu[i], cu[i] + n_pre[i]) for i in range(3)])
    cu_pre = torch.tensor([0] + torch.tensor(n_pre).cumsum(0).tolist(), dtype=torch.int32)
    out_pre = ops.gdn_prefill(q[pre_idx], k[pre_idx], v[pre_idx], g[pre_idx], beta[pre_idx], pool, cu_pre, slots,
                              empty, empty, scale)
    torch.testing.assert_close(out_pre, out_whole[pre_idx], atol=1e-5, rtol=1e-5)
    for s in range(n_dec):
        idx = torch.tensor([cu[i] + n_pre[i] + s for i in range(3)])
        o = ops.gdn_decode(q[idx], k[idx], v[idx], g[idx], beta[idx], pool, slots, scale)
        torch.testing.assert_close(o, out_whole[idx], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, pool_whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [1, 40, 64, 100, 199])
def test_prefill_in_two_pieces(split):
    gen = torch.Generator().manual_seed(split)
    H, Dk, Dv = 2, 16, 16
    (q, k, v, g, beta), _ = gdn_inputs([200], H, Dk, Dv, gen)
    scale = Dk ** -0.5
    slots = torch.tensor([1])
    empty = torch.zeros(0, dtype=torch.long)
    init = torch.randn(1, H, Dk, Dv, generator=gen)
    pool_one = torch.zeros(2, H, Dk, Dv)
    pool_one[1] = init[0]
    one = ops.gdn_prefill(q, k, v, g, beta, pool_one, torch.tensor([0, 200], dtype=torch.int32), slots,
                          empty, empty, scale)
    pool_two = torch.zeros(2, H, Dk, Dv)
    pool_two[1] = init[0]
    a = ops.gdn_prefill(q[:split], k[:split], v[:split], g[:split], beta[:split], pool_two,
                        torch.tensor([0, split], dtype=torch.int32), slots, empty, empty, scale)
    b = ops.gdn_prefill(q[split:], k[split:], v[split:], g[split:], beta[split:], pool_two,
                        torch.tensor([0, 200 - split], dtype=torch.int32), slots, empty, empty, scale)
    torch.testing.assert_close(torch.cat([a, b]), one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_two, pool_one, atol=1e-5, rtol=1e-5)


def test_decode_vs_naive_and_untouched_slots():
    gen = torch.Generator().manual_seed(7)
    H, Dk, Dv, B = 3, 128, 64, 5
    (q, k, v, g, beta), _ = gdn_inputs([B], H, Dk, Dv, gen)
    pool = torch.full((12, H, Dk, Dv), POISON)
    slots = torch.tensor([11, 2, 5, 0, 7])
    init = torch.randn(B, H, Dk, Dv, generator=gen)
    pool[slots] = init
    before = pool.clone()
    out = ops.gdn_decode(q, k, v, g, beta, pool, slots, Dk ** -0.5)
    for i in range(B):
        o_ref, st = _naive(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], init[i], Dk ** -0.5)
        _close(out[i], o_ref[0], f"decode row {i}")
        _close(pool[slots[i]], st[-1], f"decode state row {i}")
    for s in set(range(12)) - set(slots.tolist()):
        assert torch.equal(pool[s], before[s])


def test_bf16_inputs():
    gen = torch.Generator().manual_seed(3)
    H, Dk, Dv = 2, 64, 32
    lens = [90, 17]
    (q, k, v, g, beta), cu = gdn_inputs(lens, H, Dk, Dv, gen, dtype=torch.bfloat16)
    pool = torch.zeros(3, H, Dk, Dv)
    empty = torch.zeros(0, dtype=torch.long)
    out = ops.gdn_prefill(q, k, v, g, beta, pool, cu, torch.tensor([0, 2]), empty, empty, Dk ** -0.5)
    assert out.dtype == torch.bfloat16 and pool.dtype == torch.float32
    o_ref, st = _naive(q[:90], k[:90], v[:90], g[:90], beta[:90], torch.zeros(H, Dk, Dv), Dk ** -0.5)
    # bf16 output rounding only (inputs are the same bf16 values)
    torch.testing.assert_close(out[:90].double(), o_ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(pool[0].double(), st[-1], atol=1e-4, rtol=1e-4)
    o = ops.gdn_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, torch.tensor([0, 2]), Dk ** -0.5)
    assert o.dtype == torch.bfloat16


def _torch_path(fn):
    # transformers routes these through fla / causal-conv1d kernels when installed (GPU only);
    # compare against its plain-torch implementation underneath
    return inspect.unwrap(fn)


def test_matches_transformers_qwen3_5():
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = torch.Generator().manual_seed(11)
    H, Dk, Dv, L, n_dec = 4, 64, 32, 150, 3
    (q, k, v, g, beta), _ = gdn_inputs([L + n_dec], H, Dk, Dv, gen)
    init = torch.randn(1, H, Dk, Dv, generator=gen) * 0.5
    scale = Dk ** -0.5
    pool = torch.zeros(2, H, Dk, Dv)
    pool[1] = init[0]
    slots = torch.tensor([1])
    empty = torch.zeros(0, dtype=torch.long)
    out = ops.gdn_prefill(q[:L], k[:L], v[:L], g[:L], beta[:L], pool, torch.tensor([0, L], dtype=torch.int32),
                          slots, empty, empty, scale)
    ref, ref_state = _torch_path(hf.torch_chunk_gated_delta_rule)(
        q[None, :L], k[None, :L], v[None, :L], g=g[None, :L], beta=beta[None, :L], initial_state=init.clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=False)
    torch.testing.assert_close(out, ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool[1], ref_state[0], atol=1e-4, rtol=1e-4)
    state = ref_state
    for t in range(L, L + n_dec):
        o = ops.gdn_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], pool, slots, scale)
        r, state = _torch_path(hf.torch_recurrent_gated_delta_rule)(
            q[None, t:t + 1], k[None, t:t + 1], v[None, t:t + 1], g=g[None, t:t + 1], beta=beta[None, t:t + 1],
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False)
        torch.testing.assert_close(o, r[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool[1], state[0], atol=1e-4, rtol=1e-4)


def test_opcheck():
    gen = torch.Generator().manual_seed(5)
    H, Dk, Dv = 2, 16, 8
    lens = [3, 70]
    (q, k, v, g, beta), cu = gdn_inputs(lens, H, Dk, Dv, gen)
    pool = torch.randn(6, H, Dk, Dv, generator=gen)
    torch.library.opcheck(ops.gdn_prefill.overload,
                          (q, k, v, g, beta, pool, cu, torch.tensor([4, 1]), torch.tensor([1, 40]),
                           torch.tensor([0, 2]), Dk ** -0.5))
    torch.library.opcheck(ops.gdn_decode.overload,
                          (q[:2], k[:2], v[:2], g[:2], beta[:2], pool, torch.tensor([5, 3]), Dk ** -0.5))
