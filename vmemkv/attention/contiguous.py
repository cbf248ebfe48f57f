"""vmem addressing: each sequence's K/V is its slot view narrowed to its length, a plain strided
tensor, so SDPA reads it with no block table and no copy. Decoding sequences in consecutive slots
are read together: their K (or V) is one strided view ``[hi - lo, longest, kv_heads, dim]``.

A quantized cache (int8 / fp8 rows with a float32 scale each, ``memory/quantized_rows.py``) is
written quantized; the decode kernels (the native CPU routine, Triton on CUDA) read its bytes and
scales in place, and SDPA gets the rows it reads dequantized into the query's dtype (a step's rows,
never the whole cache)."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from vmemkv.attention.metadata import StepMetadata
from vmemkv.attention.packed import PackedAttention, SequenceSpan
from vmemkv.attention.slot_batch import DecodeBatch, slot_runs, worth_batching
from vmemkv.memory.quantized_rows import write_kv


class SlotReads(Protocol):
    """What batched reads need from the slot mapper (``vmemkv.memory.slots.SlotMapper``)."""

    num_layers: int

    def make_readable(self, slots: list[int], num_tokens: int) -> bool: ...

    def release_reads(self) -> None: ...


class ContiguousAttention(PackedAttention):
    """``kv_views(layer)`` gives that layer's ``[slot, token, kv_head, dim]`` K and V views.
    ``reads``: when given (CPU SDPA), decoding sequences in consecutive slots are attended in one
    call per run; it makes every position such a call reads mapped (``make_readable``).
    ``kv_scale_views(layer)``: a quantized cache's scales of that layer (``KVCacheManager.kv_scale_views``)."""

    def __init__(self, spans: list[SequenceSpan],
                 kv_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 decode_kernel: bool = False, reads: SlotReads | None = None, prefix_block_tokens: int = 0,
                 kv_scale_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.kv_views = kv_views
        self.kv_scale_views = kv_scale_views
        self.reads = reads if torch.device(device).type == "cpu" else None
        super().__init__(spans, device, decode_kernel, prefix_block_tokens)

    def plan_batches(self) -> list[DecodeBatch]:
        if self.reads is None:
            return []
        self.reads.release_reads()  # pins of a step whose forward did not finish
        batches = []
        _, _, kv_heads, head_dim = self.kv_views(0)[0].shape
        row_elements = kv_heads * head_dim
        for run in slot_runs(self.spans):
            lengths = [self.spans[i].length for i in run]
            # a run of consecutive slots: every row up to the longest must be mapped, or reading
            # it would fault, so positions past shorter requests get filler pages first
            if worth_batching(lengths, row_elements) and self.reads.make_readable(
                    [self.spans[i].slot for i in run], max(lengths)):
                batch = DecodeBatch(run, max(lengths), lo=self.spans[run[0]].slot)
                batch.finish(self.spans, self.device)
                batches.append(batch)
        return batches

    def stage(self, staged: StepMetadata) -> None:
        super().stage(staged)
        owners, positions = self.token_positions(self.spans)
        staged.add("write_slots", [self.spans[i].slot for i in owners])
        staged.add("write_positions", positions)
        if self.decodes:
            staged.add("decode_slots", [self.spans[i].slot for i in self.decodes], torch.int32)

    def __call__(self, layer, query, key, value, scaling, **variant):
        try:
            return super().__call__(layer, query, key, value, scaling, **variant)
        finally:
            if self.batches and layer == self.reads.num_layers - 1:
                self.reads.release_reads()  # the last read of this step is done

    def write(self, layer, key, value):
        write_kv(*self.kv_views(layer), self.cache_scale_views(layer), (self.write_slots, self.write_positions),
                 key, value)

    def cache_views(self, layer):
        return self.kv_views(layer)

    def cache_scale_views(self, layer):
        return None if self.kv_scale_views is None else self.kv_scale_views(layer)

    def prefill_index(self, members):
        return [self.spans[i].slot for i in members], 0

    def read(self, layer, index, start=0, dtype=None):
        span = self.spans[index]
        return self.cache_rows(layer, lambda t: t[span.slot, start:span.length], dtype)

    def batch_kv(self, layer, batch, start=0, dtype=None):
        end = batch.lo + len(batch.members)
        return self.cache_rows(layer, lambda t: t[batch.lo:end, start:batch.read_len], dtype)

    def decode(self, layer, q, scale, **variant):
        k_cache, v_cache = self.kv_views(layer)
        scales = None if self.kv_scale_views is None else self.kv_scale_views(layer)
        if self.device.type == "cpu":  # the native routine (cpu_decode); Triton on CUDA
            from vmemkv.attention.cpu_decode import decode_attention_contiguous_cpu

            return decode_attention_contiguous_cpu(q, k_cache, v_cache, self.decode_slots, self.decode_lens, scale,
                                                   max_seq_len=self.decode_max_len,
                                                   shared_prefix=self.shared_prefix(variant["window"]),
                                                   calls=self.layer_calls, kv_scales=scales, **variant)
        from vmemkv.attention.triton_decode import decode_attention_contiguous

        return decode_attention_contiguous(q, k_cache, v_cache, self.decode_slots, self.decode_lens,
                                           scale, max_seq_len=self.decode_max_len, kv_scales=scales, **variant)
