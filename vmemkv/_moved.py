"""Modules that moved into the concept folders (``cache/``, ``memory/``, ``engine/core/`` ...):
their old dotted paths stay importable for one release, as the same module objects, with a
DeprecationWarning. ``install()`` puts the finder on ``sys.meta_path`` (``vmemkv/__init__.py``)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_CACHE = {"cache_config": "config", "cache_group": "group", "kv_memory": "memory", "kv_events": "events",
          "kv_metrics": "metrics", "attention_spec": "attention_spec", "window": "window",
          "layer_groups": "layer_groups", "hashing": "hashing", "pool": "pool", "host_tier": "host_tier",
          "swap": "swap", "allocation": "allocation", "request": "request", "plans": "plans",
          "manager_state": "manager_state", "manager": "manager", "sharing": "sharing",
          "preemption": "preemption", "lookahead": "lookahead"}
_CORE = ("llm_engine", "scheduler", "runner", "postprocess", "sequence", "sampler", "sampling_params",
         "config", "model_runner", "addressing", "lpm", "detokenizer", "metrics", "outputs", "threads",
         "llm", "chat")
_SERVING = ("server", "async_engine", "kv_event_publisher", "openai_inputs", "openai_outputs",
            "openai_protocol", "openai_stream")

MOVED = {f"vmemkv.{old}": f"vmemkv.cache.{new}" for old, new in _CACHE.items()}
MOVED |= {"vmemkv.layout": "vmemkv.memory.layout", "vmemkv.slots": "vmemkv.memory.slots",
          "vmemkv.hf_support": "vmemkv.engine.models.hf_support",
          "vmemkv.engine.hub": "vmemkv.engine.models.hub"}
MOVED |= {f"vmemkv.engine.{name}": f"vmemkv.engine.core.{name}" for name in _CORE}
MOVED |= {f"vmemkv.engine.{name}": f"vmemkv.engine.serving.{name}" for name in _SERVING}
# the transformers adapter moved out of the package, to integrations/vmemkv_transformers
MOVED |= {"vmemkv.integrations": "vmemkv_transformers"}
MOVED |= {f"vmemkv.integrations.transformers_{name}": f"vmemkv_transformers.{name}"
          for name in ("cache", "layer", "model", "prefix", "rows")}
# packages moved whole: every module under them
MOVED_PACKAGES = {"vmemkv.vmm": "vmemkv.memory.vmm"}


def new_name(old: str) -> str | None:
    """Where module ``old`` lives now, or None if it did not move."""
    if old in MOVED:
        return MOVED[old]
    for package, target in MOVED_PACKAGES.items():
        if old == package or old.startswith(package + "."):
            return target + old[len(package):]
    return None


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path (imported once, one object)."""

    def __init__(self):
        self._own: dict[str, tuple] = {}

    def find_spec(self, fullname, path=None, target=None):
        if new_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(new_name(spec.name))
        self._own[module.__name__] = (module.__spec__, module.__loader__, spec.name)
        return module

    def exec_module(self, module):
        # the import system just set the module's spec to the old name's: give it back its own
        module.__spec__, module.__loader__, old = self._own.pop(module.__name__)
        warnings.warn(f"{old} is now {module.__name__}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)


def install() -> None:
    # first on the path: under an old package's name (vmemkv.vmm), the path finder would find its
    # modules again by their files and load a second copy
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
