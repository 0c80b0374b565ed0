"""mstar's runtime: engine core, scheduler, caches, sampler, offline API and server.

`from mstar.runtime import LLM, SamplingParams, EngineConfig, EngineCore` (imported lazily,
so that `python -m mstar.runtime.knobs` and friends stay light).
"""

_LAZY = {
    "LLM": "mstar.runtime.llm",
    "SamplingParams": "mstar.runtime.request",
    "EngineRequest": "mstar.runtime.request",
    "RequestError": "mstar.runtime.request",
    "EngineConfig": "mstar.runtime.config",
    "EngineCore": "mstar.runtime.engine_core",
    "OutputProcessor": "mstar.runtime.output_processor",
    "RequestOutput": "mstar.runtime.output_processor",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(name)
    import importlib
    return getattr(importlib.import_module(mod), name)
