"""Float32 linear layers through vmemkv's native kernel over a weight packed in panels of 16
outputs (``native/panel_linear.c``, the ``vmemkv._panel_linear`` extension).

A decode step's few rows make the GEMM a read of the whole weight: the panel layout is one
sequential stream, prefetched ahead, which reads faster than oneDNN's packed weights do. Over
SmolLM2-135M's 30 decoder layers and LM head (538 MB, streamed from memory), oneDNN takes
1.2-1.7x the panels' time for 1-8 rows on one thread (1.4-2.1x on two), 1.0-1.3x for 16-32 rows,
and 0.96-1.05x at prefill sizes (``experiments/bench_packed_linear.py --panels``,
``experiments/results/packed_linear_panels_*t_cpu.md``). ``unavailable()`` says why it cannot run
here.
"""

from __future__ import annotations

import functools
import os

import torch

PANEL = 16  # outputs per panel: one 64-byte line of float32 per input feature


@functools.cache
def _extension():
    try:
        from vmemkv import _panel_linear
    except ImportError:
        return None
    return _panel_linear


def unavailable(dtype: torch.dtype | None = None) -> str:
    """"" when the kernel can run (for weights of ``dtype``), else why not."""
    if _extension() is None:
        return ("the native panel linear (vmemkv._panel_linear) is not built: reinstall with a C "
                "compiler that has OpenMP (pip install -e .)")
    if dtype is not None and dtype != torch.float32:
        return f"the native panel linear is float32 only, the weight is {dtype}"
    return ""


def build_id() -> str:
    """Which build of the extension this is (its file's size and time), for measurements kept
    across starts: a rebuilt kernel is timed again."""
    extension = _extension()
    if extension is None:
        return "none"
    stat = os.stat(extension.__file__)
    return f"{stat.st_size}-{stat.st_mtime_ns}"


HINTS = ("nta", "t0")


def prefetch_hint(hint: str | None = None) -> str:
    """How the kernel prefetches a weight's first pass: "nta" (non-temporal, the default) or "t0"
    (into every cache level); which is faster depends on the CPU (``native/panel_linear.c``), and
    the engine times both (``kernel_choice.py``). With ``hint``, set it (for the whole process);
    returns the hint before."""
    if hint is not None and hint not in HINTS:
        raise ValueError(f"prefetch hint {hint!r}: one of {HINTS}")
    return _extension().prefetch_hint(*(() if hint is None else (hint,)))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` (float32, on the CPU) as panels ``[ceil(N / 16), K, 16]``: panel ``p``
    holds outputs ``16p .. 16p + 15`` for every input feature; outputs past ``N`` are zeros."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"panels pack a 2-D float32 CPU weight, not {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x W^T + b`` for ``x`` ``[..., K]`` (float32, CPU), ``W`` packed by ``pack`` and ``bias`` a
    contiguous float32 ``[N]`` or None (``PackedLinear`` makes them so once; not checked per
    call); on torch's intra-op threads."""
    in_features = panels.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != in_features or x.device.type != "cpu":
        raise ValueError(f"input {x.dtype} [..., {x.shape[-1]}] on {x.device} for a float32 CPU weight "
                         f"of {in_features} inputs")
    rows = x.reshape(-1, in_features).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    _extension().linear(rows.data_ptr(), panels.data_ptr(), 0 if bias is None else bias.data_ptr(),
                        out.data_ptr(), rows.shape[0], out_features, in_features, torch.get_num_threads())
    return out.reshape(*x.shape[:-1], out_features)
