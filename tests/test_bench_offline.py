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
