"""Tensor parallelism on the CPU: gloo, one spawned follower process per extra rank, fp32,
tiny random Qwen3.5 / Qwen3 checkpoints written by transformers. Tokens must equal tp=1's
and HF generate's; prefix-cache hits, aborts and preemptions (offload and recompute)
at tp=2; overlapped decode (async_output) at tp=2, the loop-back tokens broadcast to the
follower; tp=4 end to end (KV heads replicated); the sharding arithmetic at tp=2/4/8 on
the 9B / 27B shapes (meta tensors); the tp=1 path unchanged; follower errors surface on
rank 0; no follower outlives its engine."""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine_helpers import VOCAB, hf_greedy, model_dir, prompts, run_all
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar.models import parallel
from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.request import CoreOutput, EngineRequest, SamplingParams
from tp_helpers import PS, closed_cleanly, run_greedy, tp_engine

G32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
def _alive(core) -> list:
    return [p for p in core.tp._procs if p.is_alive()]


@pytest.fixture(autouse=True)
def short_collective_timeout(monkeypatch):
    """A bug that leaves a rank waiting fails the test in a minute, not in ten."""
    from datetime import timedelta

    from mstar.runtime.parallel import tp as tpmod
    monkeypatch.setattr(tpmod, "COLLECTIVE_TIMEOUT", timedelta(seconds=60))


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3"])
def test_tp2(kind):
    """One tp=2 engine: a batch equal to tp=1 and HF, a prefix-cache hit, an abort mid-run.
    (One engine per test: a process holds one tensor-parallel group at a time.)"""
    want = [hf_greedy(kind, p, 32) for p in PS]
    tp1 = tp_engine(kind, 1, max_num_seqs=8)
    assert run_greedy(tp1, PS) == want
    core = tp_engine(kind, 2, max_num_seqs=8)
    try:
        assert len(_alive(core)) == 1
        assert run_greedy(core, PS) == want
        _check_prefix_hit(kind, core)
        _check_abort(kind, core)
    finally:
        closed_cleanly(core)


def _check_prefix_hit(kind, core):
    base = prompts(1, 30, 30, seed=5)[0]
    # b shares a's first 32 tokens: four pages of 8, the last ending where a's prefill chunk
    # kept its GDN state snapshot (MSTAR_GDN_SNAPSHOTS=chunk-end: one per chunk)
    a, b = base + [7, 8, 9], base + [7, 8, 11, 12]
    before = core.cm.stats().prefix_hit_tokens
    assert run_greedy(core, [a], 12, "pa") == [hf_greedy(kind, a, 12)]
    assert run_greedy(core, [b], 12, "pb") == [hf_greedy(kind, b, 12)]
    assert core.cm.stats().prefix_hit_tokens - before >= 32


def _check_abort(kind, core, in_flight: bool = False):
    """Abort one of two requests after a few steps (in_flight: while a chained step of
    overlapped decode is in flight); the other one finishes equal to HF."""
    core.add_request(EngineRequest("x", PS[1], SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)))
    core.add_request(EngineRequest("y", PS[2], SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)))
    toks = {"x": [], "y": []}
    chained = core.overlap.num_chained if in_flight else 0
    for _ in range(6 if in_flight else 4):
        for o in core.step():
            toks[o.request_id].extend(o.new_token_ids)
    if in_flight:
        assert core.overlap.inflight is not None and core.overlap.num_chained > chained
    core.abort(["x"])
    fin = {}
    while core.has_unfinished():
        for o in core.step():
            toks[o.request_id].extend(o.new_token_ids)
            if o.finished:
                fin[o.request_id] = o.finish_reason
    assert fin == {"x": "abort", "y": "length"}
    assert toks["y"] == hf_greedy(kind, PS[2], 20)
    assert 0 < len(toks["x"]) < 30 and toks["x"] == hf_greedy(kind, PS[1], 30)[:len(toks["x"])]
    core.cm.check()
    # the engine (and the followers' caches) keep serving
    assert run_greedy(core, [PS[3]], 8, "after") == [hf_greedy(kind, PS[3], 8)]


