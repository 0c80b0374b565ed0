"""The Cosmos3 family (mstar/models/cosmos3/) against diffusers 0.42.1's Cosmos3OmniPipeline, CPU
float32: the generator step by step, the cached understanding K/V, and whole text-to-image /
text-to-video runs on the stage engine.

The reference runs in the cached "diffusers-0.42" environment (tests/reference_envs.py): a
pipeline of tiny random components in the Cosmos3-Edge layout, built under a fixed seed:
Cosmos3OmniTransformer (TINY_COSMOS3_TRANSFORMER: relu2, no text q/k norms, the generation
tower's own norm of the prompt keys; norm weights moved off 1), AutoencoderKLWan (the tiny Wan2.2
VAE, z_dim 8; gammas and biases moved), a byte-level BPE tokenizer built here with `tokenizers`
(specials, a few merges, a ChatML chat template: not mstar's preset tokenizer), UniPC with the
release's scheduler config (flow_shift 5), default_use_system_prompt true (the system-prompt path),
use_native_flow_schedule true (the Edge schedule), no safety checker. It is saved with
save_pretrained (model_index.json, transformer/, vae/, scheduler/, text_tokenizer/) and run:

    a  text-to-image 96x64, 3 steps, guidance 4, negative prompt, seed 11
    c  text-to-image 96x64, 3 steps, guidance 6, no negative prompt, the scheduler at flow_shift 3
       (mstar's default), seed 12
    d  text-to-image 32x32, 2 steps, guidance 1 (no uncond branch), seed 13
    v  text-to-video 64x64, 9 frames at 12 fps (fps-scaled temporal positions), 3 steps,
       guidance 5, seed 5

recording every transformer call (token ids, input latents, timestep, output) and the final latents
(a step-end callback), with output_type "np". mstar loads the directory through the registry.

Tolerances (float32), relative to the reference's largest magnitude:
  GEN_TOL 1e-5: one generator forward against the recorded call (the same math; attention and
    GEMMs in other orders; the reference runs the whole joint sequence every call); measured
    <= 3.4e-7.
  LATENT_TOL 1e-5: the final latents of a whole run (2-3 steps); measured <= 8.3e-7.
  pixels: uint8 against round(255 * diffusers' np output): at most 1 level, at most 0.1 % of the
    values differing; measured: one value of 18,432 off by 1 level (a rounding boundary) in run a,
    none in c, d, v.
  The cached understanding K/V: recomputed at any step they are the same bits, and a prompt run
    with others equals it alone within 1e-6.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch

from mstar.models import interfaces as I
from mstar.models import registry
from mstar.models.cosmos3 import rope
from mstar.models.cosmos3.config import TINY_COSMOS3_TRANSFORMER
from mstar.models.cosmos3.presets import COSMOS3_EDGE_SCHEDULER
from mstar.models.wan.vae_config import TINY_WAN22_TI2V_VAE
from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.request import EngineRequest, SamplingParams
from mstar.runtime.engine.stage_engine import StageEngine
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture: one intra-op thread
from reference_envs import reference_env, run_reference

GEN_TOL = 1e-5
LATENT_TOL = 1e-5
PIXEL_TOL = 1
PIXEL_FRAC = 1e-3

RUNS = {
    "a": {"prompt": "a red fox in the snow", "negative_prompt": "blurry, low quality", "width": 96, "height": 64,
          "num_inference_steps": 3, "guidance_scale": 4.0, "flow_shift": 5.0, "seed": 11},
    "c": {"prompt": "the lighthouse at dusk.", "width": 96, "height": 64, "num_inference_steps": 3,
          "guidance_scale": 6.0, "seed": 12},
    "d": {"prompt": "in the garden", "width": 32, "height": 32, "num_inference_steps": 2, "guidance_scale": 1.0,
          "flow_shift": 5.0, "seed": 13},
    "v": {"prompt": "waves on a beach", "negative_prompt": "static", "width": 64, "height": 64, "num_frames": 9,
          "fps": 12.0, "num_inference_steps": 3, "guidance_scale": 5.0, "flow_shift": 5.0, "seed": 5},
}

SCRIPT = r'''
import copy
torch.set_num_threads(1)  # tiny models: intra-op threads only contend on a shared machine
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<pad>"]
vocab = {s: i for i, s in enumerate(specials)}
for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
    vocab[ch] = len(vocab)
merges = [("t", "h"), ("th", "e"), ("Ġ", "a"), ("i", "n"), ("e", "r")]
for a, b in merges:
    vocab[a + b] = len(vocab)
tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
tk.decoder = decoders.ByteLevel()
tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<pad>",
                              chat_template=template)

torch.manual_seed(0)
cfg = dict(ARGS["transformer"], vocab_size=len(tok))
tr = Cosmos3OmniTransformer.from_config(cfg).float().eval()
vae = AutoencoderKLWan(**ARGS["vae"]).eval()
g = torch.Generator().manual_seed(1)
with torch.no_grad():
    for name, p in tr.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    for name, p in vae.named_parameters():
        if name.endswith(".gamma"):
            p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
sched = UniPCMultistepScheduler(**ARGS["scheduler"])
pipe = Cosmos3OmniPipeline(transformer=tr, text_tokenizer=tok, vae=vae, scheduler=sched, enable_safety_checker=False,
                           default_use_system_prompt=True, use_native_flow_schedule=True)
pipe.set_progress_bar_config(disable=True)
pipe.save_pretrained(ARGS["dir"])

calls = []
forward = tr.forward
def recording(**kw):
    out = forward(**kw)
    calls.append({"input_ids": kw["input_ids"].tolist(), "latents": kw["vision_tokens"][0].clone(),
                  "t": int(kw["vision_timesteps"][0]), "out": out[0][0].clone()})
    return out
tr.forward = recording

RESULT = {}
for name, r in ARGS["runs"].items():
    calls.clear()
    last = {}
    def keep(p, i, t, kw):
        last["z"] = kw["latents"].clone()
        return {}
    pipe.scheduler = UniPCMultistepScheduler.from_config(sched.config, flow_shift=r.get("flow_shift", 3.0))
    out = pipe(prompt=r["prompt"], negative_prompt=r.get("negative_prompt"), height=r["height"], width=r["width"],
               num_frames=r.get("num_frames", 1), fps=r.get("fps", 24.0), num_inference_steps=r["num_inference_steps"],
               guidance_scale=r["guidance_scale"], generator=torch.Generator().manual_seed(r["seed"]),
               output_type="np", callback_on_step_end=keep)
    RESULT[name] = {"frames": out.video, "latents": last["z"], "calls": copy.deepcopy(calls)}
'''


def _inputs(run: dict) -> tuple[dict, int]:
    inputs = {k: v for k, v in run.items() if k != "seed"}
    return inputs, run["seed"]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(the saved directory, the reference's results by run, mstar's pipeline of the directory)."""
    d = str(tmp_path_factory.mktemp("cosmos3"))
    sched = {k: v for k, v in COSMOS3_EDGE_SCHEDULER.items() if not k.startswith("_")}
    res = run_reference(reference_env("diffusers-0.42"), SCRIPT,
                        {"dir": d, "transformer": TINY_COSMOS3_TRANSFORMER, "vae": TINY_WAN22_TI2V_VAE,
                         "scheduler": sched, "runs": RUNS})
    pipe = registry.family_of(d).pipeline(d, dtype=torch.float32, device="cpu", random_weights=False, seed=0,
                                          max_batch=8)
    return d, res, pipe


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _generate(pipe, ids: list[int], latents: torch.Tensor, t: int, p, kv=None) -> torch.Tensor:
    """One generator forward of one row (the request's params p) after prompt `ids`."""
    tr, cfg = pipe.transformer, pipe.transformer.config
    if kv is None:
        (kv,) = tr.understand([ids], [rope.rope_table(rope.text_positions(len(ids), cfg), cfg)])
    table = pipe._vision_table(p, len(ids))
    return tr.generate(latents, torch.tensor([t]), [0], [kv], table)


