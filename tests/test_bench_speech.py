"""mstar bench speech on CPU with the tiny speech presets: the closed loop's records (every
request counted, the pinned audio length met, latencies ordered), both baselines' records, the
under-run test of a stream, and the command's --help."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mstar.bench import speech as B


def _run(tmp_path, *argv) -> list[dict]:
    out = tmp_path / "speech.jsonl"
    assert B.main([*argv, "--device", "cpu", "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_kokoro_points_and_package_baseline(tmp_path):
    recs = _run(tmp_path, "--model", "tiny-kokoro", "--concurrency", "1", "3", "--seconds", "1.5", "--waves", "2",
                "--min-requests", "3", "--baseline", "kokoro", "--baseline-requests", "1")
    ours = [r for r in recs if r["engine"] == "mstar"]
    (base,) = [r for r in recs if r["engine"] == "kokoro-package"]
    assert [(r["concurrency"], r["requests"]) for r in ours] == [(1, 3), (3, 6)]
    for r in ours + [base]:
        # durations pinned: within one frame per token of the asked length
        assert abs(r["audio_s_mean"] - 1.5) < 0.3, r
        assert 0 < r["first_audio_p50_ms"] <= r["first_audio_p90_ms"]
        assert r["req_s"] > 0 and r["rtf_mean"] > 0 and r["realtime"] == 1.0
        assert r["bench"] == "speech" and r["commit"] and r["date"]


def test_orpheus_points_and_hf_baseline(tmp_path):
    recs = _run(tmp_path, "--model", "tiny-orpheus", "--concurrency", "2", "--seconds", "1", "--waves", "2",
                "--min-requests", "1", "--baseline", "hf", "--baseline-concurrency", "2")
    (hf,) = [r for r in recs if r["engine"] == "hf-generate+snac"]
    (ours,) = [r for r in recs if r["engine"] == "mstar"]
    assert hf["max_new_tokens"] == ours["max_new_tokens"] == 7 * 12  # 12 frames of 2048 samples >= 1 s
    assert ours["requests"] == 4 and hf["requests"] == 2 and hf["realtime"] is None
    # the release's windows: 28 tokens first, then one 2048-sample window per frame
    assert hf["audio_s_mean"] == pytest.approx((12 - 3) * 2048 / 24000)
    assert ours["audio_s_mean"] >= hf["audio_s_mean"]
    assert ours["first_audio_p50_ms"] <= ours["first_audio_p90_ms"] and ours["realtime"] >= 0
    assert ours["overlap"] is True


def test_qwen3_tts_points_have_the_pinned_length(tmp_path):
    recs = _run(tmp_path, "--model", "tiny-qwen3-tts", "--concurrency", "1", "2", "--seconds", "0.5", "--waves", "2",
                "--min-requests", "1")
    assert [(r["concurrency"], r["requests"]) for r in recs] == [(1, 2), (2, 4)]
    for r in recs:
        assert r["family"] == "qwen3_tts" and r["frames"] == 7  # ceil(0.5 s / 80 ms)
        assert r["audio_s_mean"] == pytest.approx(7 * 0.08)  # end of speech is never drawn: exactly 7 frames
        assert 0 < r["first_audio_p50_ms"] <= r["first_audio_p90_ms"] and r["req_s"] > 0


def test_orpheus_no_overlap_records_it(tmp_path, monkeypatch):
    """--no-overlap builds the engine with async_output off, and the record says so."""
    from mstar.runtime.engine import llm as L
    seen = {}
    init = L.LLM.__init__

    def spy(self, model, **kw):
        seen.update(kw)
        init(self, model, **kw)
    monkeypatch.setattr(L.LLM, "__init__", spy)
    (rec,) = _run(tmp_path, "--model", "tiny-orpheus", "--concurrency", "1", "--seconds", "0.3", "--waves", "1",
                  "--min-requests", "1", "--no-overlap")
    assert seen["async_output"] is False and rec["overlap"] is False and rec["requests"] == 1


def test_stream_realtime_is_no_underrun():
    s = B.Stream(0.0)
    s.chunks = [(1.0, 0.5), (1.4, 0.5), (1.9, 0.5)]
    assert s.realtime()
    s.chunks.append((2.6, 0.5))  # 1.6 s after the first chunk, only 1.5 s had been sent
    assert not s.realtime()
    assert not B.Stream(0.0).realtime()
    assert B.orpheus_tokens(10) == 7 * 118


def test_help_and_refusals(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mstar.cli", "bench", "speech", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--baseline" in r.stdout and "--concurrency" in r.stdout
    assert B.main(["--model", "tiny-qwen3.5", "--device", "cpu", "--out", ""]) == 2
    assert B.main(["--model", "tiny-kokoro", "--baseline", "hf", "--device", "cpu", "--out", ""]) == 2
