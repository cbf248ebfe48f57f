"""Sliding-window arithmetic for releasing blocks behind the window (``CacheConfig.sliding_window``).

A query at position ``p`` of a layer with window ``W`` reads keys ``max(0, p - W + 1) .. p``
(``attention.variants.window_start``). A request's next query is at its first uncomputed
position (the first query of its next chunk, or its next decode), and later queries only read
further on, so every block wholly before that query's window start is never read again: the
manager gives it back. Pure functions of counts; the manager applies them.
"""

from __future__ import annotations

from typing import Callable

from .attention.variants import window_start


def first_needed_block(next_position: int, window: int | None, tokens_per_block: int) -> int:
    """The first block a query at ``next_position`` (or any later one) reads; 0 without a window."""
    return window_start(next_position, window) // tokens_per_block


def peak_blocks(num_tokens: int, chunk_tokens: int | None, window: int | None,
                tokens_per_block: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens holds at once when it is computed in
    chunks of at most ``chunk_tokens`` (None: all at once) and, with a window, blocks wholly
    behind it are released after each chunk: it then holds the ``W - 1`` tokens before its next
    query plus one chunk, ``L`` tokens, which span at most ``ceil((L - 1) / P) + 1`` blocks."""
    every_block = -(-num_tokens // tokens_per_block)
    if not window or chunk_tokens is None:
        return every_block
    span = window - 1 + max(chunk_tokens, 1)
    return min(every_block, (span - 1 + tokens_per_block - 1) // tokens_per_block + 1)


def windowed_prefix_hits(num_candidates: int, is_cached: Callable[[int], bool], window: int,
                         tokens_per_block: int) -> tuple[int, int]:
    """The longest usable cached prefix for a windowed request, as ``(num_hit_blocks,
    first_resident)``: its next query (at ``num_hit_blocks * P``) reads blocks
    ``first_resident .. num_hit_blocks - 1``, which must all be cached; earlier blocks need not
    be (vLLM's sliding-window rule). ``is_cached(i)``: whether block ``i`` of the prompt's hash
    chain (``i < num_candidates``) is in the cache. Scans from the longest candidate down."""
    missing_before = [0] * (num_candidates + 1)  # 1 + the last missing block index below i, or 0
    for index in range(num_candidates):
        missing_before[index + 1] = missing_before[index] if is_cached(index) else index + 1
    for hits in range(num_candidates, 0, -1):
        first = first_needed_block(hits * tokens_per_block, window, tokens_per_block)
        if missing_before[hits] <= first:
            return hits, first
    return 0, 0

