"""The physical memory behind one or more layer groups: :class:`KVMemory`.

A memory owns the pages (``backend``), the blocks' reference counts, free queues and prefix index
(``pool``), the host rows blocks are swapped or demoted to (``swap``, ``host_tier``), and the
compressed copies of blocks let go (``cold_tier``). Groups
whose blocks have the same bytes (as many layers of one shape: Gemma-2's and GPT-OSS's local and
global layers) share one memory, so one free block serves whichever group needs it: the groups'
shares follow demand (vLLM's hybrid allocator over one ``BlockPool``); ``group.py`` has the
groups, ``coordinator.py`` the steps over the memories (``fits``, ``peek``, ``take``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vmemkv.cache.allocation import RELEASED
from vmemkv.cache.config import CacheConfig, CacheStats
from vmemkv.cache.block_codec import BlockCodec, QuantizedBlockCodec
from vmemkv.cache.cold_tier import ColdEntry, ColdTier
from vmemkv.cache.host_tier import HostEntry, HostTier
from vmemkv.cache.events import KVEventSink, exact_key, is_lossy_key, lossy_sink
from vmemkv.memory.budget import SharedKVBudget
from vmemkv.memory.layout import KVLayout
from vmemkv.cache.pool import BlockOrigin, BlockPool, EvictedBlock
from vmemkv.cache.swap import SwapSpace
from vmemkv.memory.vmm import backend_class, create_backend
from vmemkv.memory.vmm.base import VirtualMemoryBackend

# A memory's share of a shared budget grows by at least what an operation needs, and by up to
# this much (at most 1/SHARE_CHUNKS_PER_BUDGET of the budget) while the budget has room: one
# take for many blocks, and little held unused.
SHARE_CHUNK_BYTES = 4 << 20
SHARE_CHUNKS_PER_BUDGET = 32

if TYPE_CHECKING:
    from vmemkv.cache.group import KVCacheGroup


def backend_pages(config: CacheConfig, layout: KVLayout,
                  device: type[VirtualMemoryBackend] | None = None) -> tuple[int, int | None]:
    """How many physical pages a memory's backend holds, and the hole page's index (or None).

    The pool's pages first. Where the ``device``'s backend (a backend class; default:
    ``config.device``'s) reads several slots in one batched
    call (``batched_reads_need_filler``), filler pages past the pool (``SlotMapper.make_readable``):
    one slot's worth, owned by no request, touched only where read. Where it needs a page behind
    released positions (``window_holes_need_page``) and a window or chunks release some, pages
    behind a window point at one "hole" page past those; elsewhere they are unmapped."""
    device = device or backend_class(config.device)
    pages = config.num_blocks * layout.pages_per_block
    if config.kv_backend != "vmem":
        return pages, None
    if device.batched_reads_need_filler:
        pages += layout.slot_pages(config.max_model_len)
    if device.window_holes_need_page and (config.sliding_window or config.attention_chunk_size):
        return pages + 1, pages
    return pages, None


class KVMemory:
    """``KVMemory(config, layout, stats, backend=None, events=None, metrics=None)``: the pages,
    pool and host rows of ``config.num_blocks`` blocks of ``layout`` (a group's: every group
    sharing the memory has this layout). ``groups`` lists the groups drawing from it."""

    def __init__(self, config: CacheConfig, stats: CacheStats, backend: VirtualMemoryBackend | None = None,
                 events: KVEventSink | None = None, metrics=None, budget: SharedKVBudget | None = None):
        self.config, self.stats = config, stats
        self.layout = config.make_layout()
        device = backend_class(config.device)  # what the device needs, before its backend is built
        num_pages, self.hole_page = backend_pages(config, self.layout, device)
        self.backend = backend or create_backend(config.device, self.layout.page_size, num_pages)
        if metrics is not None:  # the backend reports its map/unmap time to the manager's collector
            self.backend.metrics = metrics
        codec = cold_blocks = None
        if config.cold_tier != "off":
            layout = self.layout
            codec = (QuantizedBlockCodec(config.cold_tier, layout) if layout.scaled else
                     BlockCodec(config.cold_tier, layout.dtype, layout.block_bytes, layout.head_dim,
                                layout.token_stride_bytes // layout.itemsize))
            cold_blocks = config.cold_cache_bytes // codec.compressed_bytes
        # lossy blocks (decompressed from the cold tier) are told under their media (lossy_sink)
        self.pool = BlockPool(config.num_blocks, lossy_sink(events) if codec else events,
                              self.layout.tokens_per_page)
        if self.backend.takes_pages_back:  # a given-back block's pages come back as it is handed out
            self.pool.backing.on_take_again = self._take_again
        # A budget shared with other engines (memory/budget.py): the pool backs at most the blocks
        # this memory's share pays for; the share grows when an operation needs it (in chunks of
        # SHARE_CHUNK_BYTES) and shrinks when memory is given back.
        self.budget = budget
        if budget is not None:
            self.pool.backing.limit = 0
        # what a block costs the budget (ManagerState checked kv_pool_ranks)
        self.budget_block_bytes = self.layout.block_bytes * config.kv_pool_ranks
        block_bytes = self.layout.block_bytes
        host_tier_blocks = config.host_cache_bytes // block_bytes if config.enable_prefix_caching else 0
        # one host block store: swap_space_bytes of rows for swapped requests beside the tier's
        self.swap = SwapSpace(config.swap_space_bytes // block_bytes + host_tier_blocks, block_bytes,
                              device.host_row_copier())
        self.host_tier = HostTier(host_tier_blocks, self.swap, self.layout.tokens_per_page, events, stats)
        self.cold_tier = ColdTier(cold_blocks or 0, codec, self.layout.tokens_per_page, events, stats)
        if cold_blocks:
            self.host_tier.spill = self.cold_tier.store  # the full host tier's oldest go cold
        if host_tier_blocks or cold_blocks:
            self.pool.on_evict = self._demote
        self.groups: list["KVCacheGroup"] = []


    @property
    def num_growing(self) -> int:
        """Its groups whose blocks follow a request's tokens (not recurrent state)."""
        return sum(group.grows for group in self.groups)

    def _demote(self, evicted: list[EvictedBlock]) -> None:
        """The pool's eviction hook: evicted cached blocks go to the host tier, exact, or where
        there is none (or they are lossy already), to the cold tier, compressed."""
        window, host, cold = self.block_window(), self.host_tier, self.cold_tier
        if not cold.capacity:
            host.demote(window, evicted)
            return
        exact = [e for e in evicted if not is_lossy_key(e.block_hash)]
        if host.capacity:
            cold.discard([e.block_hash for e in exact])  # the exact copy supersedes a cold one
            host.demote(window, exact)
            exact = []
        # an exact block first: its content is kept where it and a lossy copy leave together
        colder = exact + [e for e in evicted if is_lossy_key(e.block_hash)]
        keys = [exact_key(e.block_hash) for e in colder]
        keep = [i for i, key in enumerate(keys) if key not in host]
        if keep:
            cold.store(window[[colder[i].block for i in keep]], [keys[i] for i in keep],
                       [colder[i].origin for i in keep])

    def claim(self, keys: list[bytes]) -> "list[HostEntry | ColdEntry]":
        """The lower tiers' entries of ``keys`` (each held by the host tier or the cold tier),
        taken out of their LRUs for a promotion (``promote``)."""
        hosted = [key in self.host_tier for key in keys]
        host = iter(self.host_tier.claim([key for key, h in zip(keys, hosted) if h]))
        cold = iter(self.cold_tier.claim([key for key, h in zip(keys, hosted) if not h]))
        return [next(host) if h else next(cold) for h in hosted]

    def promote(self, keys: list[bytes], claimed: "list[HostEntry | ColdEntry]",
                blocks: list[int]) -> list[tuple[BlockOrigin, bool]]:
        """Copy the ``claimed`` entries of ``keys`` into device ``blocks`` (the host tier's as they
        were, the cold tier's decompressed); returns each one's origin and whether it is lossy."""
        window, hosted = self.block_window(), [isinstance(entry, HostEntry) for entry in claimed]

        def part(items: list, host: bool) -> list:
            return [item for item, h in zip(items, hosted) if h == host]

        host = iter(self.host_tier.promote(window, part(keys, True), part(claimed, True), part(blocks, True)))
        cold = iter(self.cold_tier.promote(window, part(keys, False), part(claimed, False), part(blocks, False)))
        return [(next(host), False) if h else (next(cold), True) for h in hosted]

    def _take_again(self, block: int) -> None:
        self.backend.take_pages(self.layout.physical_pages(np.array([block])))

    def copy_blocks(self, pairs: list[tuple[int, int]], count: bool = True) -> None:
        """Copy each pair's source block onto its copy (just taken), all in one backend call;
        ``count``: as copy-on-write copies (``stats.blocks_copied``; a saved state's are not)."""
        if not pairs:
            return
        physical = self.layout.physical_pages
        self.backend.copy_pages(physical(np.array([s for s, _ in pairs])).tolist(),
                                physical(np.array([c for _, c in pairs])).tolist())
        if count:
            self.stats.blocks_copied += len(pairs)

    def give_back(self, keep: int, cached: bool = False) -> int:
        """Give the memory of this pool's free clean blocks back to the OS, all but ``keep`` of
        them (the ones handed out first stay); their blocks stay free and take memory again when
        written. ``cached``: the cached blocks' too, least recently used first (their content is
        forgotten first; the host tier, if any, keeps a copy). With a shared budget the share
        falls to the blocks still backed. Returns the blocks given back (none on a backend that
        cannot)."""
        pool, backing = self.pool, self.pool.backing
        if cached and self.backend.can_discard:
            pool.evict_cached(pool.num_cached - max(0, keep - backing.num_backed_clean))
        blocks = pool.give_back_candidates(backing.num_backed_clean - keep)
        if blocks and self.backend.discard_pages(self.layout.physical_pages(np.array(blocks)).tolist()):
            pool.mark_given_back(blocks)
        else:
            blocks = []
        self._shrink_share()
        return len(blocks)

    # --- the share of a shared budget -------------------------------------------------------------
    def _shrink_share(self) -> None:
        """Give the budget back the share no block has memory behind."""
        backing = self.pool.backing
        if self.budget is not None and backing.limit > backing.num_backed:
            self.budget.give((backing.limit - backing.num_backed) * self.budget_block_bytes)
            backing.limit = backing.num_backed

    def _grow_share(self, want: int, need: int, spare: int = 0) -> None:
        """Take the bytes of ``want`` more blocks (a chunk when the budget has room), at least
        ``need``, or nothing, for clean blocks waiting for memory (never more than wait), leaving
        the budget ``spare`` bytes where more than ``need`` would not."""
        pool, backing, block_bytes = self.pool, self.pool.backing, self.budget_block_bytes
        waiting = backing.unbackable(pool.num_clean)
        if waiting < need or not waiting:
            return
        chunk = min(SHARE_CHUNK_BYTES, self.budget.total_bytes // SHARE_CHUNKS_PER_BUDGET) // block_bytes
        want = min(waiting, max(want, chunk))
        if spare:
            want = max(need, min(want, (self.budget.free_bytes() - spare) // block_bytes))
        granted = self.budget.take(want * block_bytes, need * block_bytes)
        if granted % block_bytes:
            self.budget.give(granted % block_bytes)
        backing.limit += granted // block_bytes

    def available(self, with_budget: bool = False) -> int:
        """Blocks an allocation can take now; ``with_budget``: also those the shared budget's
        free bytes would back (read, not taken)."""
        pool = self.pool
        available = pool.num_available
        if with_budget and self.budget is not None:
            waiting = pool.num_free - available
            available += min(waiting, self.budget.free_bytes() // self.budget_block_bytes)
        return available

    def block_window(self) -> torch.Tensor:
        """The pool as ``[num_blocks, block_bytes]`` uint8 rows: what swap, the host tier and
        tensor-parallel replay copy blocks through."""
        pages = self.pool.num_blocks * self.layout.pages_per_block  # filler pages may follow
        return self.backend.pool_window()[:pages].view(self.pool.num_blocks, self.layout.block_bytes)

    def fits(self, needed: int, revived: "list[int] | set[int]" = (), spare: int = 0) -> bool:
        """Whether ``needed`` fresh blocks are free once the cached blocks of ``revived`` (hits
        taken out of the free queue) are not. With a shared budget, the share grows first where
        the clean blocks it backs fall short, so the budget's room is used before this pool's own
        cached blocks are evicted (the one side effect of a check: the share is this memory's,
        and shrinks when memory is given back); ``spare``: budget bytes the engine's other
        memories need for the same operation, which this one takes only if it must."""
        pool = self.pool
        available = self.available_besides(revived)
        if self.budget is not None and needed > pool.num_clean_available:
            self._grow_share(needed - pool.num_clean_available, max(needed - available, 0), spare)
            available = self.available_besides(revived)
        return needed <= available

    def budget_shortfall(self, needed: int, revived: "list[int] | set[int]" = ()) -> int:
        """Bytes of the shared budget this memory must take to hand out ``needed`` fresh blocks
        besides the cached blocks of ``revived`` (0 without a budget)."""
        if self.budget is None:
            return 0
        return max(needed - self.available_besides(revived), 0) * self.budget_block_bytes

    def available_besides(self, revived: "list[int] | set[int]" = ()) -> int:
        """Fresh blocks the pool can hand out once the cached blocks of ``revived`` are not free."""
        pool = self.pool
        return pool.num_available - sum(pool.ref[b] == 0 for b in revived if b != RELEASED)

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
        self.cold_tier.check()
        tier_rows = self.host_tier.rows()
        assert not set(swapped_rows) & set(tier_rows), "a host row is both swapped and cached"
        assert len(swapped_rows) + len(tier_rows) + self.swap.num_free == self.swap.num_blocks, (
            "host rows leaked")
