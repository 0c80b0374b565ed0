"""The model registry: every family registers what it is and how to build it; the loader, the
tokenizer lookup, the presets and the runtime ask the registry, never a family by name.

    family = registry.family_of("qwen3.5-0.8b")    # a preset name or a checkpoint directory
    family.capabilities                            # interfaces.py names
    family.model_class(config), family.config_from_dir(path, raw_config)

Families built in: qwen3_5, qwen3, llama, orpheus, whisper, kokoro, wan, cosmos3, qwen3_tts (each a package `mstar/models/<family>/`
whose `family.py` calls `register`). More come from plugins: MSTAR_MODEL_PLUGINS names modules that
call `register` when imported (read once, at the first lookup; spawned engine processes read
the same environment).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from mstar import knobs
from mstar.models.presets import Preset

_BUILTIN = ("mstar.models.qwen3_5.family", "mstar.models.qwen3.family", "mstar.models.llama.family",
            "mstar.models.orpheus.family", "mstar.models.whisper.family", "mstar.models.kokoro.family",
            "mstar.models.wan.family", "mstar.models.cosmos3.family", "mstar.models.qwen3_tts.family")
PIPELINE_INDEX = "model_index.json"  # a diffusers pipeline directory's (it has no config.json)


@dataclass(frozen=True)
class Family:
    """What the runtime needs to know of a model family.

    model_types: the `model_type` values of the checkpoints' config.json it reads.
    capabilities: interfaces.py names.
    presets: named configurations (random weights unless `embedded`: built-in tiny models).
    config_from_dir(path, raw) -> config; make_config(preset) -> config.
    model_class(config) -> the nn.Module class the loader builds (token generators: DecoderLM).
    preset_tokenizer(preset) -> a tokenizer for a preset (None: presets have none built in);
    a checkpoint directory's tokenizer is transformers' AutoTokenizer.
    engine_hooks(model, engine_config) -> the family's runtime hooks (interfaces.EngineHooks), or
    None; engine_config: the engine's settings (model, codec, device, dtype, random_weights, seed).
    pipeline(name_or_dir, dtype, device, random_weights, seed, max_batch) -> interfaces.Pipeline, for
    families that are not autoregressive (their stages run on the stage engine; max_batch: the most
    requests the engine runs at once, --max-num-seqs); None for token generators.
    transcriber(vocab_size, tokenizer) -> TRANSCRIBES families: what the transcription routes plan
    their requests with (mstar/models/whisper/transcription.py shows the methods they call).
    detect(raw config.json) -> True: the family claims the checkpoint before the model_type lookup
    (a family whose checkpoints have another family's model_type: Orpheus is a Llama checkpoint).
    pipeline_classes: the `_class_name`s of the diffusers pipeline directories it reads (their
    model_index.json stands for config.json: read_config_json returns it, config_from_dir gets it).
    """
    name: str
    model_types: tuple[str, ...]
    capabilities: frozenset[str]
    presets: tuple[Preset, ...] = ()
    config_from_dir: Callable[[str, dict], Any] | None = None
    make_config: Callable[[Preset], Any] | None = None
    model_class: Callable[[Any], type] | None = None
    preset_tokenizer: Callable[[Preset], Any] | None = None
    engine_hooks: Callable[[Any, Any], Any] | None = None
    pipeline: Callable[..., Any] | None = None
    transcriber: Callable[[int, Any], Any] | None = None
    detect: Callable[[dict], bool] | None = None
    pipeline_classes: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)


_FAMILIES: dict[str, Family] = {}
_loaded = False


def register(family: Family) -> Family:
    """Add (or replace) a family; its presets and model types must not belong to another."""
    for other in _FAMILIES.values():
        if other.name == family.name:
            continue
        clash = set(other.model_types) & set(family.model_types)
        clash |= set(other.pipeline_classes) & set(family.pipeline_classes)
        clash |= {p.name for p in other.presets} & {p.name for p in family.presets}
        if clash:
            raise ValueError(f"family {family.name!r}: {sorted(clash)} already belong to {other.name!r}")
    _FAMILIES[family.name] = family
    return family


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _BUILTIN:
        importlib.import_module(mod)
    for mod in (m.strip() for m in str(knobs.value("MSTAR_MODEL_PLUGINS")).split(",")):
        if mod:
            importlib.import_module(mod)


def families() -> list[Family]:
    _load()
    return list(_FAMILIES.values())


def get_family(name: str) -> Family:
    _load()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r} (known: {', '.join(_FAMILIES)})") from None


def presets() -> dict[str, Preset]:
    """Every registered preset by name."""
    return {p.name: p for f in families() for p in f.presets}


def preset(name: str) -> Preset | None:
    return presets().get(name.lower())


def family_of_preset(p: Preset) -> Family:
    for f in families():
        if any(q.name == p.name for q in f.presets):
            return f
    raise ValueError(f"preset {p.name!r} belongs to no registered family")


def read_config_json(path: str) -> dict:
    """A checkpoint directory's config.json, or a diffusers pipeline directory's model_index.json."""
    for name in ("config.json", PIPELINE_INDEX):
        cfg_path = os.path.join(path, name)
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                return json.load(f)
    raise FileNotFoundError(f"{path!r} has no config.json (nor a diffusers {PIPELINE_INDEX})")


def family_of_model_type(model_type: str) -> Family:
    for f in families():
        if model_type in f.model_types:
            return f
    known = sorted(t for f in families() for t in f.model_types)
    raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(known)})")


def checkpoint_model_type(raw: dict) -> str:
    """The model_type that picks a checkpoint's family: a multimodal checkpoint whose family is
    not registered as a whole is read through its `text_config`."""
    mt = raw.get("model_type", "")
    if any(mt in f.model_types for f in families()):
        return mt
    text = raw.get("text_config")
    if isinstance(text, dict):
        return text.get("model_type", mt)
    return mt


def family_of_checkpoint(raw: dict) -> Family:
    """The family of a checkpoint's config.json: one whose `detect` claims it, else by model_type
    (a diffusers model_index.json: the family listing its `_class_name` in pipeline_classes)."""
    cls = raw.get("_class_name")
    if isinstance(cls, str) and "model_type" not in raw:
        for f in families():
            if cls in f.pipeline_classes:
                return f
    for f in families():
        if f.detect is not None and f.detect(raw):
            return f
    return family_of_model_type(checkpoint_model_type(raw))


def family_of(name_or_dir: str) -> Family:
    """The family of a checkpoint directory (its config.json or model_index.json) or a preset name."""
    if os.path.isdir(name_or_dir):
        return family_of_checkpoint(read_config_json(name_or_dir))
    p = preset(name_or_dir)
    if p is None:
        raise ValueError(f"{name_or_dir!r} is neither a directory nor a preset; presets: {', '.join(presets())}")
    return family_of_preset(p)


def family_of_config(config) -> Family:
    return family_of_model_type(getattr(config, "model_type", ""))


def resolve_config(name_or_dir: str):
    """The config (a transformers config object) of a directory or preset, read by its family."""
    from mstar.models import presets
    if os.path.isdir(name_or_dir):
        raw = read_config_json(name_or_dir)
        return family_of_checkpoint(raw).config_from_dir(name_or_dir, raw)
    p = presets.get(name_or_dir)
    if p is None:
        raise ValueError(f"{name_or_dir!r} is neither a directory nor a preset; presets: "
                         f"{', '.join(presets.names())}")
    return presets.make_config(p)
