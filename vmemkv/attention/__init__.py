"""Attention over KV caches: virtually contiguous slots (vmem) and block tables (paged)."""

from .contiguous import ContiguousAttention
from .flash import FlashBlockTableAttention, FlashSlotAttention
from .metadata import StepMetadata
from .packed import PackedAttention, SequenceSpan
from .paged import BlockTableAttention

__all__ = ["BlockTableAttention", "ContiguousAttention", "FlashBlockTableAttention", "FlashSlotAttention",
           "PackedAttention", "SequenceSpan", "StepMetadata"]
