"""The prefix cache's host tier: cached blocks evicted from the device pool wait in host memory.

When the block pool hands a cached block out again (``BlockPool.on_evict``), its bytes are copied
to a host row first (a **demotion**), keeping its hash, tokens and chain parent; a later prefix
hit on that hash copies it back into a fresh device block (a **promotion**), which the admission
maps into the slot and registers in the device pool again, without recomputing it. The rows and
their copies are the host block store swap preemption uses (``swap.py``'s ``SwapSpace``: store,
load, discard, asynchronous on CUDA); the tier owns at most ``capacity`` of its rows and keeps
them in LRU order: a demotion that finds the tier full evicts its least recently used entry, and
one that finds no free row at all (swapped requests hold them) drops the block, as without a
tier. Where a cold tier is (``cold_tier.py``), what the tier lets go goes there instead,
compressed (``spill``). Hashes carry the cache keys (salt, adapter, ...), so a hit never crosses
tenants.

Promotion is part of an admission's plan: ``claim`` takes the hit entries out of the LRU (so the
demotions of the same admission cannot evict them) only after every refusable step succeeded,
and ``promote`` then loads them into the blocks just taken. A refused admission never calls
either, so it leaves the tier as it was.

Events (``kv_events.py``): a demotion sends ``BlockStored(medium="CPU")`` after the pool's
``BlockRemoved(medium="GPU")``; a host eviction and a promotion send ``BlockRemoved("CPU")`` (the
promotion's ``BlockStored("GPU")`` comes from the pool's register). A reset clears the tier with
the pool's one ``AllBlocksCleared``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from vmemkv.cache.config import CacheStats
from vmemkv.cache.events import MEDIUM_HOST, BlockRemoved, BlockStored, KVEventSink
from vmemkv.cache.pool import BlockOrigin, EvictedBlock
from vmemkv.cache.swap import SwapSpace


class HostEntry:
    """A demoted block: the host row holding its bytes and what the device pool knew of it."""

    __slots__ = ("row", "origin")

    def __init__(self, row: int, origin: BlockOrigin):
        self.row = row
        self.origin = origin


class HostTier:
    """At most ``capacity`` cached blocks in rows of ``store`` (the host block store it shares
    with swap preemption), by hash, least recently used first. ``block_size`` (tokens per block)
    is what its events report."""

    def __init__(self, capacity: int, store: SwapSpace, block_size: int,
                 events: KVEventSink | None, stats: CacheStats):
        self.capacity = capacity
        self.store = store
        self.block_bytes = store.block_bytes
        self.block_size = block_size
        self.events = events
        self.stats = stats
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()
        self._claimed: frozenset[bytes] = frozenset()  # taken out for a promotion in progress
        # where the blocks it lets go go instead of nowhere: (rows, keys, origins), the rows'
        # bytes intact for the call (the cold tier's store)
        self.spill: Callable[[torch.Tensor, list[bytes], list[BlockOrigin]], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[bytes]:
        """The hashes held, least recently used first."""
        return list(self._entries)

    def leading_hits(self, hashes: list[bytes]) -> list[bytes]:
        """The longest run of ``hashes``, from the first, that the tier holds (no side effect)."""
        run = []
        for block_hash in hashes:
            if block_hash not in self._entries:
                break
            run.append(block_hash)
        return run

    # --- demotion ----------------------------------------------------------------------------------
    def demote(self, window: torch.Tensor, evicted: list[EvictedBlock]) -> None:
        """Copy evicted device blocks to host rows (rows of ``window`` still intact). A hash the
        tier already holds is only made most recent; one it is promoting right now (the device
        also held a copy, which this promotion's own allocation evicted) is not stored twice."""
        store, blocks, hashes, origins, dropped = self.store, [], [], [], []
        unstored: list[EvictedBlock] = []
        for evicted_block in evicted:
            block, block_hash, origin = evicted_block
            if block_hash in self._claimed:
                continue
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                continue
            free_rows = store.num_free + len(dropped)  # the dropped entries' rows are freed below
            if len(self._entries) + len(blocks) >= self.capacity or free_rows <= len(blocks):
                if self._entries:  # room for one more: the least recently used entry goes
                    dropped.append(self._entries.popitem(last=False))
                else:
                    unstored.append(evicted_block)  # no room at all: dropped, as without a tier
                    continue
            blocks.append(block)
            hashes.append(block_hash)
            origins.append(origin)
        if dropped:
            rows = [entry.row for _, entry in dropped]
            if self.spill is not None:
                self.spill(store.storage[rows], [h for h, _ in dropped], [e.origin for _, e in dropped])
            store.discard(rows)
            self.stats.host_evictions += len(dropped)
            self._tell(BlockRemoved([h for h, _ in dropped], MEDIUM_HOST))
        if unstored and self.spill is not None:
            self.spill(window[[e.block for e in unstored]], [e.block_hash for e in unstored],
                       [e.origin for e in unstored])
        if not blocks:
            return
        rows = store.store(window, blocks)
        for block_hash, row, origin in zip(hashes, rows, origins):
            self._entries[block_hash] = HostEntry(row, origin)
            self._tell(BlockStored([block_hash], origin.parent_hash, list(origin.token_ids),
                                   self.block_size, None, MEDIUM_HOST))
        self.stats.host_demotions += len(blocks)
        self.stats.host_bytes_demoted += len(blocks) * self.block_bytes

    # --- promotion ---------------------------------------------------------------------------------
    def claim(self, hashes: list[bytes]) -> list[HostEntry]:
        """Take the entries of ``hashes`` (all held: ``leading_hits``) out of the LRU for a
        promotion about to happen; nothing can evict them until ``promote``."""
        self._claimed = frozenset(hashes)
        return [self._entries.pop(block_hash) for block_hash in hashes]

    def promote(self, window: torch.Tensor, hashes: list[bytes], claimed: list[HostEntry],
                blocks: list[int]) -> list[BlockOrigin]:
        """Copy claimed entries into device ``blocks`` and free their rows; returns their
        origins, for the caller to register the blocks in the device pool."""
        self._claimed = frozenset()
        if not claimed:
            return []
        self.store.load(window, [entry.row for entry in claimed], blocks)
        self._tell(BlockRemoved(list(hashes), MEDIUM_HOST))
        self.stats.host_promotions += len(claimed)
        self.stats.host_bytes_promoted += len(claimed) * self.block_bytes
        return [entry.origin for entry in claimed]

    # --- reset and invariants ----------------------------------------------------------------------
    def clear(self) -> int:
        """Forget every entry (the pool's reset sends the one ``AllBlocksCleared``)."""
        dropped = len(self._entries)
        self.store.discard([entry.row for entry in self._entries.values()])
        self._entries.clear()
        return dropped

    def rows(self) -> list[int]:
        return [entry.row for entry in self._entries.values()]

    def check(self) -> None:
        rows = self.rows()
        assert len(set(rows)) == len(rows), "two host-tier entries share a host row"
        assert len(rows) <= self.capacity, f"host tier holds {len(rows)} > {self.capacity} blocks"

    def _tell(self, event) -> None:
        if self.events is not None:
            self.events(event)
