"""The physical memory behind one or more layer groups: :class:`KVMemory`.

A memory owns the pages (``backend``), the blocks' reference counts, free queues and prefix index
(``pool``), and the host rows blocks are swapped or demoted to (``swap``, ``host_tier``). Groups
whose blocks have the same bytes (as many layers of one shape: Gemma-2's and GPT-OSS's local and
global layers) share one memory, so one free block serves whichever group needs it: the groups'
shares follow demand (vLLM's hybrid allocator over one ``BlockPool``); ``cache_group.py`` has the
groups, ``manager_state.py`` the coordinator's steps over the memories (``_fits``, ``_peek``,
``_take``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vmemkv.cache.allocation import RELEASED
from vmemkv.cache.config import CacheConfig, CacheStats
from vmemkv.cache.host_tier import HostTier
from vmemkv.cache.events import KVEventSink
from vmemkv.memory.layout import KVLayout
from vmemkv.cache.pool import BlockPool, EvictedBlock
from vmemkv.cache.swap import SwapSpace
from vmemkv.memory.vmm import create_backend
from vmemkv.memory.vmm.base import VirtualMemoryBackend

if TYPE_CHECKING:
    from vmemkv.cache.group import KVCacheGroup


def backend_pages(config: CacheConfig, layout: KVLayout) -> tuple[int, int | None]:
    """How many physical pages a memory's backend holds, and the hole page's index (or None).

    The pool's pages first. On CPU, slots read in one batched call need filler pages past the
    pool (``SlotMapper.make_readable``): one slot's worth, owned by no request, touched only where
    read. On CUDA with a sliding window, pages behind a window point at one "hole" page past
    those (FlashAttention may load a tile before the window start, and an unmapped address there
    faults); on CPU they are unmapped (no CPU path reads them)."""
    pages = config.num_blocks * layout.pages_per_block
    cuda = str(config.device).startswith("cuda")
    if config.kv_backend == "vmem" and not cuda:
        pages += layout.slot_pages(config.max_model_len)
    if config.kv_backend == "vmem" and cuda and (config.sliding_window or config.attention_chunk_size):
        return pages + 1, pages
    return pages, None


class KVMemory:
    """``KVMemory(config, layout, stats, backend=None, events=None, metrics=None)``: the pages,
    pool and host rows of ``config.num_blocks`` blocks of ``layout`` (a group's: every group
    sharing the memory has this layout). ``groups`` lists the groups drawing from it."""

    def __init__(self, config: CacheConfig, stats: CacheStats, backend: VirtualMemoryBackend | None = None,
                 events: KVEventSink | None = None, metrics=None):
        self.config, self.stats = config, stats
        self.layout = config.make_layout()
        num_pages, self.hole_page = backend_pages(config, self.layout)
        self.backend = backend or create_backend(config.device, self.layout.page_size, num_pages)
        if metrics is not None:  # the backend reports its map/unmap time to the manager's collector
            self.backend.metrics = metrics
        self.pool = BlockPool(config.num_blocks, events, self.layout.tokens_per_page)
        block_bytes = self.layout.block_bytes
        host_tier_blocks = config.host_cache_bytes // block_bytes if config.enable_prefix_caching else 0
        # one host block store: swap_space_bytes of rows for swapped requests beside the tier's
        self.swap = SwapSpace(config.swap_space_bytes // block_bytes + host_tier_blocks, block_bytes,
                              pin_memory=str(config.device).startswith("cuda"))
        self.host_tier = HostTier(host_tier_blocks, self.swap, self.layout.tokens_per_page, events, stats)
        if host_tier_blocks:
            self.pool.on_evict = self._demote
        self.groups: list["KVCacheGroup"] = []

    def _demote(self, evicted: list[EvictedBlock]) -> None:
        """The pool's eviction hook: evicted cached blocks go to the host tier."""
        self.host_tier.demote(self.block_window(), evicted)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each pair's source block onto its copy (just taken), all in one backend call."""
        if not pairs:
            return
        physical = self.layout.physical_pages
        self.backend.copy_pages(physical(np.array([s for s, _ in pairs])).tolist(),
                                physical(np.array([c for _, c in pairs])).tolist())
        self.stats.blocks_copied += len(pairs)

    def give_back(self, keep: int) -> int:
        """Give the memory of this pool's free clean blocks back to the OS, all but ``keep`` of
        them (the ones handed out first stay); their blocks stay free and take memory again when
        written. Returns the blocks given back (none on a backend that cannot)."""
        blocks = self.pool.give_back_candidates(self.pool.num_backed_clean - keep)
        if not blocks:
            return 0
        if not self.backend.discard_pages(self.layout.physical_pages(np.array(blocks)).tolist()):
            return 0
        self.pool.mark_given_back(blocks)
        return len(blocks)

    def block_window(self) -> torch.Tensor:
        """The pool as ``[num_blocks, block_bytes]`` uint8 rows: what swap, the host tier and
        tensor-parallel replay copy blocks through."""
        pages = self.pool.num_blocks * self.layout.pages_per_block  # filler pages may follow
        return self.backend.pool_window()[:pages].view(self.pool.num_blocks, self.layout.block_bytes)

    def fits(self, needed: int, revived: "list[int] | set[int]" = ()) -> bool:
        """Whether ``needed`` fresh blocks are free once the cached blocks of ``revived`` (hits
        taken out of the free queue) are not."""
        return needed <= self.pool.num_free - sum(self.pool.ref[b] == 0 for b in revived if b != RELEASED)

    def check(self, held: list[int], swapped_rows: list[int]) -> None:
        """Assert the pool's and host rows' invariants, ``held`` being every reference the
        requests hold on its blocks (in every group) and ``swapped_rows`` the host rows of
        swapped blocks."""
        pool = self.pool
        pool.check()
        refs = np.zeros(pool.num_blocks, dtype=np.int64)
        np.add.at(refs, np.asarray(held, dtype=np.int64), 1)
        assert np.array_equal(refs, np.asarray(pool.ref)), "reference counts differ from references held"
        self.host_tier.check()
        tier_rows = self.host_tier.rows()
        assert not set(swapped_rows) & set(tier_rows), "a host row is both swapped and cached"
        assert len(swapped_rows) + len(tier_rows) + self.swap.num_free == self.swap.num_blocks, (
            "host rows leaked")
