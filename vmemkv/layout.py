"""Where a model's K and V sit inside a slot's virtual range.

Two layouts, both with a *logical page* of ``tokens_per_page`` tokens as the unit that the pool
hands out and the prefix cache hashes:

* ``token_major`` (default): ``[token][layer][k|v][kv_head][dim]``. One physical page holds every
  layer of ``tokens_per_page`` tokens, so growing a request by a logical page is one map call.
* ``per_layer`` (vAttention's): each layer's K and each layer's V is its own virtual tensor
  ``[token][kv_head][dim]``; a logical page is ``2 * num_layers`` physical pages, one per tensor,
  so growing costs ``2 * num_layers`` map calls.

A logical page is backed by a *block* of ``pages_per_block`` consecutive physical pages
(1 for token-major, ``2 * num_layers`` for per-layer), so the pool and manager never see the
difference. The same layout addresses the backend's pool window as a block table, which is what the
block-table baseline reads: identical bytes, different addressing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np
import torch

from .errors import ConfigError

LayoutKind = Literal["token_major", "per_layer"]


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int  # bytes per physical page
    kind: LayoutKind = "token_major"

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size) <= 0:
            raise ConfigError(f"layout sizes must be positive, got {self}")
        if self.kind not in ("token_major", "per_layer"):
            raise ConfigError(f"layout kind must be 'token_major' or 'per_layer', got {self.kind!r}")
        row = self.row_bytes
        if self.page_size % row:
            raise ConfigError(
                f"page size {self.page_size} B is not a multiple of one token's {self.kind} row "
                f"({row} B = {self._row_description()}); choose a page size that is a multiple of {row}")

    # --- sizes -------------------------------------------------------------------------------
    @cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @cached_property
    def head_elems(self) -> int:
        """Elements of one token's K (or V) for one layer."""
        return self.num_kv_heads * self.head_dim

    @cached_property
    def token_elems(self) -> int:
        """Elements of one token's K and V over all layers."""
        return 2 * self.num_layers * self.head_elems

    @cached_property
    def token_bytes(self) -> int:
        return self.token_elems * self.itemsize

    @cached_property
    def row_bytes(self) -> int:
        """Bytes one token occupies in one physical page."""
        if self.kind == "token_major":
            return self.token_bytes
        return self.head_elems * self.itemsize

    def _row_description(self) -> str:
        if self.kind == "token_major":
            return f"2 x {self.num_layers} layers x {self.num_kv_heads} heads x {self.head_dim} dim x {self.itemsize} B"
        return f"{self.num_kv_heads} heads x {self.head_dim} dim x {self.itemsize} B"

    @cached_property
    def tokens_per_page(self) -> int:
        """Tokens in one logical page (one block)."""
        return self.page_size // self.row_bytes

    @cached_property
    def pages_per_block(self) -> int:
        """Physical pages behind one logical page: also the map calls per growth by one page."""
        return 1 if self.kind == "token_major" else 2 * self.num_layers

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

        Per-layer: tensor ``r`` (layer ``r // 2``, K if ``r`` even) owns virtual pages
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
    def slot_view_geometry(self, layer: int, kv: int, max_tokens: int) -> tuple[tuple[int, int, int], int]:
        """Strides (token, head, dim) in elements and the element offset of layer ``layer``'s
        K (``kv=0``) or V (``kv=1``) within one slot."""
        if not 0 <= layer < self.num_layers or kv not in (0, 1):
            raise ConfigError(f"no layer {layer} / kv {kv} in a {self.num_layers}-layer layout")
        if self.kind == "token_major":
            strides = (self.token_elems, self.head_dim, 1)
            offset = (2 * layer + kv) * self.head_elems
        else:
            tensor_elems = self.logical_pages_for(max_tokens) * self.page_size // self.itemsize
            strides = (self.head_elems, self.head_dim, 1)
            offset = (2 * layer + kv) * tensor_elems
        return strides, offset

    def block_view_geometry(self, layer: int, kv: int) -> tuple[tuple[int, int, int, int], int]:
        """Strides (block, token, head, dim) and offset of a layer's K or V in the pool window,
        addressed as vLLM's ``[num_blocks, block_size, kv_heads, head_dim]`` block tensor."""
        if not 0 <= layer < self.num_layers or kv not in (0, 1):
            raise ConfigError(f"no layer {layer} / kv {kv} in a {self.num_layers}-layer layout")
        block_elems = self.block_bytes // self.itemsize
        if self.kind == "token_major":
            return (block_elems, self.token_elems, self.head_dim, 1), (2 * layer + kv) * self.head_elems
        page_elems = self.page_size // self.itemsize
        return (block_elems, self.head_elems, self.head_dim, 1), (2 * layer + kv) * page_elems

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "page_size": self.page_size,
            "token_bytes": self.token_bytes,
            "tokens_per_page": self.tokens_per_page,
            "map_calls_per_growth": self.pages_per_block,
        }


def default_page_size(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      tokens_per_page: int = 16, granularity: int = 4096,
                      kind: LayoutKind = "token_major") -> int:
    """The smallest page size that is a multiple of ``granularity`` and holds a whole number of
    token rows, at least ``tokens_per_page`` of them (``tokens_per_page`` exactly when possible)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    row = num_kv_heads * head_dim * itemsize * (2 * num_layers if kind == "token_major" else 1)
    size = row * tokens_per_page
    lcm = np.lcm(row, granularity)
    return int(-(-size // lcm) * lcm)
