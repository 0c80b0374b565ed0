"""The fla GDN prefill backend's host-side step plan, on CPU.

fla-core needs CUDA, so a stand-in `fla` module runs each chunk call through mstar's own
reference op (same semantics; the GPU tests compare the real fla with the reference). What is
checked here is the backend's own logic: rows cut at the snapshot positions and run in rounds,
snapshot states written to their slots, the whole-row fast path, and the plan built once per
step (by the first layer) and reused by later calls with the same index tensors.
"""

import importlib
import sys
import types

import pytest
import torch

from gdn_helpers import gdn_inputs
from mstar.ops import gdn

H, DK, DV = 2, 8, 6


def _chunk_via_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, cu_seqlens_cpu=None, **_):
    assert cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type == "cpu"
    assert torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
    n = cu_seqlens.numel() - 1
    pool = initial_state.clone()
    empty = torch.zeros(0, dtype=torch.long)
    o = gdn.gdn_prefill.backends["reference"].fn(q[0], k[0], v[0], g[0], beta[0], pool, cu_seqlens,
                                                 torch.arange(n), empty, empty, scale)
    return o.unsqueeze(0), pool


@pytest.fixture()
def fla_backend(monkeypatch):
    names = ["fla", "fla.ops", "fla.ops.gated_delta_rule"]
    mods = {n: types.ModuleType(n) for n in names}
    mods["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = _chunk_via_reference
    mods["fla.ops.gated_delta_rule"].fused_recurrent_gated_delta_rule = None
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    monkeypatch.delitem(sys.modules, "mstar.ops.backends.fla_gdn", raising=False)
    saved = [(op, dict(op.backends)) for op in (gdn.gdn_prefill, gdn.gdn_decode, gdn.gdn_prefill_fused)]
    mod = importlib.import_module("mstar.ops.backends.fla_gdn")
    yield mod
    for op, b in saved:  # the registry as it was (the stand-in must not stay registered)
        op.backends.clear()
        op.backends.update(b)
        op._resolved.clear()
    sys.modules.pop("mstar.ops.backends.fla_gdn", None)


def _case(lens, snaps, seed):
    gen = torch.Generator().manual_seed(seed)
    (q, k, v, g, beta), cu = gdn_inputs(lens, H, DK, DV, gen)
    nslots = len(lens) + len(snaps) + 3
    pool = torch.randn(nslots, H, DK, DV, generator=gen)
    perm = torch.randperm(nslots, generator=gen)
    slots = perm[:len(lens)]
    snap_slots = perm[len(lens):len(lens) + len(snaps)]
    snap_idx = torch.tensor(snaps, dtype=torch.long)
    return (q, k, v, g, beta), pool, cu, slots, snap_idx, snap_slots


CASES = [
    ([5, 70, 1, 130], [3, 4, 20, 69, 74, 75, 80, 139]),  # mid-row cuts, row ends, a length-1 row
    ([16, 32, 48], [15, 47, 95]),  # snapshots only at row ends: one round of whole rows
    ([40, 9], []),  # no snapshots
    ([64, 64, 3], [63, 64, 127, 130]),  # a cut on a row's first token
]


@pytest.mark.parametrize("lens,snaps", CASES)
def test_fla_prefill_plan_matches_reference(fla_backend, lens, snaps):
    (q, k, v, g, beta), pool, cu, slots, snap_idx, snap_slots = _case(lens, snaps, seed=len(lens) + len(snaps))
    scale = DK ** -0.5
    ref_pool = pool.clone()
    ref = gdn.gdn_prefill.backends["reference"].fn(q, k, v, g, beta, ref_pool, cu, slots, snap_idx, snap_slots,
                                                   scale)
    got_pool = pool.clone()
    got = fla_backend.gdn_prefill(q, k, v, g, beta, got_pool, cu, slots, snap_idx, snap_slots, scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_pool, ref_pool, atol=1e-5, rtol=1e-5)  # rows, snapshots, untouched slots


def test_fla_prefill_plan_is_built_once_per_step(fla_backend, monkeypatch):
    """Layers of one step share the step's index tensors: the plan (the only device reads)
    is built by the first call; new index tensors (the next step) build a new one."""
    built = []
    real = fla_backend._build_plan
    monkeypatch.setattr(fla_backend, "_build_plan", lambda *a: built.append(1) or real(*a))
    lens, snaps = CASES[0]
    (q, k, v, g, beta), pool, cu, slots, snap_idx, snap_slots = _case(lens, snaps, seed=7)
    scale = DK ** -0.5
    ref_pool = pool.clone()
    got_pool = pool.clone()
    for _layer in range(3):  # three "layers": the same tensors; the state keeps evolving
        ref = gdn.gdn_prefill.backends["reference"].fn(q, k, v, g, beta, ref_pool, cu, slots, snap_idx,
                                                       snap_slots, scale)
        got = fla_backend.gdn_prefill(q, k, v, g, beta, got_pool, cu, slots, snap_idx, snap_slots, scale)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_pool, ref_pool, atol=1e-5, rtol=1e-5)
    assert len(built) == 1
    # the next step: new tensors with another layout
    lens2, snaps2 = CASES[3]
    (q, k, v, g, beta), pool, cu, slots, snap_idx, snap_slots = _case(lens2, snaps2, seed=8)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref = gdn.gdn_prefill.backends["reference"].fn(q, k, v, g, beta, ref_pool, cu, slots, snap_idx, snap_slots,
                                                   scale)
    got = fla_backend.gdn_prefill(q, k, v, g, beta, got_pool, cu, slots, snap_idx, snap_slots, scale)
    assert len(built) == 2
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_pool, ref_pool, atol=1e-5, rtol=1e-5)


