"""The prefix cache's cold tier: cached blocks kept in fewer bits instead of dropped.

The device pool drops a cached block it needs (it can be recomputed), or moves it to the host
tier, bit for bit (``host_tier.py``). The KV cache's reader is a model, which tolerates an
approximation, so a third way is open: keep the block compressed (``block_codec.py``: int8 or
int4 with a scale per group) in host memory. A later prefix hit on its hash decompresses it into a
fresh device block, which the attention kernels read as any other, and which is keyed in the
device index as lossy (``events.lossy_key``): a request demanding exact reuse (``KVRequest(...,
exact=True)``) never finds it, nor any block a request computed after reading lossy KV (those
are lossy too), and recomputes instead.

What comes here: blocks the device pool evicts when there is no host tier, blocks the full host
tier drops (least recently used first), and lossy device blocks evicted (their KV is
approximate already: compressing it again gives the same integers). At most ``capacity`` blocks,
least recently used dropped first. An entry is keyed by the block's plain key; the host tier's
exact copy of a hash wins over the cold one (the cold copy of a hash the host tier takes is
dropped, and a hash the host tier holds is not compressed).

Promotion follows the host tier's protocol: ``claim`` takes the hit entries out of the LRU after
every refusable step of an admission, ``promote`` decompresses them into the blocks just taken. A
refused admission calls neither. Events: ``BlockStored`` / ``BlockRemoved`` with
``medium=MEDIUM_COLD`` (``"CPU_LOSSY"``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from vmemkv.cache.block_codec import BlockCodec, CompressedBlocks
from vmemkv.cache.config import CacheStats
from vmemkv.cache.events import MEDIUM_COLD, BlockRemoved, BlockStored, KVEventSink
from vmemkv.cache.pool import BlockOrigin


class ColdEntry:
    """A compressed block (one row of ``data``) and what the device pool knew of it."""

    __slots__ = ("data", "origin")

    def __init__(self, data: CompressedBlocks, origin: BlockOrigin):
        self.data = data
        self.origin = origin


class ColdTier:
    """At most ``capacity`` blocks compressed by ``codec``, by plain key, least recently used
    first; ``block_size`` (tokens per block) is what its events report."""

    def __init__(self, capacity: int, codec: BlockCodec | None, block_size: int,
                 events: KVEventSink | None, stats: CacheStats):
        self.capacity = capacity
        self.codec = codec
        self.block_size = block_size
        self.events = events
        self.stats = stats
        self._entries: OrderedDict[bytes, ColdEntry] = OrderedDict()
        self._claimed: frozenset[bytes] = frozenset()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def hashes(self) -> list[bytes]:
        """The keys held, least recently used first."""
        return list(self._entries)

    # --- demotion ----------------------------------------------------------------------------------
    def store(self, rows: torch.Tensor, keys: list[bytes], origins: list[BlockOrigin]) -> None:
        """Compress ``rows`` (``[n, block_bytes]`` uint8: blocks about to be handed out or
        dropped, their bytes still intact) as the entries of ``keys`` (plain keys; a key given
        twice, its first row). A key held already is only made most recent; the least recently
        used entries make room."""
        new, seen = [], set()
        for index, key in enumerate(keys):
            if key in self._entries:
                self._entries.move_to_end(key)
            elif key not in self._claimed and key not in seen:
                seen.add(key)
                new.append(index)
        new = new[-self.capacity:] if self.capacity else []
        if not new:
            return
        overflow = len(self._entries) + len(new) - self.capacity
        if overflow > 0:
            dropped = [self._entries.popitem(last=False)[0] for _ in range(overflow)]
            self.stats.cold_evictions += len(dropped)
            self._tell(BlockRemoved(dropped, MEDIUM_COLD))
        packed = self.codec.compress(rows[new])
        for row, index in enumerate(new):
            key, origin = keys[index], origins[index]
            self._entries[key] = ColdEntry(packed.block(row), origin)
            self._tell(BlockStored([key], origin.parent_hash, list(origin.token_ids), self.block_size,
                                   None, MEDIUM_COLD))
        self.stats.cold_demotions += len(new)
        self.stats.cold_bytes_stored += packed.nbytes

    def discard(self, keys: list[bytes]) -> None:
        """Forget the entries of ``keys`` it holds (an exact copy of them is kept elsewhere)."""
        gone = [key for key in keys if self._entries.pop(key, None) is not None]
        if gone:
            self._tell(BlockRemoved(gone, MEDIUM_COLD))

    # --- promotion ---------------------------------------------------------------------------------
    def claim(self, keys: list[bytes]) -> list[ColdEntry]:
        """Take the entries of ``keys`` (all held) out of the LRU for a promotion about to
        happen; nothing can evict them until ``promote``."""
        self._claimed = frozenset(keys)
        return [self._entries.pop(key) for key in keys]

    def promote(self, window: torch.Tensor, keys: list[bytes], claimed: list[ColdEntry],
                blocks: list[int]) -> list[BlockOrigin]:
        """Decompress claimed entries into device ``blocks`` (rows of ``window``); returns their
        origins, for the caller to register the blocks (as lossy) in the device pool."""
        self._claimed = frozenset()
        if not claimed:
            return []
        packed = CompressedBlocks.concat([entry.data for entry in claimed])
        rows = self.codec.decompress(packed.to(window.device))
        window.index_copy_(0, torch.tensor(blocks, device=window.device), rows)
        self._tell(BlockRemoved(list(keys), MEDIUM_COLD))
        self.stats.cold_promotions += len(claimed)
        return [entry.origin for entry in claimed]

    # --- reset and invariants ----------------------------------------------------------------------
    def clear(self) -> int:
        dropped = len(self._entries)
        self._entries.clear()
        return dropped

    def check(self) -> None:
        assert len(self._entries) <= self.capacity, \
            f"cold tier holds {len(self._entries)} > {self.capacity} blocks"

    def _tell(self, event) -> None:
        if self.events is not None:
            self.events(event)
