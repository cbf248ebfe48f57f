"""Multi-head latent attention (MLA: DeepSeek-V2/V3, MiniCPM3) over the latent rows in slots.

Each token caches one row per layer, ``[c_kv | k_pe]``: the compressed KV after its norm
(``kv_lora_rank`` values) and the rope'd key shared by every head (``qk_rope_head_dim``). In the
absorbed form (DeepSeek-V2 paper, appendix; FlashMLA) attention is multi-query attention over
those rows: the caller projects each head's ``q_nope`` into the latent space through ``W_UK``
(``q_latent``), so a score is ``q_latent . c_kv + q_pe . k_pe``, one dot product with the whole
row; the output is the softmax times ``c_kv`` (the row's first ``kv_lora_rank`` values), which the
caller projects back through ``W_UV``. Nothing is decompressed, prefill or decode.

A request's rows of one layer are one strided view of its slot (``[token][layer][row]``), read in
place with no block table; each request attends its own rows ``0 .. position`` (causal within a
packed ragged step). Quantized rows (``kv_cache_dtype`` int8 / fp8: the row's bytes with a float32
scale per group beside them, ``memory/quantized_rows.py``) are written quantized and read
dequantized into float32, a request's rows at a time.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from vmemkv.attention.metadata import StepMetadata
from vmemkv.attention.packed import PackedAttention, SequenceSpan
from vmemkv.attention.variants import causal_window_mask
from vmemkv.memory.quantized_rows import dequantize, write_rows


class LatentAttention:
    """The step's attention for a latent layout: ``kv_views(layer)`` gives that layer's latent
    view ``[slot, token, 1, latent_dim]`` (both views of a latent layout are that one);
    ``kv_scale_views(layer)`` a quantized layout's scales beside it."""

    def __init__(self, spans: list[SequenceSpan], kv_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device,
                 kv_scale_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.spans, self.kv_views, self.device = spans, kv_views, torch.device(device)
        self.kv_scale_views = kv_scale_views
        self.seconds = 0.0
        self.copy_seconds = 0.0  # nothing is gathered: rows are read in place
        self._staged: StepMetadata | None = StepMetadata()
        owners, positions = PackedAttention.token_positions(spans)
        self._staged.add("write_slots", [spans[i].slot for i in owners])
        self._staged.add("write_positions", positions)

    def upload(self, **model_inputs: list[int]) -> dict[str, torch.Tensor]:
        """The write indices and ``model_inputs`` to the device in one transfer (as
        ``PackedAttention.upload``); returns the model inputs as device tensors."""
        staged, self._staged = self._staged, None
        for name, values in model_inputs.items():
            staged.add(name, values)
        uploaded = staged.upload(self.device)
        self.write_slots, self.write_positions = uploaded["write_slots"], uploaded["write_positions"]
        return {name: uploaded[name] for name in model_inputs}

    def __call__(self, layer: int, query: torch.Tensor, latent: torch.Tensor, scaling: float,
                 value_dim: int) -> torch.Tensor:
        """``query`` ``[1, H, T, D]`` (``[q_latent | q_pe]`` per head), ``latent`` ``[1, 1, T, D]``
        (the step's new rows ``[c_kv | k_pe]``), ``value_dim``: ``kv_lora_rank``. Writes the new
        rows at each request's positions, then attends; returns ``[1, T, H, value_dim]``."""
        if self._staged is not None:
            self.upload()
        began = time.perf_counter()
        cache = self.kv_views(layer)[0]
        scales = None if self.kv_scale_views is None else self.kv_scale_views(layer)[0]
        write_rows(cache, scales, (self.write_slots, self.write_positions), latent[0].transpose(0, 1))
        _, num_heads, num_tokens, _ = query.shape
        out = query.new_empty(1, num_tokens, num_heads, value_dim)
        for span in self.spans:
            rows = cache[span.slot, :span.length, 0]  # [L, D], in place
            if scales is not None:
                rows = dequantize(rows, scales[span.slot, :span.length, 0], torch.float32)
            queries = slice(span.query_start, span.query_start + span.num_queries)
            mask = (causal_window_mask(span.num_cached, span.num_queries, 0, None, self.device)
                    if span.num_queries > 1 else None)
            out[0, queries] = attend_latent(query[0, :, queries], rows, scaling, value_dim, mask).transpose(0, 1)
        self.seconds += time.perf_counter() - began
        return out


def attend_latent(query: torch.Tensor, rows: torch.Tensor, scaling: float, value_dim: int,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """``query`` ``[H, M, D]``, ``rows`` ``[N, D]``, ``mask`` bool ``[M, N]`` (True: seen) or None;
    returns ``[H, M, value_dim]`` in query's dtype: softmax(scaling * query . rows) . rows[:, :value_dim],
    in at least float32 (as eager attention)."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    keys = rows.to(dtype)
    scores = (query.to(dtype) @ keys.T) * scaling  # [H, M, N]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ keys[:, :value_dim]).to(query.dtype)
