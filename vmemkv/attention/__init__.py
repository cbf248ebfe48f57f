"""Attention over KV caches: virtually contiguous slots (vmem) and block tables (paged)."""

from vmemkv.attention.contiguous import ContiguousAttention
from vmemkv.attention.flash import FlashBlockTableAttention, FlashSlotAttention
from vmemkv.attention.metadata import StepMetadata
from vmemkv.attention.packed import PackedAttention, SequenceSpan
from vmemkv.attention.paged import BlockTableAttention

__all__ = ["BlockTableAttention", "ContiguousAttention", "FlashBlockTableAttention", "FlashSlotAttention",
           "PackedAttention", "SequenceSpan", "StepMetadata"]
