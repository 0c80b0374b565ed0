"""mstar's models: Qwen3.5 (hybrid Gated DeltaNet / attention) and Qwen3 (dense) on
mstar.ops, with the checkpoint loader, presets and tokenizers.

    load_model(name_or_dir, dtype=..., device=..., random_weights=False, seed=0)
    load_tokenizer(name_or_dir)
    resolve_config(name_or_dir)

The runtime talks to a model only through the API of `DecoderLM` (base.py) and the
per-step contract of context.py. Models never import the runtime.
"""

from mstar.models.loader import WeightLoadError, build_model, load_model, load_tokenizer, resolve_config
from mstar.models.presets import DEFAULT_MODEL

__all__ = ["load_model", "load_tokenizer", "resolve_config", "build_model", "WeightLoadError", "DEFAULT_MODEL"]
