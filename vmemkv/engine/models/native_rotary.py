"""Llama's rotary position embedding as one native call on float32 or bfloat16 rows (``native/rotary.c``, the
``vmemkv._rotary`` extension), for a model the engine loaded itself on the CPU.

transformers computes ``q * cos + rotate_half(q) * sin`` (and the same for k) in eight tensor ops
each, on the projections' transposed views: at a 2,048-token prefill chunk of SmolLM2-135M that is
5.4 ms a layer at two threads (a sixth of the linears' time), at a 16-row decode step 31 µs. The
native call reads each element once and writes it once, and its result equals transformers' bit
for bit.

The hook is transformers' own: an attention class decorated with ``use_kernelized_func`` calls
the module-level ``apply_rotary_pos_emb`` through a private wrapper per instance
(``module._kernel_funcs``), the one the ``kernels`` package's ``kernelize`` swaps for a hub kernel.
``swap_rotaries`` puts a ``NativeRotary`` there where the wrapped function is Llama's own code
(Llama, Qwen2/3, Mistral, SmolLM2 share it); where the hook is missing (another transformers) the
model runs as it is.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from transformers.models.llama import modeling_llama

from vmemkv.engine.models.native_norm import same_code


@functools.cache
def _extension():
    try:
        from vmemkv import _rotary
    except ImportError:
        return None
    return _rotary


def unavailable() -> str:
    """"" when the native rotary embedding can run, else why not."""
    if _extension() is None:
        return ("the native rotary embedding (vmemkv._rotary) is not built: reinstall with a C "
                "compiler that has OpenMP (pip install -e .)")
    return ""


def plain_function(rotary) -> types.FunctionType | None:
    """The function behind transformers' ``apply_rotary_pos_emb``: itself, or the one its
    hub-kernel wrapper (a module whose ``forward`` closes over ``func``) calls."""
    if isinstance(rotary, types.FunctionType):
        return rotary
    forward = getattr(type(rotary), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "func" not in code.co_freevars:
        return None
    function = forward.__closure__[code.co_freevars.index("func")].cell_contents
    return function if isinstance(function, types.FunctionType) else None


def is_llama_rotary(rotary) -> bool:
    """Whether ``rotary`` (a function or its hub-kernel wrapper) is Llama's rotary code."""
    function, llama = plain_function(rotary), plain_function(modeling_llama.apply_rotary_pos_emb)
    return function is not None and llama is not None and same_code(function.__code__, llama.__code__)


NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native_layout(x: torch.Tensor, tokens: int, dim: int, dtype: torch.dtype) -> bool:
    """A CPU ``[1, heads, tokens, dim]`` tensor of ``dtype`` whose head rows are contiguous."""
    return (x.dtype == dtype and x.device.type == "cpu" and x.dim() == 4 and x.shape[0] == 1
            and x.shape[2] == tokens and x.shape[3] == dim and x.stride(3) == 1)


class NativeRotary:
    """In place of the rotary a Llama-style attention calls, for float32 or bfloat16 rows on the CPU in one
    sequence (the engine's packed batch); other inputs go to the function it replaces. The hook
    calls it and reads its ``forward`` (for compiled graphs), as of the wrapper it stands in for."""

    def __init__(self, function):
        self.function = function

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        tokens, dim, dtype = q.shape[-2], q.shape[-1], q.dtype
        tables = all(t.dtype == dtype and t.device.type == "cpu" and t.shape == (1, tokens, dim)
                     and t.is_contiguous() for t in (cos, sin))
        if not (dtype in NATIVE_DTYPES and unsqueeze_dim == 1 and dim % 2 == 0 and tables
                and _native_layout(q, tokens, dim, dtype) and _native_layout(k, tokens, dim, dtype)):
            return self.function(q, k, cos, sin, unsqueeze_dim)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)  # the inputs' layout (the projections')
        _extension().rotary(q.data_ptr(), k.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), cos.data_ptr(),
                            sin.data_ptr(), tokens, dim, q.shape[1], q.stride(2), q.stride(1), k.shape[1],
                            k.stride(2), k.stride(1), q_out.stride(2), q_out.stride(1), k_out.stride(2),
                            k_out.stride(1), torch.get_num_threads(), dtype == torch.bfloat16)
        return q_out, k_out

    __call__ = forward


def kernel_funcs(module: nn.Module) -> dict:
    """The module's private wrappers of the functions its forward calls (transformers' per-instance
    hook, ``use_kernelized_func``), by name; empty where it has none."""
    funcs = module.__dict__.get("_kernel_funcs")
    return funcs if isinstance(funcs, dict) else {}


def swap_rotaries(model: nn.Module) -> int:
    """Route every Llama-style rotary of ``model``'s attention modules to a ``NativeRotary``;
    returns how many (0 without the native build or transformers' per-instance hook)."""
    if unavailable():
        return 0
    swaps = [(funcs, name) for module in model.modules() for funcs in (kernel_funcs(module),)
             for name, function in funcs.items() if is_llama_rotary(function)]
    for funcs, name in swaps:
        funcs[name] = NativeRotary(plain_function(funcs[name]))
    return len(swaps)
