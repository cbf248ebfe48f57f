"""vmem addressing: each sequence's K/V is its slot view narrowed to its length, a plain strided
tensor, so SDPA reads it with no block table and no copy."""

from __future__ import annotations

from typing import Callable

import torch

from .packed import PackedAttention, SequenceSpan


class ContiguousAttention(PackedAttention):
    """``kv_views(layer)`` gives that layer's ``[slot, token, kv_head, dim]`` K and V views."""

    def __init__(self, spans: list[SequenceSpan],
                 kv_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 decode_kernel: bool = False):
        super().__init__(spans, device, decode_kernel)
        self.kv_views = kv_views
        owners, positions = self.token_positions(spans)
        self.write_slots = torch.tensor([spans[i].slot for i in owners], dtype=torch.long, device=device)
        self.write_positions = torch.tensor(positions, dtype=torch.long, device=device)
        if self.decodes:
            self.decode_slots = torch.tensor([spans[i].slot for i in self.decodes], dtype=torch.int32,
                                             device=device)

    def write(self, layer, key, value):
        k_cache, v_cache = self.kv_views(layer)
        k_cache[self.write_slots, self.write_positions] = key.to(k_cache.dtype)
        v_cache[self.write_slots, self.write_positions] = value.to(v_cache.dtype)

    def read(self, layer, index):
        k_cache, v_cache = self.kv_views(layer)
        span = self.spans[index]
        return k_cache[span.slot, :span.length], v_cache[span.slot, :span.length]

    def decode(self, layer, q, scale):
        from .triton_decode import decode_attention_contiguous

        k_cache, v_cache = self.kv_views(layer)
        return decode_attention_contiguous(q, k_cache, v_cache, self.decode_slots, self.decode_lens,
                                           scale, max_seq_len=self.decode_max_len)
