"""Which kernel a model's float32 weights are packed for on this machine: measured, not assumed.

Both packed kernels compute the same linear (``packed_linear.py``), but which is faster depends on
the CPU, not on the dtype alone. On an AMD EPYC (Zen 4) the native panels read a decode step's
weights 1.2-1.7x faster than oneDNN's packed weights for 1-8 rows and match them from 16 rows up;
on an Intel Xeon (2.6 GHz, AVX-512, 48 MB L3) they took 1.4x oneDNN's time for a 16-sequence
decode step of SmolLM2-135M at two threads (148 against 106 ms) and 1.2x for a 2,048-token
prefill step. So when both can run, the engine times them once at its start on the model's own
first layers, enough of them to stream from memory as a step does (twice the last-level cache),
at a decode batch's rows, and packs for the faster (``EngineConfig.linear_kernel="auto"``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from vmemkv.engine.models.packed_linear import KERNELS, PackedLinear, kernel_for, why_not_packed

ROWS = 16  # a decode step's batch
REPEATS = 3


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache's size (Linux sysfs), else ``default``."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=default)


def _first_linears(model: nn.Module, min_bytes: int) -> list[nn.Linear]:
    """The model's linear layers in order, as many as hold ``min_bytes`` of weights (or all)."""
    chosen, total = [], 0
    for module in model.modules():
        if type(module) is nn.Linear and total < min_bytes:
            chosen.append(module)
            total += module.weight.numel() * module.weight.element_size()
    return chosen


def time_kernels(model: nn.Module, rows: int = ROWS, min_bytes: int | None = None,
                 repeats: int = REPEATS) -> dict[str, float]:
    """Seconds of one pass of ``rows`` rows through the model's first linears (``min_bytes`` of
    weights, default twice the last-level cache), packed for each kernel; the best of
    ``repeats`` passes, alternating kernels so that drift on the machine hits both."""
    linears = _first_linears(model, min_bytes or 2 * last_level_cache_bytes())
    generator = torch.Generator().manual_seed(0)
    inputs = {layer.in_features: torch.randn(rows, layer.in_features, generator=generator)
              for layer in linears}
    passes: dict[str, list[float]] = {kernel: [] for kernel in KERNELS}
    with torch.inference_mode():
        packed = {kernel: [PackedLinear(layer, kernel) for layer in linears] for kernel in KERNELS}
        for _ in range(repeats + 1):  # the first pass warms up and is not counted
            for kernel, layers in packed.items():
                start = time.perf_counter()
                for layer in layers:
                    layer(inputs[layer.in_features])
                passes[kernel].append(time.perf_counter() - start)
    return {kernel: min(seconds[1:]) for kernel, seconds in passes.items()}


def choose_kernel(model: nn.Module, requested: str = "auto") -> tuple[str, str]:
    """(kernel, why): ``requested`` if not "auto"; else the one that can run for the model's
    dtype, or, where both can, the faster on this machine (``time_kernels``)."""
    if requested != "auto":
        return requested, "requested"
    weight = next(m.weight for m in model.modules() if type(m) is nn.Linear)
    kernel = kernel_for(weight.dtype)
    if kernel != "panels":  # oneDNN is the only one for this dtype or build
        return kernel, f"the only one for {weight.dtype}"
    if why_not_packed(model, "onednn"):
        return kernel, "oneDNN cannot run here"
    seconds = time_kernels(model)
    fastest = min(seconds, key=seconds.get)
    timings = ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in seconds.items())
    return fastest, f"faster here at {ROWS} rows: {timings}"
