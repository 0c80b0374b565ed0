"""Named model configurations: the `Preset` record every family's table is made of, the ids of
the built-in byte tokenizer the tiny embedded models use, and lookups over the registered
families (registry.py): `get(name)`, `names()`, `make_config(preset)`, `PRESETS`.

The tables themselves live with their families (mstar/models/<family>/presets.py).
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Any


# ids of the embedded byte tokenizer (tokenizer.py): 256 bytes, then the specials
TINY_VOCAB = 259
TINY_ENDOFTEXT, TINY_IM_START, TINY_IM_END = 256, 257, 258


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str  # the config's model_type ("qwen3_5_text", "qwen3", "whisper", ...)
    config: dict[str, Any]
    embedded: bool = False  # tiny built-in model: random weights + byte tokenizer
    init_std: float | None = None  # random-init std (None: config.initializer_range)
    note: str = ""


DEFAULT_MODEL = "tiny-qwen3.5"


def get(name: str) -> Preset | None:
    from mstar.models import registry
    return registry.preset(name)


def random_weights_preset(preset: Preset | None, name: str, random_weights: bool, family: str,
                          layout: str) -> Preset:
    """`preset` (a family's lookup of `name`) when it can be built: it exists and has random
    weights asked for, or is embedded; else the ValueError a user sees (`layout`: what the
    family's checkpoint directory is)."""
    if preset is None:
        raise ValueError(f"{name!r} is neither a {family} {layout} nor a {family} preset")
    if not (random_weights or preset.embedded):
        raise ValueError(f"preset {preset.name!r} has random weights only: pass random_weights=True "
                         f"(--random-weights), or a {layout}")
    return preset


def names() -> list[str]:
    from mstar.models import registry
    return list(registry.presets())


def make_config(preset: Preset):
    """The config object (a transformers config) of a preset, made by its family."""
    from mstar.models import registry
    return registry.family_of_preset(preset).make_config(preset)


def __getattr__(name):  # PRESETS: every registered preset by name (a fresh dict)
    if name == "PRESETS":
        from mstar.models import registry
        return registry.presets()
    raise AttributeError(name)
