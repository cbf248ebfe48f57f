"""Block-table addressing (the vLLM-style baseline): K/V live in block tensors
``[num_blocks, tokens_per_page, kv_head, dim]``; token ``t`` of a sequence is at block
``block_table[t // tokens_per_page]``, offset ``t % tokens_per_page``. SDPA needs a contiguous
sequence, so reading gathers the sequence's blocks (a copy) — the honest CPU baseline. At its best
on CPU: decoding sequences are gathered into one padded tensor and attended in one call when that
is cheaper than a gather and a call per sequence (``worth_batching``); ``copy_seconds`` counts the
gathers.

A quantized cache (int8 / fp8 rows with float32 scales beside them, ``memory/quantized_rows.py``) is
written quantized into the blocks; the decode kernels read its bytes and scales through the
tables, and what SDPA reads is gathered and dequantized into the query's dtype, as
``ContiguousAttention`` does over slots."""

from __future__ import annotations

from typing import Callable

import time

import torch

from vmemkv.attention.metadata import StepMetadata
from vmemkv.attention.packed import PackedAttention, SequenceSpan
from vmemkv.attention.slot_batch import DecodeBatch, gather_padded, worth_batching
from vmemkv.memory.quantized_rows import write_kv


class BlockTableAttention(PackedAttention):
    """``block_views(layer)`` gives that layer's K and V block tensors. ``share_prefixes``:
    decoding sequences holding the same leading blocks read them once (``shared_prefix``).
    ``block_scale_views(layer)``: a quantized cache's scales of that layer as block tensors
    (``KVCacheManager.block_scale_views``)."""

    # Stage the block ids per-sequence SDPA reads (``read``) with the step's upload; a subclass
    # whose kernel reads the tables itself turns this off, and ``read`` uploads them if asked.
    stage_sdpa_reads = True

    def __init__(self, spans: list[SequenceSpan],
                 block_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 tokens_per_page: int, device: torch.device, decode_kernel: bool = False,
                 share_prefixes: bool = False,
                 block_scale_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.block_views = block_views
        self.block_scale_views = block_scale_views
        self.tokens_per_page = tokens_per_page
        super().__init__(spans, device, decode_kernel, tokens_per_page if share_prefixes else 0)

    def stage(self, staged: StepMetadata) -> None:
        super().stage(staged)
        spans, size = self.spans, self.tokens_per_page
        owners, positions = self.token_positions(spans)
        staged.add("write_blocks", [spans[i].block_table[p // size] for i, p in zip(owners, positions)])
        staged.add("write_offsets", [p % size for p in positions])
        tables = [span.block_table[: -(-span.length // size)] for span in spans]
        # Every sequence's blocks back to back; read() slices its own (SDPA sequences only).
        self._table_starts = [0]
        for table in tables:
            self._table_starts.append(self._table_starts[-1] + len(table))
        self._read_blocks = [block for table in tables for block in table]
        if self.stage_sdpa_reads:
            staged.add("read_block_ids", self._read_blocks)
        if self.decodes:  # the decode sequences' block tables, padded with block 0 (never read)
            width = max(len(tables[i]) for i in self.decodes)
            staged.add("decode_tables", [list(tables[i]) + [0] * (width - len(tables[i]))
                                         for i in self.decodes], torch.int32)

    def plan_batches(self) -> list[DecodeBatch]:
        if self.device.type != "cpu":
            return []
        decoding = [i for i, span in enumerate(self.spans) if span.num_queries == 1]
        lengths = [self.spans[i].length for i in decoding]
        _, _, kv_heads, head_dim = self.block_views(0)[0].shape
        if not worth_batching(lengths, kv_heads * head_dim):
            return []
        batch = DecodeBatch(decoding, max(lengths))
        batch.finish(self.spans, self.device)
        # each row's blocks, padded with block 0 (read, then masked: the pool is all mapped)
        size = self.tokens_per_page
        width = -(-batch.read_len // size)
        tables = [list(self.spans[i].block_table[: -(-self.spans[i].length // size)]) for i in decoding]
        self._batch_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.device)
        return [batch]

    def batch_kv(self, layer, batch, start=0, dtype=None):
        began = time.perf_counter()
        k, v = self.cache_rows(layer, lambda t: gather_padded(t, self._batch_table, batch.read_len, start), dtype)
        self.copy_seconds += time.perf_counter() - began
        return k, v

    def write(self, layer, key, value):
        write_kv(*self.block_views(layer), self.cache_scale_views(layer), (self.write_blocks, self.write_offsets),
                 key, value)

    def cache_views(self, layer):
        return self.block_views(layer)

    def cache_scale_views(self, layer):
        return None if self.block_scale_views is None else self.block_scale_views(layer)

    def prefill_index(self, members):
        size = self.tokens_per_page
        tables = [self.spans[i].block_table[: -(-self.spans[i].length // size)] for i in members]
        width = max(map(len, tables))
        return [list(table) + [0] * (width - len(table)) for table in tables], size

    def read(self, layer, index, start=0, dtype=None):
        began = time.perf_counter()
        first = start // self.tokens_per_page  # blocks wholly behind the window are not gathered
        blocks = self._read_block_ids()[self._table_starts[index] + first: self._table_starts[index + 1]]
        offset = first * self.tokens_per_page  # the first gathered row's position
        rows = slice(start - offset, self.spans[index].length - offset)
        k, v = self.cache_rows(layer, lambda t: t.index_select(0, blocks).flatten(0, 1)[rows], dtype)
        self.copy_seconds += time.perf_counter() - began
        return k, v

    def _read_block_ids(self) -> torch.Tensor:
        ids = self.__dict__.get("read_block_ids")
        if ids is None:  # not staged (stage_sdpa_reads off), or no upload yet: build it now
            if self._staged is not None:
                self.upload()
            ids = self.__dict__.get("read_block_ids")
            if ids is None:
                ids = self.read_block_ids = torch.tensor(self._read_blocks, device=self.device)
        return ids

    def decode(self, layer, q, scale, **variant):
        k_blocks, v_blocks = self.block_views(layer)
        scales = self.cache_scale_views(layer)
        if self.device.type == "cpu":  # the native routine (cpu_decode); Triton on CUDA
            from vmemkv.attention.cpu_decode import decode_attention_paged_cpu

            return decode_attention_paged_cpu(q, k_blocks, v_blocks, self.decode_tables, self.decode_lens, scale,
                                              max_seq_len=self.decode_max_len,
                                              shared_prefix=self.shared_prefix(variant["window"]),
                                              calls=self.layer_calls, kv_scales=scales, **variant)
        from vmemkv.attention.triton_decode import decode_attention_paged

        return decode_attention_paged(q, k_blocks, v_blocks, self.decode_tables, self.decode_lens,
                                      scale, max_seq_len=self.decode_max_len, kv_scales=scales, **variant)
