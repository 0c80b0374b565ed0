"""Piecewise graphs for prefill and mixed steps (runtime/graphs/prefill_graphs.py), on CPU in "static"
mode: the same segments, fixed buffers and padded token counts as the captured graphs, run
eagerly. Tokens must equal the plain forward's (greedy and seeded sampling) over steps that mix
decode rows with prefill chunks, chunked prompts, prefix-cache hits (GDN snapshots) and every
bucket; nothing leaks. The GPU test captures them for real."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_no_leaks, engine, prompts, run_all
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar.runtime.graphs.prefill_graphs import prefill_sizes
from mstar.runtime.engine.request import EngineRequest, SamplingParams


def test_prefill_sizes():
    assert prefill_sizes(8192) == [16, 32, 64, 128, 256, 512] + list(range(1024, 8193, 512))
    assert prefill_sizes(64) == [16, 32, 64]
    assert prefill_sizes(100) == [16, 32, 64, 112]  # the budget, rounded up to 16
    assert prefill_sizes(1) == [16]


def _reqs(ps, shared):
    out = []
    for i, p in enumerate(ps):
        sp = (SamplingParams(max_tokens=5 + i % 4, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=5 + i % 4, temperature=0.8, seed=7 + i, ignore_eos=True))
        out.append(EngineRequest(str(i), (shared if i % 3 == 0 else []) + p, sp))
    return out


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3"])
def test_static_prefill_graphs_match_the_forward(kind):
    ps = prompts(9, 1, 70, seed=31)
    shared = prompts(1, 24, 24, seed=32)[0]  # a prefix some prompts share: prefix-cache hits
    opts = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    ref_core = engine(kind, **opts)
    ref = run_all(ref_core, _reqs(ps, shared))
    core = engine(kind, prefill_graphs="static", **opts)
    pg = core.prefill_graphs
    assert pg is not None and pg.sizes == [16, 32, 64] and not pg.graphs
    used, run = [], pg.run
    pg.run = lambda ctx: used.append((int(ctx.input_ids.shape[0]), ctx.num_decode_tokens)) or run(ctx)
    assert run_all(core, _reqs(ps, shared)) == ref
    assert {pg.bucket(t) for t, _ in used} == {16, 32, 64}  # every bucket served a step
    assert any(nd > 0 and t > nd for t, nd in used)  # mixed steps (decode rows + prefill) went through it
    assert_no_leaks(core)


def test_prefill_graphs_refuse_what_they_cannot_cut(caplog):
    from engine_helpers import model_dir
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    core = engine("qwen3", prefill_graphs="static", compile="on")
    assert core.prefill_graphs is None
    assert any("prefill graphs are off" in r.getMessage() for r in caplog.records)
    assert engine("qwen3").config.prefill_graphs == "auto"  # the default
    assert engine("qwen3", prefill_graphs="auto").prefill_graphs is None  # auto: CUDA only
    caplog.clear()
    assert engine("qwen3", prefill_graphs="on").prefill_graphs is None  # on: CUDA, else off with a warning
    assert any("prefill graphs are off" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="prefill_graphs"):
        EngineCore(EngineConfig(model=model_dir("qwen3"), prefill_graphs="yes", device="cpu"))


def test_static_prefill_graphs_at_tp2():
    """tp = 2 over gloo: both ranks run the segments at the same padded size (their all-reduces
    pair up); tokens equal the tp = 1 plain forward's."""
    from tp_helpers import PS, closed_cleanly, run_greedy, tp_engine
    ref = run_greedy(tp_engine("qwen3.5", 1, max_num_seqs=4, max_num_batched_tokens=32), PS, 12)
    core = tp_engine("qwen3.5", 2, max_num_seqs=4, max_num_batched_tokens=32, prefill_graphs="static")
    try:
        assert core.prefill_graphs is not None and core.prefill_graphs.sizes == [16, 32]
        assert run_greedy(core, PS, 12) == ref
    finally:
        closed_cleanly(core)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3.5-gpu", "qwen3-gpu"])
def test_cuda_prefill_graphs_match_the_forward(kind):
    """Captured segments replayed around eager cores give the plain forward's tokens (bf16; the
    presets' per-head shapes, so a kernel cache built for the presets has the attention / GDN kernels)."""
    ps = prompts(9, 1, 70, seed=31)
    shared = prompts(1, 24, 24, seed=32)[0]
    opts = dict(page_size=16, max_num_seqs=4, max_num_batched_tokens=128, device="cuda", dtype="bfloat16")
    ref = run_all(engine(kind, prefill_graphs="off", **opts), _reqs(ps, shared))
    core = engine(kind, **opts)  # the default, "auto": captured on CUDA at tp = 1
    assert core.prefill_graphs is not None and core.prefill_graphs.graphs
    assert run_all(core, _reqs(ps, shared)) == ref
    assert_no_leaks(core)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_prefill_graphs_at_tp2():
    """NCCL: both ranks capture the segments (all-reduces inside) and replay them in step."""
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_core import EngineCore
    from engine_helpers import model_dir
    from tp_helpers import PS, closed_cleanly, run_greedy
    opts = dict(model=model_dir("qwen3-gpu"), device="cuda", dtype="bfloat16", tp=2, max_num_seqs=8,
                max_model_len=256, max_num_batched_tokens=128)
    ps = PS
    outs = []
    for mode in ("off", "on", "auto"):  # auto: not at tp > 1 (unmeasured there)
        core = EngineCore(EngineConfig(prefill_graphs=mode, **opts))
        try:
            assert (core.prefill_graphs is not None and bool(core.prefill_graphs.graphs)) == (mode == "on")
            outs.append(run_greedy(core, ps, 16))
        finally:
            closed_cleanly(core)
    assert outs[0] == outs[1] == outs[2]
