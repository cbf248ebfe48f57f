"""Packages whose public names load on first use, so that importing the package (and running
``vmemkv --help``) loads neither torch nor transformers: ``lazy_exports``."""

from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` (PEP 562) of ``package``, whose names ``exports`` maps
    each to the module defining it; a name, once loaded, is set on the package."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
