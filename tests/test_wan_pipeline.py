"""The Wan family (mstar/models/wan/family.py, pipeline.py, text_encoder.py) against diffusers'
WanPipeline and WanImageToVideoPipeline (0.36), end to end on the stage engine, CPU float32.

The reference is a diffusers pipeline of tiny random components of the Wan2.2 TI2V kind, built
under a fixed seed: WanTransformer3DModel (TINY_WAN_TRANSFORMER, its biases and norm weights moved
off their init), AutoencoderKLWan (TINY_WAN22_TI2V_VAE: residual, z_dim 8 = the transformer's
in_channels; norm gammas and biases moved), UMT5EncoderModel (TINY_UMT5), the offline byte
tokenizer, UniPCMultistepScheduler with the Wan2.2 config and expand_timesteps=True. It is saved
with save_pretrained (diffusers' layout, model_index.json, no config.json) and loaded through
mstar: registry.family_of(dir).pipeline(dir, ...), run by StageEngine(EngineConfig(model=dir)).
diffusers runs the same request: pipe(prompt, negative_prompt, height, width, num_frames,
num_inference_steps=3, guidance_scale=5.0, generator=torch.Generator().manual_seed(seed),
output_type="np" | "latent").

Tolerances (float32):
  LATENT_TOL = 1e-4 of the reference latents' largest magnitude, for the denoised latents (the
    stage functions run by hand against output_type="latent"): the same float32 math in other
    orders (the transformer's and VAE's own parity tests see ~1e-7 relative); measured <= 2e-6.
    A wrong noise draw, a swapped cond / uncond, a missed first-frame condition or a wrong
    timestep is O(1).
  pixels: mstar's uint8 frames against round(255 * diffusers' np output): at most PIXEL_TOL = 1
    level anywhere (a value on a rounding boundary) and at most PIXEL_FRAC = 0.1 % of the values
    differing at all; measured: max 1 level, <= 0.01 % of values, largest float difference
    0.5002 levels (|uint8 - 255 * reference|).
  A batch of two requests against each alone: the same code on other GEMM shapes, within the
    same bounds.
diffusers' prompt_clean needs ftfy; without it installed, the test gives diffusers an identity
fix_text (mstar's prompt_clean does the same then).
"""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from mstar.models import interfaces as I  # noqa: E402
from mstar.models import registry  # noqa: E402
from mstar.models.wan import presets as wan_presets  # noqa: E402
from mstar.models.wan.scheduler import WAN22_TI2V_5B_SCHEDULER  # noqa: E402
from mstar.models.wan.text_encoder import BYTE_VOCAB, byte_tokenizer, prompt_clean  # noqa: E402
from mstar.models.wan.transformer_config import WanTransformerConfig  # noqa: E402
from mstar.models.wan.vae_config import WanVAEConfig  # noqa: E402
from mstar.runtime.engine.config import EngineConfig  # noqa: E402
from mstar.runtime.engine.request import EngineRequest, RequestError, SamplingParams  # noqa: E402
from mstar.runtime.engine.stage_engine import StageEngine  # noqa: E402

LATENT_TOL = 1e-4
PIXEL_TOL = 1
PIXEL_FRAC = 1e-3
STEPS = 3
GUIDANCE = 5.0
H, W = 64, 64


def _no_grad_copy(p, v):
    with torch.no_grad():
        p.copy_(v)


