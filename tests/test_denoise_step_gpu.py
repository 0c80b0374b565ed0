"""On CUDA, a denoising step of the Wan and Cosmos3 pipelines (timesteps up, the step's graph
replay, guidance, the UniPC update) makes no host sync: under torch.cuda.set_sync_debug_mode
("error") a step that copied from pageable memory, read a device value or waited for the device
would raise. A sync per step leaves the GPU idle while the host prepares the next one."""

from __future__ import annotations

import pytest
import torch

from mstar.models import interfaces as I
from mstar.models import registry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("model,size", [("tiny-wan", "32x32"), ("tiny-cosmos3", "64x64")])
def test_denoise_steps_make_no_host_sync(model, size):
    pipe = registry.family_of(model).pipeline(model, dtype=torch.bfloat16, device="cuda", random_weights=True)
    inputs = {"prompt": "a fox", "size": size, "num_inference_steps": 8, "guidance_scale": 4.0}
    encode = pipe.encode if hasattr(pipe, "encode") else pipe.understand
    (prev,) = encode([I.MediaRequest("a", inputs, 3)])
    state = pipe.start([I.MediaRequest("a", {**inputs, "previous": prev}, 3)])
    for i in range(3):  # eager, capture, replay: the shape's graph exists from here on
        pipe.step(state, i)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3, 8):
            pipe.step(state, i)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    ((z,),) = pipe.finish(state)
    assert torch.isfinite(z.float()).all()
