"""Linear layers on oneDNN's packed weights, for a model the engine loaded itself on the CPU.

A decode step multiplies a few rows by every weight of the model, so on a CPU it streams the
weights from memory and its speed is the GEMM's for skinny inputs. ``F.linear`` over a row-major
weight reaches about two thirds of the memory bandwidth there; oneDNN over the same weight
reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what
PyTorch's inductor does when it freezes a CPU model, and what vLLM's CPU backend runs) is measured
1.1-2.7x faster for 4-32 rows at SmolLM2's shapes in float32 and bfloat16, and 1.3-2.3x on its LM
head; slower only for one row through the small 576 x 576 float32 projection (26 against 42 us)
(``experiments/bench_packed_linear.py``, ``experiments/results/packed_linear_cpu.md``).

``pack_linears`` swaps each ``nn.Linear`` for a ``PackedLinear`` holding only the packed weight (the
row-major one is freed, unless another module shares it: a tied LM head keeps its embedding).
Results equal ``F.linear``'s up to float rounding (another summation order). Before it packs
anything it checks one layer against ``F.linear`` and, where the build lacks the operators or
disagrees, leaves the model as it is and says why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in oneDNN's packed layout. ``weight`` is a meta tensor of the
    original shape and dtype (for code that reads ``.weight.dtype`` or ``.shape``)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed (oneDNN)"


def why_not_packed(model: nn.Module) -> str:
    """"" when ``pack_linears`` can run on ``model``, else why not."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    if not linears:
        return "the model has no nn.Linear layers"
    weight = linears[0].weight
    if weight.device.type != "cpu":
        return f"packed weights are for the CPU, the model is on {weight.device}"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this PyTorch build has no oneDNN linear operators"
    try:
        probe = PackedLinear(linears[0])
        x = torch.randn(3, linears[0].in_features, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        with torch.inference_mode():
            got, want = probe(x).float(), F.linear(x, linears[0].weight, linears[0].bias).float()
    except RuntimeError as exc:  # a dtype or CPU oneDNN does not take
        return f"oneDNN's packed linear failed on {weight.dtype}: {exc}"
    tolerance = 1e-3 if weight.dtype == torch.float32 else 5e-2
    error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
    if error > tolerance:
        return f"oneDNN's packed linear disagrees with F.linear (relative error {error:.2g})"
    return ""


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` (on the CPU) by a ``PackedLinear``; returns how many.
    Call ``why_not_packed`` first."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    with torch.no_grad():  # every layer packed before any is swapped: a failure changes nothing
        packed = [PackedLinear(child) for _, _, child in targets]
    for (parent, name, _), layer in zip(targets, packed):
        setattr(parent, name, layer)
    return len(targets)
