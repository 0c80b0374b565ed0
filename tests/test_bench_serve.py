"""The serving benchmark at tiny sizes: against a real server (CPU) and against HF generate."""

from __future__ import annotations

import json
import math

import pytest
from server_harness import ServerProc

from mstar.bench import serve as bench

FIELDS = {"bench", "model", "tp", "concurrency", "output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms",
          "itl_p90_ms", "gpu", "commit", "date"}


def test_percentile():
    assert bench.percentile([3, 1, 2], 50) == 2
    assert bench.percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert math.isnan(bench.percentile([], 50))
    ps = bench.random_prompts(3, 10, 259, seed=1)
    assert len(ps) == 3 and all(len(p) == 10 and max(p) < 256 for p in ps)
    assert ps == bench.random_prompts(3, 10, 259, seed=1)


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_bench_against_server(tmp_path, capsys):
    # A checkpoint directory with a config and no tokenizer, random weights: what serving a preset at real
    # shapes looks like (`--model qwen3.5-0.8b --random-weights` has no tokenizer either). Token-id prompts
    # only; the benchmark counts tokens through return_token_ids.
    from mstar.models import resolve_config
    model_dir = tmp_path / "tiny-no-tokenizer"
    resolve_config("tiny-qwen3.5").save_pretrained(model_dir)
    s = ServerProc("--model", str(model_dir), "--random-weights", "--served-model-name", "tiny",
                   "--max-num-seqs", "8")
    try:
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "text", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer"
        rc = bench.main(["--base-url", s.url, "--model", "tiny", "--concurrency", "1", "4",
                         "--num-prompts", "4", "--num-warmup", "1", "--input-len", "16", "--output-len", "8",
                         "--results-dir", str(tmp_path), "--bench-name", "serve_test"])
        assert rc == 0
        out = capsys.readouterr().out
        assert "out tok/s" in out and "TTFT p50 ms" in out
        recs = _records(tmp_path / "serve_test.jsonl")
        assert [r["concurrency"] for r in recs] == [1, 4]
        for r in recs:
            assert FIELDS <= set(r), FIELDS - set(r)
            assert r["bench"] == "serve_test" and r["backend"] == "openai" and r["gpu"] == "cpu"
            assert r["model"] == "tiny"
            assert r["failed"] == 0 and r["output_tok_s"] > 0
            assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"]
            assert 0 < r["itl_p50_ms"] <= r["itl_p90_ms"]
            assert r["num_prompts"] == 4 and r["input_len"] == 16 and r["output_len"] == 8
        # every timed request produced exactly output_len tokens (ignore_eos), counted server-side too
        m = s.metrics()
        assert m["mstar_generation_tokens_total"] == (4 + 1) * 8 * 2
        s.wait_idle()
    finally:
        s.close()


def test_bench_hf_backend(tmp_path):
    rc = bench.main(["--backend", "hf", "--model", "tiny-qwen3.5", "--concurrency", "2", "--num-prompts", "2",
                     "--input-len", "8", "--output-len", "4", "--device", "cpu", "--results-dir", str(tmp_path)])
    assert rc == 0
    (r,) = _records(tmp_path / "llm_serve.jsonl")
    assert FIELDS <= set(r)
    assert r["backend"] == "hf" and r["concurrency"] == 2 and r["failed"] == 0
    assert r["output_tok_s"] > 0 and r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0