def _components(seed: int = 0):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tr = WanTransformer3DModel(**WanTransformerConfig.from_dict(wan_presets.TINY_WAN["transformer"]).to_dict())
    vae = AutoencoderKLWan(**WanVAEConfig.from_dict(wan_presets.TINY_WAN["vae"]).to_dict())
    te = UMT5EncoderModel(UMT5Config(**wan_presets.TINY_UMT5))
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in tr.named_parameters():
        if name.endswith(".bias"):
            _no_grad_copy(p, 0.1 * torch.randn(p.shape, generator=g))
        elif p.dim() == 1:  # norm weights
            _no_grad_copy(p, 1.0 + 0.2 * torch.randn(p.shape, generator=g))
    for name, p in vae.named_parameters():
        if name.endswith(".gamma"):
            _no_grad_copy(p, 1.0 + 0.5 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            _no_grad_copy(p, 0.1 * torch.randn(p.shape, generator=g))
    sched = UniPCMultistepScheduler(**{k: v for k, v in WAN22_TI2V_5B_SCHEDULER.items() if not k.startswith("_")})
    return dict(tokenizer=byte_tokenizer(), text_encoder=te.eval(), vae=vae.eval(), scheduler=sched,
                transformer=tr.eval())


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(diffusers T2V pipeline, I2V pipeline, the saved T2V directory, the saved I2V directory, mstar's pipeline)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    mp = pytest.MonkeyPatch()
    for mod in (pipeline_wan, pipeline_wan_i2v):
        if not hasattr(mod, "ftfy"):
            mp.setattr(mod, "ftfy", types.SimpleNamespace(fix_text=lambda t: t), raising=False)
    comps = _components()
    t2v = WanPipeline(**comps, expand_timesteps=True)
    i2v = WanImageToVideoPipeline(**comps, image_processor=None, image_encoder=None, expand_timesteps=True)
    for p in (t2v, i2v):
        p.set_progress_bar_config(disable=True)
    d_t2v, d_i2v = tmp_path_factory.mktemp("wan_t2v"), tmp_path_factory.mktemp("wan_i2v")
    t2v.save_pretrained(d_t2v)
    i2v.save_pretrained(d_i2v)
    fam = registry.family_of(str(d_t2v))
    pipe = fam.pipeline(str(d_t2v), dtype=torch.float32, device="cpu", random_weights=False, seed=0, max_batch=8)
    yield t2v, i2v, str(d_t2v), str(d_i2v), pipe
    mp.undo()


def _engine(model: str, pipe=None) -> StageEngine:
    fam = registry.family_of(model)
    return StageEngine(EngineConfig(model=model, device="cpu", dtype="float32"), family=fam, pipeline=pipe)


def _run(engine: StageEngine, reqs: dict[str, tuple[dict, int]]) -> dict:
    for rid, (inputs, seed) in reqs.items():
        engine.add_request(EngineRequest(rid, [], SamplingParams(), media=I.MediaRequest(rid, inputs, seed)))
    outs, starts = {}, []
    while engine.has_unfinished():
        for o in engine.step():
            if o.finish_reason is not None:
                outs[o.request_id] = o
        starts += [n for k, what, _, n in engine.last_step if k == 1 and what == "start"]
    for rid, o in outs.items():
        assert o.finish_reason == "stop", (rid, o.error)
    return {rid: o.media for rid, o in outs.items()}, starts


def _latents_by_hand(pipe, inputs: dict, seed: int) -> torch.Tensor:
    """The denoise stage's final latents of one request, its stage functions called by hand."""
    r = I.MediaRequest("h", inputs, seed)
    (prev,) = pipe.encode([r])
    r = I.MediaRequest("h", {**inputs, "previous": prev}, seed)
    state = pipe.start([r])
    for i in range(pipe.num_steps(state)):
        pipe.step(state, i)
    ((z,),) = pipe.finish(state)
    return z


def _check_latents(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < LATENT_TOL, rel
    return rel


def _check_pixels(got: np.ndarray, want: np.ndarray) -> None:
    """got uint8; want diffusers' float [0, 1] of the same shape."""
    assert got.dtype == np.uint8 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    inside = ((want > 0) & (want < 1)).mean()
    assert inside > 0.5, inside  # the clamp hides little of the comparison
    levels = np.abs(got.astype(np.int32) - (want * 255).round().astype(np.int32))
    assert levels.max() <= PIXEL_TOL and (levels > 0).mean() <= PIXEL_FRAC, (levels.max(), (levels > 0).mean())
    assert np.abs(got - want * 255).max() <= 0.5 + 1e-2


def _t2v_inputs(prompt="a red fox in the snow", neg="blurry, low quality", frames=5, **kw):
    inputs = {"prompt": prompt, "negative_prompt": neg, "width": W, "height": H, "num_inference_steps": STEPS,
              "guidance_scale": GUIDANCE, **kw}
    if frames is not None:
        inputs["num_frames"] = frames
    return inputs


def _diffusers(pipe, inputs: dict, seed: int, output_type: str, **kw):
    return pipe(prompt=inputs["prompt"], negative_prompt=inputs["negative_prompt"], height=inputs["height"],
                width=inputs["width"], num_frames=inputs.get("num_frames") or 1,
                num_inference_steps=inputs["num_inference_steps"], guidance_scale=inputs["guidance_scale"],
                generator=torch.Generator().manual_seed(seed), output_type=output_type, **kw).frames


# -- the family and its directories -----------------------------------------------------------------
def test_family_found_from_the_directory(ref):
    from mstar.models.loader import resolve_config
    _, _, d_t2v, d_i2v, pipe = ref
    assert not os.path.exists(os.path.join(d_t2v, "config.json"))
    for d, cls in ((d_t2v, "WanPipeline"), (d_i2v, "WanImageToVideoPipeline")):
        assert json.load(open(os.path.join(d, "model_index.json")))["_class_name"] == cls
        fam = registry.family_of(d)
        assert fam.name == "wan" and fam.capabilities == frozenset({I.GENERATES_VIDEO, I.GENERATES_IMAGES})
        cfg = resolve_config(d)
        assert cfg.model_type == "wan" and cfg.expand_timesteps and cfg.sizes == wan_presets.TINY_SIZES
    assert isinstance(pipe, I.Pipeline) and [s.kind for s in pipe.stages] == ["one_shot", "fixed_step_loop",
                                                                            "one_shot"]
    acc = pipe.accepts
    assert acc["sizes"][0] == "64x64" and acc["max_frames"] == 121 and acc["fps"] == 24.0 and acc["image_input"]
    assert registry.family_of("tiny-wan") is registry.family_of("wan2.2-ti2v-5b") is registry.get_family("wan")
    with pytest.raises(ValueError, match="already belong"):
        registry.register(registry.Family(name="impostor", model_types=("imp",), capabilities=frozenset(),
                                          pipeline_classes=("WanPipeline",)))


def test_refused_directories(tmp_path):
    from mstar.models.wan.family import config_from_dir
    index = {"_class_name": "WanPipeline", "transformer_2": ["diffusers", "WanTransformer3DModel"],
             "boundary_ratio": 0.875}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    assert registry.family_of(str(tmp_path)).name == "wan"
    with pytest.raises(ValueError, match="transformer_2"):
        config_from_dir(str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match="not supported"):
        registry.family_of(str(tmp_path))


# -- parity with diffusers ----------------------------------------------------------------------------
def test_text_to_video_matches_diffusers(ref):
    t2v, _, d, _, pipe = ref
    inputs, seed = _t2v_inputs(), 1234
    outs, _ = _run(_engine(d, pipe), {"v": (inputs, seed)})
    (clip,) = outs["v"]
    assert isinstance(clip, I.VideoFrames) and clip.frames.shape == (5, H, W, 3) and clip.fps == 24.0
    _check_pixels(clip.frames, _diffusers(t2v, inputs, seed, "np")[0])
    _check_latents(_latents_by_hand(pipe, inputs, seed), _diffusers(t2v, inputs, seed, "latent"))


@pytest.mark.parametrize("width,guidance", [(96, GUIDANCE), (64, 1.0)])
def test_image_matches_diffusers(ref, width, guidance):
    """No num_frames (the image route): one frame, an Image; diffusers' num_frames=1. Guidance 1:
    no uncond rows (diffusers runs no uncond forward)."""
    t2v, _, d, _, pipe = ref
    inputs = _t2v_inputs(prompt="a lighthouse at dusk", frames=None, width=width, guidance_scale=guidance)
    seed = 99
    outs, _ = _run(_engine(d, pipe), {"i": (inputs, seed)})
    (img,) = outs["i"]
    assert isinstance(img, I.Image) and img.pixels.shape == (H, width, 3)
    _check_pixels(img.pixels, _diffusers(t2v, inputs, seed, "np")[0, 0])


def test_image_to_video_matches_diffusers(ref):
    """TI2V image-to-video: diffusers' WanImageToVideoPipeline with expand_timesteps; the input image
    at another size (resized by PIL Lanczos on both sides)."""
    from PIL import Image as PILImage
    _, i2v, d, _, pipe = ref
    rng = np.random.default_rng(5)
    base = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
    image = np.asarray(PILImage.fromarray(base).resize((80, 48), PILImage.BILINEAR))  # smooth-ish, 80 x 48
    inputs, seed = _t2v_inputs(prompt="the same scene, moving", frames=9, image=image), 7
    outs, _ = _run(_engine(d, pipe), {"iv": (inputs, seed)})
    (clip,) = outs["iv"]
    assert clip.frames.shape == (9, H, W, 3)
    want = _diffusers(i2v, inputs, seed, "np", image=PILImage.fromarray(image))
    _check_pixels(clip.frames, want[0])
    got = _latents_by_hand(pipe, inputs, seed)
    _check_latents(got, _diffusers(i2v, inputs, seed, "latent", image=PILImage.fromarray(image)))
    # the first latent frame is the image's (the same whatever the seed), the rest differ
    other = _latents_by_hand(pipe, inputs, seed + 1)
    assert torch.equal(got[:, :, 0], other[:, :, 0]) and not torch.allclose(got[:, :, 1:], other[:, :, 1:])


def test_a_batch_equals_each_alone(ref):
    """Two different requests (prompt, seed, guidance scale, flow shift) in one denoise batch; the
    one with its own flow_shift against diffusers with the scheduler's flow_shift set to it."""
    from diffusers import UniPCMultistepScheduler
    t2v, _, d, _, pipe = ref
    a = (_t2v_inputs(prompt="a boat", neg=""), 3)
    b = (_t2v_inputs(prompt="a mountain lake at sunrise", guidance_scale=3.5, flow_shift=3.0), 4)
    together, starts = _run(_engine(d, pipe), {"a": a, "b": b})
    assert starts == [2]
    for rid, req in (("a", a), ("b", b)):
        alone, starts = _run(_engine(d, pipe), {rid: req})
        assert starts == [1]
        x, y = together[rid][0].frames, alone[rid][0].frames
        levels = np.abs(x.astype(np.int32) - y.astype(np.int32))
        assert levels.max() <= PIXEL_TOL and (levels > 0).mean() <= PIXEL_FRAC
    assert np.abs(together["a"][0].frames.astype(int) - together["b"][0].frames.astype(int)).mean() > 5
    sched = t2v.scheduler
    t2v.scheduler = UniPCMultistepScheduler.from_config(sched.config, flow_shift=3.0)
    try:
        want = _diffusers(t2v, b[0], b[1], "np")[0]
    finally:
        t2v.scheduler = sched
    _check_pixels(together["b"][0].frames, want)


def test_a_request_joins_a_running_batch(ref):
    """Continuous batching: b arrives after a's second step and joins a's denoise batch (one
    transformer call for both from then on); a leaves after its own last step, b runs its own
    steps; each is diffusers' output for its request. Image-to-video rows join the same way."""
    t2v, i2v, d, d_i2v, pipe = ref
    a = (_t2v_inputs(prompt="a boat", neg=""), 3)
    b = (_t2v_inputs(prompt="a mountain lake at sunrise", guidance_scale=3.5), 4)
    eng = _engine(d, pipe)
    eng.add_request(EngineRequest("a", [], SamplingParams(), media=I.MediaRequest("a", *a)))
    eng.step()
    eng.step()
    eng.add_request(EngineRequest("b", [], SamplingParams(), media=I.MediaRequest("b", *b)))
    outs, seen = {}, []
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        seen += [(what, n) for k, what, _, n in eng.last_step if k == 1]
    assert ("join", 1) in seen and ("leave", 1) in seen and ("start", 1) not in seen
    assert seen.count(("step", 2)) == STEPS - 2  # a's last steps with b's first ones, in one call
    for rid, (inputs, seed) in (("a", a), ("b", b)):
        assert outs[rid].finish_reason == "stop", outs[rid].error
        _check_pixels(outs[rid].media[0].frames, _diffusers(t2v, inputs, seed, "np")[0])
    # image-to-video: the conditioning latents follow their rows through join and leave
    ipipe = registry.family_of(d_i2v).pipeline(d_i2v, dtype=torch.float32, device="cpu", seed=0, max_batch=8)
    img = np.random.default_rng(5).integers(0, 256, size=(H, W, 3), dtype=np.uint8)
    reqs = {"p": (_t2v_inputs(prompt="a cat", image=img), 1), "q": (_t2v_inputs(prompt="a dog", image=img[::-1]), 2)}
    state = ipipe.start([I.MediaRequest("p", {**reqs["p"][0], "previous": ipipe.encode(
        [I.MediaRequest("p", *reqs["p"])])[0]}, 1)])
    ipipe.step(state, 0)
    state = ipipe.join(state, [I.MediaRequest("q", {**reqs["q"][0], "previous": ipipe.encode(
        [I.MediaRequest("q", *reqs["q"])])[0]}, 2)])
    for i in range(1, STEPS):
        ipipe.step(state, i)
    state, ((zp,),) = ipipe.leave(state, [0])
    ipipe.step(state, STEPS)
    ((zq,),) = ipipe.finish(state)
    for z, rid in ((zp, "p"), (zq, "q")):
        _check_latents(z, _latents_by_hand(ipipe, *reqs[rid]))


# -- the embedded preset, refusals ---------------------------------------------------------------------
def test_tiny_preset_end_to_end():
    engine = StageEngine(EngineConfig(model="tiny-wan", device="cpu", dtype="float32"))
    assert engine.family.name == "wan" and engine.accepts["sizes"] == list(wan_presets.TINY_SIZES)
    img = np.full((40, 30, 3), 128, dtype=np.uint8)
    reqs = {"v": ({"prompt": "hello", "width": 64, "height": 64, "num_frames": 8, "fps": 12.0}, 1),
            "v2": ({"prompt": "hello", "width": 64, "height": 64, "num_frames": 8, "fps": 12.0}, 1),
            "i": ({"prompt": "hello", "width": 32, "height": 32, "guidance_scale": 1.0}, 2),
            "iv": ({"prompt": "hello", "width": 64, "height": 64, "num_frames": 5, "image": img}, 3)}
    outs, starts = _run(engine, reqs)
    (v,), (v2,), (i,), (iv,) = outs["v"], outs["v2"], outs["i"], outs["iv"]
    assert isinstance(v, I.VideoFrames) and v.frames.shape == (9, 64, 64, 3) and v.fps == 12.0  # 8 -> 9 frames
    assert np.array_equal(v.frames, v2.frames)  # a function of (seed, inputs)
    assert isinstance(i, I.Image) and i.pixels.shape == (32, 32, 3) and i.pixels.dtype == np.uint8
    assert isinstance(iv, I.VideoFrames) and iv.frames.shape == (5, 64, 64, 3)
    assert sorted(starts) == [1, 1, 2]  # v and v2 share a batch
    assert engine.num_finished == 4 and not engine.has_unfinished()


def test_text_keys_are_made_once_a_batch(monkeypatch):
    """The text's cross-attention keys / values are made on a batch's first step and after each
    join or leave, not at every step."""
    pipe = registry.family_of("tiny-wan").pipeline("tiny-wan", dtype=torch.float32, device="cpu")
    calls = []
    plain = pipe.transformer.text_kv
    monkeypatch.setattr(pipe.transformer, "text_kv", lambda text: calls.append(text.shape[0]) or plain(text))
    inputs = {"prompt": "a fox", "width": 32, "height": 32, "num_inference_steps": 4}

    def req(rid, seed):
        return I.MediaRequest(rid, {**inputs, "previous": pipe.encode([I.MediaRequest(rid, inputs, seed)])[0]}, seed)

    state = pipe.start([req("a", 1)])
    pipe.step(state, 0)
    pipe.step(state, 1)
    state = pipe.join(state, [req("b", 2)])
    pipe.step(state, 2)
    pipe.step(state, 3)
    state, _ = pipe.leave(state, [0])
    pipe.step(state, 4)
    assert calls == [2, 4, 2]  # guided rows: cond + uncond per request


@pytest.mark.parametrize("inputs,field", [
    ({"prompt": "x", "width": 48, "height": 48}, "size"),
    ({"prompt": "x", "width": 64, "height": 64, "num_frames": 18}, "num_frames"),
    ({"prompt": "x", "width": 64, "height": 64, "num_frames": 0}, "num_frames"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": -1.0}, "guidance_scale"),
    ({"prompt": "x", "flow_shift": 0.0}, "flow_shift"),
    ({"prompt": "x", "image": np.zeros((4, 4), dtype=np.uint8)}, "image"),
    ({"prompt": "x" * 4001}, "prompt"),
    ({"width": 64, "height": 64}, "prompt"),
])
def test_bad_requests_name_the_field(inputs, field):
    engine = StageEngine(EngineConfig(model="tiny-wan", device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match=rf"^{field}: "):
        engine.pipeline.check(I.MediaRequest("bad", inputs, 0))
    with pytest.raises(RequestError, match=rf"^{field}: ") as refused:
        engine.add_request(EngineRequest("bad", [], SamplingParams(), media=I.MediaRequest("bad", inputs, 0)))
    assert refused.value.field == field
    assert not engine.has_unfinished()


def test_presets_and_prompt_clean():
    from transformers import UMT5Config, UMT5EncoderModel

    from mstar.models.wan.family import wan_pipeline
    from mstar.models.wan.transformer_weights import build_meta
    assert wan_presets.BYTE_VOCAB == BYTE_VOCAB
    cfg = registry.family_of("wan2.2-ti2v-5b").make_config(registry.preset("wan2.2-ti2v-5b"))
    assert cfg.model_type == "wan" and cfg.sizes == ("1280x704", "704x1280", "832x480", "480x832") and cfg.max_frames == 121
    n = sum(p.numel() for p in build_meta(WanTransformerConfig.from_dict(cfg.transformer)).parameters())
    assert abs(n / 1e9 - 5.0) < 0.1, n
    with torch.device("meta"):
        enc = UMT5EncoderModel(UMT5Config(**cfg.text_encoder))
    assert abs(sum(p.numel() for p in enc.parameters()) / 1e9 - 5.68) < 0.05
    with pytest.raises(ValueError, match="random_weights"):
        wan_pipeline("wan2.2-ti2v-5b", dtype=torch.float32, device="cpu")
    assert prompt_clean("  a &amp;amp;\n\tb  ") == "a & b"
