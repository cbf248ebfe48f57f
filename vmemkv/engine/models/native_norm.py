"""Llama's RMSNorm as one native call on float32 or bfloat16 rows (``native/rms_norm.c``, the
``vmemkv._rms_norm`` extension), for a model the engine loaded itself on the CPU.

A decode step runs two norms per layer on a few rows, and transformers' module runs six tensor
ops for each (the cast, square, mean, rsqrt and two products), plus its hub-kernel wrapper:
about 50 µs a call on a 2.6 GHz Xeon, 3 ms of a long-context step of SmolLM2-135M (61 norms);
this module takes about 15 µs, its call included. ``swap_rms_norms`` replaces only norms whose ``forward`` is
Llama's own code (Llama, Qwen2/3, Mistral, SmolLM2 share it; Gemma's adds one to its weight and is
left alone). Results equal the module's up to float rounding (another summation order; in
bfloat16 the native routine rounds where the module's tensor ops round).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm


NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _extension():
    try:
        from vmemkv import _rms_norm
    except ImportError:
        return None
    return _rms_norm


def unavailable() -> str:
    """"" when the native norm can run, else why not."""
    if _extension() is None:
        return ("the native RMS norm (vmemkv._rms_norm) is not built: reinstall with a C compiler "
                "that has OpenMP (pip install -e .)")
    return ""


def same_code(a, b) -> bool:
    """Whether two code objects are the same code (a modular copy in another model's file is)."""
    return (a.co_code, a.co_names, a.co_consts) == (b.co_code, b.co_names, b.co_consts)


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` computes Llama's RMSNorm: its class's ``forward`` is that code (a
    modular copy in another model's file counts) over a 1-D float32 or bfloat16 CPU weight."""
    forward = getattr(type(module).forward, "__code__", None)
    weight = getattr(module, "weight", None)
    return (forward is not None and same_code(forward, LlamaRMSNorm.forward.__code__)
            and isinstance(getattr(module, "variance_epsilon", None), float)
            and isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.dtype in NATIVE_DTYPES
            and weight.device.type == "cpu")


class NativeRMSNorm(nn.Module):
    """In place of a Llama-style RMSNorm (``is_llama_rms_norm``), sharing its weight."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self.size = norm.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype != weight.dtype or x.device.type != "cpu" or x.shape[-1] != self.size \
                or not x.is_contiguous() or not weight.is_contiguous():
            return LlamaRMSNorm.forward(self, x)  # what the model's module computes, in tensor ops
        out = torch.empty_like(x)
        _extension().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // self.size,
                              self.size, self.variance_epsilon, torch.get_num_threads(),
                              x.dtype == torch.bfloat16)
        return out

    def extra_repr(self) -> str:
        return f"{self.size}, eps={self.variance_epsilon}, native"


def swap_rms_norms(model: nn.Module) -> int:
    """Replace every Llama-style RMSNorm of ``model`` by a ``NativeRMSNorm``; returns how many
    (0 without the native build)."""
    if unavailable():
        return 0
    swaps = [(parent, name, NativeRMSNorm(child)) for parent in model.modules()
             for name, child in parent.named_children() if is_llama_rms_norm(child)]
    for parent, name, norm in swaps:
        setattr(parent, name, norm)
    return len(swaps)
