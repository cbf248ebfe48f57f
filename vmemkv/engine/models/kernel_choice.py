"""Which kernel a model's float32 or bfloat16 weights are packed for on this machine: measured, not assumed.

Both packed kernels compute the same linear (``packed_linear.py``), but which is faster depends on
the CPU, not on the dtype alone, and so does the native panels' prefetch hint
(``native/panel_linear.c``). Over SmolLM2-135M's first layers (96 MB) at two threads on an Intel
Xeon (2.6 GHz, AVX-512, 48 MB L3), in ms for 16 / 256 / 2,048 rows: panels with T0 prefetches
10.4 / 88.5 / 629, panels with non-temporal prefetches 20.8 / 103 / 600, oneDNN's packed weights
15.3 / 70.4 / 438 (panels/T0 10.5 / 87-93 at 16 / 256 rows once the hint left the inner loop,
oneDNN 16.4 / 82-84): neither is fastest at every size. On an AMD EPYC (Zen 4) the panels with
non-temporal prefetches read a decode step's weights 1.2-1.7x faster than oneDNN for 1-8 rows
and matched it at prefill sizes. So when the panels can run, the engine times each candidate once
at its start on the model's own first layers, enough of them to stream from memory as a step
does (twice the last-level cache), for a decode batch and a prefill chunk (16 and 256 rows)
(``EngineConfig.linear_kernel="auto"``, 1-8 s on two cores). The times are kept per machine
(``machine_cache.py``), so only an engine's first start on a machine, thread count and model
shape measures them. Where the panels win the decode batch
and oneDNN the prefill chunk, and a second packing of the weights fits in an eighth of the
machine's memory, both are kept ("split": panels below 64 rows, oneDNN from there); else the
candidate of least total time. ``"panels"`` and ``"split"`` asked for time the two hints only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

from vmemkv.engine.models import machine_cache, panel_linear
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
                 min_bytes: int | None = None, repeats: int = REPEATS) -> dict[tuple[str, str | None], tuple]:
    """Seconds of one pass through the model's first linears (``min_bytes`` of weights, default
    twice the last-level cache) for each (kernel, prefetch hint), one per entry of ``rows``
    (inputs of that many rows): each the best of ``repeats`` passes, alternating candidates so
    that drift on the machine hits each. The panels' hint is as before when it returns."""
    linears = _first_linears(model, min_bytes or 2 * last_level_cache_bytes())
    hint_before = panel_linear.prefetch_hint() if any(hint for _, hint in candidates) else None
    try:
        with torch.inference_mode():  # each layer packed once per kernel, for every row count
            packed = {kernel: [PackedLinear(layer, kernel) for layer in linears]
                      for kernel in {kernel for kernel, _ in candidates}}
            per_rows = [_time_at(packed, candidates, count, repeats) for count in rows]
    finally:
        if hint_before:
            panel_linear.prefetch_hint(hint_before)
    return {candidate: tuple(times) for candidate, times in zip(candidates, zip(*per_rows))}


def _time_at(packed: dict[str, list[PackedLinear]], candidates, rows: int, repeats: int) -> list[float]:
    """``time_kernels`` for one row count: a time per candidate, in order."""
    generator = torch.Generator().manual_seed(0)
    inputs = {layer.in_features: torch.randn(rows, layer.in_features, generator=generator).to(layer.weight.dtype)
              for layer in next(iter(packed.values()))}
    passes: dict[tuple[str, str | None], list[float]] = {candidate: [] for candidate in candidates}
    for _ in range(repeats + 1):  # the first pass warms up and is not counted
        for kernel, hint in candidates:
            if hint:
                panel_linear.prefetch_hint(hint)
            start = time.perf_counter()
            for layer in packed[kernel]:
                layer(inputs[layer.in_features])
            passes[kernel, hint].append(time.perf_counter() - start)
    return [min(seconds[1:]) for seconds in passes.values()]


def fits_twice(model: nn.Module, share: int = 8) -> bool:
    """Whether a second packing of the model's linear weights takes at most 1/``share`` of the
    machine's memory."""
    weights = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is nn.Linear)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return weights * share <= memory


def remembered_times(model: nn.Module, candidates) -> tuple[dict[tuple[str, str | None], tuple], str | None]:
    """``time_kernels(model, candidates)``, read from this machine's earlier measurement of the same
    shapes, threads and builds where there is one: (times, when measured, or None if just now)."""
    linears = _first_linears(model, 2 * last_level_cache_bytes())
    key = {"candidates": [list(c) for c in candidates], "rows": list(ROWS), "repeats": REPEATS,
           "shapes": [list(layer.weight.shape) for layer in linears], "dtype": str(linears[0].weight.dtype),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "panels": panel_linear.build_id()}

    def measure():
        return [[*candidate, list(times)] for candidate, times in time_kernels(model, candidates).items()]

    rows, measured = machine_cache.remembered("linear-kernel-times", key, measure, threads=torch.get_num_threads())
    return {(kernel, hint): tuple(times) for kernel, hint, times in rows}, measured


def choose_kernel(model: nn.Module, requested: str = "auto") -> tuple[str, str | None, str]:
    """(kernel, the panels' prefetch hint or None, why). "onednn" as requested, or the only kernel
    that can run for the model's dtype; "panels" and "split" with the faster hint at a decode
    batch; "auto": ``time_kernels`` at a decode batch and a prefill chunk, and "split" where the
    panels win the first and oneDNN the second and both packings fit (``fits_twice``), else the
    least total."""
    weight = next(m.weight for m in model.modules() if type(m) is nn.Linear)
    if requested == "onednn" or kernel_for(weight.dtype) != "panels":
        return "onednn", None, "requested" if requested == "onednn" else f"the only one for {weight.dtype}"
    onednn_runs = requested == "auto" and not why_not_packed(model, "onednn")
    seconds, measured = remembered_times(model, CANDIDATES if onednn_runs else PANELS)
    timings = ", ".join(f"{label(*candidate)} {' / '.join(f'{1e3 * t:.1f}' for t in times)} ms"
                        for candidate, times in seconds.items())
    why = f"at {' / '.join(map(str, ROWS))} rows: {timings}" + (f" (measured {measured})" if measured else "")
    decode = min(seconds, key=lambda candidate: seconds[candidate][0])
    if requested != "auto":
        return requested, decode[1], f"requested; {why}"
    prefill = min(seconds, key=lambda candidate: seconds[candidate][-1])
    if decode[0] == "panels" and prefill[0] == "onednn" and fits_twice(model):
        return "split", decode[1], f"panels fastest at the first, oneDNN at the last: both packed; {why}"
    kernel, hint = min(seconds, key=lambda candidate: sum(seconds[candidate]))
    return kernel, hint, f"least total {why}"
