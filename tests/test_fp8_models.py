"""MSTAR_DIT_FP8: the denoising transformers' linear layers in float8 (to_fp8).

Off (the default) the pipelines hold no float8 layer; on, exactly the layers each family names are
Fp8Linear, and a whole short generation (3 guided steps, float32 and bfloat16 models, the tiny
presets) stays within a stated distance of the unquantized one. Final latents, relative L2 error
seen on CPU: Wan 0.8% (float32) / 1.6% (bfloat16), Cosmos3 3.3% / 3.5%. The bounds below fail
for a wrong activation in the quantize kernel: the FFN's GELU dropped moved Wan to 5.1%, relu^2
replaced by GELU moved Cosmos3 to 9.8%.
"""

from __future__ import annotations

import pytest
import torch

from mstar import knobs
from mstar.models import interfaces as I
from mstar.models.cosmos3.family import cosmos3_pipeline
from mstar.models.layers.fp8 import Fp8Linear
from mstar.models.wan.family import wan_pipeline

BOUND = {"wan": 0.025, "cosmos3": 0.06}
INPUTS = {"prompt": "a fox in the snow", "negative_prompt": "blurry", "width": 64, "height": 64,
          "num_inference_steps": 3}
PIPELINES = {"wan": (wan_pipeline, {**INPUTS, "num_frames": 9}), "cosmos3": (cosmos3_pipeline, INPUTS)}


def _latents(pipe, inputs: dict, seed: int) -> torch.Tensor:
    """The denoise stage's final latents of one request, its stages called by hand."""
    r = I.MediaRequest("h", inputs, seed)
    first = pipe.encode if hasattr(pipe, "encode") else pipe.understand
    (prev,) = first([r])
    state = pipe.start([I.MediaRequest("h", {**inputs, "previous": prev}, seed)])
    for i in range(pipe.num_steps(state)):
        pipe.step(state, i)
    ((z,),) = pipe.finish(state)
    return z


def _fp8_names(pipe) -> set[str]:
    return {n for n, m in pipe.transformer.named_modules() if isinstance(m, Fp8Linear)}


@pytest.mark.parametrize("family", ["wan", "cosmos3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generation_close_to_unquantized(family, dtype):
    make, inputs = PIPELINES[family]
    assert knobs.value("MSTAR_DIT_FP8") is False
    plain = make(f"tiny-{family}", dtype=dtype, device="cpu")
    assert not _fp8_names(plain)
    want = _latents(plain, inputs, seed=5)
    with knobs.override(MSTAR_DIT_FP8=True):
        quant = make(f"tiny-{family}", dtype=dtype, device="cpu")
    got = _latents(quant, inputs, seed=5)
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert 0 < err <= BOUND[family], err


def test_the_layers_each_family_quantizes():
    with knobs.override(MSTAR_DIT_FP8=True):
        wan = wan_pipeline("tiny-wan", device="cpu")
        cosmos = cosmos3_pipeline("tiny-cosmos3", device="cpu")
    blocks = len(wan.transformer.blocks)
    want = {f"blocks.{i}.{name}" for i in range(blocks) for name in wan.transformer.FP8_LINEARS}
    assert _fp8_names(wan) == want  # not the text's keys / values, the embedders or proj_out
    layers = len(cosmos.transformer.layers)
    want = {f"layers.{i}.{name}" for i in range(layers)
            for name in ("self_attn.gen_qkv_fp8", "self_attn.to_add_out", "mlp_moe_gen.up_proj",
                         "mlp_moe_gen.down_proj")}
    assert _fp8_names(cosmos) == want  # the understanding tower stays
    params = {n for n, _ in cosmos.transformer.named_parameters()}
    assert not any(".add_" in n and "_proj" in n for n in params)  # the bf16 q / k / v are freed
    assert "layers.0.self_attn.to_q.weight" in params

def test_understanding_is_unchanged_by_fp8():
    """Cosmos3's prompt K/V (the understanding tower) are the same bits with the generation tower in float8."""
    plain = cosmos3_pipeline("tiny-cosmos3", device="cpu")
    with knobs.override(MSTAR_DIT_FP8=True):
        quant = cosmos3_pipeline("tiny-cosmos3", device="cpu")
    r = I.MediaRequest("u", INPUTS, 3)
    (a,), (b,) = plain.understand([r]), quant.understand([r])
    assert len(a) == len(b) == 2  # the prompt and the negative prompt
    for x, y in zip(a, b):
        assert x.length == y.length and torch.equal(x.k, y.k) and torch.equal(x.v, y.v)


def test_a_gpu_without_float8_tensor_cores_is_refused(monkeypatch):
    from mstar.models.layers.fp8 import apply_dit_fp8

    class OnOldGpu:
        device = torch.device("cuda", 0)

        def to_fp8(self):
            raise AssertionError("not to be converted")

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "an sm80 GPU")
    plain = OnOldGpu()
    assert apply_dit_fp8(plain) is plain  # the knob off: nothing checked
    with knobs.override(MSTAR_DIT_FP8=True):
        with pytest.raises(ValueError, match="MSTAR_DIT_FP8.*8.9"):
            apply_dit_fp8(plain)
