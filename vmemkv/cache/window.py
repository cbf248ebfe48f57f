"""Sliding-window arithmetic (``CacheConfig.sliding_window``) as functions of the window: the
rules of ``kv_spec.SlidingWindowSpec`` for a window ``W`` (None: full attention's).
"""

from __future__ import annotations

from typing import Callable

from vmemkv.cache.kv_spec import local_spec


def first_needed_block(next_position: int, window: int | None, tokens_per_block: int) -> int:
    """The first block a query at ``next_position`` (or any later one) reads; 0 without a window."""
    return local_spec(window).first_needed_block(next_position, tokens_per_block)


def peak_blocks(num_tokens: int, chunk_tokens: int | None, window: int | None,
                tokens_per_block: int) -> int:
    """``KVCacheSpec.peak_blocks`` for a sliding window (every block without one)."""
    return local_spec(window).peak_blocks(num_tokens, chunk_tokens, tokens_per_block)


def windowed_prefix_hits(num_candidates: int, is_cached: Callable[[int], bool], window: int,
                         tokens_per_block: int) -> tuple[int, int]:
    """``KVCacheSpec.prefix_hits`` for a sliding window: ``(num_hit_blocks, first_resident)``."""
    return local_spec(window).prefix_hits(num_candidates, is_cached, tokens_per_block)
