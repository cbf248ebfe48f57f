"""``AttentionSpec(kind, size)``: the spelling of a layer's kind that users pass in
``layer_windows`` (and ``make_kv_manager``), kept for them. It makes the spec of that kind
(``kv_spec.py``: ``FullAttentionSpec``, ``SlidingWindowSpec``, ``ChunkedLocalSpec``), which
everything inside works with; ``spec.kind`` is one of the names below."""

from __future__ import annotations

from vmemkv.cache.kv_spec import ChunkedLocalSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, local_spec
from vmemkv.errors import ConfigError

FULL = FullAttentionSpec.kind
SLIDING = SlidingWindowSpec.kind
CHUNKED = ChunkedLocalSpec.kind
_SIZED = {SLIDING: SlidingWindowSpec, CHUNKED: ChunkedLocalSpec}


class AttentionSpec:
    """``AttentionSpec(kind=FULL, size=None)``: the spec of ``kind`` (``FULL``, ``SLIDING`` or
    ``CHUNKED``) with ``size`` (the window ``W`` or the chunk ``C``; None for full attention)."""

    def __new__(cls, kind: str = FULL, size: int | None = None) -> KVCacheSpec:
        if kind != FULL and kind not in _SIZED:
            raise ConfigError(f"attention kind {kind!r}: use {FULL!r}, {SLIDING!r} or {CHUNKED!r}")
        if (kind == FULL) != (size is None):
            raise ConfigError(f"{kind} takes {'no size' if kind == FULL else 'a size'}; got {size!r}")
        return FullAttentionSpec() if kind == FULL else _SIZED[kind](size)

    @staticmethod
    def of(sliding_window: int | None = None, chunk_size: int | None = None) -> KVCacheSpec:
        """The spec of ``CacheConfig``'s ``sliding_window`` / ``attention_chunk_size`` (at most
        one of them)."""
        return local_spec(sliding_window, chunk_size)
