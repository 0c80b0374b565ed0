"""Checks on served MP4s. H.264 loses detail, and two encodes of the same frames are not
bit-identical on every host (their pixels have differed by ~1.4 levels on average), so a served
video is compared with its frames sent through the same encoder, against what that encoder loses."""
from __future__ import annotations

import io

import numpy as np

from mstar.runtime.serving.api_video import mp4_bytes


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


def is_video_of(served: np.ndarray, frames: np.ndarray, fps: float) -> bool:
    gap, loss = video_gap(served, frames, fps)
    return gap < max(1.0, loss / 2)


def assert_video_of(served: np.ndarray, frames: np.ndarray, fps: float) -> None:
    gap, loss = video_gap(served, frames, fps)
    assert gap < max(1.0, loss / 2), f"served video {gap:.2f} levels from the frames' encode, which loses {loss:.2f}"
