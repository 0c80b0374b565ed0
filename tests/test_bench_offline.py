"""`python -m mstar.bench.offline` at tiny sizes on CPU: one JSON record per concurrency with
the protocol's fields, through the eager path and through the decode-graph path with
overlapped decode ("static": the graphs' buffers without capturing)."""

from __future__ import annotations

import json

import pytest

from mstar.bench import offline


@pytest.mark.parametrize("extra", [["--decode-graphs", "off"], ["--decode-graphs", "static", "--async-output", "on"]])
def test_offline_bench_records(tmp_path, extra):
    out = tmp_path / "offline.jsonl"
    offline.main(["--model", "tiny-qwen3.5", "--concurrency", "2", "4", "--num-prompts", "6", "--input-len", "12",
                  "--output-len", "5", "--out", str(out), *extra])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["concurrency"] for r in recs] == [2, 4]
    for r in recs:
        assert r["num_prompts"] == 6 and r["output_len"] == 5 and r["output_tok_s"] > 0
        assert r["decode_graphs"] == extra[1] and r["async_output"] == ("on" if "--async-output" in extra else "auto")
        assert r["startup_s"] >= 0 and r["commit"] and r["backends"]["sample"]


def test_one_engine_caps_the_running_batch_per_point(tmp_path, monkeypatch):
    """--one-engine: one build for every point, and each point runs at most c rows at once."""
    builds, peak = [], {}
    real_build, real_measure = offline._build, offline._measure

    def build(args, m):
        builds.append(m)
        return real_build(args, m)

    def measure(args, llm, c, t_start):
        core, step = llm.engine, llm.engine.step
        seen = []

        def counted():
            seen.append(len(core.scheduler.running))
            return step()

        monkeypatch.setattr(core, "step", counted)
        try:
            return real_measure(args, llm, c, t_start)
        finally:
            monkeypatch.setattr(core, "step", step)
            peak[c] = max(seen)

    monkeypatch.setattr(offline, "_build", build)
    monkeypatch.setattr(offline, "_measure", measure)
    out = tmp_path / "offline.jsonl"
    offline.main(["--model", "tiny-qwen3.5", "--concurrency", "2", "5", "--num-prompts", "8", "--input-len", "12",
                  "--output-len", "6", "--one-engine", "--out", str(out)])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert builds == [5] and [r["concurrency"] for r in recs] == [2, 5]
    assert all(r["one_engine"] and r["knobs"] == {} for r in recs)
    assert peak[2] == 2 and 2 < peak[5] <= 5, peak


def test_symmetric_memory_with_an_engine_per_point_warns(monkeypatch, caplog):
    """notes/tp.md, Limits: a second tensor-parallel engine's symmetric-memory set-up in one
    process did not finish; the bench says to pass --one-engine (and says nothing with NCCL)."""
    import argparse
    import logging

    from mstar import knobs
    from mstar.bench import offline

    class Built(Exception):
        pass

    def build(args, c):
        raise Built

    monkeypatch.setattr(offline, "_build", build)
    args = argparse.Namespace(tp=2, one_engine=False, concurrency=[8, 32])
    for mode, warned in (("symm_mem_norm", True), ("nccl", False)):
        caplog.clear()
        with knobs.override(MSTAR_TP_ALLREDUCE=mode), caplog.at_level(logging.WARNING):
            with pytest.raises(Built):
                offline.run(args)
        assert any("pass --one-engine" in r.getMessage() for r in caplog.records) == warned
