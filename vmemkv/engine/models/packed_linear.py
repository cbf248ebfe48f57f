"""Linear layers on packed weights, for a model the engine loaded itself on the CPU.

A decode step multiplies a few rows by every weight of the model, so on a CPU it streams the
weights from memory and its speed is the GEMM's for skinny inputs. ``F.linear`` over a row-major
weight reaches about two thirds of the memory bandwidth there. Each weight is packed once, for
one of two kernels (the engine times both and takes the faster on this machine:
``kernel_choice.py``):

- float32, and bfloat16 on CPUs with AVX-512 BF16: panels of 16 outputs read by vmemkv's native
  kernel (``panel_linear.py``): one sequential, prefetched stream; on an AMD EPYC (Zen 4), over
  SmolLM2-135M's layers, oneDNN's packed weights take 1.2-1.7x its time for 1-8 rows (one
  thread), about the same from 32 rows up to prefill sizes; on an Intel Xeon with AVX-512 it is
  the slower of the two;
- any dtype (the only one for bfloat16 without AVX-512 BF16, or without the native build): oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, what PyTorch's inductor does when it freezes a CPU
  model, and what vLLM's CPU backend runs), 1.1-2.7x ``F.linear`` for 4-32 rows in float32 and
  bfloat16 (``experiments/results/packed_linear_cpu.md``).

``pack_linears`` swaps each ``nn.Linear`` for a ``PackedLinear`` holding only the packed weight (the
row-major one is freed, unless another module shares it: a tied LM head keeps its embedding).
Results equal ``F.linear``'s up to float rounding (another summation order). Before it packs
anything it checks one layer against ``F.linear`` and, where the build lacks the operators or
disagrees, leaves the model as it is and says why.

Projections that read the same input run as one GEMM, as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do: a module with ``q_proj``, ``k_proj`` and ``v_proj`` (a Llama-family
attention) or ``gate_proj`` and ``up_proj`` (its MLP) gets one packed weight for their concatenation
(``FusedPackedLinear``), and each projection becomes a ``PackedSlice`` returning its columns of that
GEMM. The model's own code is unchanged: it still calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``;
the first call computes the group's output for ``x`` and the others take their slice of it. With a
few rows the GEMM streams the weights, and one call over the concatenation is cheaper than three:
one decode layer of SmolLM2-135M (float32, one thread, oneDNN), q, k, v, gate and up 17% faster
at 4 rows, 10-12% at 1 and 16, the layer's seven projections 6-10% (``experiments/bench_packed_linear.py
--fused``). End to end it measured no gain (a 32-sequence decode: median 6% slower over seven
pairs; the slices are strided views, slower for the element-wise ops after them), so ``fuse`` is
off by default (``EngineConfig.fused_projections``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vmemkv.engine.models.panel_linear import linear as panel_linear, pack as pack_panels, unavailable as no_panels

KERNELS = ("panels", "onednn")
# "split": both packed, panels for a decode step's few rows, oneDNN from SPLIT_ROWS rows (prefill)
SPLIT_ROWS = 64
PACKINGS = {"panels": (("packed", "panels"),), "onednn": (("packed", "onednn"),),
            "split": (("packed", "panels"), ("packed_large", "onednn"))}  # buffer name, kernel


def kernel_for(dtype: torch.dtype) -> str:
    """The kernel a weight of ``dtype`` is packed for here: "panels" (float32, or bfloat16 with AVX-512
    BF16; native build), else "onednn"."""
    return "onednn" if no_panels(dtype) else "panels"


def _pack(weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """``weight`` packed once for ``kernel`` (one of ``KERNELS``)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: one of {KERNELS}")
    if kernel == "panels":
        return pack_panels(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _register_packed(module: nn.Module, weight: torch.Tensor, kernel: str) -> None:
    """``module``'s packed buffer(s) of ``weight`` for ``kernel`` (one of ``PACKINGS``)."""
    if kernel not in PACKINGS:
        raise ValueError(f"kernel {kernel!r}: one of {tuple(PACKINGS)}")
    for name, packing in PACKINGS[kernel]:
        module.register_buffer(name, _pack(weight, packing), persistent=False)


def _forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A packed module's ``x W^T + b``; with "split", by the rows ``x`` has."""
    kernel, packed = module.kernel, module.packed
    if kernel == "split":
        large = x.numel() >= SPLIT_ROWS * module.in_features
        kernel, packed = ("onednn", module.packed_large) if large else ("panels", packed)
    return _linear(x, packed, module.bias, kernel, module.out_features, module.in_features)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias, kernel: str, out_features: int,
            in_features: int) -> torch.Tensor:
    """``x W^T + b`` over ``packed`` (from ``_pack(W, kernel)``), for ``x`` ``[..., in_features]``."""
    if kernel == "panels":
        return panel_linear(x, packed, bias, out_features, in_features)
    # oneDNN's op folds x's leading dimensions into rows and back itself: no reshape ops around
    # it (two fewer dispatches a layer, ~420 a decode step of SmolLM2-135M), the same result
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` packed for ``kernel`` (default: ``kernel_for`` its dtype).
    ``weight`` is a meta tensor of the original shape and dtype (for code that reads
    ``.weight.dtype`` or ``.shape``)."""

    def __init__(self, linear: nn.Linear, kernel: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.kernel = kernel or kernel_for(weight.dtype)
        _register_packed(self, weight, self.kernel)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().contiguous(),
                                                                  requires_grad=False)
        self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _forward(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed ({self.kernel})"


class _Cached:
    """A ``FusedPackedLinear``'s output for one input, and which layers took their slice."""

    __slots__ = ("input", "output", "taken")

    def __init__(self):
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.taken: set[int] = set()


class FusedPackedLinear(nn.Module):
    """Linear layers over one input (``q|k|v``, ``gate|up``) as one GEMM over their weights
    concatenated and packed. Layer ``i``'s output is ``output(x, i)``: its columns of the GEMM over
    ``x``, computed at the first layer's call and kept for the others' calls with the same tensor
    (``x is`` the cached input). The cache is dropped once every layer has taken its slice; a call
    with another tensor, or a second call for a slice already taken, computes the GEMM again (for
    that tensor), so results never depend on the order of calls, only the time does. (It assumes
    the input is not changed in place between the calls, as HF's attention and MLP modules do not.)"""

    def __init__(self, linears: list[nn.Linear], kernel: str | None = None):
        super().__init__()
        self.in_features = linears[0].in_features
        self.sizes = [linear.out_features for linear in linears]
        self.starts = [sum(self.sizes[:i]) for i in range(len(linears))]
        self.out_features = sum(self.sizes)
        weight = torch.cat([linear.weight.detach() for linear in linears])
        self.kernel = kernel or kernel_for(weight.dtype)
        _register_packed(self, weight, self.kernel)
        self.bias = None
        if any(linear.bias is not None for linear in linears):  # a missing bias is zeros
            bias = torch.cat([linear.weight.new_zeros(linear.out_features) if linear.bias is None
                              else linear.bias.detach() for linear in linears])
            self.bias = nn.Parameter(bias, requires_grad=False)
        self.cache = _Cached()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every layer's output, concatenated along the last dimension."""
        return _forward(self, x)

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Layer ``index``'s output for ``x`` (a view into the group's output)."""
        cache = self.cache  # a plain object: nn.Module's attribute setting costs microseconds
        if x is not cache.input or index in cache.taken:
            cache.input, cache.output = x, self.forward(x)
            cache.taken.clear()
        output = cache.output
        cache.taken.add(index)
        if len(cache.taken) == len(self.sizes):  # every slice handed out: keep nothing alive
            cache.input = cache.output = None
        return output[..., self.starts[index]:self.starts[index] + self.sizes[index]]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={'+'.join(map(str, self.sizes))}, packed ({self.kernel})"


class PackedSlice(nn.Module):
    """One layer of a ``FusedPackedLinear``, in place of the ``nn.Linear`` it was made from.
    ``weight``: a meta tensor of the layer's shape and dtype, as ``PackedLinear``'s."""

    def __init__(self, group: FusedPackedLinear, index: int, linear: nn.Linear):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)

    def extra_repr(self) -> str:
        return f"slice {self.index} ({self.out_features} of {self.group.out_features} outputs)"


# Sibling projections that a Llama-family module (Llama, Qwen2, Mistral, Gemma-2, SmolLM2) calls
# on one tensor: the attention's q/k/v, the MLP's gate/up.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fusable(parent: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    linears = [getattr(parent, name, None) for name in names]
    if not all(type(linear) is nn.Linear for linear in linears):
        return None
    first = linears[0].weight
    if any(linear.in_features != linears[0].in_features or linear.weight.dtype != first.dtype
           or linear.weight.device != first.device for linear in linears):
        return None
    return linears


def why_not_packed(model: nn.Module, kernel: str | None = None) -> str:
    """"" when ``pack_linears`` can run on ``model`` for ``kernel`` (default: ``kernel_for`` its
    dtype), else why not."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    if not linears:
        return "the model has no nn.Linear layers"
    weight = linears[0].weight
    if weight.device.type != "cpu":
        return f"packed weights are for the CPU, the model is on {weight.device}"
    kernel = kernel or kernel_for(weight.dtype)
    if kernel in ("panels", "split") and (reason := no_panels(weight.dtype)):
        return reason
    if kernel in ("onednn", "split") and (not torch.backends.mkldnn.is_available()
                               or not hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this PyTorch build has no oneDNN linear operators"
    try:
        probe = PackedLinear(linears[0], kernel)
        generator = torch.Generator().manual_seed(0)
        errors = []
        for rows in (3, SPLIT_ROWS) if kernel == "split" else (3,):  # each path a split takes
            x = torch.randn(rows, linears[0].in_features, generator=generator).to(weight.dtype)
            with torch.inference_mode():
                got, want = probe(x).float(), F.linear(x, linears[0].weight, linears[0].bias).float()
            errors.append(float((got - want).abs().max() / want.abs().max().clamp_min(1e-6)))
    except RuntimeError as exc:  # a dtype or CPU oneDNN does not take
        return f"the packed linear ({kernel}) failed on {weight.dtype}: {exc}"
    tolerance = 1e-3 if weight.dtype == torch.float32 else 5e-2
    error = max(errors)
    if error > tolerance:
        return f"the packed linear ({kernel}) disagrees with F.linear (relative error {error:.2g})"
    return ""


def pack_linears(model: nn.Module, fuse: bool = False, kernel: str | None = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` (on the CPU) by a ``PackedLinear``, or, with ``fuse``,
    a ``PackedSlice`` of its group's ``FusedPackedLinear`` where it is one of ``FUSED_GROUPS``;
    packed for ``kernel`` (default: ``kernel_for`` the weight's dtype); returns how many layers
    were replaced. Call ``why_not_packed`` first."""
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    fused: set[int] = set()  # ids of the linears packed in a group
    with torch.no_grad():  # every layer packed before any is swapped: a failure changes nothing
        for parent in model.modules() if fuse else ():
            for names in FUSED_GROUPS:
                if (linears := _fusable(parent, names)) is None:
                    continue
                group = FusedPackedLinear(linears, kernel)
                for index, (name, linear) in enumerate(zip(names, linears)):
                    swaps.append((parent, name, PackedSlice(group, index, linear)))
                    fused.add(id(linear))
        for parent in model.modules():
            for name, child in parent.named_children():
                # keep_unpacked: a layer whose weight is read, not multiplied by (MLA's kv_b_proj)
                if type(child) is nn.Linear and id(child) not in fused and not getattr(child, "keep_unpacked", False):
                    swaps.append((parent, name, PackedLinear(child, kernel)))
    for parent, name, layer in swaps:
        setattr(parent, name, layer)
    return len(swaps)
