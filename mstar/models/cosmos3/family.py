"""The Cosmos3 family: Cosmos3-Edge's generator (text-to-image, text-to-video) as three stages of the
stage engine (pipeline.py). Presets cosmos3-edge (the published shapes, random weights) and the
embedded tiny-cosmos3 (presets.py); a checkpoint directory is diffusers' pipeline layout
(nvidia/Cosmos3-Edge, or Cosmos3OmniPipeline.save_pretrained):

    model_index.json        _class_name Cosmos3OmniPipeline; use_native_flow_schedule (the sigma
                            schedule: true, the Edge release's, "native"; absent or false:
                            diffusers >= 0.40's default), default_use_system_prompt (diffusers'
                            default true; Edge false); enable_safety_checker and a safety_checker
                            are not run (the release's guardrail is an optional gated model), a
                            sound_tokenizer is not used (no sound is generated)
    transformer/            Cosmos3OmniTransformer, the relu2 (Edge) backbone (weights.py)
    vae/                    AutoencoderKLWan, the Wan2.2 residual kind (mstar.models.wan)
    text_tokenizer/         the tokenizer with its chat template (AutoTokenizer)
    scheduler/              scheduler_config.json: UniPCMultistepScheduler with flow sigmas

Such a directory has no config.json: the registry finds the family from model_index.json's
_class_name. A transformer of the published width (2048) gets the published sizes and defaults
(presets.py), another one the tiny preset's sizes (the release's step and guidance defaults).

dtype: the transformer's (bfloat16 on GPU by default; time_embedder stays float32); the VAE runs
in float32 whatever it is (as Wan's).
"""

from __future__ import annotations

import json
import os

from mstar.models import interfaces as I
from mstar.models.cosmos3.presets import MODEL_TYPE, PRESETS, PUBLISHED_SIZES, TINY_SETTINGS, Cosmos3Config
from mstar.models.presets import Preset, random_weights_preset
from mstar.models.registry import Family, register

PIPELINE_CLASSES = ("Cosmos3OmniPipeline",)
SCHEDULER_CLASS = "UniPCMultistepScheduler"
PUBLISHED_HIDDEN = 2048  # Cosmos3-Edge's width: such a directory gets the published sizes


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def config_from_dir(path: str, raw: dict | None = None) -> Cosmos3Config:
    """The Cosmos3Config of a diffusers pipeline directory (raw: its model_index.json, if read)."""
    from mstar.models.cosmos3.config import Cosmos3TransformerConfig
    from mstar.models.wan.scheduler import FLOW_SIGMAS_DIFFUSERS, FLOW_SIGMAS_NATIVE

    index = raw if raw is not None else _read_json(os.path.join(path, "model_index.json"))
    cls = index.get("_class_name")
    if cls not in PIPELINE_CLASSES:
        raise ValueError(f"{path!r}: model_index.json's _class_name {cls!r} is not one of "
                         f"{', '.join(PIPELINE_CLASSES)}")
    for name in ("transformer", "vae", "text_tokenizer", "scheduler"):
        if not os.path.isdir(os.path.join(path, name)):
            raise FileNotFoundError(f"{path!r}: no {name}/ directory (diffusers' pipeline layout)")
    sched = _read_json(os.path.join(path, "scheduler", "scheduler_config.json"))
    if sched.get("_class_name", SCHEDULER_CLASS) != SCHEDULER_CLASS:
        raise ValueError(f"{path!r}: scheduler {sched.get('_class_name')!r} is not supported (only {SCHEDULER_CLASS} "
                         "with flow sigmas, the release's)")
    transformer = _read_json(os.path.join(path, "transformer", "config.json"))
    tcfg = Cosmos3TransformerConfig.from_dict(transformer)  # refuses what mstar does not run
    settings = {} if tcfg.hidden_size >= PUBLISHED_HIDDEN else dict(TINY_SETTINGS)
    return Cosmos3Config(
        transformer=transformer, vae=_read_json(os.path.join(path, "vae", "config.json")), scheduler=sched,
        flow_sigmas=FLOW_SIGMAS_NATIVE if index.get("use_native_flow_schedule") else FLOW_SIGMAS_DIFFUSERS,
        use_system_prompt=bool(index.get("default_use_system_prompt", True)),
        **{"sizes": PUBLISHED_SIZES, **settings})


