"""The Wan family: Wan2.2 TI2V (text-to-video, text-to-image as one frame, image-to-video) as three
stages of the stage engine (pipeline.py). Presets wan2.2-ti2v-5b (the published shapes, random
weights) and the embedded tiny-wan (presets.py); a checkpoint directory is diffusers' pipeline
layout (Wan-AI/Wan2.2-TI2V-5B-Diffusers, or WanPipeline / WanImageToVideoPipeline.save_pretrained):

    model_index.json            _class_name WanPipeline or WanImageToVideoPipeline; expand_timesteps
                                (Wan2.2 TI2V: true; image input needs it); no transformer_2 /
                                boundary_ratio (the two-expert A14B models) and no image_encoder
                                (Wan2.1 I2V's CLIP): refused
    transformer/                WanTransformer3DModel (transformer_weights.py)
    vae/                        AutoencoderKLWan, the Wan2.2 residual kind (vae_weights.py)
    text_encoder/, tokenizer/   UMT5EncoderModel, its tokenizer (text_encoder.py)
    scheduler/                  scheduler_config.json: UniPCMultistepScheduler with flow sigmas

Such a directory has no config.json: the registry finds the family from model_index.json's
_class_name (Family.pipeline_classes). What a directory's routes accept: the published sizes
(1280x704, 704x1280, and 480p: 832x480, 480x832) when the transformer has the published width,
else the tiny preset's; at most 121 frames, 24 fps, 50 steps and guidance 5 by default.

dtype: the transformer's and the text encoder's (bfloat16 on GPU by default); the VAE runs in
float32 whatever it is (diffusers' documented use of TI2V-5B: the VAE loaded in float32).
"""

from __future__ import annotations

import json
import os

from mstar.models import interfaces as I
from mstar.models.presets import Preset, random_weights_preset
from mstar.models.registry import Family, register
from mstar.models.wan.presets import MODEL_TYPE, PRESETS, PUBLISHED_SIZES, TINY_SIZES, WanConfig

PIPELINE_CLASSES = ("WanPipeline", "WanImageToVideoPipeline")
SCHEDULER_CLASS = "UniPCMultistepScheduler"
PUBLISHED_DIM = 3072  # the TI2V-5B transformer's width: such a directory gets the published sizes


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _component(index: dict, name: str):
    """model_index.json's [library, class] of a component, or None when absent / [null, null]."""
    v = index.get(name)
    if isinstance(v, (list, tuple)) and any(x is not None for x in v):
        return list(v)
    return None


def config_from_dir(path: str, raw: dict | None = None) -> WanConfig:
    """The WanConfig of a diffusers pipeline directory (raw: its model_index.json, if read)."""
    index = raw if raw is not None else _read_json(os.path.join(path, "model_index.json"))
    cls = index.get("_class_name")
    if cls not in PIPELINE_CLASSES:
        raise ValueError(f"{path!r}: model_index.json's _class_name {cls!r} is not one of "
                         f"{', '.join(PIPELINE_CLASSES)}")
    if _component(index, "transformer_2") is not None or index.get("boundary_ratio") is not None:
        raise ValueError(f"{path!r}: two transformers (transformer_2 / boundary_ratio, the Wan2.2 A14B kind) are "
                         "not supported; mstar runs the TI2V-5B kind")
    if _component(index, "image_encoder") is not None:
        raise ValueError(f"{path!r}: an image_encoder (Wan2.1 I2V's CLIP conditioning) is not supported; mstar "
                         "runs the TI2V-5B kind (first-frame conditioning, expand_timesteps)")
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        if not os.path.isdir(os.path.join(path, name)):
            raise FileNotFoundError(f"{path!r}: no {name}/ directory (diffusers' pipeline layout)")
    sched = _read_json(os.path.join(path, "scheduler", "scheduler_config.json"))
    if sched.get("_class_name", SCHEDULER_CLASS) != SCHEDULER_CLASS:
        raise ValueError(f"{path!r}: scheduler {sched.get('_class_name')!r} is not supported (only {SCHEDULER_CLASS} "
                         "with flow sigmas, the release's)")
    transformer = _read_json(os.path.join(path, "transformer", "config.json"))
    dim = int(transformer.get("num_attention_heads", 0)) * int(transformer.get("attention_head_dim", 0))
    return WanConfig(
        transformer=transformer, vae=_read_json(os.path.join(path, "vae", "config.json")),
        text_encoder=_read_json(os.path.join(path, "text_encoder", "config.json")), scheduler=sched,
        expand_timesteps=bool(index.get("expand_timesteps", False)),
        sizes=PUBLISHED_SIZES if dim >= PUBLISHED_DIM else TINY_SIZES)


def _make_config(preset: Preset) -> WanConfig:
    return WanConfig.from_dict(preset.config)


def _seeded(seed: int, device, build):
    import torch
    dev = torch.device(device)
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        with dev:
            return build()


