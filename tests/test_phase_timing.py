"""MSTAR_PHASE_TIMING: the default path calls no timing code and the knob changes no token;
with it on, every step writes one JSON line with every phase, and
`python -m mstar.bench.tools.phase_idle` summarises the file."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from engine_helpers import POOL_SEED, engine, model_dir, prompts, run_all
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar import knobs
from mstar.runtime.engine import phase_timing
from mstar.runtime.engine.request import EngineRequest, SamplingParams

TOOL = pathlib.Path(__file__).resolve().parents[1] / "mstar" / "bench" / "tools" / "phase_idle.py"
PS = prompts(6, 3, 30, seed=POOL_SEED)
PHASES = phase_timing.PHASES


def _reqs(n_tokens: int = 6):
    # different lengths and max_tokens: prefill, mixed and decode-only steps, rows finishing apart
    return [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=n_tokens + i, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(PS)]


def _opts():
    # a small token budget so prompts are chunked and decode rows share steps with prefill
    return {"page_size": 8, "max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 24}


def test_default_path_calls_no_timing_code(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("timing code ran with MSTAR_PHASE_TIMING off")

    for name in ("start", "mark", "before_forward", "after_forward", "end", "note_loop", "flush"):
        monkeypatch.setattr(phase_timing.PhaseTimer, name, boom)
    monkeypatch.setattr(phase_timing, "_now", boom)
    monkeypatch.setattr("torch.cuda.synchronize", boom)
    with knobs.override(MSTAR_PHASE_TIMING=False):
        core = engine("qwen3.5", **_opts())
    assert core.phase_timer is None
    got = run_all(core, _reqs())
    assert all(fin == "length" for _, fin in got.values())
    core.close()


def _records(path: pathlib.Path) -> tuple[list[dict], list[dict]]:
    heads, recs = [], []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        (heads if "run" in d else recs).append(d)
    return heads, recs


def test_knob_on_is_bit_identical_and_records_every_step(tmp_path):
    log = tmp_path / "phases.jsonl"
    core_off = engine("qwen3.5", **_opts())
    assert core_off.phase_timer is None
    want = run_all(core_off, _reqs())
    with knobs.override(MSTAR_PHASE_TIMING=True, MSTAR_PHASE_LOG=str(log)):
        core_on = engine("qwen3.5", **_opts())
    assert core_on.phase_timer is not None
    got = run_all(core_on, _reqs())
    assert got == want
    n_steps = core_on.num_steps
    core_on.close()

    heads, recs = _records(log)
    assert len(heads) == 1 and heads[0]["run"]["pid"] == os.getpid() and heads[0]["run"]["device"] == "cpu"
    assert [r["step"] for r in recs] == list(range(n_steps))
    for r in recs:
        for p in PHASES:
            assert r[p + "_us"] >= 0, (p, r)
        assert r["decode"] >= 0 and r["prefill_tokens"] >= 0 and r["decode"] + r["prefill_tokens"] > 0
    assert recs[0]["idle_us"] is None  # nothing ran before the first step
    idles = [r["idle_us"] for r in recs[1:]]
    assert all(i is not None and i >= 0 for i in idles)  # run_all steps back to back
    assert any(r["prefill_tokens"] and r["decode"] for r in recs), "expected a mixed step"
    assert any(r["forward_us"] > 0 for r in recs)
    assert sum(r["decode"] for r in recs) + sum(1 for r in recs if r["prefill_tokens"]) >= len(PS)

    # the tool: every phase, the derived step / cycle, non-negative; buckets and runs
    out = subprocess.run([sys.executable, str(TOOL), str(log), "--json", "--buckets", "1,2,4", "--by-run"],
                         capture_output=True, text=True, check=True).stdout
    summary = json.loads(out)
    (run,) = summary.values()
    assert run["steps"] == n_steps
    for name in [*PHASES, "step", "idle", "cycle"]:
        s = run["all"][name]
        assert s["n"] > 0 and s["p50"] >= 0 and s["p95"] >= s["p50"] and s["mean"] >= 0, (name, s)
    assert run["all"]["idle"]["n"] == n_steps - 1
    assert sum(b["step"]["n"] for b in run["buckets"].values()) == n_steps
    assert "mixed" in run["buckets"]
    text = subprocess.run([sys.executable, str(TOOL), str(log), "--buckets", "4"], capture_output=True,
                          text=True, check=True).stdout
    for name in [*PHASES, "idle", "cycle"]:
        assert f"  {name} " in text
    assert "decode 1-4" in text


def test_tool_help_and_empty_input(tmp_path):
    h = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, check=True).stdout
    assert "p50" in h and "idle" in h and "--buckets" in h
    empty = tmp_path / "e.jsonl"
    empty.write_text('{"run": {"pid": 1}}\nnot json\n')
    r = subprocess.run([sys.executable, str(TOOL), str(empty)], capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "no step records" in r.stderr


def test_stderr_when_log_is_empty(capsys):
    with knobs.override(MSTAR_PHASE_TIMING=True, MSTAR_PHASE_LOG=""):
        core = engine("qwen3.5", **_opts())
    run_all(core, _reqs(2)[:2])
    core.close()
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert "run" in lines[0] and len(lines) == 1 + core.num_steps


def test_engine_process_notes_the_loop(tmp_path, monkeypatch):
    """In the server's engine process the gap between steps is split into its known parts."""
    from mstar.runtime.engine.config import EngineConfig
    from mstar.runtime.engine.engine_process import EngineProcess
    log = tmp_path / "ep.jsonl"
    monkeypatch.setenv("MSTAR_PHASE_TIMING", "1")
    monkeypatch.setenv("MSTAR_PHASE_LOG", str(log))
    ep = EngineProcess(EngineConfig(model=model_dir("qwen3.5"), dtype="float32", device="cpu", max_model_len=64,
                                    page_size=8))
    ep.start()
    try:
        ep.wait_ready(timeout=120)
        done = []
        ep.start_reader(lambda m: done.extend(o for o in (m[1] if m[0] == "step" else []) if o.finished))
        for i, p in enumerate(PS[:3]):
            ep.add(EngineRequest(f"p{i}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
        deadline = time.monotonic() + 60
        while len(done) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(done) == 3
    finally:
        ep.shutdown()
    heads, recs = _records(log)
    assert len(heads) == 1 and heads[0]["run"]["pid"] == ep.pid
    assert recs and all(r["pid"] == ep.pid for r in recs)
    busy = [r for r in recs if r["idle_us"] is not None]
    assert busy and all(r["idle_drain_us"] >= 0 and r["idle_emit_us"] >= 0 for r in busy)
    assert all(r["idle_us"] >= r["idle_drain_us"] + r["idle_emit_us"] - 1.0 for r in busy)