def test_fla_plan_in_the_engine_matches_the_reference(fla_backend, monkeypatch):
    """The engine's own steps through the fla backend (its stand-in, selected on CPU): every GDN
    layer of a step shares the step's metadata tensors, so one plan serves them all, and a new
    step builds a new one. Tokens equal the reference backend's, with chunked prompts, decode rows
    beside prefill chunks and prefix-cache snapshots."""
    from engine_helpers import engine, prompts, run_all
    from mstar import knobs
    from mstar.ops.registry import Backend
    from mstar.runtime.engine.request import EngineRequest, SamplingParams
    fla = gdn.gdn_prefill.backends["fla"]
    gdn.gdn_prefill.backends["fla"] = Backend("fla", fla.fn, ("cpu",), lambda: True, fla.priority, fla.note)
    gdn.gdn_prefill._resolved.clear()
    # the model calls gdn_prefill_fused: its composed backend (enabled here on the CPU) reaches gdn_prefill
    comp = gdn.gdn_prefill_fused.backends["composed"]
    gdn.gdn_prefill_fused.backends["composed"] = Backend("composed", comp.fn, ("cpu",), lambda: True,
                                                         comp.priority, comp.note)
    gdn.gdn_prefill_fused._resolved.clear()
    built = []
    real = fla_backend._build_plan
    monkeypatch.setattr(fla_backend, "_build_plan", lambda *a: built.append(1) or real(*a))
    ps = prompts(6, 3, 50, seed=41)
    shared = prompts(1, 16, 16, seed=42)[0]
    reqs = lambda: [EngineRequest(str(i), (shared if i % 2 else []) + p,  # noqa: E731
                                  SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
                    for i, p in enumerate(ps)]
    opts = dict(page_size=4, max_num_seqs=3, max_num_batched_tokens=40)
    with knobs.override(MSTAR_BACKENDS="gdn_prefill=reference"):
        ref_core = engine("qwen3.5", **opts)
        ref = run_all(ref_core, reqs())
    with knobs.override(MSTAR_BACKENDS="gdn_prefill=fla"):
        core = engine("qwen3.5", **opts)
        steps = []
        step = core.step
        monkeypatch.setattr(core, "step", lambda: steps.append(1) or step())
        got = run_all(core, reqs())
    assert got == ref
    n_gdn = len(core.model.state_layers)
    assert n_gdn > 1 and 0 < len(built) <= len(steps)  # one plan per prefill step, not one per layer
