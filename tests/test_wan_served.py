"""The tiny Wan preset served over HTTP (`python -m mstar.runtime.serve --model tiny-wan` on CPU):
an image (PNG, lossless) equal to the stage engine's pixels for the same request and seed, a video
(MP4) close to them, image-to-video from a PNG reference, an async job, and the 400s of the inputs
the model cannot take."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest

from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.stage_engine import StageEngine
from media_checks import assert_video_of, mp4_frames, png_pixels, run_locally
from server_harness import ServerProc

pytest.importorskip("av")
PIL = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--model", "tiny-wan", "--device", "cpu")
    yield s
    s.close()


@pytest.fixture(scope="module")
def engine():
    return StageEngine(EngineConfig(model="tiny-wan", device="cpu"))


def _err(r, param):
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param and e["message"], e
    return e


def test_image_and_video_routes(server, engine):
    body = {"prompt": "a red fox in the snow", "size": "96x64", "seed": 3, "num_inference_steps": 3,
            "guidance_scale": 4.0, "negative_prompt": "blurry"}
    r = server.post("/v1/images/generations", {**body, "response_format": "b64_json"})
    assert r.status_code == 200, r.text
    got = png_pixels(r.json()["data"][0]["b64_json"])
    want = run_locally(engine, {"prompt": body["prompt"], "negative_prompt": "blurry", "width": 96, "height": 64,
                           "num_inference_steps": 3, "guidance_scale": 4.0}, 3).pixels
    assert got.shape == (64, 96, 3) and int(np.abs(got.astype(int) - want.astype(int)).max()) <= 1

    vbody = {"prompt": "waves on a beach", "size": "64x64", "num_frames": 5, "num_inference_steps": 2, "seed": 4}
    r = server.post("/v1/videos/sync", vbody)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    frames = mp4_frames(r.content)
    clip = run_locally(engine, {"prompt": vbody["prompt"], "width": 64, "height": 64, "num_frames": 5,
                           "num_inference_steps": 2}, 4)
    assert frames.shape == clip.frames.shape == (5, 64, 64, 3)
    assert_video_of(frames, clip.frames, clip.fps)  # the engine's frames, through the encoder

    # image to video: the first frame follows the reference image
    img = np.zeros((64, 64, 3), np.uint8)
    img[:, :32] = 255
    buf = io.BytesIO()
    PIL.fromarray(img).save(buf, format="PNG")
    ref_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    r = server.post("/v1/videos/sync", {**vbody, "input_reference": ref_url})
    assert r.status_code == 200, r.text
    assert not np.array_equal(mp4_frames(r.content), frames)

    # an async job: progress to completion, its content the same request's video
    job = server.post("/v1/videos", vbody).json()
    deadline = time.monotonic() + 120
    while (rec := server.get(f"/v1/videos/{job['id']}").json())["status"] != "completed":
        assert rec["status"] in ("queued", "in_progress") and time.monotonic() < deadline, rec
        time.sleep(0.05)
    again = mp4_frames(server.get(f"/v1/videos/{job['id']}/content").content)
    assert_video_of(again, clip.frames, clip.fps)


def test_inputs_the_model_cannot_take(server):
    for body, param in (({"prompt": "x", "size": "50x50", "num_frames": 5}, "size"),
                        ({"prompt": "x", "size": "64x64", "num_frames": 999}, "num_frames"),
                        ({"prompt": "x", "size": "64x64", "num_frames": 5, "num_inference_steps": 0},
                         "num_inference_steps"),
                        ({"prompt": "x", "size": "64x64", "num_frames": 5, "input_reference": "aGVsbG8="},
                         "input_reference"),
                        ({"size": "64x64", "num_frames": 5}, "prompt")):
        _err(server.post("/v1/videos/sync", body), param)
        _err(server.post("/v1/videos", body), param)
    _err(server.post("/v1/images/generations", {"prompt": "x", "size": "31x31"}), "size")
    assert server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}).status_code == 400
    assert server.post("/v1/images/generations", {"prompt": "still fine", "size": "32x32"}).status_code == 200