@pytest.mark.parametrize("mode", ["offload", "recompute"])
def test_tp2_preemption(mode):
    # 9 pages of 8 tokens: four sequences of up to 56 tokens cannot all stay resident
    core = tp_engine("qwen3.5", 2, max_num_seqs=4, num_pages=12, max_model_len=64, preemption_mode=mode)
    try:
        ps = prompts(4, 10, 24, seed=9)
        got = run_greedy(core, ps, 32, "pre")
        assert core.stats()["num_preemptions"] > 0
        assert got == [hf_greedy("qwen3.5", p, 32) for p in ps]
    finally:
        closed_cleanly(core)


def test_tp2_offline_llm_and_embedded_preset():
    # tiny-qwen3 preset: tied, vocab 259 (padded to 2 x 130), random weights drawn whole then sharded
    from mstar.runtime.engine.llm import LLM
    ps = [[1, 2, 3, 4, 5], list(range(40, 80))]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM("tiny-qwen3", dtype="float32", device="cpu", max_model_len=128, tp=2) as llm:
        got = [o.token_ids for o in llm.generate(ps, sp)]
        procs = list(llm.engine.tp._procs)
    assert not any(p.is_alive() for p in procs)
    want = [o.token_ids for o in LLM("tiny-qwen3", dtype="float32", device="cpu", max_model_len=128).generate(ps, sp)]
    assert got == want


def test_tp2_llama_equals_tp1():
    # tiny-llama: untied head, llama3 rope scaling; the Qwen3 attention split without q/k norms
    from mstar.runtime.engine.llm import LLM
    ps = [[7, 8, 9], list(range(30, 75))]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM("tiny-llama", dtype="float32", device="cpu", max_model_len=128, tp=2) as llm:
        got = [o.token_ids for o in llm.generate(ps, sp)]
    want = [o.token_ids for o in LLM("tiny-llama", dtype="float32", device="cpu", max_model_len=128).generate(ps, sp)]
    assert got == want