def _make_config(preset: Preset) -> Cosmos3Config:
    return Cosmos3Config.from_dict(preset.config)


def random_transformer(raw: dict, seed: int, device, dtype):
    """A Cosmos3Transformer of `raw` (a transformer/config.json dict) with PyTorch's default init."""
    import torch

    from mstar.models.cosmos3.config import Cosmos3TransformerConfig
    from mstar.models.cosmos3.transformer import Cosmos3Transformer
    cfg = Cosmos3TransformerConfig.from_dict(raw)
    dev = torch.device(device)
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        with dev:
            model = Cosmos3Transformer(cfg)
    return model.to_dtype(dtype).eval().requires_grad_(False).fuse_projections()


def cosmos3_pipeline(name_or_dir: str, dtype=None, device="cpu", random_weights: bool = False, seed: int = 0,
                     max_batch: int = 8, vae_dtype=None):
    """A Cosmos3Pipeline of a diffusers pipeline directory or a preset (random weights: the preset's
    shapes, or the directory's configs and tokenizer)."""
    import torch

    from mstar.models.cosmos3.pipeline import Cosmos3Pipeline
    from mstar.models.cosmos3.prompt import Cosmos3Prompter, byte_tokenizer
    from mstar.models.layers.fp8 import apply_dit_fp8
    from mstar.models.wan.family import configure_vae, default_vae_dtype, random_vae
    from mstar.models.wan.scheduler import FlowUniPCScheduler

    dtype = dtype or torch.float32
    vae_dtype = vae_dtype or default_vae_dtype(dtype)  # Cosmos3OmniPipeline: one torch_dtype for all
    if os.path.isdir(name_or_dir):
        from transformers import AutoTokenizer
        cfg = config_from_dir(name_or_dir)
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(name_or_dir, "text_tokenizer"))
        if random_weights:
            transformer = random_transformer(cfg.transformer, seed, device, dtype)
            vae = random_vae(cfg.vae, seed + 1, device, vae_dtype)
        else:
            from mstar.models.cosmos3.weights import load_transformer
            from mstar.models.wan.vae_weights import load_wan_vae
            transformer = load_transformer(os.path.join(name_or_dir, "transformer"), device, dtype)
            vae = load_wan_vae(os.path.join(name_or_dir, "vae"), vae_dtype, device)
        scheduler = FlowUniPCScheduler.from_dir(os.path.join(name_or_dir, "scheduler"), flow_sigmas=cfg.flow_sigmas)
    else:
        from mstar.models.cosmos3.presets import get
        preset = random_weights_preset(get(name_or_dir), name_or_dir, random_weights, "Cosmos3",
                                       "diffusers pipeline directory")
        cfg = _make_config(preset)
        tokenizer = byte_tokenizer()
        transformer = random_transformer(cfg.transformer, seed, device, dtype)
        vae = random_vae(cfg.vae, seed + 1, device, vae_dtype)
        scheduler = FlowUniPCScheduler(cfg.scheduler, flow_sigmas=cfg.flow_sigmas)
    return Cosmos3Pipeline(apply_dit_fp8(transformer), configure_vae(vae), Cosmos3Prompter(tokenizer, cfg.use_system_prompt), scheduler,
                           max_batch=max_batch, **cfg.defaults())


FAMILY = register(Family(
    name="cosmos3", model_types=(MODEL_TYPE,), capabilities=frozenset({I.GENERATES_VIDEO, I.GENERATES_IMAGES}),
    presets=PRESETS, config_from_dir=config_from_dir, make_config=_make_config, pipeline=cosmos3_pipeline,
    pipeline_classes=PIPELINE_CLASSES))
