"""Sliding-window arithmetic (``CacheConfig.sliding_window``) as functions of the window: the
rules of ``attention_spec.AttentionSpec`` for a sliding window ``W`` (None: full attention).
A query at position ``p`` reads keys ``max(0, p - W + 1) .. p``; every block wholly before the
next query's window start is never read again, so the manager gives it back.
"""

from __future__ import annotations

from typing import Callable

from vmemkv.cache.attention_spec import AttentionSpec


def _spec(window: int | None) -> AttentionSpec:
    return AttentionSpec.of(sliding_window=window)


def first_needed_block(next_position: int, window: int | None, tokens_per_block: int) -> int:
    """The first block a query at ``next_position`` (or any later one) reads; 0 without a window."""
    return _spec(window).first_needed_block(next_position, tokens_per_block)


def peak_blocks(num_tokens: int, chunk_tokens: int | None, window: int | None,
                tokens_per_block: int) -> int:
    """``AttentionSpec.peak_blocks`` for a sliding window (every block without one)."""
    return _spec(window).peak_blocks(num_tokens, chunk_tokens, tokens_per_block)


def windowed_prefix_hits(num_candidates: int, is_cached: Callable[[int], bool], window: int,
                         tokens_per_block: int) -> tuple[int, int]:
    """``AttentionSpec.prefix_hits`` for a sliding window: ``(num_hit_blocks, first_resident)``."""
    return _spec(window).prefix_hits(num_candidates, is_cached, tokens_per_block)
