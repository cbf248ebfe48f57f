"""Attention for a packed, ragged batch whose KV lives in virtually contiguous slots.

Each sequence's K and V for a layer are the slot views narrowed to its length: plain strided
tensors, so PyTorch SDPA reads them with no block table and no copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's share of a packed forward pass."""

    slot: int
    query_start: int  # first row in the packed batch
    num_queries: int  # new tokens this step
    num_cached: int  # tokens already in the cache before this step


class ContiguousAttention:
    """The attention of one forward pass. ``kv_views(layer)`` gives that layer's
    ``[slot, token, kv_head, dim]`` K and V views."""

    def __init__(self, spans: list[SequenceSpan],
                 kv_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]], device: torch.device):
        self.spans = spans
        self.kv_views = kv_views
        slots, positions = [], []
        for span in spans:
            slots += [span.slot] * span.num_queries
            positions += range(span.num_cached, span.num_cached + span.num_queries)
        self.write_slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.write_positions = torch.tensor(positions, dtype=torch.long, device=device)
        self._masks = {}

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float | None) -> torch.Tensor:
        """``query`` ``[1, Hq, T, D]``, ``key``/``value`` ``[1, Hk, T, D]`` (after RoPE); returns
        ``[1, T, Hq, D]``."""
        k_cache, v_cache = self.kv_views(layer)
        # Write every new token first, so each sequence below reads a complete cache.
        k_cache[self.write_slots, self.write_positions] = key[0].transpose(0, 1).to(k_cache.dtype)
        v_cache[self.write_slots, self.write_positions] = value[0].transpose(0, 1).to(v_cache.dtype)
        outputs = []
        for span in self.spans:
            length = span.num_cached + span.num_queries
            q = query[:, :, span.query_start: span.query_start + span.num_queries]
            k = k_cache[span.slot, :length].transpose(0, 1).unsqueeze(0)
            v = v_cache[span.slot, :length].transpose(0, 1).unsqueeze(0)
            outputs.append(F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=self._mask(span, q.device),
                is_causal=span.num_cached == 0 and span.num_queries > 1, scale=scaling,
                enable_gqa=True))
        return torch.cat(outputs, dim=2).transpose(1, 2)

    def _mask(self, span: SequenceSpan, device) -> torch.Tensor | None:
        """Causal mask for queries that follow cached tokens (SDPA's own is_causal aligns
        top-left, which is right only when nothing is cached)."""
        if span.num_queries == 1 or span.num_cached == 0:
            return None
        key = (span.num_cached, span.num_queries)
        if key not in self._masks:
            rows = torch.arange(span.num_queries, device=device)[:, None] + span.num_cached
            self._masks[key] = torch.arange(span.num_cached + span.num_queries, device=device) <= rows
        return self._masks[key]
