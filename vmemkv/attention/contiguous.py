"""vmem addressing: each sequence's K/V is its slot view narrowed to its length, a plain strided
tensor, so SDPA reads it with no block table and no copy."""

from __future__ import annotations

from typing import Callable

import torch

from .metadata import StepMetadata
from .packed import PackedAttention, SequenceSpan


class ContiguousAttention(PackedAttention):
    """``kv_views(layer)`` gives that layer's ``[slot, token, kv_head, dim]`` K and V views."""

    def __init__(self, spans: list[SequenceSpan],
                 kv_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 decode_kernel: bool = False):
        self.kv_views = kv_views
        super().__init__(spans, device, decode_kernel)

    def stage(self, staged: StepMetadata) -> None:
        super().stage(staged)
        owners, positions = self.token_positions(self.spans)
        staged.add("write_slots", [self.spans[i].slot for i in owners])
        staged.add("write_positions", positions)
        if self.decodes:
            staged.add("decode_slots", [self.spans[i].slot for i in self.decodes], torch.int32)

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
