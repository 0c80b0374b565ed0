"""mstar's runtime: engine core, scheduler, caches, sampler, offline API and server.

`from mstar.runtime import LLM, SamplingParams, EngineConfig, EngineCore` (imported lazily,
so that `python -m mstar.runtime.knobs` and friends stay light).
"""

_LAZY = {
    "LLM": "mstar.runtime.engine.llm",
    "SamplingParams": "mstar.runtime.engine.request",
    "EngineRequest": "mstar.runtime.engine.request",
    "RequestError": "mstar.runtime.engine.request",
    "EngineConfig": "mstar.runtime.engine.config",
    "EngineCore": "mstar.runtime.engine.engine_core",
    "OutputProcessor": "mstar.runtime.engine.output_processor",
    "RequestOutput": "mstar.runtime.engine.output_processor",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(name)
    import importlib
    return getattr(importlib.import_module(mod), name)
