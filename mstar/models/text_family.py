"""What the decoder-only text families share: reading a Hugging Face text checkpoint's config
(multimodal checkpoints: their `text_config`), the eos ids of generation_config.json, and the
byte tokenizer of the tiny embedded presets."""

from __future__ import annotations

import json
import os

from mstar.models.presets import Preset


def eos_ids(*values) -> tuple[int, ...]:
    """The distinct ids of several eos fields (an int, a list or None each), in order."""
    out: list[int] = []
    for v in values:
        if v is None:
            continue
        for x in ([v] if isinstance(v, int) else v):
            if int(x) not in out:
                out.append(int(x))
    return tuple(out)


def text_config_from_dir(path: str, raw: dict, config_class, model_type: str | None = None):
    """The text config of a checkpoint's config.json (`raw`): a multimodal checkpoint's
    `text_config` (with the top-level eos / bos / pad ids and tie_word_embeddings), else the whole
    file. eos_token_id merges generation_config.json's, the text config's and the top level's."""
    if isinstance(raw.get("text_config"), dict):
        text = dict(raw["text_config"])
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if key not in text and key in raw:
                text[key] = raw[key]
        if "tie_word_embeddings" in raw:  # the top-level model ties (or not) the head
            text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    else:
        text = dict(raw)
    text.pop("architectures", None)
    if model_type is not None:
        text["model_type"] = model_type
    cfg = config_class.from_dict(text)
    gen_path = os.path.join(path, "generation_config.json")
    gen_eos = None
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
    cfg.eos_token_id = list(eos_ids(gen_eos, cfg.eos_token_id, raw.get("eos_token_id")))
    return cfg


def text_preset_tokenizer(preset: Preset):
    """The byte tokenizer for the tiny embedded presets; None for the full-size ones (their
    tokenizer comes with the checkpoint)."""
    if preset.embedded:
        from mstar.models.tokenizer import byte_tokenizer
        return byte_tokenizer()
    return None
