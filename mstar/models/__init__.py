"""mstar's models: the families on mstar.ops, with the checkpoint loader, presets and tokenizers.

    load_model(name_or_dir, dtype=..., device=..., random_weights=False, seed=0)
    load_tokenizer(name_or_dir)
    resolve_config(name_or_dir)

The runtime talks to a model only through the API of `DecoderLM` (base.py) and the
per-step contract of context.py. Models never import the runtime.

The loader's names are imported on first use: `import mstar.models.presets` (what the API
process and the engine's configuration read) does not pull in torch or the op layer.
"""

from mstar.models.presets import DEFAULT_MODEL

# name -> the module that defines it (the tokenizer and config readers need neither torch nor the ops)
_LAZY = {"load_model": "loader", "build_model": "loader", "WeightLoadError": "loader",
         "load_tokenizer": "tokenizer", "resolve_config": "registry"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"mstar.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mstar.models' has no attribute {name!r}")


__all__ = ["load_model", "load_tokenizer", "resolve_config", "build_model", "WeightLoadError", "DEFAULT_MODEL"]