def _engine(d, pipe) -> StageEngine:
    return StageEngine(EngineConfig(model=d, device="cpu", dtype="float32"), family=registry.family_of(d),
                       pipeline=pipe)


def _run(engine, reqs: dict[str, tuple[dict, int]]) -> dict:
    for rid, (inputs, seed) in reqs.items():
        engine.add_request(EngineRequest(rid, [], SamplingParams(), media=I.MediaRequest(rid, inputs, seed)))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finish_reason is not None:
                assert o.finish_reason == "stop", (o.request_id, o.error)
                outs[o.request_id] = o.media
    return outs


def _latents_by_hand(pipe, inputs: dict, seed: int) -> torch.Tensor:
    r = I.MediaRequest("h", inputs, seed)
    (prev,) = pipe.understand([r])
    state = pipe.start([I.MediaRequest("h", {**inputs, "previous": prev}, seed)])
    for i in range(pipe.num_steps(state)):
        pipe.step(state, i)
    ((z,),) = pipe.finish(state)
    return z


def _check_pixels(got: np.ndarray, want: np.ndarray) -> None:
    """got uint8; want diffusers' float [0, 1] of the same shape."""
    assert got.dtype == np.uint8 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    assert ((want > 0) & (want < 1)).mean() > 0.5  # the clamp hides little of the comparison
    levels = np.abs(got.astype(np.int32) - (want * 255).round().astype(np.int32))
    assert levels.max() <= PIXEL_TOL and (levels > 0).mean() <= PIXEL_FRAC, (levels.max(), (levels > 0).mean())


