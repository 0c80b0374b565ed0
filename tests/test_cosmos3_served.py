"""The tiny Cosmos3 preset served over HTTP (`python -m mstar.runtime.serve --model tiny-cosmos3` on
CPU): an image (PNG, lossless) equal to the stage engine's pixels for the same request and seed, a
video (MP4) close to them, and the 4xx of the inputs the model cannot take, with the same fields
and errors as Wan's routes."""

from __future__ import annotations


import numpy as np
import pytest

from mstar.models import interfaces as I
from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.stage_engine import StageEngine
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture: one intra-op thread
from media_checks import assert_video_of, mp4_frames, png_pixels, run_locally
from server_harness import ServerProc

pytest.importorskip("av")
PIL = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def server():
    # the tiny model in the server process: no spinning threads
    s = ServerProc("--model", "tiny-cosmos3", "--device", "cpu", env={"OMP_NUM_THREADS": "1"})
    yield s
    s.close()


@pytest.fixture(scope="module")
def engine():
    return StageEngine(EngineConfig(model="tiny-cosmos3", device="cpu"))


def _err(r, param):
    assert 400 <= r.status_code < 500, r.text
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
                           "num_inference_steps": 3, "guidance_scale": 4.0}, 3)
    assert isinstance(want, I.Image) and got.shape == (64, 96, 3)
    assert np.array_equal(got, want.pixels)  # PNG is lossless: the engine's pixels exactly

    vbody = {"prompt": "waves on a beach", "size": "64x64", "num_frames": 9, "num_inference_steps": 2, "seed": 4}
    r = server.post("/v1/videos/sync", vbody)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    frames = mp4_frames(r.content)
    clip = run_locally(engine, {"prompt": vbody["prompt"], "width": 64, "height": 64, "num_frames": 9,
                           "num_inference_steps": 2}, 4)
    assert frames.shape == clip.frames.shape == (9, 64, 64, 3) and clip.fps == 24.0
    assert_video_of(frames, clip.frames, clip.fps)  # the engine's frames, through the encoder


def test_inputs_the_model_cannot_take(server):
    for body, param in (({"prompt": "x", "size": "50x50", "num_frames": 5}, "size"),
                        ({"prompt": "x", "size": "64x64", "num_frames": 999}, "num_frames"),
                        ({"prompt": "x", "size": "64x64", "num_frames": 5, "num_inference_steps": 0},
                         "num_inference_steps"),
                        ({"prompt": "x", "size": "64x64", "num_frames": 5, "input_reference": "aGVsbG8="},
                         "input_reference"),
                        ({"size": "64x64", "num_frames": 5}, "prompt")):
        _err(server.post("/v1/videos/sync", body), param)
    _err(server.post("/v1/images/generations", {"prompt": "x", "size": "31x31"}), "size")
    _err(server.post("/v1/images/generations", {"prompt": "x", "size": "640x640"}), "size")
    r = server.post("/v1/images/generations", {"prompt": "still fine", "size": "32x32", "num_inference_steps": 1})
    assert r.status_code == 200 and png_pixels(r.json()["data"][0]["b64_json"]).shape == (32, 32, 3)
