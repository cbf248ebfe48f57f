"""Attention over KV caches: virtually contiguous slots (vmem) and, later, block tables (paged)."""

from .contiguous import ContiguousAttention, SequenceSpan

__all__ = ["ContiguousAttention", "SequenceSpan"]
