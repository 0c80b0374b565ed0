"""Causal depthwise conv1d ops against a float64 F.conv1d computation, against transformers'
Qwen3.5 causal_conv1d_fn / causal_conv1d_update, and against themselves (prefill pieces,
prefill then decode), with snapshots and untouched pool slots."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from mstar import ops

POISON = 777.0


def _ref_row(x_row, hist, weight, bias, silu):
    """float64: F.conv1d over (history, tokens); returns (out [L, C], xpad [L+K-1, C])."""
    xpad = torch.cat([hist.double().T, x_row.double()], dim=0)  # [K-1+L, C]
    C = weight.shape[0]
    if x_row.shape[0] == 0:
        return torch.zeros(0, C, dtype=torch.float64), xpad
    out = F.conv1d(xpad.T[None], weight.double()[:, None, :], None if bias is None else bias.double(),
                   groups=C)[0].T
    if silu:
        out = F.silu(out)
    return out, xpad


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("K", [4, 2])
@pytest.mark.parametrize("with_bias,silu", [(False, True), (True, False)])
def test_prefill_vs_conv1d_with_snapshots(K, with_bias, silu):
    gen = torch.Generator().manual_seed(K * 10 + with_bias)
    C = 24
    lens = [1, 2, 3, 0, 5, 64, 100]
    T = sum(lens)
    cu = _cu(lens)
    x = torch.randn(T, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    bias = torch.randn(C, generator=gen) if with_bias else None
    num_slots = 16
    pool = torch.full((num_slots, C, K - 1), POISON)
    slots = torch.tensor([5, 0, 9, 3, 14, 7, 2])
    hist = torch.randn(len(lens), C, K - 1, generator=gen)
    hist[0] = 0  # a new sequence
    pool[slots] = hist
    starts = cu[:-1].tolist()
    snap_tok = [starts[0], starts[1], starts[2] + 1, starts[4] + 4, starts[5] + 30, starts[6], T - 1]
    snap_slots = [1, 4, 6, 8, 10, 11, 12]
    before = pool.clone()
    out = ops.causal_conv1d_prefill(x, weight, bias, pool, cu, slots, torch.tensor(snap_tok),
                                    torch.tensor(snap_slots), silu)
    assert out.shape == (T, C) and out.dtype == x.dtype
    state_after = {}
    for i in range(len(lens)):
        a, b = starts[i], cu[i + 1].item()
        ref, xpad = _ref_row(x[a:b], hist[i], weight, bias, silu)
        torch.testing.assert_close(out[a:b].double(), ref, atol=1e-5, rtol=1e-5)
        # last K-1 inputs, from history when the row is shorter than K-1
        torch.testing.assert_close(pool[slots[i]].double(), xpad[-(K - 1):].T)
        for t in range(a, b):
            state_after[t] = xpad[t - a + 1:t - a + K].T
    for t, s in zip(snap_tok, snap_slots):
        torch.testing.assert_close(pool[s].double(), state_after[t])
    touched = set(slots.tolist()) | set(snap_slots)
    for s in range(num_slots):
        if s not in touched:
            assert torch.equal(pool[s], before[s]), f"slot {s} was written"


def test_update_vs_conv1d_and_untouched():
    gen = torch.Generator().manual_seed(2)
    B, C, K = 6, 40, 4
    x = torch.randn(B, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    bias = torch.randn(C, generator=gen)
    pool = torch.full((10, C, K - 1), POISON)
    slots = torch.tensor([9, 1, 4, 0, 6, 3])
    hist = torch.randn(B, C, K - 1, generator=gen)
    pool[slots] = hist
    before = pool.clone()
    out = ops.causal_conv1d_update(x, weight, bias, pool, slots, True)
    for i in range(B):
        ref, xpad = _ref_row(x[i:i + 1], hist[i], weight, bias, True)
        torch.testing.assert_close(out[i].double(), ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[slots[i]].double(), xpad[1:].T)
    for s in set(range(10)) - set(slots.tolist()):
        assert torch.equal(pool[s], before[s])


def test_prefill_pieces_and_updates_equal_whole():
    gen = torch.Generator().manual_seed(3)
    C, K = 16, 4
    lens_whole = [50, 8, 6]
    x_rows = [torch.randn(n, C, generator=gen) for n in lens_whole]
    weight = torch.randn(C, K, generator=gen)
    bias = torch.randn(C, generator=gen)
    slots = torch.tensor([2, 0, 1])
    empty = torch.zeros(0, dtype=torch.long)

    pool_w = torch.zeros(3, C, K - 1)
    out_w = ops.causal_conv1d_prefill(torch.cat(x_rows), weight, bias, pool_w, _cu(lens_whole), slots, empty,
                                      empty, True)
    outs_w = out_w.split(lens_whole)

    # piece 1: prefill (pieces shorter than K-1 included), piece 2: prefill, then token-by-token updates
    cuts = [(20, 45), (1, 3), (1, 1)]
    pool = torch.zeros(3, C, K - 1)
    o1 = ops.causal_conv1d_prefill(torch.cat([r[:a] for r, (a, _) in zip(x_rows, cuts)]), weight, bias, pool,
                                   _cu([a for a, _ in cuts]), slots, empty, empty, True)
    o2 = ops.causal_conv1d_prefill(torch.cat([r[a:b] for r, (a, b) in zip(x_rows, cuts)]), weight, bias, pool,
                                   _cu([b - a for a, b in cuts]), slots, empty, empty, True)
    for i, (a, b) in enumerate(cuts):
        torch.testing.assert_close(o1.split([c[0] for c in cuts])[i], outs_w[i][:a])
        torch.testing.assert_close(o2.split([c[1] - c[0] for c in cuts])[i], outs_w[i][a:b])
    n_dec = 5  # every row's remaining tokens
    for s in range(n_dec):
        xb = torch.stack([r[b + s] for r, (_, b) in zip(x_rows, cuts)])
        o = ops.causal_conv1d_update(xb, weight, bias, pool, slots, True)
        torch.testing.assert_close(o, torch.stack([ow[b + s] for ow, (_, b) in zip(outs_w, cuts)]))
    torch.testing.assert_close(pool, pool_w)


def _torch_path(fn):
    # transformers routes these through fla / causal-conv1d kernels when installed (GPU only);
    # compare against its plain-torch implementation underneath
    return inspect.unwrap(fn)


def test_matches_transformers_qwen3_5():
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = torch.Generator().manual_seed(4)
    C, K, L, n_dec = 32, 4, 37, 5
    x = torch.randn(L + n_dec, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    empty = torch.zeros(0, dtype=torch.long)
    pool = torch.zeros(1, C, K - 1)
    slots = torch.tensor([0])
    out = ops.causal_conv1d_prefill(x[:L], weight, None, pool, torch.tensor([0, L], dtype=torch.int32), slots,
                                    empty, empty, True)
    ref = _torch_path(hf.causal_conv1d_fn)(x[:L].T[None].contiguous(), weight, None, activation="silu")[0].T
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # transformers keeps the last K inputs in its conv state
    hf_state = x[L - K:L].T[None].contiguous()
    for t in range(L, L + n_dec):
        o = ops.causal_conv1d_update(x[t:t + 1], weight, None, pool, slots, True)
        r = _torch_path(hf.causal_conv1d_update)(x[t:t + 1].T[None].contiguous(), hf_state, weight, None,
                                                 activation="silu")
        torch.testing.assert_close(o, r[0].T, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[0], hf_state[0, :, 1:])


def test_bf16():
    gen = torch.Generator().manual_seed(5)
    C, K = 16, 4
    x = torch.randn(10, C, generator=gen).bfloat16()
    weight = torch.randn(C, K, generator=gen).bfloat16()
    pool = torch.zeros(2, C, K - 1, dtype=torch.bfloat16)
    empty = torch.zeros(0, dtype=torch.long)
    out = ops.causal_conv1d_prefill(x, weight, None, pool, torch.tensor([0, 10], dtype=torch.int32),
                                    torch.tensor([1]), empty, empty, True)
    ref, _ = _ref_row(x, torch.zeros(C, K - 1), weight, None, True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=1e-2)
    assert torch.equal(pool[1], x[-3:].T)
    o = ops.causal_conv1d_update(x[:1], weight, None, pool, torch.tensor([1]), False)
    assert o.dtype == torch.bfloat16


def test_opcheck():
    gen = torch.Generator().manual_seed(6)
    C, K = 8, 4
    x = torch.randn(12, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    pool = torch.randn(5, C, K - 1, generator=gen)
    cu = torch.tensor([0, 2, 12], dtype=torch.int32)
    for bias in (None, torch.randn(C, generator=gen)):
        torch.library.opcheck(ops.causal_conv1d_prefill.overload,
                              (x, weight, bias, pool, cu, torch.tensor([3, 0]), torch.tensor([1, 7]),
                               torch.tensor([2, 4]), True))
        torch.library.opcheck(ops.causal_conv1d_update.overload,
                              (x[:3], weight, bias, pool, torch.tensor([1, 4, 2]), False))
