"""Attention for one packed, ragged forward pass: the part both KV backends share.

Each sequence contributes ``num_queries`` new tokens after ``num_cached`` cached ones. A layer's
call writes every new token's K/V into the cache first, then attends per sequence with PyTorch
SDPA over the sequence's keys. Subclasses say only how tokens are addressed: through a slot view
(vmem) or through a block table (paged).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's share of a packed forward pass."""

    slot: int
    query_start: int  # first row in the packed batch
    num_queries: int  # new tokens this step
    num_cached: int  # tokens already in the cache before this step
    block_table: tuple[int, ...] = ()  # its blocks, for block-table addressing

    @property
    def length(self) -> int:
        return self.num_cached + self.num_queries


class PackedAttention:
    """``decode_kernel``: attend all single-token (decode) sequences in one Triton launch that
    reads the cache in place (CUDA only); the others, and everything when off, go through SDPA."""

    def __init__(self, spans: list[SequenceSpan], device: torch.device, decode_kernel: bool = False):
        self.spans = spans
        self._masks: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self.seconds = 0.0  # wall time inside attention (host time: on a GPU, launch time only)
        self.decodes = [i for i, span in enumerate(spans) if span.num_queries == 1] if decode_kernel else []
        if self.decodes:
            decoding = [spans[i] for i in self.decodes]
            self.decode_rows = torch.tensor([s.query_start for s in decoding], device=device)
            self.decode_lens = torch.tensor([s.length for s in decoding], dtype=torch.int32, device=device)
            self.decode_max_len = max(s.length for s in decoding)

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float | None) -> torch.Tensor:
        """``query`` ``[1, Hq, T, D]``, ``key``/``value`` ``[1, Hk, T, D]`` (after RoPE); returns
        ``[1, T, Hq, D]``."""
        start = time.perf_counter()
        # Write every new token first, so each sequence below reads a complete cache.
        self.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
        outputs: list[torch.Tensor | None] = [None] * len(self.spans)
        if self.decodes:
            q = query[0].index_select(1, self.decode_rows).transpose(0, 1).contiguous()  # [B, Hq, D]
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            decoded = self.decode(layer, q, scale)  # [B, Hq, D]
            for row, index in enumerate(self.decodes):
                outputs[index] = decoded[row][None, :, None]
        for index, span in enumerate(self.spans):
            if outputs[index] is not None:
                continue
            q = query[:, :, span.query_start: span.query_start + span.num_queries]
            k, v = self.read(layer, index)  # [length, Hk, D] each
            if k.dtype != q.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
            outputs[index] = F.scaled_dot_product_attention(
                q, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=self._mask(span, q.device),
                is_causal=span.num_cached == 0 and span.num_queries > 1, scale=scaling,
                enable_gqa=True)
        output = torch.cat(outputs, dim=2).transpose(1, 2)
        self.seconds += time.perf_counter() - start
        return output

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[T, Hk, D]`` (the packed batch's new tokens)."""
        raise NotImplementedError

    def read(self, layer: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``index``'s keys and values, ``[length, Hk, D]`` each."""
        raise NotImplementedError

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """The decode sequences' attention with the Triton kernel, ``q`` ``[B, Hq, D]``."""
        raise NotImplementedError

    def _mask(self, span: SequenceSpan, device) -> torch.Tensor | None:
        """Causal mask for queries that follow cached tokens (SDPA's own is_causal aligns
        top-left, which is right only when nothing is cached)."""
        if span.num_queries == 1 or span.num_cached == 0:
            return None
        key = (span.num_cached, span.num_queries, device)
        if key not in self._masks:
            rows = torch.arange(span.num_queries, device=device)[:, None] + span.num_cached
            self._masks[key] = torch.arange(span.length, device=device) <= rows
        return self._masks[key]

    @staticmethod
    def token_positions(spans: list[SequenceSpan]) -> tuple[list[int], list[int]]:
        """(span index, absolute position) of every new token, in packed order."""
        owners, positions = [], []
        for index, span in enumerate(spans):
            owners += [index] * span.num_queries
            positions += range(span.num_cached, span.length)
        return owners, positions
