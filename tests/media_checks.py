"""What the served-media tests share: a request run through a local engine (the reference of a
served one), the pixels of a served PNG or MP4, and the check that a served video is given frames.

H.264 loses detail, and two encodes of the same frames have not been bit-identical on every host
(their pixels differed by ~1.4 levels on average), so a served video is compared with its frames
sent through the same encoder, against what that encoder loses."""
from __future__ import annotations

import base64
import io

import numpy as np

from mstar.models import interfaces as I
from mstar.runtime.engine.request import EngineRequest, SamplingParams
from mstar.runtime.serving.api_video import mp4_bytes


def run_locally(engine, inputs: dict, seed: int):
    """The media of one request (`inputs`, `seed`) run to its end on a StageEngine."""
    engine.add_request(EngineRequest("local", [], SamplingParams(), media=I.MediaRequest("local", inputs, seed)))
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                assert o.finish_reason == "stop", o.error
                return o.media[0]


def png_pixels(b64: str) -> np.ndarray:
    """uint8 [H, W, 3] RGB of a base64 PNG."""
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def mp4_frames(data: bytes) -> np.ndarray:
    """uint8 [F, H, W, 3] RGB frames of an MP4."""
    import av
    with av.open(io.BytesIO(data)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.int64) - b.astype(np.int64)).mean())


def video_gap(served: np.ndarray, frames: np.ndarray, fps: float) -> tuple[float, float]:
    """(how far a decoded served video is from `frames` encoded here, how far that encode is from
    `frames`): the first is under half the second (and under 1 level) when `frames` is what was served."""
    local = mp4_frames(mp4_bytes(frames, fps))
    return mean_abs_diff(served, local), mean_abs_diff(local, frames)


def _judge(served: np.ndarray, frames: np.ndarray, fps: float) -> tuple[bool, str]:
    gap, loss = video_gap(served, frames, fps)
    return gap < max(1.0, loss / 2), f"served video {gap:.2f} levels from the frames' encode, which loses {loss:.2f}"


def is_video_of(served: np.ndarray, frames: np.ndarray, fps: float) -> bool:
    return _judge(served, frames, fps)[0]


def assert_video_of(served: np.ndarray, frames: np.ndarray, fps: float) -> None:
    ok, why = _judge(served, frames, fps)
    assert ok, why
