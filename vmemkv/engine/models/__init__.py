"""Models: the built-in model zoo (``zoo``), fetching weights (``hub``) and what vmemkv reads from
a Hugging Face model (``hf_support``: KV shapes, attention windows and chunks, what is supported),
and linear layers on packed weights for the CPU (``packed_linear``, over ``panel_linear``'s native kernel).
"""

import importlib


def __getattr__(name: str):
    # Before the concept folders this package was the module vmemkv/engine/models.py, now
    # ``zoo``: its names still import from here for one release.
    # (import_module, not ``from . import zoo``: that asks this hook for "zoo" before importing it)
    zoo = importlib.import_module("vmemkv.engine.models.zoo")

    if name.startswith("__") or not hasattr(zoo, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings
    warnings.warn(f"vmemkv.engine.models.{name} is now vmemkv.engine.models.zoo.{name}; the old "
                  "path goes in the next release", DeprecationWarning, stacklevel=2)
    return getattr(zoo, name)
