"""Which attention the engine runs: ``--attention auto|flash|triton|native|sdpa``, decided once.

``auto``: on CUDA, FlashAttention-2 (one varlen call per layer per step) when a kernel is available
on this device for these shapes and passes ``probe``; else the Triton decode kernel (decodes in one
launch, prefill through SDPA); else SDPA per sequence. On CPU, the native decode routine
(``cpu_decode``: decodes in one call that reads the cache in place; float32 prompt chunks in one
call of ``cpu_prefill``) when it is built and reads this dtype; else SDPA. An explicit choice that cannot run raises
``ConfigError`` saying why, rather than silently running something else.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vmemkv.errors import ConfigError
from vmemkv.attention.flash_args import (FlashUnsupportedError, block_varlen_args, fa2_block_size_supported,
                                         flatten_slots, slot_geometry, slot_varlen_args)
from vmemkv.attention.flash_kernels import FlashKernel, flash_kernel_for, kvcache_batch_index_safe, shape_supported
from vmemkv.attention.flash_reference import varlen_attention_reference
from vmemkv.attention.packed import SequenceSpan

KINDS = ("auto", "flash", "triton", "native", "sdpa")


@dataclass(frozen=True)
class AttentionChoice:
    kind: str  # "flash", "triton", "native" or "sdpa": what runs
    kernel: FlashKernel | None = None  # flash only
    rows_per_slot: int = 0  # flash over slots: the flattened views' geometry
    num_rows: int = 0
    why_not_flash: str = ""  # when flash was wanted (auto or flash) and is not what runs

    @property
    def decode_kernel(self) -> bool:
        """Whether decodes go through one kernel call a step (Triton on CUDA, native on CPU)."""
        return self.kind in ("triton", "native")

    @property
    def label(self) -> str:
        """What ran, for stats and the A/B: "flash-bundled", "triton", "native", "sdpa"."""
        return f"flash-{self.kernel.name}" if self.kernel is not None else self.kind


def choose_attention(requested: str, device: torch.device, kv_backend: str, dtype: torch.dtype,
                     num_q_heads: int, num_kv_heads: int, head_dim: int, tokens_per_page: int,
                     kv_views: tuple[torch.Tensor, torch.Tensor] | None,
                     other_kv_views: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> AttentionChoice:
    """``kv_views``: layer 0's slot views (vmem), ``None`` for block tables; ``other_kv_views``:
    the other layers' (layout groups flatten differently: flash runs only if every one can)."""
    if requested not in KINDS:
        raise ConfigError(f"attention must be one of {', '.join(KINDS)}, got {requested!r}")
    if device.type != "cuda":
        if requested in ("flash", "triton"):
            raise ConfigError(f"attention={requested!r} needs a CUDA device; use 'native', 'sdpa' or 'auto' "
                              f"on {device}")
        return _cpu_choice(requested, dtype)
    if requested == "native":
        raise ConfigError(f"attention='native' is the CPU decode routine; on {device} use 'auto', 'flash', "
                          "'triton' or 'sdpa'")
    if requested == "sdpa":
        return AttentionChoice("sdpa")
    why_not = ""
    if requested in ("auto", "flash"):
        try:
            return _flash_choice(device, kv_backend, dtype, num_q_heads, num_kv_heads, head_dim,
                                 tokens_per_page, kv_views, other_kv_views)
        except FlashUnsupportedError as exc:
            if requested == "flash":
                raise ConfigError(f"attention='flash' cannot run here: {exc}") from exc
            why_not = str(exc)
    try:
        from vmemkv.attention import triton_decode  # noqa: F401
    except ImportError:
        if requested == "triton":
            raise
        return AttentionChoice("sdpa", why_not_flash=why_not)
    return AttentionChoice("triton", why_not_flash=why_not)


def _cpu_choice(requested: str, dtype: torch.dtype) -> AttentionChoice:
    if requested == "sdpa":
        return AttentionChoice("sdpa")
    from vmemkv.attention.cpu_decode import unavailable

    if reason := unavailable(dtype):
        if requested == "native":
            raise ConfigError(f"attention='native' cannot run here: {reason}")
        return AttentionChoice("sdpa")
    return AttentionChoice("native")


