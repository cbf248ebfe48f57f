"""Where a model's K and V sit inside a slot's virtual range.

Two layouts, both with a *logical page* of ``tokens_per_page`` tokens as the unit that the pool
hands out and the prefix cache hashes:

* ``token_major`` (default): ``[token][layer][k|v][kv_head][dim]``. One physical page holds every
  layer of ``tokens_per_page`` tokens, so growing a request by a logical page is one map call.
* ``per_layer`` (vAttention's): each layer's K and each layer's V is its own virtual tensor
  ``[token][kv_head][dim]``; a logical page is ``2 * num_layers`` physical pages, one per tensor,
  so growing costs ``2 * num_layers`` map calls.

A ``latent`` layout (multi-head latent attention: DeepSeek-V2/V3, MiniCPM3) holds one row per token
per layer instead of K and V: the compressed KV after its norm and the rope'd shared key,
``kv_lora_rank + qk_rope_head_dim`` values (one "head" of that dim), ``[token][layer][latent]``.
Its K and V views are the same latent view: attention uses the whole row as the key and its first
``kv_lora_rank`` values as the value.

A logical page is backed by a *block* of ``pages_per_block`` consecutive physical pages
(1 for token-major, ``2 * num_layers`` for per-layer), so the pool and manager never see the
difference. The same layout addresses the backend's pool window as a block table, which is what the
block-table baseline reads: identical bytes, different addressing.

A quantized layout (``dtype`` int8 or float8_e4m3fn: ``kv_cache_dtype`` "int8" / "fp8",
``quantized_rows.py``) stores each row of ``head_dim`` values in one byte a value and a float32
scale per group of 32 of them, each layer's K (or V) values ``[kv_head][dim]`` followed by their
scales ``[kv_head][group]``: a token-major token row is ``[layer][k|v]`` of those, a per-layer
tensor's row one. The scales sit in the page, so every copy of a page carries them, and beside the
values they scale, so a read of one layer's rows of a token fetches its scales in the same cache
lines. A quantized row is padded to a multiple of 32 bytes (216 -> 224 at SmolLM2's shape), so a
layer's K and V rows fill whole cache lines. ``scale_view_geometry`` addresses the scales as float32
views ``[token, kv_head, group]``.

A token's row may be padded (``token_stride_bytes`` > the bytes it needs) so that a page of few
tokens is a whole number of 2 MiB CUDA granules; ``choose_page`` picks the stride and the page.
Views step over the padding with their strides, so attention never reads or writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal, NamedTuple

import numpy as np
import torch

from vmemkv.errors import ConfigError
from vmemkv.memory.quantized_rows import SCALE_BYTES, groups_per_row, is_quantized

LayoutKind = Literal["token_major", "per_layer"]

MAX_TOKENS_PER_PAGE = 512  # past this a page is too coarse for prefix caching and fragmentation
STRIDE_ALIGNMENT = 16  # a padded row starts on a 16-byte boundary (kernels load 16-byte vectors)
# A quantized row (values and scales: 216 B at SmolLM2's shape) is padded to a multiple of this, so
# a layer's K and V rows fill whole 64-byte cache lines in a token-major row: no line is then shared
# with the next layer's rows (each layer's decode fetched it again), and a head's values split fewer
# loads across lines (native int8 decode from memory, 4 x 7,500 tokens: 52.6 -> 46.3 ms, for 448
# bytes a token and layer instead of 432; docs/benchmarks.md).
QUANTIZED_ROW_ALIGNMENT = 32


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int  # bytes per physical page
    kind: LayoutKind = "token_major"
    token_stride_bytes: int = 0  # bytes from one token's row to the next; 0: unpadded (the row's own size)
    latent: bool = False  # one latent row per token per layer (MLA) instead of K and V

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size) <= 0:
            raise ConfigError(f"layout sizes must be positive, got {self}")
        if self.kind not in ("token_major", "per_layer"):
            raise ConfigError(f"layout kind must be 'token_major' or 'per_layer', got {self.kind!r}")
        needed = self.row_data_bytes
        if not self.token_stride_bytes:
            object.__setattr__(self, "token_stride_bytes", needed)  # frozen: set once, here
        stride = self.token_stride_bytes
        unit = SCALE_BYTES if self.scaled else self.itemsize  # a scale view steps in float32s
        if self.scaled and (self.head_elems * self.itemsize) % SCALE_BYTES:
            raise ConfigError(f"{self.dtype} KV needs kv_heads x head_dim ({self.head_elems}) to be a "
                              f"multiple of {SCALE_BYTES}: the scales after the values are float32s")
        if stride < needed or stride % unit:
            raise ConfigError(
                f"token stride {stride} B must be a multiple of {unit} B and at least one "
                f"token's {self.kind} row ({needed} B = {self._row_description()})")
        if self.page_size % stride:
            what = f"one token's {self.kind} row" if stride == needed else "the padded token stride"
            raise ConfigError(
                f"page size {self.page_size} B is not a multiple of {what} ({stride} B, rows of "
                f"{self._row_description()}); choose a page size that is a multiple of {stride}, "
                "or leave CacheConfig.page_size unset to let vmemkv pad the stride")

    # --- sizes -------------------------------------------------------------------------------
    @cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @cached_property
    def scaled(self) -> bool:
        """Whether each row carries a float32 scale (int8 or fp8 values)."""
        return is_quantized(self.dtype)

    @cached_property
    def head_elems(self) -> int:
        """Elements of one token's K (or V) for one layer."""
        return self.num_kv_heads * self.head_dim

    @cached_property
    def rows_per_layer(self) -> int:
        """Rows one token caches per layer: K and V, or one latent row."""
        return 1 if self.latent else 2

    @cached_property
    def token_elems(self) -> int:
        """Elements of one token's K and V (or latent rows) over all layers."""
        return self.rows_per_layer * self.num_layers * self.head_elems

    @cached_property
    def scale_bytes_per_row(self) -> int:
        """The scales of one K (or V) row of every head: 0 unless quantized."""
        return self.num_kv_heads * self.scale_groups * SCALE_BYTES if self.scaled else 0

    @cached_property
    def scale_groups(self) -> int:
        """Scales per head's row (quantized layouts: ``quantized_rows.groups_per_row``)."""
        return groups_per_row(self.head_dim)

    @cached_property
    def row_block_bytes(self) -> int:
        """One layer's K (or V, or latent) of one token: its values and, quantized, their scales."""
        return self.head_elems * self.itemsize + self.scale_bytes_per_row

    @cached_property
    def row_stride_bytes(self) -> int:
        """One row with its padding (quantized rows: to ``QUANTIZED_ROW_ALIGNMENT``): a token-major
        token row is its rows back to back, this far apart."""
        return padded_row_bytes(self.row_block_bytes, self.dtype)

    @cached_property
    def kv_bytes_per_token_per_layer(self) -> int:
        """What one token holds for one layer: its K and V, or an MLA model's latent row (with
        their scales and the rows' padding when quantized)."""
        return self.rows_per_layer * self.row_stride_bytes

    @cached_property
    def token_bytes(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_per_layer

    @cached_property
    def row_data_bytes(self) -> int:
        """Bytes one token needs in one physical page (all layers, or one layer's K or V)."""
        return unpadded_row_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                                  self.kind, self.latent)

    @property
    def row_bytes(self) -> int:
        """Bytes one token occupies in one physical page, padding included."""
        return self.token_stride_bytes

    @cached_property
    def token_stride(self) -> int:
        """``token_stride_bytes`` in elements: the token stride of every K/V view."""
        return self.token_stride_bytes // self.itemsize

    @property
    def padding_fraction(self) -> float:
        """Bytes stored per token beyond those it needs, as a fraction of those it needs."""
        return self.token_stride_bytes / self.row_data_bytes - 1

    def _row_description(self) -> str:
        if self.kind == "token_major":
            rows = f"{self.rows_per_layer} x {self.num_layers} layers x "
        else:
            rows = ""
        scales = f" + {self.num_kv_heads} x {self.scale_groups} scales x {SCALE_BYTES} B" if self.scaled else ""
        return f"{rows}({self.num_kv_heads} heads x {self.head_dim} dim x {self.itemsize} B{scales})"

    @cached_property
    def tokens_per_page(self) -> int:
        """Tokens in one logical page (one block)."""
        return self.page_size // self.row_bytes

    @cached_property
    def pages_per_block(self) -> int:
        """Physical pages behind one logical page: also the map calls per growth by one page."""
        return 1 if self.kind == "token_major" else self.rows_per_layer * self.num_layers

    @cached_property
    def block_bytes(self) -> int:
        return self.pages_per_block * self.page_size

    def logical_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_page)

    def slot_pages(self, max_tokens: int) -> int:
        """Virtual pages one slot reserves to hold ``max_tokens`` tokens."""
        return self.logical_pages_for(max_tokens) * self.pages_per_block

    # --- logical page -> virtual and physical pages -------------------------------------------
    def virtual_pages(self, logical_pages: np.ndarray, max_tokens: int) -> np.ndarray:
        """Virtual page indices (within a slot) that back the given logical pages.

        Per-layer: tensor ``r`` (layer ``r // 2``, K if ``r`` even; layer ``r`` if latent) owns virtual pages
        ``[r * P, (r + 1) * P)`` where ``P`` is the slot's logical page count.
        """
        logical_pages = np.asarray(logical_pages, dtype=np.int64)
        if self.kind == "token_major":
            return logical_pages
        per_tensor = self.logical_pages_for(max_tokens)
        tensors = np.arange(self.pages_per_block, dtype=np.int64)[:, None] * per_tensor
        return (tensors + logical_pages[None, :]).reshape(-1)

    def physical_pages(self, blocks: np.ndarray) -> np.ndarray:
        """Physical pages behind the given blocks, ordered to pair with ``virtual_pages``."""
        blocks = np.asarray(blocks, dtype=np.int64)
        if self.kind == "token_major":
            return blocks
        offsets = np.arange(self.pages_per_block, dtype=np.int64)[:, None]
        return (blocks[None, :] * self.pages_per_block + offsets).reshape(-1)

    # --- per-layer views ------------------------------------------------------------------------
    def _row_index(self, layer: int, kv: int) -> int:
        """Which of a token's rows holds layer ``layer``'s K (``kv=0``) or V (``kv=1``): a latent
        layout's one row per layer is both."""
        if not 0 <= layer < self.num_layers or kv not in (0, 1):
            raise ConfigError(f"no layer {layer} / kv {kv} in a {self.num_layers}-layer layout")
        return layer if self.latent else 2 * layer + kv

    def slot_view_geometry(self, layer: int, kv: int, max_tokens: int) -> tuple[tuple[int, int, int], int]:
        """Strides (token, head, dim) in elements and the element offset of layer ``layer``'s
        K (``kv=0``) or V (``kv=1``) within one slot."""
        row = self._row_index(layer, kv)
        strides = (self.token_stride, self.head_dim, 1)  # the stride steps over any padding
        if self.kind == "token_major":
            offset = row * self.row_stride_bytes // self.itemsize
        else:
            tensor_elems = self.logical_pages_for(max_tokens) * self.page_size // self.itemsize
            offset = row * tensor_elems
        return strides, offset

    def block_view_geometry(self, layer: int, kv: int) -> tuple[tuple[int, int, int, int], int]:
        """Strides (block, token, head, dim) and offset of a layer's K or V in the pool window,
        addressed as vLLM's ``[num_blocks, block_size, kv_heads, head_dim]`` block tensor."""
        row = self._row_index(layer, kv)
        strides = (self.block_bytes // self.itemsize, self.token_stride, self.head_dim, 1)
        if self.kind == "token_major":
            return strides, row * self.row_stride_bytes // self.itemsize
        return strides, row * (self.page_size // self.itemsize)

    def scale_view_geometry(self, layer: int, kv: int, max_tokens: int) -> tuple[tuple[int, int, int], int]:
        """Strides (token, head, group) in float32 elements and the float32 offset of the scales of layer
        ``layer``'s K (``kv=0``) or V (``kv=1``) within one slot (a quantized layout only)."""
        row = self._scaled_row_index(layer, kv)
        strides = (self.token_stride_bytes // SCALE_BYTES, self.scale_groups, 1)
        if self.kind == "token_major":
            row_start = row * self.row_stride_bytes
        else:  # the row's own tensor
            row_start = row * self.logical_pages_for(max_tokens) * self.page_size
        return strides, self._scales_of_row(row_start)

    def block_scale_view_geometry(self, layer: int, kv: int) -> tuple[tuple[int, int, int, int], int]:
        """Strides (block, token, head, group) and float32 offset of the scales of a layer's K or V
        in the pool window, beside ``block_view_geometry``'s rows (a quantized layout only)."""
        row = self._scaled_row_index(layer, kv)
        strides = (self.block_bytes // SCALE_BYTES, self.token_stride_bytes // SCALE_BYTES, self.scale_groups, 1)
        row_start = row * (self.row_stride_bytes if self.kind == "token_major" else self.page_size)
        return strides, self._scales_of_row(row_start)

    def _scaled_row_index(self, layer: int, kv: int) -> int:
        if not self.scaled:
            raise ConfigError(f"a {self.dtype} layout has no scales")
        return self._row_index(layer, kv)

    def _scales_of_row(self, row_start: int) -> int:
        """The float32 offset of the scales of the row starting at byte ``row_start``: after its values."""
        return (row_start + self.head_elems * self.itemsize) // SCALE_BYTES

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "page_size": self.page_size,
            "token_bytes": self.token_bytes,
            "tokens_per_page": self.tokens_per_page,
            "row_data_bytes": self.row_data_bytes,  # needed per token in one page
            "token_stride_bytes": self.token_stride_bytes,  # stored per token in one page
            "padding_fraction": round(self.padding_fraction, 4),
            "map_calls_per_growth": self.pages_per_block,
        }


class PageChoice(NamedTuple):
    page_size: int  # bytes, a multiple of the granularity
    token_stride_bytes: int  # bytes per token row, padding included
    tokens_per_page: int  # page_size // token_stride_bytes, exactly


def choose_page(row_bytes: int, granularity: int, min_tokens: int = 16, max_padding: float = 0.07,
                max_page_bytes: int = 16 << 20, max_tokens: int = MAX_TOKENS_PER_PAGE) -> PageChoice:
    """The page (a multiple of ``granularity``) and token stride (``row_bytes`` padded by at most
    ``max_padding`` of itself) that give the fewest tokens per page, at least ``min_tokens``.

    ``max_padding`` is the knob: padding a row lets a page of few tokens fill whole granules
    (SmolLM2-135M, 23,040 B rows on 2 MiB granules: 256 tokens in 6 MiB at 6.7 % padding instead
    of 4,096 tokens in 90 MiB unpadded). Padding never exceeds ``max_padding``; within it, a choice
    of at most ``max_tokens`` tokens in at most ``max_page_bytes`` is preferred, then one of at most
    ``max_tokens`` tokens in a bigger page, then the fewest tokens (rows so small that
    ``max_tokens`` of them cannot fill a granule, such as per-layer rows). An unpadded page always
    qualifies, so there is always a choice.
    """
    if not (isinstance(max_padding, (int, float)) and 0 <= max_padding < float("inf")):
        raise ConfigError(f"max_padding is {max_padding!r}; pass a fraction >= 0, such as 0.07")
    for name, value in (("row_bytes", row_bytes), ("granularity", granularity),
                        ("min_tokens", min_tokens), ("max_page_bytes", max_page_bytes),
                        ("max_tokens", max_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name} is {value!r}; pass a positive int")
    # The smallest unpadded page holding min_tokens qualifies; nothing with more tokens can beat it.
    unpadded = int(np.lcm(row_bytes, granularity))
    unpadded *= -(-min_tokens * row_bytes // unpadded)
    most_tokens = unpadded // row_bytes
    best: tuple | None = None
    for multiple in range(1, int(unpadded * (1 + max_padding)) // granularity + 1):
        page = multiple * granularity
        fewest = max(min_tokens, -int(-page // (row_bytes * (1 + max_padding))))
        tokens = np.arange(fewest, min(page // row_bytes, most_tokens) + 1, dtype=np.int64)
        tokens = tokens[page % tokens == 0]  # the stride must tile the page exactly
        strides = page // tokens
        tokens = tokens[(strides == row_bytes) | (strides % STRIDE_ALIGNMENT == 0)]
        if len(tokens):
            t = int(tokens[0])  # the fewest tokens this page size holds within the padding limit
            key = (t > max_tokens, page > max_page_bytes, t, page)
            best = min(best or key, key)
    assert best is not None  # the unpadded page is always a candidate
    _, _, tokens_per_page, page_size = best
    return PageChoice(page_size, page_size // tokens_per_page, tokens_per_page)


def unpadded_row_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kind: LayoutKind = "token_major", latent: bool = False) -> int:
    """Bytes one token needs in one physical page of a ``kind`` layout (``latent``: one row per
    layer, not K and V): its rows as ``padded_row_bytes`` pads them, without the token stride's
    padding (``choose_page``)."""
    row = num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    if is_quantized(dtype):
        row += num_kv_heads * groups_per_row(head_dim) * SCALE_BYTES  # each head's row has its scales
    row = padded_row_bytes(row, dtype)
    return row * (1 if latent else 2) * num_layers if kind == "token_major" else row


def padded_row_bytes(row: int, dtype: torch.dtype) -> int:
    """A row of ``row`` bytes with its padding: quantized rows to ``QUANTIZED_ROW_ALIGNMENT``."""
    if not is_quantized(dtype):
        return row
    return -(-row // QUANTIZED_ROW_ALIGNMENT) * QUANTIZED_ROW_ALIGNMENT


def default_page_size(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      tokens_per_page: int = 16, granularity: int = 4096,
                      kind: LayoutKind = "token_major") -> int:
    """The smallest page size that is a multiple of ``granularity`` and holds a whole number of
    unpadded token rows, at least ``tokens_per_page`` of them (``tokens_per_page`` exactly when
    possible)."""
    row = unpadded_row_bytes(num_layers, num_kv_heads, head_dim, dtype, kind)
    return choose_page(row, granularity, tokens_per_page, max_padding=0.0).page_size
