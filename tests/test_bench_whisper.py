"""The Whisper benchmark at tiny sizes: it launches a real server (CPU, the tiny random
Whisper checkpoint), runs two concurrency levels and appends records with the phase
breakdown."""

from __future__ import annotations

import json

from engine_helpers import single_thread  # noqa: F401 -- fixture
from mstar.bench import whisper as bench
from whisper_helpers import whisper_dir


def test_bench_whisper_launch(tmp_path, capsys):
    d = whisper_dir()
    rc = bench.main(["--launch", "--model", d, "--concurrency", "1", "3", "--num-requests", "4", "--num-warmup", "1",
                     "--clip-seconds", "2", "--output-len", "5", "--results-dir", str(tmp_path),
                     "--server-log", str(tmp_path / "server.log"), "--server-args", "--device", "cpu", "--dtype", "float32", "--page-size", "4"])
    assert rc == 0
    assert "mstar is serving" in (tmp_path / "server.log").read_text()  # --server-log keeps it
    out = capsys.readouterr().out
    assert "req/s" in out and "first tok p90 ms" in out and "phases" in out
    with open(tmp_path / "whisper.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [r["concurrency"] for r in recs] == [1, 3]
    for r in recs:
        assert r["bench"] == "whisper" and r["failed"] == 0 and r["gpu"] == "cpu"
        assert r["num_requests"] == 4 and r["clip_seconds"] == 2 and r["output_len"] == 5
        assert r["req_s"] > 0 and 0 < r["first_token_p50_ms"] <= r["first_token_p90_ms"]
        assert r["first_token_source"] == "server" and r["output_len_ok"] is True
        ph = r["phases"]
        for k in ("audio_ms", "first_token_ms", "after_first_token_ms", "feature_ms", "encoder_ms", "encoder_batch"):
            assert ph[k] is not None and ph[k] > 0, (k, ph)


def test_make_clip():
    import soundfile as sf
    import io
    a, b = bench.make_clip(10, 1), bench.make_clip(10, 2)
    x, sr = sf.read(io.BytesIO(a))
    assert sr == 16000 and len(x) == 160000 and a != b