def random_transformer(raw: dict, seed: int, device, dtype):
    from mstar.models.wan.transformer import WanTransformer
    from mstar.models.wan.transformer_config import WanTransformerConfig
    cfg = WanTransformerConfig.from_dict(raw)
    return _seeded(seed, device, lambda: WanTransformer(cfg)).to_dtype(dtype).eval()


def random_vae(raw: dict, seed: int, device, dtype):
    """A WanVAE with PyTorch's default conv init (kaiming uniform weights, uniform biases)."""
    import math

    import torch

    from mstar.models.wan.vae import WanVAE
    from mstar.models.wan.vae_blocks import CausalConv3d
    from mstar.models.wan.vae_config import WanVAEConfig

    def build():
        vae = WanVAE(WanVAEConfig.from_dict(raw))
        for m in vae.modules():
            if isinstance(m, CausalConv3d):
                torch.nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5))
                bound = 1.0 / math.sqrt(m.weight[0].numel())
                torch.nn.init.uniform_(m.bias, -bound, bound)
        return vae
    return _seeded(seed, device, build).to(dtype).eval().requires_grad_(False)


def default_vae_dtype(family_dtype):
    """The VAE's dtype where the caller names none: MSTAR_VAE_DTYPE, its "auto" the family's
    `family_dtype` (Wan: float32; Cosmos3: the pipeline's dtype)."""
    import torch

    from mstar import knobs
    name = knobs.value("MSTAR_VAE_DTYPE")
    return family_dtype if name == "auto" else getattr(torch, name)


def configure_vae(vae):
    """vae in the layout MSTAR_VAE_CHANNELS_LAST names (WanVAE.set_channels_last)."""
    from mstar import knobs
    return vae.set_channels_last(knobs.value("MSTAR_VAE_CHANNELS_LAST"))


def wan_pipeline(name_or_dir: str, dtype=None, device="cpu", random_weights: bool = False, seed: int = 0,
                 max_batch: int = 8, vae_dtype=None):
    """A WanPipeline of a diffusers pipeline directory or a preset (random weights: the preset's
    shapes, or the directory's configs and tokenizer)."""
    import torch

    from mstar.models.layers.fp8 import apply_dit_fp8
    from mstar.models.wan.pipeline import WanPipeline
    from mstar.models.wan.scheduler import FlowUniPCScheduler
    from mstar.models.wan.text_encoder import byte_tokenizer, load_text_encoder, random_text_encoder

    dtype = dtype or torch.float32
    vae_dtype = vae_dtype or default_vae_dtype(torch.float32)  # the Wan2.2 pipelines' float32 VAE
    if os.path.isdir(name_or_dir):
        cfg = config_from_dir(name_or_dir)
        if random_weights:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(os.path.join(name_or_dir, "tokenizer"))
            transformer = random_transformer(cfg.transformer, seed, device, dtype)
            vae = random_vae(cfg.vae, seed + 1, device, vae_dtype)
            text = _seeded(seed + 2, device,
                           lambda: random_text_encoder(cfg.text_encoder, tok, seed + 2, device, dtype))
        else:
            from mstar.models.wan.transformer_weights import load_transformer
            from mstar.models.wan.vae_weights import load_wan_vae
            transformer = load_transformer(os.path.join(name_or_dir, "transformer"), device, dtype)
            vae = load_wan_vae(os.path.join(name_or_dir, "vae"), vae_dtype, device)
            text = load_text_encoder(name_or_dir, device, dtype)
        scheduler = FlowUniPCScheduler.from_dir(os.path.join(name_or_dir, "scheduler"))
    else:
        from mstar.models.wan.presets import get
        preset = random_weights_preset(get(name_or_dir), name_or_dir, random_weights, "Wan",
                                       "diffusers pipeline directory")
        cfg = _make_config(preset)
        transformer = random_transformer(cfg.transformer, seed, device, dtype)
        vae = random_vae(cfg.vae, seed + 1, device, vae_dtype)
        text = _seeded(seed + 2, device,
                       lambda: random_text_encoder(cfg.text_encoder, byte_tokenizer(), seed + 2, device, dtype))
        scheduler = FlowUniPCScheduler(cfg.scheduler)
    return WanPipeline(apply_dit_fp8(transformer), configure_vae(vae), text, scheduler, expand_timesteps=cfg.expand_timesteps, sizes=cfg.sizes,
                       max_frames=cfg.max_frames, fps=cfg.fps, num_inference_steps=cfg.num_inference_steps,
                       guidance_scale=cfg.guidance_scale, max_batch=max_batch)


FAMILY = register(Family(
    name="wan", model_types=(MODEL_TYPE,), capabilities=frozenset({I.GENERATES_VIDEO, I.GENERATES_IMAGES}),
    presets=PRESETS, config_from_dir=config_from_dir, make_config=_make_config, pipeline=wan_pipeline,
    pipeline_classes=PIPELINE_CLASSES))
