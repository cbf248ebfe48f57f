"""Which kernel a model's float32 weights are packed for on this machine: measured, not assumed.

Both packed kernels compute the same linear (``packed_linear.py``), but which is faster depends on
the CPU, not on the dtype alone, and so does the native panels' prefetch hint
(``native/panel_linear.c``). Over SmolLM2-135M's first layers (96 MB) at two threads on an Intel
Xeon (2.6 GHz, AVX-512, 48 MB L3), in ms for 16 / 256 / 2,048 rows: panels with T0 prefetches
10.4 / 88.5 / 629, panels with non-temporal prefetches 20.8 / 103 / 600, oneDNN's packed weights
15.3 / 70.4 / 438; end to end oneDNN was the faster there on a prefill-heavy workload. On an AMD
EPYC (Zen 4) the panels with non-temporal prefetches read a decode step's weights 1.2-1.7x faster
than oneDNN for 1-8 rows and matched it at prefill sizes. So when the panels can run, the engine
times each candidate once at its start on the model's own first layers, enough of them to stream
from memory as a step does (twice the last-level cache), for a decode batch and a prefill chunk
(16 and 256 rows), and packs for the least total (``EngineConfig.linear_kernel="auto"``;
``"panels"`` times the two hints only).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from vmemkv.engine.models import panel_linear
from vmemkv.engine.models.packed_linear import PackedLinear, kernel_for, why_not_packed

ROWS = (16, 256)  # a decode batch and a prefill chunk
REPEATS = 2
PANELS = (("panels", "t0"), ("panels", "nta"))  # (kernel, prefetch hint)
CANDIDATES = (*PANELS, ("onednn", None))


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


def label(kernel: str, hint: str | None) -> str:
    return f"{kernel}/{hint}" if hint else kernel


def time_kernels(model: nn.Module, candidates=CANDIDATES, rows: tuple[int, ...] = ROWS,
                 min_bytes: int | None = None, repeats: int = REPEATS) -> dict[tuple[str, str | None], float]:
    """Seconds of one pass through the model's first linears (``min_bytes`` of weights, default
    twice the last-level cache) for each (kernel, prefetch hint), summed over inputs of ``rows``
    rows: for each, the best of ``repeats`` passes, alternating candidates so that drift on the
    machine hits each. The panels' hint is as before when it returns."""
    return {candidate: sum(seconds) for candidate, seconds in
            zip(candidates, zip(*(_time_at(model, candidates, count, min_bytes, repeats) for count in rows)))}


def _time_at(model: nn.Module, candidates, rows: int, min_bytes: int | None, repeats: int) -> list[float]:
    """``time_kernels`` for one row count: a time per candidate, in order."""
    linears = _first_linears(model, min_bytes or 2 * last_level_cache_bytes())
    generator = torch.Generator().manual_seed(0)
    inputs = {layer.in_features: torch.randn(rows, layer.in_features, generator=generator)
              for layer in linears}
    passes: dict[tuple[str, str | None], list[float]] = {candidate: [] for candidate in candidates}
    hint_before = panel_linear.prefetch_hint() if any(hint for _, hint in candidates) else None
    try:
        with torch.inference_mode():
            packed = {kernel: [PackedLinear(layer, kernel) for layer in linears]
                      for kernel in {kernel for kernel, _ in candidates}}
            for _ in range(repeats + 1):  # the first pass warms up and is not counted
                for kernel, hint in candidates:
                    if hint:
                        panel_linear.prefetch_hint(hint)
                    start = time.perf_counter()
                    for layer in packed[kernel]:
                        layer(inputs[layer.in_features])
                    passes[kernel, hint].append(time.perf_counter() - start)
    finally:
        if hint_before:
            panel_linear.prefetch_hint(hint_before)
    return [min(seconds[1:]) for seconds in passes.values()]


def choose_kernel(model: nn.Module, requested: str = "auto") -> tuple[str, str | None, str]:
    """(kernel, the panels' prefetch hint or None, why): the only kernel that can run for the
    model's dtype, or the fastest candidate here (``time_kernels``); "onednn" as requested, and
    "panels" with the faster hint."""
    weight = next(m.weight for m in model.modules() if type(m) is nn.Linear)
    if requested == "onednn" or kernel_for(weight.dtype) != "panels":
        return "onednn", None, "requested" if requested == "onednn" else f"the only one for {weight.dtype}"
    onednn_runs = requested == "auto" and not why_not_packed(model, "onednn")
    seconds = time_kernels(model, CANDIDATES if onednn_runs else PANELS)
    kernel, hint = min(seconds, key=seconds.get)
    timings = ", ".join(f"{label(*candidate)} {1e3 * s:.1f} ms" for candidate, s in seconds.items())
    return kernel, hint, ("requested; " if requested != "auto" else "") + f"fastest here at {' + '.join(map(str, ROWS))} rows: {timings}"
