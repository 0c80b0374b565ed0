"""The Orpheus TTS family: a Llama LM that samples SNAC audio tokens (mstar/models/llama), whose
tokens feed a streaming SNAC codec stage (codec_stage.py); served on /v1/audio/speech.

Checkpoints: an Orpheus directory is a Llama checkpoint (model_type "llama") with Orpheus's
vocabulary (156940 ids); `detect` claims it. Its codec is a SNAC directory in the release's layout
(config.json + pytorch_model.bin): EngineConfig.codec (`--codec DIR`), else a `snac` directory
inside the model's or a `snac*` directory beside it. The presets run random weights with a SNAC
preset as the codec, and (having no checkpoint tokenizer) the built-in byte tokenizer.

Sampling: the release's defaults (tokens.py DEFAULT_SAMPLING), seeded by the request's seed, and
restricted at every position to the audio tokens of that frame position (plus end of speech at a
frame boundary): every window then decodes, where the release would drop a window that holds a
token of the wrong range. With trained weights such tokens are rare; with random weights (the
benchmarks) this is what makes the output audio of the asked length. The engine hooks that do it
(hooks.py) load with the engine; this declaration imports neither torch nor the op layer.
"""

from __future__ import annotations

import glob
import os

from mstar.models import interfaces as I
from mstar.models.llama.family import _from_dir, _make_config, _model_class
from mstar.models.orpheus.presets import CODEC_PRESETS, ORPHEUS_VOCAB, PRESETS
from mstar.models.presets import Preset
from mstar.models.registry import Family, register


def _detect(raw: dict) -> bool:
    return raw.get("model_type") == "llama" and raw.get("vocab_size") == ORPHEUS_VOCAB


def _preset_tokenizer(preset: Preset):
    from mstar.models.tokenizer import byte_tokenizer
    return byte_tokenizer()


def find_codec(name_or_dir: str, codec: str | None) -> str:
    """The codec's directory or SNAC preset name (see the module docstring)."""
    if codec:
        return codec
    if name_or_dir in CODEC_PRESETS:
        return CODEC_PRESETS[name_or_dir]
    inside = os.path.join(name_or_dir, "snac")
    found = [inside] if os.path.isfile(os.path.join(inside, "config.json")) else []
    parent = os.path.dirname(os.path.abspath(name_or_dir))
    found += sorted(d for d in glob.glob(os.path.join(parent, "snac*")) if os.path.isfile(os.path.join(d, "config.json")))
    if not found:
        raise ValueError(f"codec: no SNAC codec for {name_or_dir!r} (looked for {inside!r} and snac* beside it); "
                         "pass its directory with --codec")
    return found[0]


def _engine_hooks(model, engine_config):
    from mstar.models.orpheus.hooks import OrpheusHooks
    return OrpheusHooks(model, engine_config)


FAMILY = register(Family(
    name="orpheus", model_types=(), capabilities=frozenset({I.SYNTHESIZES_SPEECH}),
    presets=PRESETS, config_from_dir=_from_dir, make_config=_make_config, model_class=_model_class,
    preset_tokenizer=_preset_tokenizer, engine_hooks=_engine_hooks, detect=_detect))