# -- the directory ------------------------------------------------------------------------------------
def test_family_found_from_the_directory(ref):
    from mstar.models.loader import resolve_config
    d, _, pipe = ref
    index = json.load(open(os.path.join(d, "model_index.json")))
    assert index["_class_name"] == "Cosmos3OmniPipeline" and index["use_native_flow_schedule"] is True
    assert not os.path.exists(os.path.join(d, "config.json")) and os.path.isdir(os.path.join(d, "text_tokenizer"))
    fam = registry.family_of(d)
    assert fam.name == "cosmos3" and fam.capabilities == frozenset({I.GENERATES_VIDEO, I.GENERATES_IMAGES})
    cfg = resolve_config(d)
    assert cfg.model_type == "cosmos3" and cfg.flow_sigmas == "native" and cfg.use_system_prompt
    assert [s.kind for s in pipe.stages] == ["one_shot", "fixed_step_loop", "one_shot"]
    assert pipe.accepts["sizes"][0] == "64x64" and pipe.accepts["image_input"] is False
    assert registry.family_of("tiny-cosmos3") is registry.family_of("cosmos3-edge") is fam


# -- the generator, call by call ------------------------------------------------------------------------
@pytest.mark.parametrize("run", ["a", "v"])
def test_generator_matches_each_diffusers_call(ref, run):
    """Every recorded transformer call (cond and uncond, every step): the token ids mstar makes for
    the request, and the velocity of mstar's generator for the call's latents and timestep."""
    _, res, pipe = ref
    inputs, _ = _inputs(RUNS[run])
    p = pipe.params(inputs)
    cond, uncond = pipe.prompt_ids(p)
    calls = res[run]["calls"]
    assert len(calls) == 2 * inputs["num_inference_steps"]
    worst = 0.0
    for k, call in enumerate(calls):
        assert call["input_ids"] == (cond if k % 2 == 0 else uncond), k
        got = _generate(pipe, call["input_ids"], call["latents"], call["t"], p)
        worst = max(worst, _rel(got, call["out"]))
    assert worst < GEN_TOL, worst


