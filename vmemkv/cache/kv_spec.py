"""Kinds of KV memory as types: one :class:`KVCacheSpec` subclass per kind, as vLLM v1's
``KVCacheSpec`` subclasses, each knowing its rules.

* :class:`FullAttentionSpec`: a query at position ``p`` reads keys ``0 .. p``; nothing is ever
  released.
* :class:`SlidingWindowSpec` ``(window)`` (Mistral, Gemma's local layers): keys
  ``max(0, p - W + 1) .. p``.
* :class:`ChunkedLocalSpec` ``(chunk)`` (Llama-4's ``attention_chunk_size``): keys
  ``p // C * C .. p``, the query's own chunk of ``C`` positions.
* :class:`MLALatentSpec` ``(kv_lora_rank, rope_dim)`` (DeepSeek-V2/V3, MiniCPM3): reads as full
  attention; each token caches one latent row per layer instead of K and V.
* :class:`RecurrentStateSpec` ``(parts)`` (short convolutions, gated delta nets, Mamba): no rows
  per token; each request holds a fixed state per layer, one tensor per part.

``first_read`` is the one place each rule is written: the cache releases the blocks wholly before
the next query's first read (every later query starts at the same position or further on, since
each rule's start only grows with ``p``), a prefix hit needs only the blocks that query reads,
and the attention code (``attention/variants.py``) and ``VmemkvCache`` start reading there.
``first_read`` takes an int or a tensor of positions (the attention masks). The cache's group
class of each kind is registered in ``coordinator.GROUP_CLASSES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, ClassVar

from vmemkv.errors import ConfigError

if TYPE_CHECKING:  # not imported at run time: `vmemkv --help` reads the A/B's workloads, which read specs
    import torch


class KVCacheSpec:
    """What every kind answers; the base reads as full attention and releases nothing."""

    kind: ClassVar[str]  # the kind's name
    event_kind: ClassVar[str]  # its name in KV events (vLLM's ``KVCacheSpecKind``)
    releases: ClassVar[bool] = False  # whether blocks become unreadable while a request runs
    rows_per_token: ClassVar[int] = 2  # rows a token caches per layer: K and V

    @property
    def size(self) -> int | None:
        """The window or chunk that bounds what a query reads; None when it reads every key."""
        return None

    window: ClassVar[int | None] = None  # the sliding window, or None (a field of SlidingWindowSpec)

    def describe(self) -> str:
        raise NotImplementedError

    def first_read(self, position):
        """The first key position a query at ``position`` (or any later one) reads."""
        return 0

    def first_needed_block(self, next_position: int, tokens_per_block: int) -> int:
        """The first block a query at ``next_position`` (or any later one) reads."""
        return self.first_read(next_position) // tokens_per_block

    def peak_blocks(self, num_tokens: int, chunk_tokens: int | None, tokens_per_block: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once when it is computed
        in chunks of at most ``chunk_tokens`` (None: all at once): every block of its tokens."""
        return -(-num_tokens // tokens_per_block)

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

    def config_fields(self) -> dict:
        """The ``CacheConfig`` fields that name this kind (``sliding_window``,
        ``attention_chunk_size``), for a group's or a memory's config."""
        return {"sliding_window": None, "attention_chunk_size": None}

    def bytes_per_token_per_layer(self, layout) -> int:
        """What one token caches for one layer of ``layout`` (a ``KVLayout``), padding aside."""
        return self.rows_per_token * layout.head_elems * layout.itemsize

    def page_bytes(self, layout) -> int:
        """The bytes of one block of ``layout``: its tokens of every layer, token stride padding
        included."""
        return layout.block_bytes


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every earlier position is read: nothing is released."""

    kind: ClassVar[str] = "full_attention"
    event_kind: ClassVar[str] = "full_attention"

    def describe(self) -> str:
        return "full attention"


@dataclass(frozen=True)
class MLALatentSpec(FullAttentionSpec):
    """Multi-head latent attention: reads as full attention; a token caches one row per layer,
    the compressed KV (``kv_lora_rank``) and the rope'd key every head shares (``rope_dim``).
    A ``CacheConfig`` holds only the row's width (``head_dim``), so a spec made from one has the
    whole width as ``kv_lora_rank`` and ``rope_dim`` 0: the cache needs only the sum."""

    kv_lora_rank: int
    rope_dim: int = 0
    kind: ClassVar[str] = "mla_latent"
    rows_per_token: ClassVar[int] = 1

    def __post_init__(self):
        if self.kv_lora_rank < 1 or self.rope_dim < 0:
            raise ConfigError(f"an MLA latent row of kv_lora_rank {self.kv_lora_rank} and rope_dim "
                              f"{self.rope_dim}: give a positive rank and a rope_dim of at least 0")

    @property
    def row_width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def describe(self) -> str:
        return f"MLA latent rows of {self.row_width}"

    def bytes_per_token_per_layer(self, layout) -> int:
        return self.row_width * layout.itemsize


class LocalAttentionSpec(KVCacheSpec):
    """A kind whose queries read a bounded span (``size`` positions at most) ending at
    themselves: blocks wholly before the next query's first read are released."""

    releases: ClassVar[bool] = True

    def peak_blocks(self, num_tokens: int, chunk_tokens: int | None, tokens_per_block: int) -> int:
        """With blocks wholly before the next query's first read released after each chunk, a
        request holds at most the ``size - 1`` positions before its next query plus one chunk,
        ``L`` positions, which span at most ``ceil((L - 1) / P) + 1`` blocks."""
        every_block = -(-num_tokens // tokens_per_block)
        if chunk_tokens is None:
            return every_block
        span = self.size - 1 + max(chunk_tokens, 1)
        return min(every_block, (span - 1 + tokens_per_block - 1) // tokens_per_block + 1)


def _positive(value: int, what: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class SlidingWindowSpec(LocalAttentionSpec):
    """A query at ``p`` reads the last ``window`` positions, ``max(0, p - W + 1) .. p``."""

    window: int
    kind: ClassVar[str] = "sliding_window"
    event_kind: ClassVar[str] = "sliding_window"

    def __post_init__(self):
        _positive(self.window, "a sliding window")

    @property
    def size(self) -> int:
        return self.window

    def describe(self) -> str:
        return f"sliding window of {self.window}"

    def config_fields(self) -> dict:
        return {"sliding_window": self.window, "attention_chunk_size": None}

    def first_read(self, position):
        start = position - self.window + 1
        return start.clamp(min=0) if hasattr(start, "clamp") else max(0, start)  # a tensor or an int


@dataclass(frozen=True)
class ChunkedLocalSpec(LocalAttentionSpec):
    """A query at ``p`` reads its own chunk of ``chunk`` positions, ``p // C * C .. p``."""

    chunk: int
    kind: ClassVar[str] = "chunked_local"
    event_kind: ClassVar[str] = "chunked_local_attention"  # this project's name; vLLM's not checked

    def __post_init__(self):
        _positive(self.chunk, "an attention chunk")

    @property
    def size(self) -> int:
        return self.chunk

    def describe(self) -> str:
        return f"attention chunks of {self.chunk}"

    def config_fields(self) -> dict:
        return {"sliding_window": None, "attention_chunk_size": self.chunk}

    def first_read(self, position):
        return position // self.chunk * self.chunk


@dataclass(frozen=True)
class StatePart:
    """One tensor of a layer's recurrent state per request: its name, shape and dtype (the
    dtype the model computes it in: the SSM / delta-rule state is often float32)."""

    name: str
    shape: tuple[int, ...]
    dtype: "torch.dtype"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


STATE_ALIGNMENT = 64  # each part starts on a 64-byte boundary (vector loads, any dtype)


@dataclass(frozen=True)
class RecurrentStateSpec(KVCacheSpec):
    """A recurrent layer (a short convolution's window, a gated delta net's or Mamba's state):
    no rows per token, a fixed state per request per layer, ``parts`` in order. It is rewritten
    at each step, so nothing of it is shared or cached: a request of a model with state layers
    gets no prefix hits (a state group's hit length is 0) in this first version."""

    parts: tuple[StatePart, ...]
    kind: ClassVar[str] = "recurrent_state"
    event_kind: ClassVar[str] = "mamba"  # vLLM's name for its state kind
    rows_per_token: ClassVar[int] = 0

    def __post_init__(self):
        if not self.parts or any(min(part.shape, default=0) < 1 for part in self.parts):
            raise ConfigError(f"a recurrent state of parts {self.parts}: give at least one part, "
                              "each of a positive shape")

    def offsets(self) -> list[int]:
        """Each part's byte offset in one layer's state."""
        offsets, at = [], 0
        for part in self.parts:
            offsets.append(at)
            at += -(-part.nbytes // STATE_ALIGNMENT) * STATE_ALIGNMENT
        return offsets

    @property
    def bytes_per_layer(self) -> int:
        """One request's state of one layer, alignment of its parts included."""
        return -(-(self.offsets()[-1] + self.parts[-1].nbytes) // STATE_ALIGNMENT) * STATE_ALIGNMENT

    def describe(self) -> str:
        shapes = ", ".join(f"{part.name} {list(part.shape)}" for part in self.parts)
        return f"recurrent state of {shapes}"

    def prefix_hits(self, num_candidates, is_cached, tokens_per_block) -> tuple[int, int]:
        return 0, 0

    def peak_blocks(self, num_tokens: int, chunk_tokens: int | None, tokens_per_block: int) -> int:
        return 0  # the state's blocks do not follow the tokens: its group counts them

    def bytes_per_token_per_layer(self, layout) -> int:
        return 0


def is_state(spec: KVCacheSpec) -> bool:
    return isinstance(spec, RecurrentStateSpec)


@lru_cache(maxsize=256)
def local_spec(window: int | None = None, chunk: int | None = None) -> KVCacheSpec:
    """The spec of a layer reading a sliding ``window`` or attention ``chunk`` (at most one of
    them; neither: full attention), as the attention code and configs name them."""
    if window and chunk:
        raise ConfigError(f"a sliding window ({window}) and attention chunks ({chunk}) in one "
                          "group; give one of them")
    if window:
        return SlidingWindowSpec(window)
    if chunk:
        return ChunkedLocalSpec(chunk)
    return FullAttentionSpec()


def spec_of_config(config) -> KVCacheSpec:
    """The spec of every layer of a ``CacheConfig``: its latent rows, sliding window or chunks."""
    if config.latent:
        if config.sliding_window or config.attention_chunk_size:
            raise ConfigError("CacheConfig.latent reads as full attention; leave sliding_window and "
                              "attention_chunk_size None")
        return MLALatentSpec(config.head_dim)
    return local_spec(config.sliding_window, config.attention_chunk_size)


class _NoMemory:
    """The marker of a layer that holds no memory (Nemotron-H's MLP-only layers)."""

    def __repr__(self) -> str:
        return "NO_MEMORY"


# A ``layer_windows`` entry for a layer with nothing to cache: it belongs to no group.
NO_MEMORY = _NoMemory()


def layer_specs(layer) -> tuple[KVCacheSpec | None, RecurrentStateSpec | None]:
    """A ``layer_windows`` entry's ``(attention spec, state spec)``, either None: ``NO_MEMORY``
    holds neither, a ``RecurrentStateSpec`` a state, a pair ``(window or spec or None,
    RecurrentStateSpec)`` both (Falcon-H1's layers run attention and Mamba2 side by side), any
    other entry attention (``spec_of_layer``)."""
    if layer is NO_MEMORY:
        return None, None
    if isinstance(layer, tuple):
        if len(layer) != 2 or not isinstance(layer[1], RecurrentStateSpec) or isinstance(
                layer[0], (tuple, RecurrentStateSpec)) or layer[0] is NO_MEMORY:
            raise ConfigError(f"a layer_windows pair is (a window, KVCacheSpec or None, "
                              f"RecurrentStateSpec): a layer with attention and a state; got {layer!r}")
        return spec_of_layer(layer[0]), layer[1]
    spec = spec_of_layer(layer)
    return (None, spec) if is_state(spec) else (spec, None)


def spec_of_layer(layer: "int | KVCacheSpec | None") -> KVCacheSpec:
    """A ``layer_windows`` entry's spec: its own, a sliding window given as an int, or full
    attention (None)."""
    if isinstance(layer, KVCacheSpec):
        return layer
    if layer is not None and (not isinstance(layer, int) or layer < 0):
        raise ConfigError(f"a layer_windows entry is a sliding window (an int), a KVCacheSpec or "
                          f"None; got {layer!r}")
    return SlidingWindowSpec(layer) if layer else FullAttentionSpec()
