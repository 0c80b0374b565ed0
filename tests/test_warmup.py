"""Start-up warm-up (EngineConfig.warmup; "auto" = on CUDA): one short request run at start-up so
that first-use kernel builds do not land in the first real request. It must leave no trace:
later requests get the same tokens (greedy, seeded and unseeded sampling), the prefix cache is
empty (the warm-up prompt is not a hit), the counters start at zero, nothing leaks."""

from __future__ import annotations

import pytest

from engine_helpers import assert_no_leaks, engine, prompts, run_all
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar.runtime.engine.request import EngineRequest, SamplingParams


def _reqs(ps):
    out = []
    for i, p in enumerate(ps):
        if i % 3 == 0:
            sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        elif i % 3 == 1:
            sp = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
        else:
            sp = SamplingParams(max_tokens=6, temperature=0.9, ignore_eos=True)  # the engine's seed sequence
        out.append(EngineRequest(str(i), p, sp))
    return out


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3"])
def test_warm_up_leaves_no_trace(kind):
    ps = prompts(6, 3, 40, seed=21)
    cold = engine(kind, page_size=4, warmup="off")
    ref = run_all(cold, _reqs(ps))
    warm = engine(kind, page_size=4, warmup="on")
    assert warm.num_steps == 0 and warm.num_generated_tokens == 0 and warm.num_prefill_tokens == 0
    assert warm.cm.stats().cached_pages == 0  # the warm-up prompt's pages are gone
    n = 4 * warm.page_size
    again = [EngineRequest("w", [i % warm.vocab_size for i in range(n)],
                           SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))]
    out = []
    warm.add_request(again[0])
    while warm.has_unfinished():
        out += warm.step()
    assert out[0].num_cached_tokens == 0  # not a prefix-cache hit on the warm-up prompt
    warm.reset_prefix_cache()
    fresh = engine(kind, page_size=4, warmup="on")
    assert run_all(fresh, _reqs(ps)) == ref
    assert_no_leaks(fresh)


def test_warm_up_is_off_on_cpu_by_default_and_checks_its_value():
    core = engine("qwen3", page_size=4)  # "auto": CUDA only
    assert core.config.warmup == "auto" and core.num_steps == 0
    with pytest.raises(ValueError, match="warmup"):
        engine("qwen3", warmup="yes")


def test_warm_up_that_is_refused_is_skipped(caplog, monkeypatch):
    """If the warm-up request is refused (RequestError), the engine starts cold instead of failing."""
    from mstar.runtime.engine.engine_core import EngineCore
    from mstar.runtime.engine.request import RequestError

    def refuse(self, req):
        raise RequestError("prompt", "refused for the test")
    monkeypatch.setattr(EngineCore, "add_request", refuse)
    core = engine("qwen3", page_size=4, warmup="on")
    assert any("warm-up skipped" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert core.num_steps == 0 and not core.has_unfinished()
    assert_no_leaks(core)


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3"])
def test_warm_up_covers_one_row_and_a_ragged_multi_row_prefill(kind, monkeypatch):
    """Kernels compile a variant per shape class (Triton: integers == 1 or % 16; FlashInfer and
    fla: the batch layout). The warm-up must meet a one-row prefill and a several-row prefill whose
    token count is no multiple of 16, each in one step, so a served request meets neither first."""
    from mstar.runtime.engine.step_inputs import StepInputBuilder

    seen = []
    build = StepInputBuilder.build

    def record(self, rows):
        if rows.prefill_starts:
            seen.append((len(rows.prefill_starts), sum(e - s for s, e in zip(rows.prefill_starts, rows.prefill_ends))))
        return build(self, rows)
    monkeypatch.setattr(StepInputBuilder, "build", record)
    core = engine(kind, page_size=16, warmup="on")
    assert core.warm_up_steps > 0 and core.num_steps == 0
    assert any(p == 1 and t % 16 == 0 for p, t in seen), seen
    assert any(p >= 3 and t % 16 != 0 for p, t in seen), seen
    assert_no_leaks(core)


@pytest.fixture()
def building_backend():
    """A paged-attention backend on the CPU that, like FlashInfer on a cold start, is still building
    its kernels when the engine starts: its prepare hook returns a live thread, released by the
    test. The backend runs the reference and records which phase called it."""
    import threading

    from mstar.ops import attention, registry
    release = threading.Event()
    build = threading.Thread(target=release.wait, name="test-build", daemon=True)
    calls = []
    ops = (attention.paged_attention_decode, attention.paged_attention_prefill)

    def wrap(op):
        ref = op.backends["reference"].fn

        def fn(*args):
            calls.append(op.name)
            return ref(*args)
        return fn

    def prepare(device, **kw):
        if release.is_set():
            return None  # built
        if not build.is_alive():
            build.start()
        return build
    for op in ops:
        registry.register_backend(op, "test-building", wrap(op), devices=("cpu",), priority=99)
    attention.register_prepare("test-building", prepare)
    try:
        yield calls, release
    finally:
        release.set()
        attention._PREPARE.pop("test-building", None)
        for op in ops:
            op.backends.pop("test-building", None)
            op._resolved.clear()


def test_a_cold_start_warms_up_beside_the_attention_build(building_backend, monkeypatch):
    """While the attention backend builds, the warm-up runs with paged attention on the reference
    (every other kernel of the step compiles meanwhile); the warm-up after the capture runs on the
    backend. Both leave no trace: the engine's tokens are a cold engine's."""
    from mstar.runtime.engine.engine_core import EngineCore
    calls, release = building_backend
    phases = []
    warm_up = EngineCore._warm_up

    def record(self):
        from mstar.ops import attention
        n = len(calls)
        warm_up(self)
        phases.append((attention.paged_attention_prefill.selected("cpu"), len(calls) - n))
        release.set()  # the build finishes after the first warm-up
    monkeypatch.setattr(EngineCore, "_warm_up", record)
    ps = prompts(5, 3, 40, seed=5)
    core = engine("qwen3.5", page_size=4, warmup="on")
    # first: the selection overridden to the reference, the backend never called; then the backend
    assert [p[0] for p in phases] == ["reference", "test-building"]
    assert phases[0][1] == 0 and phases[1][1] > 0
    assert core.num_steps == 0 and core.cm.stats().cached_pages == 0
    out = run_all(core, _reqs(ps))
    monkeypatch.undo()
    assert out == run_all(engine("qwen3.5", page_size=4, warmup="off"), _reqs(ps))
    assert_no_leaks(core)


def test_no_build_under_way_one_warm_up(building_backend, monkeypatch):
    from mstar.runtime.engine.engine_core import EngineCore
    calls, release = building_backend
    from mstar.ops import attention
    monkeypatch.setitem(attention._PREPARE, "test-building", lambda device, **kw: None)  # already built
    n = []
    warm_up = EngineCore._warm_up
    monkeypatch.setattr(EngineCore, "_warm_up", lambda self: (n.append(1), warm_up(self)))
    engine("qwen3.5", page_size=4, warmup="on")
    assert len(n) == 1 and calls