def test_cached_understanding_equals_recomputing_it(ref):
    """The K/V cached at the first step serve every step: recomputed at a later step they are the
    same bits, and so is the velocity; a prompt understood with others equals it alone."""
    _, res, pipe = ref
    inputs, _ = _inputs(RUNS["v"])
    p = pipe.params(inputs)
    cond, uncond = pipe.prompt_ids(p)
    tr, cfg = pipe.transformer, pipe.transformer.config

    def table(ids):
        return rope.rope_table(rope.text_positions(len(ids), cfg), cfg)

    (cached,) = tr.understand([cond], [table(cond)])
    last = res["v"]["calls"][-2]  # the cond call of the last step
    (again,) = tr.understand([cond], [table(cond)])
    assert torch.equal(cached.k, again.k) and torch.equal(cached.v, again.v)
    assert cached.k.shape == (cfg.num_hidden_layers, len(cond), cfg.num_key_value_heads, cfg.head_dim)
    a = _generate(pipe, cond, last["latents"], last["t"], p, kv=cached)
    assert torch.equal(a, _generate(pipe, cond, last["latents"], last["t"], p))
    both = tr.understand([uncond, cond], [table(uncond), table(cond)])
    assert _rel(both[1].k, cached.k) < 1e-6 and _rel(both[1].v, cached.v) < 1e-6
    assert both[0].length == len(uncond) != len(cond)


def test_fused_generation_projections_equal_the_three(ref):
    """The loaded model's generation q / k / v projections are one matrix, their parameters views
    of it (the diffusers state dict unchanged); its step equals the three projections' step within
    float32 rounding, and moving the model undoes the fusion."""
    _, res, pipe = ref
    inputs, _ = _inputs(RUNS["v"])
    p = pipe.params(inputs)
    cond, _ = pipe.prompt_ids(p)
    last = res["v"]["calls"][-2]
    tr = pipe.transformer
    attn = [layer.self_attn for layer in tr.layers]
    assert all(a._gen_qkv is not None for a in attn)
    w = attn[0]._gen_qkv[0]
    assert attn[0].add_k_proj.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    assert set(tr.state_dict()) >= {"layers.0.self_attn.add_q_proj.weight", "layers.0.self_attn.add_v_proj.weight"}
    fused = _generate(pipe, cond, last["latents"], last["t"], p)
    saved = [a._gen_qkv for a in attn]
    try:
        for a in attn:
            a._gen_qkv = None
        three = _generate(pipe, cond, last["latents"], last["t"], p)
    finally:
        for a, g in zip(attn, saved):
            a._gen_qkv = g
    assert _rel(fused, three) < 1e-5 and not torch.equal(fused, torch.zeros_like(fused))
    moved = copy.deepcopy(tr).to(torch.float64)
    assert all(layer.self_attn._gen_qkv is None for layer in moved.layers)


# -- whole runs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("run", ["v", "d"])
def test_whole_run_matches_diffusers(ref, run):
    d, res, pipe = ref
    inputs, seed = _inputs(RUNS[run])
    (out,) = _run(_engine(d, pipe), {run: (inputs, seed)})[run]
    want = res[run]["frames"]
    if "num_frames" in inputs:
        assert isinstance(out, I.VideoFrames) and out.frames.shape == (9, 64, 64, 3) and out.fps == 12.0
        _check_pixels(out.frames, want)
    else:
        assert isinstance(out, I.Image) and out.pixels.shape == (32, 32, 3)
        _check_pixels(out.pixels, want[0])
    assert _rel(_latents_by_hand(pipe, inputs, seed), res[run]["latents"]) < LATENT_TOL


def test_a_request_joins_a_running_batch(ref):
    """Continuous batching: c (its own prompt, guidance, default flow_shift, no negative prompt)
    joins a's denoise batch after a's first step; each is diffusers' output for its request."""
    d, res, pipe = ref
    eng = _engine(d, pipe)
    a, c = _inputs(RUNS["a"]), _inputs(RUNS["c"])
    eng.add_request(EngineRequest("a", [], SamplingParams(), media=I.MediaRequest("a", *a)))
    eng.step()  # understand
    eng.step()  # a's first step
    eng.add_request(EngineRequest("c", [], SamplingParams(), media=I.MediaRequest("c", *c)))
    outs, seen = {}, []
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        seen += [(what, n) for k, what, _, n in eng.last_step if k == 1]
    assert ("join", 1) in seen and ("leave", 1) in seen and ("step", 2) in seen
    for rid in ("a", "c"):
        assert outs[rid].finish_reason == "stop", outs[rid].error
        (img,) = outs[rid].media
        assert isinstance(img, I.Image) and img.pixels.shape == (64, 96, 3)
        _check_pixels(img.pixels, res[rid]["frames"][0])


