"""Which earlier positions a layer's queries read, as the KV cache sees it: :class:`AttentionSpec`,
the rules a group of layers gives its manager (vLLM's ``KVCacheSpec`` and single-type managers).

* **full attention**: a query at position ``p`` reads keys ``0 .. p``; nothing is ever released.
* **sliding window** ``W`` (Mistral, Gemma's local layers): keys ``max(0, p - W + 1) .. p``.
* **chunked local** ``C`` (Llama-4's ``attention_chunk_size``): keys ``p // C * C .. p``, the
  query's own chunk of ``C`` positions.

A request's next query is at its first uncomputed position, and every later query starts reading
at the same position or further on (each rule's start only grows with ``p``), so every block wholly
before that query's first read is never read again: the manager gives it back while the request
runs, and a prefix hit needs only the blocks that query reads. Pure functions of counts; the
manager applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vmemkv.errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_window"
CHUNKED = "chunked_local"


@dataclass(frozen=True)
class AttentionSpec:
    """``kind`` (``FULL``, ``SLIDING`` or ``CHUNKED``) and ``size`` (the window ``W`` or the
    chunk ``C``; None for full attention)."""

    kind: str = FULL
    size: int | None = None

    def __post_init__(self):
        if self.kind not in (FULL, SLIDING, CHUNKED):
            raise ConfigError(f"attention kind {self.kind!r}: use {FULL!r}, {SLIDING!r} or {CHUNKED!r}")
        if (self.kind == FULL) != (self.size is None):
            raise ConfigError(f"{self.kind} takes {'no size' if self.kind == FULL else 'a size'}; "
                              f"got {self.size!r}")

    @staticmethod
    def of(sliding_window: int | None = None, chunk_size: int | None = None) -> "AttentionSpec":
        """The spec of ``CacheConfig``'s ``sliding_window`` / ``attention_chunk_size`` (at most
        one of them)."""
        if sliding_window and chunk_size:
            raise ConfigError(f"a sliding window ({sliding_window}) and attention chunks "
                              f"({chunk_size}) in one group; give one of them")
        if sliding_window:
            return AttentionSpec(SLIDING, sliding_window)
        if chunk_size:
            return AttentionSpec(CHUNKED, chunk_size)
        return AttentionSpec()

    @property
    def releases(self) -> bool:
        """Whether blocks become unreadable while a request runs (anything but full attention)."""
        return self.kind != FULL

    @property
    def window(self) -> int | None:
        """The sliding window, or None."""
        return self.size if self.kind == SLIDING else None

    def describe(self) -> str:
        return {FULL: "full attention", SLIDING: f"sliding window of {self.size}",
                CHUNKED: f"attention chunks of {self.size}"}[self.kind]

    def first_read(self, position: int) -> int:
        """The first key position a query at ``position`` (or any later one) reads."""
        if self.kind == SLIDING:
            return max(0, position - self.size + 1)
        if self.kind == CHUNKED:
            return position // self.size * self.size
        return 0

    def first_needed_block(self, next_position: int, tokens_per_block: int) -> int:
        """The first block a query at ``next_position`` (or any later one) reads."""
        return self.first_read(next_position) // tokens_per_block

    def peak_blocks(self, num_tokens: int, chunk_tokens: int | None, tokens_per_block: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once when it is computed
        in chunks of at most ``chunk_tokens`` (None: all at once) and blocks wholly before its
        next query's first read are released after each chunk: it then holds at most the
        ``size - 1`` positions before its next query plus one chunk, ``L`` positions, which span
        at most ``ceil((L - 1) / P) + 1`` blocks."""
        every_block = -(-num_tokens // tokens_per_block)
        if not self.releases or chunk_tokens is None:
            return every_block
        span = self.size - 1 + max(chunk_tokens, 1)
        return min(every_block, (span - 1 + tokens_per_block - 1) // tokens_per_block + 1)

    def prefix_hits(self, num_candidates: int, is_cached: Callable[[int], bool],
                    tokens_per_block: int) -> tuple[int, int]:
        """The longest usable cached prefix, as ``(num_hit_blocks, first_resident)``: its next
        query (at ``num_hit_blocks * P``) reads blocks ``first_resident .. num_hit_blocks - 1``,
        which must all be cached; earlier blocks need not be (vLLM's sliding-window rule; full
        attention reads from block 0). ``is_cached(i)``: whether block ``i`` of the prompt's hash
        chain (``i < num_candidates``) is in the cache. Scans from the longest candidate down."""
        missing_before = [0] * (num_candidates + 1)  # 1 + the last missing block index below i, or 0
        for index in range(num_candidates):
            missing_before[index + 1] = missing_before[index] if is_cached(index) else index + 1
        for hits in range(num_candidates, 0, -1):
            first = self.first_needed_block(hits * tokens_per_block, tokens_per_block)
            if missing_before[hits] <= first:
                return hits, first
        return 0, 0
