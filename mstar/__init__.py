"""mstar: a kernel-centric research framework for multimodal inference."""

__version__ = "0.1.0"


def __getattr__(name):
    # The offline API pulls in the runtime; import it only when asked for.
    if name in ("LLM", "SamplingParams"):
        from mstar.runtime.engine import llm
        return getattr(llm, name)
    raise AttributeError(name)