def _flash_choice(device, kv_backend, dtype, num_q_heads, num_kv_heads, head_dim, tokens_per_page,
                  kv_views, other_kv_views=()) -> AttentionChoice:
    reason = shape_supported(dtype, head_dim, num_q_heads, num_kv_heads)
    if not reason and torch.cuda.get_device_capability(device) < (8, 0):
        reason = "FlashAttention-2 needs an sm80 (Ampere) or newer GPU"
    paged = kv_backend == "paged"
    if not reason and paged and not fa2_block_size_supported(tokens_per_page):
        reason = (f"FlashAttention-2 reads block tables of a multiple of 256 tokens, pages hold "
                  f"{tokens_per_page}; set tokens_per_page to 256 or use kv_backend='vmem'")
    if reason:
        raise FlashUnsupportedError(reason)
    rows = num_rows = 0
    safe = False
    if not paged:
        rows = slot_geometry(*kv_views)  # raises FlashUnsupportedError when not uniform
        num_rows = flatten_slots(kv_views[0], rows).shape[0]
        for views in other_kv_views:  # another layout group's rows per slot may differ: checked
            slot_geometry(*views)     # here, and used per layer (addressing.layer_geometries)
        safe = all(kvcache_batch_index_safe(tuple(k.shape), k.stride())
                   for k, _ in (kv_views, *other_kv_views))
    kernel, why = flash_kernel_for(paged, safe)
    if kernel is None:
        raise FlashUnsupportedError(f"no FlashAttention-2 kernel with what this needs ({why})")
    problem = probe(kernel, device.index if device.index is not None else torch.cuda.current_device(),
                    dtype, num_q_heads, num_kv_heads, head_dim, tokens_per_page if paged else 0)
    if problem:
        raise FlashUnsupportedError(f"the {kernel.name} FlashAttention-2 kernel failed its probe: {problem}")
    return AttentionChoice("flash", kernel, rows, num_rows)


@functools.cache
def probe(kernel: FlashKernel, device_index: int, dtype: torch.dtype, num_q_heads: int,
          num_kv_heads: int, head_dim: int, block_size: int) -> str:
    """Run the kernel once on tiny tensors shaped like ours (a reordered chunked prefill and a
    decode; slots with gaps, or a block table) and compare with the float64 reference. Returns
    "" when it agrees, else what went wrong. ``block_size`` 0: slots."""
    device = torch.device("cuda", device_index)
    generator = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(4, num_q_heads, head_dim, generator=generator)
    if block_size:
        k = torch.randn(3, block_size, num_kv_heads, head_dim, generator=generator)
        v = torch.randn(3, block_size, num_kv_heads, head_dim, generator=generator)
        spans = [SequenceSpan(0, 0, 3, 2, (2,)), SequenceSpan(1, 3, 1, 4, (0,))]
        args = block_varlen_args(spans, block_size)
        k_in, v_in = k, v
    else:  # slot views with 8 rows per slot, 6 tokens each: only their used rows are meaningful
        store_k = torch.randn(3, 8, num_kv_heads, head_dim, generator=generator)
        store_v = torch.randn(3, 8, num_kv_heads, head_dim, generator=generator)
        spans = [SequenceSpan(2, 0, 3, 2, ()), SequenceSpan(0, 3, 1, 4, ())]
        k_in, v_in = flatten_slots(store_k[:, :6], 8), flatten_slots(store_v[:, :6], 8)
        args = slot_varlen_args(spans, 8, k_in.shape[0])
    host = args.tensors()
    scale = head_dim ** -0.5
    q_sorted = q.index_select(0, host["query_rows"]) if "query_rows" in host else q
    expected = varlen_attention_reference(q_sorted, k_in, v_in, host["cu_seqlens_q"], host["cu_seqlens_k"],
                                          scale, seqused_k=host["seqused_k"],
                                          block_table=host.get("block_table"))
    to = dict(device=device)
    try:
        if block_size:
            k_dev, v_dev = k.to(dtype=dtype, **to), v.to(dtype=dtype, **to)
        else:
            k_dev = flatten_slots(store_k.to(dtype=dtype, **to)[:, :6], 8)
            v_dev = flatten_slots(store_v.to(dtype=dtype, **to)[:, :6], 8)
        table = host["block_table"].to(**to) if block_size else None
        out = kernel.varlen(q_sorted.to(dtype=dtype, **to), k_dev, v_dev, host["cu_seqlens_q"].to(**to),
                            host["cu_seqlens_k"].to(**to), host["seqused_k"].to(**to),
                            args.max_seqlen_q, args.max_seqlen_k, scale, block_table=table)
        torch.cuda.synchronize(device)
    except Exception as exc:  # a missing build, an unsupported GPU: not chosen, and we say why
        return f"{type(exc).__name__}: {exc}"
    error = (out.double().cpu() - expected).abs().max().item()
    return "" if error < 5e-2 else f"max error {error:.3g} against the float64 reference"
