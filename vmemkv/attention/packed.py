"""Attention for one packed, ragged forward pass: the part both KV backends share.

Each sequence contributes ``num_queries`` new tokens after ``num_cached`` cached ones. A layer's
call writes every new token's K/V into the cache first, then attends: decoding sequences in
batches (``plan_batches``: one SDPA call per batch, see ``slot_batch``) where the subclass can
read them together, everything else per sequence with PyTorch SDPA over the sequence's keys.
Subclasses say only how tokens are addressed: through a slot view (vmem) or through a block
table (paged).

A layer may ask for a sliding window, soft-capping or sinks (``variants``): reads then start at
the window start (``read(layer, index, start)``, a batch's earliest window start), and only
layers with soft-capping or sinks leave SDPA for ``explicit_attention``. A chunked local layer
(``chunk``) attends every sequence on its own, from its first query's chunk start.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from vmemkv.attention.cpu_decode import LayerCalls
from vmemkv.attention.cpu_prefill import PrefillSpans, prefill_attention_cpu
from vmemkv.attention.cpu_prefill import unavailable as prefill_unavailable
from vmemkv.attention.metadata import StepMetadata
from vmemkv.attention.shared_prefix import shared_prefixes
from vmemkv.attention.slot_batch import DecodeBatch, attend
from vmemkv.attention.variants import (causal_chunk_mask, causal_window_mask, chunk_start, explicit_attention,
                                       needs_explicit, window_start)
from vmemkv.memory.quantized_rows import dequantize


class SequenceSpan(NamedTuple):
    """One sequence's share of a packed forward pass (a named tuple: the step builds one per
    sequence, and a tuple is made several times faster than a frozen dataclass)."""

    slot: int
    query_start: int  # first row in the packed batch
    num_queries: int  # new tokens this step
    num_cached: int  # tokens already in the cache before this step
    block_table: tuple[int, ...] = ()  # its blocks, for block-table addressing

    @property
    def length(self) -> int:
        return self.num_cached + self.num_queries


class PackedAttention:
    """``decode_kernel``: attend all single-token (decode) sequences in one call that reads the
    cache in place (the Triton kernel on CUDA, the native routine on CPU); the others, and
    everything when off, go through SDPA.

    The step's index tensors are staged on the host and uploaded once (``StepMetadata``), with
    the model's inputs when the caller passes them to ``upload``: subclasses add theirs in
    ``stage`` and find them as attributes of the same name.

    ``prefix_block_tokens``: the tokens of a block of the spans' ``block_table``; when given (and
    the decode kernel is the CPU's), decoding sequences that hold the same leading blocks read
    them once per group (``shared_prefix``)."""

    def __init__(self, spans: list[SequenceSpan], device: torch.device, decode_kernel: bool = False,
                 prefix_block_tokens: int = 0):
        self.spans = spans
        self.prefix_block_tokens = prefix_block_tokens
        self._shared_prefix: tuple[list[int], list[int]] | None = None
        self.device = torch.device(device)
        self.decodes_natively_on_cpu = decode_kernel and self.device.type == "cpu"  # so does prefill
        self._prefill_arrays: tuple[tuple[int, ...], PrefillSpans] | None = None
        self._masks: dict[tuple[int, int, int | None], torch.Tensor] = {}
        self.seconds = 0.0  # wall time inside attention (host time: on a GPU, launch time only)
        self.copy_seconds = 0.0  # of which gathering K/V into new tensors (block tables)
        self.decodes = [i for i, span in enumerate(spans) if span.num_queries == 1] if decode_kernel else []
        self.batches = [] if decode_kernel else self.plan_batches()
        self.sdpa_spans = self._unbatched()
        self._one_batch_is_all = (len(self.batches) == 1 and not self.sdpa_spans and not self.decodes
                                  and self.batches[0].first_row == 0
                                  and len(self.batches[0].members) == len(spans)
                                  and all(span.num_queries == 1 for span in spans))
        if self.decodes:
            self.decode_max_len = max(spans[i].length for i in self.decodes)
            self.layer_calls = LayerCalls()  # the native decode call, checked at the first layer (CPU)
        # a decode step whose rows are the packed rows in order: q read and output written in place
        self._decodes_are_all = (0 < len(self.decodes) == len(spans)
                                 and all(span.query_start == i for i, span in enumerate(spans)))
        self._staged: StepMetadata | None = StepMetadata()
        self.stage(self._staged)

    def _unbatched(self) -> list[int]:
        """Span indices that neither the decode kernel nor a batch takes: SDPA one by one."""
        taken = len(self.decodes) + sum(len(batch.members) for batch in self.batches)
        if taken == len(self.spans):  # every span is taken (a decode step): no set to build
            return []
        taken = set(self.decodes).union(*(batch.members for batch in self.batches))
        return [i for i in range(len(self.spans)) if i not in taken]

    def upload(self, **model_inputs: list[int]) -> dict[str, torch.Tensor]:
        """Send the staged index tensors to the device, together with ``model_inputs`` (int64
        lists such as the step's token ids), in one transfer; returns the model inputs as device
        tensors. Runs by itself before the first layer if nobody called it."""
        staged, self._staged = self._staged, None
        for name, values in model_inputs.items():
            staged.add(name, values)
        uploaded = staged.upload(self.device)
        for name, tensor in uploaded.items():
            if name not in model_inputs:
                setattr(self, name, tensor)
        return {name: uploaded[name] for name in model_inputs}

    def stage(self, staged: StepMetadata) -> None:
        """Add this step's index arrays (host lists) to ``staged``; uploaded together."""
        if self.decodes:
            decoding = [self.spans[i] for i in self.decodes]
            staged.add("decode_rows", [s.query_start for s in decoding])
            staged.add("decode_lens", [s.length for s in decoding], torch.int32)
            if self.prefix_block_tokens and self.device.type == "cpu":
                self._shared_prefix = shared_prefixes([s.block_table for s in decoding],
                                                      [s.length for s in decoding], self.prefix_block_tokens)
            if self._shared_prefix:
                leaders, lengths = self._shared_prefix
                staged.add("decode_prefix_leaders", leaders, torch.int32)
                staged.add("decode_prefix_lens", lengths, torch.int32)

    def shared_prefix(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decoding sequences' prefix groups for a layer's native decode call (none with a
        window: its reads start at the window)."""
        if not self._shared_prefix or window:
            return None
        return self.decode_prefix_leaders, self.decode_prefix_lens

    def __getattr__(self, name: str):
        # A staged tensor asked for before the upload (a caller that writes without a forward):
        # upload now. Only reached when normal lookup fails, so it costs the hot path nothing.
        staged = self.__dict__.get("_staged")
        if staged is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.upload()
        return getattr(self, name)

    def _begin(self) -> float:
        """At each layer's call: the upload, if the caller did not (the first layer); returns the
        start time."""
        if self._staged is not None:
            self.upload()
        return time.perf_counter()

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float | None, window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """``query`` ``[1, Hq, T, D]``, ``key``/``value`` ``[1, Hk, T, D]`` (after RoPE); returns
        ``[1, T, Hq, D]``. ``window``, ``softcap``, ``sinks``, ``chunk``: the layer's variant
        (``variants``)."""
        start = self._begin()
        _, num_heads, num_tokens, head_dim = query.shape
        scale = scaling if scaling is not None else head_dim ** -0.5
        new_kv = key[0].transpose(0, 1), value[0].transpose(0, 1)
        if self._decodes_are_all and self.device.type == "cpu" and not chunk:
            # the native routine writes each sequence's new token itself, then attends: one call
            output = query.new_empty((1, num_tokens, num_heads, head_dim))
            self.decode(layer, query[0].transpose(0, 1), scale, out=output[0], new_kv=new_kv, window=window,
                        softcap=softcap, sinks=sinks)
            self.seconds += time.perf_counter() - start
            return output
        # Write every new token first, so each sequence below reads a complete cache.
        self.write(layer, *new_kv)
        if chunk:  # each sequence from its own chunk start; the spans tile the packed rows in order
            attended = [self._attend_span(layer, index, query, scale, None, softcap, sinks, chunk)
                        for index in range(len(self.spans))]
            self.seconds += time.perf_counter() - start
            return torch.cat(attended, dim=2).transpose(1, 2)
        output = None
        variant = dict(window=window, softcap=softcap, sinks=sinks)
        if self._decodes_are_all:  # one kernel call over the packed rows, no gather or scatter
            output = query.new_empty((1, num_tokens, num_heads, head_dim))
            self.decode(layer, query[0].transpose(0, 1), scale, out=output[0], **variant)
            self.seconds += time.perf_counter() - start
            return output
        if self.decodes:  # one gather in, one kernel, one scatter out: no per-sequence ops
            output = query.new_empty((1, num_tokens, num_heads, head_dim))
            q = query[0].index_select(1, self.decode_rows).transpose(0, 1).contiguous()  # [B, Hq, D]
            output[0].index_copy_(0, self.decode_rows, self.decode(layer, q, scale, **variant))
        one_by_one = self.sdpa_spans
        if self._one_batch_is_all and (read := self.batches[0].window(window)) is not None:
            # the common decode step: one batch whose rows are the packed rows, in order
            output = attend(query, *self.batch_kv(layer, self.batches[0], read[0], query.dtype), read[1],
                            self.batches[0], scale, None, softcap, sinks)
            self.seconds += time.perf_counter() - start
            return output
        if self.batches:
            output = query.new_empty((1, num_tokens, num_heads, head_dim))
            for batch in self.batches:  # one call per batch, rows in and out by index
                read = batch.window(window)
                if read is None:  # windows start apart: no read behind any member's window
                    one_by_one = one_by_one + batch.members
                    continue
                attend(query, *self.batch_kv(layer, batch, read[0], query.dtype), read[1], batch, scale, output,
                       softcap, sinks)
        if one_by_one and self._native_prefill(query, layer, window, softcap, sinks):
            # every other sequence in one native call that reads the cache in place (cpu_prefill)
            output = query.new_empty((1, num_tokens, num_heads, head_dim)) if output is None else output
            prefill_attention_cpu(query[0].transpose(0, 1), *self.cache_views(layer),
                                  self._prefill_spans(one_by_one), scale, output[0],
                                  kv_scales=self.cache_scale_views(layer))
            one_by_one = []
        attended = [self._attend_span(layer, index, query, scale, window, softcap, sinks)
                    for index in one_by_one]
        if output is None:  # SDPA only (CPU): the spans tile the packed rows in order, one cat
            output = torch.cat(attended, dim=2).transpose(1, 2)
        else:
            for index, part in zip(one_by_one, attended):
                span = self.spans[index]
                output[0, span.query_start: span.query_start + span.num_queries] = part[0].transpose(0, 1)
        self.seconds += time.perf_counter() - start
        return output

    def _attend_span(self, layer: int, index: int, query: torch.Tensor, scale: float,
                     window: int | None, softcap: float | None, sinks: torch.Tensor | None,
                     chunk: int | None = None) -> torch.Tensor:
        """Span ``index``'s attention over its keys from its window (or chunk) start,
        ``[1, Hq, num_queries, D]``: SDPA, or ``explicit_attention`` for soft-capping and sinks."""
        span = self.spans[index]
        q = query[:, :, span.query_start: span.query_start + span.num_queries]
        first = chunk_start(span.num_cached, chunk) if chunk else window_start(span.num_cached, window)
        k, v = self.read(layer, index, first, q.dtype)  # [length - first, Hk, D] each
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if needs_explicit(softcap, sinks):
            mask = self._chunk_mask(span, first, chunk, q.device) if chunk else self._mask(span, first, window, q.device)
            return explicit_attention(q, k, v, scale, mask, softcap, sinks)
        # Plain causal from position 0 is SDPA's own (top-left aligned) is_causal.
        bounded = (window and span.length > window) or (chunk and span.length > chunk)
        if span.num_cached == 0 and span.num_queries > 1 and not bounded:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        mask = self._chunk_mask(span, first, chunk, q.device) if chunk else self._mask(span, first, window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def _native_prefill(self, query: torch.Tensor, layer: int, window: int | None, softcap: float | None,
                        sinks: torch.Tensor | None) -> bool:
        """Whether this layer's SDPA sequences go to the native prefill routine: on the CPU with
        the native decode routine, plain causal attention (no window, cap or sinks), rows of the
        query's dtype (or quantized, with their scales) with a contiguous last dim."""
        if not (self.decodes_natively_on_cpu and not window and softcap is None and sinks is None
                and query.stride(3) == 1):
            return False
        k = self.cache_views(layer)[0]
        quantized = self.cache_scale_views(layer) is not None
        return (query.dtype == k.dtype or quantized) and not prefill_unavailable(query.dtype, query.shape[1],
                                                                                 k.shape[2], query.shape[3])

    def _prefill_spans(self, members: list[int]) -> PrefillSpans:
        """The routine's arrays for ``members`` (span indices), made once a step."""
        key = tuple(members)
        if self._prefill_arrays is None or self._prefill_arrays[0] != key:
            spans = [self.spans[i] for i in members]
            index, block_size = self.prefill_index(members)
            self._prefill_arrays = key, PrefillSpans([s.query_start for s in spans], [s.num_queries for s in spans],
                                                     [s.num_cached for s in spans], index, block_size)
        return self._prefill_arrays[1]

    def prefill_index(self, members: list[int]) -> tuple[list, int]:
        """Where ``members``' keys are, for the native prefill routine: ``(index, block_size)``,
        slot ids and 0, or block tables (padded) and the tokens of a block."""
        raise NotImplementedError

    def cache_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V cache as ``[outer, tokens, Hk, D]``: slot views or block tensors."""
        raise NotImplementedError

    def cache_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantized cache's scales beside ``cache_views``, ``[outer, tokens, Hk, groups]``
        float32; None for a plain cache."""
        return None

    def cache_rows(self, layer: int, select, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``select(t)`` of the layer's K and V cache (an index or a gather): as they lie, or, of a
        quantized cache, with ``select`` of their scales, dequantized into ``dtype`` (new tensors)."""
        k_cache, v_cache = self.cache_views(layer)
        scales = self.cache_scale_views(layer)
        if scales is None:
            return select(k_cache), select(v_cache)
        return (dequantize(select(k_cache), select(scales[0]), dtype),
                dequantize(select(v_cache), select(scales[1]), dtype))

    def plan_batches(self) -> list[DecodeBatch]:
        """Decoding spans this addressing reads together (called once per step; none here)."""
        return []

    def batch_kv(self, layer: int, batch: DecodeBatch, start: int = 0,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's keys and values at positions ``start .. read_len``, ``[B, read_len - start, Hk, D]``
        (a quantized cache's dequantized into ``dtype``)."""
        raise NotImplementedError

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[T, Hk, D]`` (the packed batch's new tokens)."""
        raise NotImplementedError

    def read(self, layer: int, index: int, start: int = 0,
             dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``index``'s keys and values from position ``start``, ``[length - start, Hk, D]``
        (a quantized cache's dequantized into ``dtype``)."""
        raise NotImplementedError

    def decode(self, layer: int, q: torch.Tensor, scale: float, **variant) -> torch.Tensor:
        """The decode sequences' attention with the decode kernel, ``q`` ``[B, Hq, D]``;
        ``variant``: ``window``, ``softcap``, ``sinks``."""
        raise NotImplementedError

    def _mask(self, span: SequenceSpan, start: int, window: int | None, device) -> torch.Tensor | None:
        """Causal (and window) mask of the span's queries over its keys from ``start`` (SDPA's own
        is_causal aligns top-left, which is right only when nothing is cached); None when every
        key read is seen (a decode)."""
        if span.num_queries == 1:
            return None
        key = (span.num_cached, span.num_queries, window if window and span.length > window else None)
        if key not in self._masks:
            self._masks[key] = causal_window_mask(span.num_cached, span.num_queries, start, key[2], device)
        return self._masks[key]

    def _chunk_mask(self, span: SequenceSpan, start: int, chunk: int, device) -> torch.Tensor | None:
        """``_mask`` for chunked local attention (``variants.causal_chunk_mask``)."""
        if span.num_queries == 1:
            return None  # a decode reads from its own chunk start: every key read is seen
        key = (span.num_cached, span.num_queries, -chunk)  # apart from the window masks' keys
        if key not in self._masks:
            self._masks[key] = causal_chunk_mask(span.num_cached, span.num_queries, start, chunk, device)
        return self._masks[key]

    @staticmethod
    def token_positions(spans: list[SequenceSpan]) -> tuple[list[int], list[int]]:
        """(span index, absolute position) of every new token, in packed order."""
        if all(span.num_queries == 1 for span in spans):  # a decode step: one token each
            return list(range(len(spans))), [span.num_cached for span in spans]
        owners, positions = [], []
        for index, span in enumerate(spans):
            owners += [index] * span.num_queries
            positions += range(span.num_cached, span.length)
        return owners, positions
