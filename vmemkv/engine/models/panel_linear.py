"""Float32 and bfloat16 linear layers through vmemkv's native kernel over a weight packed in panels
of 16 outputs (``native/panel_linear.c``, the ``vmemkv._panel_linear`` extension).

A decode step's few rows make the GEMM a read of the whole weight: the panel layout is one
sequential stream, prefetched ahead, which reads faster than oneDNN's packed weights do. Over
SmolLM2-135M's 30 decoder layers and LM head (538 MB, streamed from memory), oneDNN takes
1.2-1.7x the panels' time for 1-8 rows on one thread (1.4-2.1x on two), 1.0-1.3x for 16-32 rows,
and 0.96-1.05x at prefill sizes (``experiments/bench_packed_linear.py --panels``,
``experiments/results/packed_linear_panels_*t_cpu.md``). bfloat16 weights (on CPUs with AVX-512
BF16) are packed with their input features in pairs, what ``vdpbf16ps`` multiplies: at 4 rows of
SmolLM2-135M's linears, two threads, an AMD EPYC without AMX, 22.6-24.5 GB/s of weights where
oneDNN's bfloat16 path reads 15.8-18.1. ``unavailable()`` says why it cannot run here.
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
    if dtype == torch.bfloat16 and not _extension().bf16_dots():
        return "the native panel linear takes bfloat16 with AVX-512 BF16, which this CPU lacks"
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        return f"the native panel linear is float32 and bfloat16 only, the weight is {dtype}"
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
    """``weight`` ``[N, K]`` (on the CPU) as panels: float32 ``[ceil(N / 16), K, 16]``, panel ``p``
    holding outputs ``16p .. 16p + 15`` for every input feature; bfloat16 ``[ceil(N / 16), ceil(K /
    2), 16, 2]``, the same for every pair of features (an odd K's last pair ends in a zero). Outputs
    past ``N`` are zeros."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"panels pack a 2-D float32 or bfloat16 CPU weight, not {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    if weight.dtype == torch.bfloat16:
        padded = weight.new_zeros(panels * PANEL, k + k % 2)
        padded[:n, :k] = weight
        return padded.view(panels, PANEL, -1, 2).transpose(1, 2).contiguous()
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           in_features: int | None = None) -> torch.Tensor:
    """``x W^T + b`` for ``x`` ``[..., K]`` (CPU, the weight's dtype), ``W`` packed by ``pack`` and
    ``bias`` a contiguous ``[N]`` of that dtype or None (``PackedLinear`` makes them so once; not
    checked per call); on torch's intra-op threads. ``in_features``: K, which a bfloat16 packing
    of an odd K does not tell (default: the packing's width)."""
    pairs = panels.dim() == 4  # bfloat16: the features in pairs
    width = panels.shape[1] * 2 if pairs else panels.shape[1]
    in_features = width if in_features is None else in_features
    if (x.dtype != panels.dtype or x.shape[-1] != in_features or in_features not in (width, width - pairs)
            or x.device.type != "cpu"):
        raise ValueError(f"input {x.dtype} [..., {x.shape[-1]}] on {x.device} for a {panels.dtype} CPU weight of "
                         f"{in_features} inputs")
    rows = x if x.is_contiguous() else x.contiguous()  # [..., K] as rows of K, without a reshape op
    if in_features != width:  # an odd K: the last pair's zero
        rows = torch.nn.functional.pad(rows, (0, 1))
    out = x.new_empty((*x.shape[:-1], out_features))
    run = _extension().linear_bf16 if pairs else _extension().linear
    run(rows.data_ptr(), panels.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
        rows.numel() // rows.shape[-1], out_features, panels.shape[1], torch.get_num_threads())
    return out
