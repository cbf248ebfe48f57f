"""vmem addressing: each sequence's K/V is its slot view narrowed to its length, a plain strided
tensor, so SDPA reads it with no block table and no copy."""

from __future__ import annotations

from typing import Callable

import torch

from .packed import PackedAttention, SequenceSpan


class ContiguousAttention(PackedAttention):
    """``kv_views(layer)`` gives that layer's ``[slot, token, kv_head, dim]`` K and V views."""

    def __init__(self, spans: list[SequenceSpan],
                 kv_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]], device: torch.device):
        super().__init__(spans)
        self.kv_views = kv_views
        owners, positions = self.token_positions(spans)
        self.write_slots = torch.tensor([spans[i].slot for i in owners], dtype=torch.long, device=device)
        self.write_positions = torch.tensor(positions, dtype=torch.long, device=device)

    def write(self, layer, key, value):
        k_cache, v_cache = self.kv_views(layer)
        k_cache[self.write_slots, self.write_positions] = key.to(k_cache.dtype)
        v_cache[self.write_slots, self.write_positions] = value.to(v_cache.dtype)

    def read(self, layer, index):
        k_cache, v_cache = self.kv_views(layer)
        span = self.spans[index]
        return k_cache[span.slot, :span.length], v_cache[span.slot, :span.length]
