"""media_outputs: the VAE's [-1, 1] video to uint8 pixels on the video's device, byte for byte
numpy's float32 arithmetic (diffusers' np output and numpy_to_pil's rounding, half to even), for
float32 and bfloat16 videos, images and videos; fresh inputs each run, exact halves included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.models import interfaces as I
from mstar.models.generation_request import media_outputs


class _Fields:
    def __init__(self, video: bool):
        self.video, self.fps = video, 12.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pixels_are_numpys(dtype):
    v = (torch.randn(2, 3, 4, 16, 24) * 1.3).to(dtype)
    v[0, 0, 0, 0, :16] = torch.tensor([(k + 0.5) / 255 * 2 - 1 for k in range(16)]).to(dtype)  # x.5 after * 255
    px = (v * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().numpy()
    want = (px * 255).round().astype(np.uint8)
    got = media_outputs(v, [_Fields(True), _Fields(False)])
    assert isinstance(got[0][0], I.VideoFrames) and got[0][0].fps == 12.0
    assert np.array_equal(got[0][0].frames, want[0]) and got[0][0].frames.flags["C_CONTIGUOUS"]
    assert isinstance(got[1][0], I.Image) and np.array_equal(got[1][0].pixels, want[1][0])
