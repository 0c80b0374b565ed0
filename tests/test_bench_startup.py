"""mstar.bench.startup: the server log's start-up timeline parsed, and one real launch of the
tiny model on the CPU measured to its first token."""

import json

from mstar.bench import startup

LOG = """\
2026-12-06 06:00:39,038 INFO mstar.serve: starting the engine process (0.3 s after launch)
2026-12-06 06:00:39,203 INFO mstar.engine_process: engine process: up 0.2 s after it was started (interpreter start-up, spawn)
2026-12-06 06:00:47,070 INFO mstar.engine_process: engine process: modules imported in 7.9 s
2026-12-06 06:01:27,737 INFO mstar.runtime: start-up built 15 Triton kernel variants (0.5 s of compiles and cache loads)
2026-12-06 06:01:27,737 INFO mstar.runtime: engine start-up 40.7 s: model 8.3 s, tokenizer + caches 0.0 s, graphs 32.0 s, warm-up 0.4 s
2026-12-06 06:01:27,990 INFO mstar.serve: engine ready in 49.3 s (pid 1363, max_model_len 4096, device cuda)
2026-12-06 06:01:28,398 INFO mstar.serve: mstar is serving qwen3.5-0.8b at http://127.0.0.1:40411 (ready in 49.7 s)
"""


def test_timeline_parsed():
    t = startup.parse_timeline(LOG)
    assert t == {"api_s": 0.3, "spawn_s": 0.2, "imports_s": 7.9, "engine_s": 40.7, "model_s": 8.3, "caches_s": 0.0,
                 "graphs_s": 32.0, "warmup_s": 0.4, "engine_ready_s": 49.3, "triton_variants": 15, "triton_s": 0.5,
                 "ready_s": 49.7}
    assert startup.parse_timeline("no timeline here") == {}


def test_a_cold_then_warm_launch_of_the_tiny_model(tmp_path, capsys):
    root = tmp_path / "cache"
    assert startup.main(["tiny-qwen3.5", "--runs", "2", "--cold", "--cache-root", str(root), "--results-dir",
                         str(tmp_path), "--log-dir", str(tmp_path / "logs"), "--", "--device", "cpu"]) == 0
    recs = [json.loads(line) for line in (tmp_path / "startup.jsonl").read_text().splitlines()]
    assert [r["cache"] for r in recs] == ["empty", "warm"] and root.is_dir()
    for r in recs:
        assert 0 < r["ready_s"] <= r["first_token_s"] < 120 and r["imports_s"] > 0 and r["server_args"] == "--device cpu"
        assert r["api_s"] < r["ready_s"]
    assert (tmp_path / "logs" / "startup-2.log").is_file()
    assert "first token s" in capsys.readouterr().out


def test_cold_needs_an_empty_cache_root(tmp_path):
    (tmp_path / "x").write_text("")
    import pytest
    with pytest.raises(SystemExit, match="not empty"):
        startup.main(["tiny-qwen3.5", "--cold", "--cache-root", str(tmp_path), "--no-record"])
    with pytest.raises(SystemExit, match="goes with --cold"):
        startup.main(["tiny-qwen3.5", "--cache-root", str(tmp_path / "y"), "--no-record"])
