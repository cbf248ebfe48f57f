"""FlashAttention over the step: one varlen kernel call per layer, prefill and decode together.

``FlashSlotAttention`` (vmem) hands the kernel each layer's slot views flattened into one uniformly
strided tensor (``flash_args.flatten_slots``): no block table, no copy. ``FlashBlockTableAttention``
hands it the pool's block views and the sequences' block tables. Both write the step's new K/V
first, exactly as the SDPA path does (they inherit ``write``), then make one call; the per-step
integer arguments travel in the same single upload as the write indices. A layer's sliding window
and soft-capping go to the kernel (``window_size_left``, ``softcap``) where it takes them; a
layer it cannot compute (sinks, or a variant the kernel lacks) takes the SDPA path of the class
it extends.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from vmemkv.attention.contiguous import ContiguousAttention
from vmemkv.attention.flash_args import VarlenArgs, block_varlen_args, flatten_slots, slot_varlen_args
from vmemkv.attention.flash_kernels import FlashKernel, package_kvcache_decode
from vmemkv.attention.metadata import StepMetadata
from vmemkv.attention.packed import SequenceSpan
from vmemkv.attention.paged import BlockTableAttention


def _stage_varlen(staged: StepMetadata, args: VarlenArgs) -> None:
    staged.add("cu_seqlens_q", args.cu_seqlens_q, torch.int32)
    staged.add("cu_seqlens_k", args.cu_seqlens_k, torch.int32)
    staged.add("seqused_k", args.seqused_k, torch.int32)
    if args.query_rows is not None:
        staged.add("query_rows", args.query_rows)
    if args.block_table is not None:
        staged.add("block_table", args.block_table, torch.int32)


class _VarlenCall:
    """The call both addressings share: packed queries in kernel order, one kernel call, the
    output scattered back to packed order (one gather and one scatter, only when reordered)."""

    kernel: FlashKernel
    args: VarlenArgs
    query_rows: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqused_k: torch.Tensor

    def _varlen(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                block_table: torch.Tensor | None = None, **variant) -> torch.Tensor:
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        q = q.index_select(0, self.query_rows) if self.query_rows is not None else q.contiguous()
        out = self.kernel.varlen(q, k, v, self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k,
                                 self.args.max_seqlen_q, self.args.max_seqlen_k, scale,
                                 block_table=block_table, **variant)
        if self.query_rows is not None:
            out = torch.empty_like(out).index_copy_(0, self.query_rows, out)
        return out[None]

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float | None, window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        if chunk or not self.kernel.runs(window, softcap, sinks):  # the SDPA / explicit path
            return super().__call__(layer, query, key, value, scaling, window=window,
                                    softcap=softcap, sinks=sinks, chunk=chunk)
        start = self._begin()
        self.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = self._attend(layer, query, scale, window=window, softcap=softcap)
        self.seconds += time.perf_counter() - start
        return out

    def _attend(self, layer: int, query: torch.Tensor, scale: float, **variant) -> torch.Tensor:
        """Layer ``layer``'s attention output ``[1, T, Hq, D]`` (K/V already written);
        ``variant``: ``window``, ``softcap``."""
        raise NotImplementedError


class FlashSlotAttention(_VarlenCall, ContiguousAttention):
    """vmem: ``rows_per_slot`` and ``num_rows`` describe the flattened slot views (from
    ``flash_args.slot_geometry``, checked once per engine)."""

    def __init__(self, spans: list[SequenceSpan],
                 kv_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 kernel: FlashKernel, rows_per_slot: int, num_rows: int):
        self.kernel = kernel
        self.rows_per_slot = rows_per_slot
        self.args = slot_varlen_args(spans, rows_per_slot, num_rows)
        # Decode-only steps may take flash_attn_with_kvcache (cache_batch_idx) where it is safe.
        self.kvcache_decode = kernel.kvcache_decode and all(s.num_queries == 1 for s in spans)
        super().__init__(spans, kv_views, device, decode_kernel=False)

    def stage(self, staged: StepMetadata) -> None:
        super().stage(staged)
        _stage_varlen(staged, self.args)
        if self.kvcache_decode:
            staged.add("kv_slots", [s.slot for s in self.spans], torch.int32)
            staged.add("kv_lengths", [s.length for s in self.spans], torch.int32)

    def _attend(self, layer: int, query: torch.Tensor, scale: float, **variant) -> torch.Tensor:
        k_view, v_view = self.kv_views(layer)
        if self.kvcache_decode:  # packed order is batch order: no reordering
            q = query[0].transpose(0, 1).contiguous()
            return package_kvcache_decode(q, k_view, v_view, self.kv_lengths, self.kv_slots,
                                          self.args.max_seqlen_k, scale, **variant)[None]
        return self._varlen(query, flatten_slots(k_view, self.rows_per_slot),
                            flatten_slots(v_view, self.rows_per_slot), scale, **variant)


class FlashBlockTableAttention(_VarlenCall, BlockTableAttention):
    """Block tables: the pool's block views and each sequence's table (FlashAttention-2 needs
    ``tokens_per_page % 256 == 0``; the engine checks that before choosing this class). The
    kernel reads the block tables: the block ids of per-sequence SDPA reads are uploaded only
    if a layer the kernel cannot run asks for them."""

    stage_sdpa_reads = False

    def __init__(self, spans: list[SequenceSpan],
                 block_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 tokens_per_page: int, device: torch.device, kernel: FlashKernel):
        self.kernel = kernel
        self.args = block_varlen_args(spans, tokens_per_page)
        super().__init__(spans, block_views, tokens_per_page, device, decode_kernel=False)

    def stage(self, staged: StepMetadata) -> None:
        super().stage(staged)
        _stage_varlen(staged, self.args)

    def _attend(self, layer: int, query: torch.Tensor, scale: float, **variant) -> torch.Tensor:
        k_blocks, v_blocks = self.block_views(layer)
        return self._varlen(query, k_blocks, v_blocks, scale, self.block_table, **variant)