def test_invalid_tp_rejected():
    # the test models have 4 attention heads and 2 KV heads: tp=3 divides neither
    with pytest.raises(ValueError, match=r"tp: tensor parallel size 3 must divide num_attention_heads \(4\)"):
        tp_engine("qwen3.5", 3)
    # GDN heads: tiny-qwen3.5 has a single GDN key head
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(1"):
        tp_engine("tiny-qwen3.5", 2)
    with pytest.raises(ValueError, match="tp: must be a positive integer"):
        EngineConfig(model="tiny-qwen3", tp=0)
    import torch.distributed as dist
    assert not dist.is_initialized() and parallel.tp_size() == 1


@pytest.mark.parametrize("where", ["load", "step"])
def test_follower_error_surfaces_on_rank0(where, monkeypatch):
    from mstar.runtime.parallel import tp as tpmod
    monkeypatch.setattr(tpmod.TensorParallel, "_test_fault", (1, where, 3))
    if where == "load":
        with pytest.raises(tpmod.TPError, match="rank 1 failed:(.|\n)*injected fault: rank 1 at load"):
            tp_engine("qwen3", 2)
        import torch.distributed as dist
        assert not dist.is_initialized()
        return
    core = tp_engine("qwen3", 2)
    try:
        with pytest.raises(tpmod.TPError, match="rank 1 failed:(.|\n)*injected fault: rank 1 at step 3"):
            run_greedy(core, PS[:2], 8, "f")
    finally:
        closed_cleanly(core)


def test_engine_process_with_tp2():
    """The server's engine process starts a tp=2 engine, serves, and leaves no follower behind."""
    from mstar.runtime.engine.engine_process import EngineProcess
    cfg = EngineConfig(model=model_dir("qwen3"), dtype="float32", device="cpu", max_model_len=128, tp=2)
    ep = EngineProcess(cfg)
    ep.start()
    try:
        info = ep.wait_ready(timeout=120)
        assert info["tp"] == 2
        kids = _children(ep.pid)
        assert len(kids) >= 1
        ep.add(EngineRequest("s", PS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
        toks, deadline = [], time.monotonic() + 60
        while len(toks) < 8 and time.monotonic() < deadline:
            msg = ep._out_q.get(timeout=30)
            if msg[0] == "step":
                for o in msg[1]:
                    if isinstance(o, tuple):  # CoreOutputs may travel as tuples (engine_process)
                        o = CoreOutput(*o)
                    toks.extend(o.new_token_ids)
        assert toks == hf_greedy("qwen3", PS[0], 8)
    finally:
        ep.shutdown()
    assert not ep.is_alive() and ep.exitcode == 0
    for pid in kids:
        assert not _pid_alive(pid), f"follower {pid} outlived the engine"


def test_tp2_startup_phases_logged_and_close_is_quick(caplog, monkeypatch):
    """Rank 0 and the follower each log one start-up line naming every phase (tp.STARTUP_PHASES);
    close() of a healthy engine returns at once: the followers exit as soon as they are told
    (os._exit after their reports: no interpreter teardown, 0.7-1.5 s here before), the monitor
    thread is woken (not left to its 0.2 s poll), and nothing waits on JOIN_TIMEOUT_S (set to
    30 s here, so a close that waited on it fails the bound). Once dropped, the engine's model
    and caches are freed at once (no reference cycle waiting for the garbage collector)."""
    import logging
    import re

    from mstar.runtime.parallel import tp as tpmod
    from mstar.runtime.engine.llm import LLM
    monkeypatch.setattr(tpmod, "JOIN_TIMEOUT_S", 30.0)
    caplog.set_level(logging.INFO, logger="mstar.runtime.parallel.tp")
    llm = LLM(model_dir("qwen3"), dtype="float32", device="cpu", max_model_len=128, tp=2)
    tp = llm.engine.tp
    procs = list(tp._procs)
    try:
        outs = llm.generate([PS[0], PS[1]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outs] == [hf_greedy("qwen3", p, 6) for p in PS[:2]]
    finally:
        t0 = time.perf_counter()
        llm.close()
        dt = time.perf_counter() - t0
    assert not any(p.is_alive() for p in procs) and all(p.exitcode == 0 for p in procs)
    assert dt < 0.5, f"close() took {dt:.2f} s: {tp.close_timing}"
    assert tp.close_timing["monitor"] < 0.1
    lines = [r.getMessage() for r in caplog.records if r.name == "mstar.runtime.parallel.tp"]
    num = r"(\d+(\.\d+)? (s|ms|us)|-)"
    for rank in (0, 1):
        found = [ln for ln in lines if ln.startswith(f"tp start-up rank {rank}: ")]
        assert len(found) == 1, lines
        for phase in tpmod.STARTUP_PHASES:
            assert re.search(rf"[:,] {phase} {num}", found[0]), (phase, found[0])
        for phase in ("spawn", "init_process_group", "load", "caches", "first_forward", "total"):
            assert not re.search(rf"[:,] {phase} -", found[0]), (phase, found[0])  # each happened
        assert re.search(r"capture -", found[0])  # no decode graphs on the CPU
    # per-step lines: the first step apart from the rest (median / max), counts
    assert any(re.match(r"tp rank 1: \d+ steps \(\d+ eager, 0 graph replays\); forward .*first .*; then \d+: "
                        r"median .*max .*\(step \d+\)", ln) for ln in lines), lines
    close = [ln for ln in lines if ln.startswith("tp close: ")]
    assert len(close) == 1 and "killed" not in close[0] and "rank 1: got it +" in close[0], close
    assert "group destroyed in" in close[0], close  # gloo: destroyed (NCCL: aborted)
    # no reference cycle keeps the closed engine's model and caches (on CUDA: the GPU) allocated
    import gc
    import weakref
    w_model, w_caches = weakref.ref(llm.engine.model), weakref.ref(llm.engine.cm.caches)
    gc.disable()
    try:
        del llm, tp
        assert w_model() is None and w_caches() is None
    finally:
        gc.enable()


def test_step_stat_separates_the_first_step():
    """One huge step (a first step compiling kernels) no longer hides in a per-step mean."""
    from mstar.runtime.parallel.tp import StepStat
    s = StepStat()
    s.add(40.0)
    for i in range(2000):
        s.add(0.005 * (1 + 0.02 * (i % 5)))
    s.add(2.0)
    assert s.n == 2002 and s.first == 40.0
    assert s.median() == pytest.approx(0.0052, rel=0.05)
    assert (s.max, s.max_at) == (2.0, 2002)
    k, tot = s.outliers()
    assert k == 1 and tot == pytest.approx(2.0)
    text = s.summary()
    assert text.startswith("first 40.00 s; then 2001: median 5.") and "max 2.00 s (step 2002)" in text
    assert "1 over 10x the median (2.00 s in all)" in text
    assert s.total / s.n > 4 * s.median()  # what the old per-step mean would have reported
    empty = StepStat()
    assert empty.summary() == "none" and empty.median() is None


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(d))
            except OSError:
                pass
    return out


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- tp = 4 end to end ----------------------------------------------------------------------------
def _tp4_dir(tmp_path_factory) -> str:
    """Qwen3.5 whose heads split 4 ways: 4 q heads, 2 KV heads (replicated at tp=4), GDN 4 key / 8 value heads."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from mstar.models.tokenizer import byte_tokenizer
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=258)
    torch.manual_seed(3)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 8.0).log())
            elif "norm" in name:
                p.copy_((0.0 if "linear_attn.norm" not in name else 1.0) + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
    path = str(tmp_path_factory.mktemp("tp4"))
    m.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_tp4_tokens_equal_tp1(tmp_path_factory):
    path = _tp4_dir(tmp_path_factory)
    ps = PS[:3]
    want = run_greedy(tp_engine(path, 1), ps, 16)
    core = tp_engine(path, 4)
    try:
        assert len(_alive(core)) == 3
        assert run_greedy(core, ps, 16) == want
    finally:
        closed_cleanly(core)


# --- sharding arithmetic at 2, 4, 8 (meta tensors, no processes) -----------------------------------
@pytest.mark.parametrize("preset", ["qwen3.5-9b", "qwen3.5-27b", "qwen3-8b"])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_sharding_covers_every_checkpoint_tensor(preset, size):
    from mstar.models import build_model, resolve_config
    cfg = resolve_config(preset)
    full = build_model(cfg).expected_weights()
    full_shapes = {k: s.shape for k, s in full.items()}
    cover: dict[str, torch.Tensor] = {}
    kv = cfg.num_key_value_heads
    try:
        for rank in range(size):
            parallel.set_tp(rank, size)
            m = build_model(cfg)
            wm = m.expected_weights()
            assert {k: s.shape for k, s in wm.items()} == full_shapes  # checkpoint names and shapes
            for name, slot in wm.items():
                sh = slot.shard
                shape = full_shapes[name]
                c = cover.setdefault(name, torch.zeros(shape[sh.dim] if sh else 1, dtype=torch.int32))
                if sh is None:
                    c += 1
                    continue
                for s, d, n in sh.pieces:
                    assert d + n <= slot.target().shape[sh.dim]
                    c[s:s + n] += 1
            spec = m.cache_spec()
            for a in spec.attention:
                assert a.num_kv_heads == max(1, kv // size)
            for st in spec.state:
                assert st.num_heads == cfg.linear_num_value_heads // size
        # every row / column of every tensor is held by exactly the expected number of ranks
        for name, c in cover.items():
            if name.endswith(("k_proj.weight", "v_proj.weight")) and size > kv:
                assert torch.all(c == size // kv), name  # replicated KV heads
            elif c.numel() == 1:
                assert int(c) == size, name  # replicated (norms)
            else:
                assert torch.all(c == 1), name
    finally:
        parallel.reset_tp()


def test_tp1_path_unchanged(monkeypatch):
    """tp = 1 builds the plain tensors and calls no collective: the parallel layers run
    exactly F.linear / F.embedding on the same weights."""
    import torch.nn.functional as F

    from mstar.models import build_model, resolve_config
    from mstar.models import layers as L

    def boom(*a, **k):
        raise AssertionError("collective called at tp=1")

    monkeypatch.setattr(parallel, "all_reduce", boom)
    monkeypatch.setattr(parallel, "all_gather_last", boom)
    assert parallel.tp_size() == 1
    cfg = resolve_config(model_dir("qwen3.5"))
    m = build_model(cfg, device="cpu")
    m.init_random(0)
    assert all(s.shard is None for s in m.expected_weights().values())
    assert not any(getattr(mod, "tp_shards", None) for mod in m.modules())
    x = torch.randn(5, cfg.hidden_size)
    for mod in m.modules():
        if isinstance(mod, L.RowParallelLinear):
            xi = torch.randn(5, mod.weight.shape[1])
            assert torch.equal(mod(xi), F.linear(xi, mod.weight, mod.bias))
    ids = torch.tensor([0, 5, VOCAB - 1])
    emb = m.model.embed_tokens
    assert emb.weight.shape[0] == VOCAB and torch.equal(emb(ids), F.embedding(ids, emb.weight))
    assert torch.equal(m.compute_logits(x), F.linear(x, m.lm_head.weight).float())
    # and the engine at tp=1 starts no process and no group
    core = tp_engine("qwen3.5", 1)
    assert core.tp is None
    import torch.distributed as dist
    assert not dist.is_initialized()


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3"])
def test_one_all_reduce_per_mixer_and_mlp(kind, monkeypatch):
    """A rank's forward: one all-reduce for the embedding, then exactly one after each mixer
    and one after each MLP; one all-gather for the logits (collectives counted, not run)."""
    from model_harness import Harness

    from mstar.models import build_model, resolve_config
    calls = {"reduce": 0, "gather": 0}

    def reduce(x, group=None):
        calls["reduce"] += 1
        return x

    def gather(x, size, group=None):
        calls["gather"] += 1
        return torch.cat([x] * size, dim=-1)

    monkeypatch.setattr(parallel, "all_reduce", reduce)
    monkeypatch.setattr(parallel, "all_gather_last", gather)
    cfg = resolve_config(model_dir(kind))
    with parallel.building(1, 2):
        m = build_model(cfg, device="cpu")
    assert parallel.tp_size() == 1  # the process is not sharded, only the model
    m.init_random(0)
    h = Harness(m, max_seqs=2, max_len=32, page_size=4)
    h.step(prefill={0: [1, 2, 3, 4, 5]})
    calls.update(reduce=0, gather=0)
    h.step(decode={0: 6}, prefill={1: [7, 8, 9]})
    assert calls == {"reduce": 1 + 2 * cfg.num_hidden_layers, "gather": 1}


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3"])
def test_tp2_decode_graph_path(kind):
    """Decode steps through the graph runner on every rank ("static": the CUDA-graph path's
    fixed buffers and padding without capturing): rank 0 sends the rows, followers fill
    their own buffers; tokens equal HF's, with rows padded (5 rows run at 8)."""
    ps = PS[:5]
    want = [hf_greedy(kind, p, 32) for p in ps]
    core = tp_engine(kind, 2, max_num_seqs=8, decode_graphs="static")
    try:
        assert core.graphs is not None and core.overlap is None
        calls = []
        run = core.graphs.run
        core.graphs.run = lambda rows, **kw: calls.append(len(rows.decode_tokens)) or run(rows, **kw)
        assert run_greedy(core, ps) == want
        assert 5 in calls
    finally:
        closed_cleanly(core)


# --- overlapped decode (async_output) at tp = 2 -------------------------------------------------------
def _overlap_requests(stop_tok: int) -> list[EngineRequest]:
    """Greedy rows of different lengths (one stopping on a token it produces mid-way: with overlap,
    found only after the next step was launched) and two short sampled rows (steps holding them run
    synchronously; the greedy rows chain once they are gone)."""
    reqs = []
    for i, p in enumerate(PS):
        if i < 4:
            sp = SamplingParams(max_tokens=20 + 3 * i, temperature=0.0, ignore_eos=True,
                                stop_token_ids=[stop_tok] if i == 2 else [])
        else:
            sp = SamplingParams(max_tokens=5, temperature=0.8, seed=11, ignore_eos=True)
        reqs.append(EngineRequest(f"o{i}", p, sp))
    reqs.append(EngineRequest("s", PS[0], SamplingParams(max_tokens=4, temperature=1.0, top_k=20, seed=5,
                                                         ignore_eos=True)))
    return reqs


def _abort_in_flight(core, kind) -> None:
    """Abort a request while a chained step is in flight; the engine keeps serving."""
    _check_abort(kind, core, in_flight=True)
    assert core.overlap.inflight is None
    assert run_greedy(core, [PS[3]], 8, "after") == [hf_greedy(kind, PS[3], 8)]


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3"])
def test_tp2_overlapped_decode(kind):
    """async_output at tp=2: chained graph steps take their input ids from rank 0's device
    (broadcast to the follower); tokens equal tp=1 (overlapped and synchronous) and the
    synchronous tp=2 engine's, with sampled rows (steps fall back to synchronous), a stop token
    found late, and an abort while a chained step is in flight."""
    opts = dict(max_num_seqs=8, decode_graphs="static")
    stop_tok = hf_greedy(kind, PS[2], 26)[6]
    want = run_all(tp_engine(kind, 1, async_output="off", **opts), _overlap_requests(stop_tok))
    assert want["o2"][1] == "stop" and want["o2"][0][-1] == stop_tok
    tp1 = tp_engine(kind, 1, async_output="on", **opts)
    assert run_all(tp1, _overlap_requests(stop_tok)) == want and tp1.overlap.num_chained > 0
    got = {}
    for mode in ("off", "on"):
        core = tp_engine(kind, 2, async_output=mode, **opts)
        try:
            assert (core.overlap is not None) == (mode == "on")
            got[mode] = run_all(core, _overlap_requests(stop_tok))
            if mode == "on":
                assert core.overlap.num_chained > 0, core.num_steps
                assert core.overlap.num_chained >= core.num_steps // 3, (core.overlap.num_chained, core.num_steps)
                core.cm.check()
                _abort_in_flight(core, kind)
        finally:
            closed_cleanly(core)
    assert got["off"] == want
    assert got["on"] == want


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_tp2_follower_dies_mid_chain(how, monkeypatch):
    """A follower that fails (raises before a chained step's broadcast) or is killed while
    steps are chained: rank 0 raises TPError, and the engine still closes cleanly."""
    import signal

    from mstar.runtime.parallel import tp as tpmod
    if how == "raise":
        monkeypatch.setattr(tpmod.TensorParallel, "_test_fault", (1, "chained", 4))
    core = tp_engine("qwen3", 2, max_num_seqs=8, decode_graphs="static", async_output="on")
    try:
        for i, p in enumerate(PS[:3]):
            core.add_request(EngineRequest(f"k{i}", p, SamplingParams(max_tokens=40, temperature=0.0,
                                                                      ignore_eos=True)))
        if how == "raise":
            with pytest.raises(tpmod.TPError, match="rank 1 failed:(.|\n)*injected fault: rank 1 at chained step"):
                for _ in range(60):
                    core.step()
            assert core.overlap.num_chained > 0
        else:
            while core.overlap.num_chained < 3:
                core.step()
            os.kill(core.tp._procs[0].pid, signal.SIGKILL)
            with pytest.raises(tpmod.TPError, match="rank 1 (exited|failed)"):
                for _ in range(60):
                    core.step()
    finally:
        closed_cleanly(core)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_cuda_graphs_match_eager():
    """NCCL: every rank captures the decode graphs (all-reduces inside them) and replays them;
    tokens equal the eager tp=2 engine's, with overlapped decode (the default with captured
    graphs: chained steps broadcast their loop-back tokens) and without. Run on the two-GPU host."""
    # the 0.6B preset's head shapes: a kernel cache built for the presets holds their attention kernels
    opts = dict(model=model_dir("qwen3-gpu"), device="cuda", dtype="bfloat16", tp=2, max_num_seqs=8,
                max_model_len=256)
    ps = PS
    outs = []
    for graphs, overlap in (("auto", "auto"), ("auto", "off"), ("off", "auto")):
        from mstar.runtime.engine.engine_core import EngineCore
        core = EngineCore(EngineConfig(decode_graphs=graphs, async_output=overlap, **opts))
        try:
            assert (core.graphs is not None and bool(core.graphs.graphs)) == (graphs == "auto")
            assert (core.overlap is not None) == (graphs == "auto" and overlap == "auto")
            outs.append(run_greedy(core, ps, 16))
            if core.overlap is not None:
                assert core.overlap.num_chained > 0
        finally:
            closed_cleanly(core)
    assert outs[0] == outs[1] == outs[2]
