"""paged: multi-backend LLM serving with a paged KV cache.

This file (core/_root/paged/__init__.py) is installed as ``paged/__init__.py`` (see pyproject.toml); the
subpackages live in the repository's top-level core/, backends/, platforms/.
Public names are resolved lazily so ``import paged`` stays cheap and never
initialises a device runtime.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "paged.core.entrypoints.llm",
    "SamplingParams": "paged.core.engine.sampling_params",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'paged' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)


__all__ = ["LLM", "SamplingParams", "__version__"]
