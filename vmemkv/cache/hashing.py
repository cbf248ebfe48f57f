"""Content hashes of full blocks for the prefix cache.

``h_0 = H(root, tokens of block 0, keys of block 0)``, ``h_i = H(h_{i-1}, tokens of block i, keys
of block i)``, where ``root = H(seed, adapter id, cache salt)`` and a block's keys are the multimodal
items it overlaps, each with its offset from the block's start. The chain makes a block's hash name
its whole prefix, so equal hashes mean equal KV. ``seed`` is random per hasher (so per manager)
unless configured (``CacheConfig.hash_seed``), so hashes cannot be predicted (or collided on
purpose) from outside.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from vmemkv.errors import ConfigError


@dataclass(frozen=True)
class MultimodalItem:
    """A multimodal input (an image, say) occupying prompt positions ``[offset, offset + length)``,
    named by a hash of its content."""

    offset: int
    length: int
    content_hash: bytes


@dataclass(frozen=True)
class CacheKeys:
    """What besides token ids decides whether two prefixes have the same KV."""

    adapter_id: str | int | None = None
    cache_salt: str | None = None
    multimodal: tuple[MultimodalItem, ...] = field(default_factory=tuple)


def multimodal_key(item: MultimodalItem, block_start: int) -> bytes:
    """A block's extra key for a multimodal item it overlaps: the item's placement relative to the
    block's start (negative when it began in an earlier block) and its content hash, as vLLM's
    ``(identifier, offset)``. Without the placement, one image at offset 0 and at offset 3 of the
    same tokens would give the same block hash, and the blocks would be shared."""
    placement = np.array([item.offset - block_start, item.length, len(item.content_hash)], np.int64)
    return placement.tobytes() + item.content_hash


class PrefixHasher:
    def __init__(self, algorithm: str = "sha256", seed: bytes | None = None):
        if algorithm not in ("sha256", "blake2b"):
            raise ConfigError(f"hash algorithm must be 'sha256' or 'blake2b', got {algorithm!r}")
        self.algorithm = algorithm
        self.seed = os.urandom(32) if seed is None else bytes(seed)

    def _new(self):
        return hashlib.sha256() if self.algorithm == "sha256" else hashlib.blake2b(digest_size=32)

    def root(self, keys: CacheKeys) -> bytes:
        h = self._new()
        h.update(self.seed)
        h.update(repr((keys.adapter_id, keys.cache_salt)).encode())
        return h.digest()

    def block_hashes(self, token_ids: Sequence[int], tokens_per_block: int, keys: CacheKeys,
                     start_block: int = 0, parent: bytes | None = None,
                     end_block: int | None = None) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on (up to block
        ``end_block``, exclusive, when given), continuing the chain from ``parent`` (the hash of
        block ``start_block - 1``, or the root)."""
        parent = self.root(keys) if parent is None else parent
        last = len(token_ids) // tokens_per_block
        if end_block is not None:
            last = min(last, end_block)
        first = start_block * tokens_per_block
        # only the blocks hashed here are converted: a decode commit hashes one block, not the prefix
        tokens = np.asarray(token_ids[first:last * tokens_per_block], dtype=np.int64)
        hashes = []
        for block in range(start_block, last):
            begin = block * tokens_per_block
            h = self._new()
            h.update(parent)
            h.update(tokens[begin - first:begin - first + tokens_per_block].tobytes())
            for item in keys.multimodal:
                if item.offset < begin + tokens_per_block and begin < item.offset + item.length:
                    h.update(multimodal_key(item, begin))
            parent = h.digest()
            hashes.append(parent)
        return hashes
