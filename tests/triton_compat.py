"""Triton 3.6's interpreter (the GPU image's Triton, run here on CPU) fails on a loop whose bound
was loaded from memory: its ``tensor.__index__`` calls ``int()`` on a one-element array, which
NumPy 2 refuses ("only 0-dimensional arrays can be converted to Python scalars"); later releases
squeeze the array first. Compiled kernels (on a GPU) never run this code. Patched here as later
releases have it, only where the installed interpreter still lacks it."""

from __future__ import annotations

import inspect


def patch_interpreter_index() -> bool:
    """Whether the installed interpreter needed (and got) the patch."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = interpreter._patch_lang_tensor
    if "squeeze" in inspect.getsource(original):
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