# -- the presets, refusals ------------------------------------------------------------------------------
def test_presets_and_defaults():
    from mstar.models.cosmos3.config import COSMOS3_EDGE_TRANSFORMER, Cosmos3TransformerConfig
    from mstar.models.cosmos3.family import cosmos3_pipeline
    from mstar.models.cosmos3.weights import build_meta
    cfg = registry.family_of("cosmos3-edge").make_config(registry.preset("cosmos3-edge"))
    assert cfg.model_type == "cosmos3" and cfg.flow_sigmas == "native" and not cfg.use_system_prompt
    assert cfg.sizes[0] == "832x480" and "640x640" in cfg.sizes and cfg.flow_shift == 3.0
    assert (cfg.image_size, cfg.image_steps, cfg.image_guidance) == ("640x640", 50, 4.0)
    assert (cfg.video_size, cfg.video_steps, cfg.video_guidance) == ("832x480", 50, 5.0)
    tc = Cosmos3TransformerConfig.from_dict(COSMOS3_EDGE_TRANSFORMER)
    assert tc.rope_axes == (24, 20, 20) and tc.k_norm_for_gen and not tc.qk_norm_for_text
    n = sum(p.numel() for p in build_meta(tc).parameters())
    # the release's 3.37 B less lm_head, the final text norm and the action heads
    assert abs(n / 1e9 - 3.093) < 0.005, n
    with pytest.raises(ValueError, match="random_weights"):
        cosmos3_pipeline("cosmos3-edge", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="silu"):
        Cosmos3TransformerConfig.from_dict({**COSMOS3_EDGE_TRANSFORMER, "hidden_act": "silu"})
    pipe = cosmos3_pipeline("tiny-cosmos3", device="cpu")
    img, vid = pipe.params({"prompt": "x"}), pipe.params({"prompt": "x", "num_frames": 8})
    assert (img.width, img.height, img.video, img.steps, img.guidance) == (64, 64, False, 4, 4.0)
    assert (vid.width, vid.height, vid.video, vid.guidance, vid.flow_shift) == (96, 64, True, 5.0, 3.0)
    assert pipe.latent_frames(vid) == 2  # 8 frames -> 1 + 7 // 4 latent frames (5 out, as diffusers)


@pytest.mark.parametrize("inputs,field", [
    ({"prompt": "x", "width": 48, "height": 48}, "size"),
    ({"prompt": "x", "num_frames": 18}, "num_frames"),
    ({"prompt": "x", "num_frames": 0}, "num_frames"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": -1.0}, "guidance_scale"),
    ({"prompt": "x", "flow_shift": 0.0}, "flow_shift"),
    ({"prompt": "x", "image": np.zeros((4, 4, 3), dtype=np.uint8)}, "image"),
    ({"prompt": "x" * 4001}, "prompt"),
    ({"width": 64, "height": 64}, "prompt"),
])
def test_bad_requests_name_the_field(inputs, field):
    from mstar.models.cosmos3.family import cosmos3_pipeline
    with pytest.raises(ValueError, match=rf"^{field}: "):
        cosmos3_pipeline("tiny-cosmos3", device="cpu").check(I.MediaRequest("bad", inputs, 0))


def test_refused_directories(tmp_path):
    from mstar.models.cosmos3.family import config_from_dir
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Cosmos3OmniPipeline"}))
    assert registry.family_of(str(tmp_path)).name == "cosmos3"
    with pytest.raises(FileNotFoundError, match="transformer"):
        config_from_dir(str(tmp_path))
