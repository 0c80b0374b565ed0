"""On CUDA, the Wan and Cosmos3 pipelines' per-step work and a request joining a running batch
make no host sync: under torch.cuda.set_sync_debug_mode("error"), a copy from pageable memory, a
read of a device value or a wait for the device would raise. A sync leaves the GPU idle while the
host prepares the next step (and, on a join, while it prepares the new request's rows)."""

from __future__ import annotations

import pytest
import torch

from mstar.models import interfaces as I
from mstar.models import registry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("model,size", [("tiny-wan", "32x32"), ("tiny-cosmos3", "64x64")])
def test_denoise_steps_and_a_join_make_no_host_sync(model, size):
    pipe = registry.family_of(model).pipeline(model, dtype=torch.bfloat16, device="cuda", random_weights=True)
    inputs = {"prompt": "a fox", "size": size, "num_inference_steps": 12, "guidance_scale": 4.0}
    first = pipe.encode if hasattr(pipe, "encode") else pipe.understand

    def request(rid: str, seed: int) -> I.MediaRequest:
        return I.MediaRequest(rid, {**inputs, "previous": first([I.MediaRequest(rid, inputs, seed)])[0]}, seed)

    state = pipe.start([request("a", 3)])
    for i in range(3):  # eager, capture, replay: the shape's graph exists from here on
        pipe.step(state, i)
    b = request("b", 4)  # its first stage (Wan's text encoder) may sync: not part of a step
    torch.cuda.synchronize()
    with _no_sync():
        pipe.step(state, 3)
        state = pipe.join(state, [b])
    for i in range(4, 6):  # the joined batch's shape: eager, then captured (a capture syncs)
        pipe.step(state, i)
    with _no_sync():
        for i in range(6, 9):
            pipe.step(state, i)
        if not hasattr(pipe, "encode"):  # Cosmos3: the understanding tower of a new request
            first([I.MediaRequest("c", inputs, 5)])
    torch.cuda.synchronize()
    for (z,) in pipe.finish(state):
        assert torch.isfinite(z.float()).all()


class _no_sync:
    """torch.cuda.set_sync_debug_mode("error") inside."""

    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
