"""The qwen-tts package baseline of `mstar bench speech` (mstar/bench/speech_qwen3_tts.py) on CPU:
the tiny preset through the package in its reference environment (tests/reference_envs.py), every
request forced to ceil(seconds * 12.5) frames, one record per batch size."""

from __future__ import annotations

import json
import math
import types

from mstar.bench.speech_qwen3_tts import run_qwen_tts_baseline
from reference_envs import reference_env


def test_package_baseline_records(tmp_path):
    out = tmp_path / "speech.jsonl"
    args = types.SimpleNamespace(model="tiny-qwen3-tts", seconds=0.4, baseline_concurrency=[1, 2], device="cpu",
                                 dtype="auto", no_overlap=False, out=str(out),
                                 qwen_tts_python=reference_env("qwen-tts"), qwen_tts_path=None)
    recs = run_qwen_tts_baseline(args)
    frames = math.ceil(0.4 * 12.5)
    assert [(r["concurrency"], r["requests"]) for r in recs] == [(1, 1), (2, 2)]
    for r in recs:
        assert r["engine"] == "qwen-tts-package" and r["family"] == "qwen3_tts" and r["bench"] == "speech"
        assert r["frames"] == frames and abs(r["audio_s_mean"] - frames * 0.08) < 1e-6, r
        assert r["req_s"] > 0 and r["rtf_mean"] > 0 and r["realtime"] is None
        # not streamed: first audio is the whole call, the same for every request of the batch
        assert r["first_audio_p50_ms"] == r["first_audio_p90_ms"] and abs(r["first_audio_p50_ms"] - 1e3 * r["wall_s"]) < 1
        assert 0 < r["decode_s"] < r["wall_s"]
        assert r["versions"]["qwen_tts"] == "0.1.1" and r["versions"]["transformers"] == "4.57.3"
    assert [json.loads(line)["concurrency"] for line in out.read_text().splitlines()] == [1, 2]
