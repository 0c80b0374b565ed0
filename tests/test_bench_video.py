"""mstar bench video / images on CPU with the tiny Wan preset: dit_flops against torch's FLOP
counter on the transformer's forward, the closed loop's records (every request counted, the stage
split, the transformer rows per step), diffusers' baseline record, the images variant and --help."""

from __future__ import annotations

import os
import json
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mstar.bench import video as B
from mstar.models.wan.transformer import WanTransformer
from mstar.models.wan.transformer_config import TINY_WAN_TRANSFORMER, WanTransformerConfig


@pytest.mark.parametrize("frames,height,width,text_len", [(5, 64, 96, 7), (1, 32, 32, 3), (9, 64, 64, 512)])
def test_dit_flops_counts_every_matrix_product(frames, height, width, text_len):
    """The formula against torch's count of the forward's matmuls (one timestep per row), with the
    text's keys / values in the step (the forward) and made before it (the pipeline's step)."""
    cfg = WanTransformerConfig.from_dict(TINY_WAN_TRANSFORMER)
    torch.manual_seed(frames)
    model = WanTransformer(cfg).eval()
    f = (frames - 1) // 4 + 1
    x = torch.randn(1, cfg.in_channels, f, height // 16, width // 16)
    text = torch.randn(1, text_len, cfg.text_dim)
    with FlopCounterMode(display=False) as fc:
        model(x, torch.tensor([500.0]), text)
    assert fc.get_total_flops() == B.dit_flops(cfg, frames, height, width, text_len, text_once=False)
    kv = model.text_kv(text)
    with FlopCounterMode(display=False) as fc:  # a step as the pipeline runs it: the text's k / v made before
        model.forward_kv(x, torch.tensor([500.0]), *kv)
    assert fc.get_total_flops() == B.dit_flops(cfg, frames, height, width, text_len)


def _run(tmp_path, *argv, main=B.main) -> list[dict]:
    out = tmp_path / "video.jsonl"
    assert main([*argv, "--device", "cpu", "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_video_points_and_diffusers_baseline(tmp_path):
    recs = _run(tmp_path, "--model", "tiny-wan", "--size", "32x32", "--frames", "5", "--steps", "3",
                "--concurrency", "1", "2", "--waves", "2", "--min-requests", "1", "--baseline", "diffusers",
                "--baseline-requests", "1")
    (base,) = [r for r in recs if r["engine"] == "diffusers"]
    ours = [r for r in recs if r["engine"] == "mstar"]
    assert [(r["concurrency"], r["requests"]) for r in ours] == [(1, 2), (2, 4)]
    assert base["requests"] == 1 and base["step_rows"] == 2
    # guidance doubles the rows; c2 batches two requests into one transformer call
    assert [r["step_rows"] for r in ours] == [2, 4]
    for r in ours + [base]:
        assert r["bench"] == "video" and r["frames"] == 5 and r["steps"] == 3 and r["commit"] and r["date"]
        assert 0 < r["latency_p50_s"] <= r["latency_p90_s"]
        stages = r["encode_p50_s"] + r["denoise_p50_s"] + r["decode_p50_s"]
        assert all(r[f"{k}_p50_s"] > 0 for k in ("encode", "denoise", "decode"))
        assert stages <= r["latency_p90_s"] * 1.05 + 0.01, r
        assert r["step_ms_p50"] > 0 and r["dit_tflops"] > 0 and r["req_s"] > 0


def test_images_and_refusals(tmp_path):
    from mstar.bench import images
    (rec,) = _run(tmp_path, "--model", "tiny-wan", "--size", "64x64", "--steps", "2", "--concurrency", "1",
                  "--min-requests", "1", "--waves", "1", main=images.main)
    assert rec["bench"] == "images" and rec["frames"] == 1 and rec["requests"] == 1
    assert B.main(["--model", "tiny-wan", "--size", "30x30", "--device", "cpu", "--out", ""]) == 2
    with pytest.raises(SystemExit, match="not a Wan or Cosmos3 model"):
        B.main(["--model", "tiny-kokoro", "--device", "cpu", "--out", ""])


def test_help_names_every_flag():
    out = subprocess.run([sys.executable, "-m", "mstar.cli", "bench", "video", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for flag in ("--size", "--frames", "--steps", "--guidance", "--flow-shift", "--concurrency", "--baseline",
                 "--peak-tflops", "--warmup-steps"):
        assert flag in out


def test_profile_dit_groups_the_kernels(capsys):
    from mstar.bench.tools import profile_dit
    assert profile_dit.main(["--model", "tiny-wan", "--size", "64x64", "--frames", "5", "--repeats", "1",
                             "--device", "cpu", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "ms a forward" in out and "TFLOP/s" in out
    assert "gemm" in out and "device time" in out


def test_cosmos3_images_and_video_points(tmp_path):
    """Cosmos3 runs through the same loop: step times, no TFLOP/s (the count is Wan's); its
    diffusers baseline is refused where diffusers has no Cosmos3OmniPipeline (the dev pin, 0.36)."""
    from mstar.bench import images
    (img,) = _run(tmp_path, "--model", "tiny-cosmos3", "--size", "64x64", "--steps", "2", "--concurrency", "1",
                  "--min-requests", "1", "--waves", "1", main=images.main)
    assert img["frames"] == 1 and img["requests"] == 1 and img["step_ms_p50"] > 0 and img["dit_tflops"] is None
    (tmp_path / "v").mkdir()
    (vid,) = _run(tmp_path / "v", "--model", "tiny-cosmos3", "--size", "64x64", "--frames", "5", "--steps", "2",
                  "--concurrency", "1", "--min-requests", "1", "--waves", "1")
    assert vid["frames"] == 5 and vid["denoise_p50_s"] > 0 and vid["decode_p50_s"] > 0
    if not B._has_diffusers("Cosmos3OmniPipeline"):
        assert B.main(["--model", "tiny-cosmos3", "--size", "64x64", "--baseline", "diffusers", "--device", "cpu",
                       "--out", ""]) == 2


_COSMOS3_BASELINE = """
import json, os
sys.path.append(ARGS["root"])  # mstar from the checkout, after the environment's own packages
from mstar.bench import video as B
out = os.path.join(ARGS["dir"], "video.jsonl")
rc = B.main(["--model", "tiny-cosmos3", "--size", "64x64", "--frames", ARGS["frames"], "--steps", "2",
             "--concurrency", "1", "--waves", "1", "--min-requests", "1", "--baseline", "diffusers",
             "--baseline-requests", "1", "--device", "cpu", "--out", out])
RESULT = (rc, [json.loads(line) for line in open(out)])
"""


@pytest.mark.parametrize("frames", ["0", "5"], ids=["image", "video"])
def test_cosmos3_diffusers_baseline(tmp_path, frames):
    """The Cosmos3 baseline (diffusers 0.42's Cosmos3OmniPipeline, in the cached reference
    environment) runs beside mstar's point: one request, two guided rows a step, every stage timed."""
    from reference_envs import reference_env, run_reference
    rc, recs = run_reference(reference_env("diffusers-0.42"), _COSMOS3_BASELINE,
                             {"dir": str(tmp_path), "frames": frames,
                              "root": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert rc == 0
    (base,) = [r for r in recs if r["engine"] == "diffusers"]
    (ours,) = [r for r in recs if r["engine"] == "mstar"]
    assert base["requests"] == 1 and base["step_rows"] == 2 and base["frames"] == ours["frames"] == max(int(frames), 1)
    assert all(base[f"{k}_p50_s"] > 0 for k in ("encode", "denoise", "decode")) and base["step_ms_p50"] > 0


def test_stage_clock_follows_requests_through_join_and_leave():
    """A continuous loop whose join and leave hand back new state objects (Cosmos3's do): the
    clock keeps each request's denoise time and each step's rows, and forgets a batch once its
    last request left."""
    import types

    from mstar.models import interfaces as I

    def start(reqs):
        return {"rows": [r.request_id for r in reqs]}

    def join(state, reqs):
        return {"rows": state["rows"] + [r.request_id for r in reqs]}

    def leave(state, rows):
        return {"rows": [r for j, r in enumerate(state["rows"]) if j not in rows]}, [[] for _ in rows]

    loop = I.FixedStepLoopStage(start=start, step=lambda state, i: None, finish=lambda state: [],
                                num_steps=lambda state: 3, join=join, leave=leave)
    one_shot = I.OneShotStage(run=lambda reqs: [[] for _ in reqs])
    pipe = types.SimpleNamespace(stages=[one_shot, loop, one_shot])
    clock = B.StageClock(pipe, cuda=False)
    enc, loop, dec = pipe.stages
    reqs = [I.MediaRequest(f"r{i}", {}) for i in range(3)]
    state = loop.start(reqs[:1])
    loop.step(state, 0)
    state = loop.join(state, reqs[1:])
    loop.step(state, 1)
    state, _ = loop.leave(state, [0, 2])
    loop.step(state, 2)
    state, _ = loop.leave(state, [0])
    assert [rows for rows, _ in clock.take_steps()] == [1, 3, 1]
    assert {k: len(v["denoise"]) for k, v in clock.spans.items()} == {"r0": 3, "r1": 3, "r2": 2}  # start / join + steps
    assert clock._batch == {}
