"""One layer group's KV cache: :class:`KVCacheGroup`, a single-type manager over the layers of one
kind of KV memory (its :class:`KVCacheSpec`), as vLLM v1's ``SingleTypeKVCacheManager``; one
subclass per kind (``FullAttentionGroup``, ``MLALatentGroup``, ``SlidingWindowGroup``,
``ChunkedLocalGroup``) holds the kind's prefix-hit and release steps, and the coordinator picks it
by the spec's type (``coordinator.GROUP_CLASSES``). Its blocks come from a
:class:`vmemkv.cache.memory.KVMemory`, shared by the groups whose blocks have the same bytes; a later
group of a shared memory keys its blocks in the prefix index by its hash and one byte (``key``),
so a hash cached in one group never hits in another, whose block holds other layers.

A group owns the virtual tensors of its layers (``slots``, one slot index shared by every group)
and its spec's rules. It keeps no requests: each request's blocks in this group are the
:class:`Allocation` ``request.allocations[group.index]``, which the group's steps below read and
change through the allocation's transitions. The steps are what one operation of the
:class:`vmemkv.KVCacheManager` and its parts ask of each group: which prefix blocks it reuses
(its spec's rule), how many fresh blocks it needs, what it maps given the fresh blocks the
coordinator (``coordinator.py``) peeked for it (a :class:`Plan`), and carrying the plan out, for
fork, reorder and truncate too (``sharing.py`` runs them over every group). The coordinator owns the
order of the pools: it checks every memory's free blocks for all its groups at once, peeks each
memory's fresh blocks for its groups in order, and takes them in one call after every group
mapped and took its shared references, so what each group maps is what the pool hands out.
Its plans' data are in ``plans.py``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from vmemkv.cache.allocation import RELEASED, Allocation
from vmemkv.cache.config import CacheConfig
from vmemkv.cache.kv_spec import KVCacheSpec
from vmemkv.errors import ConfigError, MappingLimitError
from vmemkv.cache.events import HASH_BYTES, STATE_KEY_INDEX_BYTES, exact_key, is_lossy_key, lossy_key
from vmemkv.cache.memory import KVMemory
from vmemkv.cache.plans import Admission, Plan
from vmemkv.memory.slot_mapper import SlotMapper
from vmemkv.memory.slots import MapJob, SlotBinder


class KVCacheGroup:
    """``KVCacheGroup(index, config, layers, spec, memory)``: ``config`` is the group's (its
    ``num_layers`` are its own); ``layers`` the model layers it holds, in order; ``memory`` the
    :class:`KVMemory` its blocks come from (shared with other groups of the same layout, or its
    own)."""

    def __init__(self, index: int, config: CacheConfig, layers: tuple[int, ...], spec: KVCacheSpec,
                 memory: KVMemory):
        self.index, self.config, self.layers, self.spec, self.memory = index, config, layers, spec, memory
        self.window = spec.window
        self.layout = memory.layout
        self.tokens_per_page = self.layout.tokens_per_page
        self.stats = memory.stats
        # the first group of a memory keys blocks by their hash, a later one by hash + its index
        self.tag = bytes([index]) if memory.groups else b""
        memory.groups.append(self)
        mapper = SlotMapper if config.kv_backend == "vmem" else SlotBinder
        extra = {"hole_page": memory.hole_page} if config.kv_backend == "vmem" else {}
        self.slots = mapper(memory.backend, self.layout, config.max_num_seqs, config.max_model_len,
                            memory.config.num_blocks, **extra)
        self.blocks_copied = 0  # this group's share of stats.blocks_copied

    grows = True  # its blocks follow a request's tokens (a recurrent state's do not)
    holds_state = False  # its layers keep a recurrent state, read by state_views

    # the memory's parts, as a group's own (shared when the memory is)
    pool = property(lambda self: self.memory.pool)
    backend = property(lambda self: self.memory.backend)
    swap = property(lambda self: self.memory.swap)
    host_tier = property(lambda self: self.memory.host_tier)
    cold_tier = property(lambda self: self.memory.cold_tier)

    def key(self, block_hash: bytes) -> bytes:
        """The key of a chain hash in this group's prefix index."""
        return block_hash + self.tag if self.tag else block_hash

    def keys(self, hashes: list[bytes]) -> list[bytes]:
        tag = self.tag
        return [h + tag for h in hashes] if tag else hashes

    # --- counts (the memory's: shared with the groups drawing from it) ---------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks_in_use(self) -> int:
        return self.pool.num_in_use

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def blocks_for_tokens(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds here at once
        (``KVCacheSpec.peak_blocks``)."""
        return self.spec.peak_blocks(num_tokens, chunk_tokens, self.tokens_per_page)

    @staticmethod
    def check_config(config: CacheConfig, spec: KVCacheSpec) -> None:
        """Refuse (``ConfigError``) a group ``config`` this kind cannot hold, before any memory
        is made."""

    def in_group(self) -> str:
        return "" if self.index == 0 else f"in layer group {self.index} ({self.spec.describe()}) "

    # --- prefix hits (each kind's rule: the subclasses') ---------------------------------------
    def cached_blocks(self, hashes: list[bytes], lossy: bool = False) -> list[int]:
        """The cached blocks of the longest usable prefix of ``hashes`` (``lossy``: lossy blocks
        count, where exact ones are not cached: a kind that can hold them says so)."""
        raise NotImplementedError

    def capped_hits(self, hashes: list[bytes], hits: list[int], max_blocks: int) -> list[int]:
        """``hits`` (``cached_blocks(hashes)``) cut to at most ``max_blocks`` blocks."""
        raise NotImplementedError

    def hit_length(self, hits: list[int]) -> int:
        """How many prompt blocks ``hits`` (``cached_blocks``) reuse."""
        return len(hits)

    def host_run(self, hashes: list[bytes], lossy: bool = False) -> int:
        """How many leading ``hashes`` the host tier holds for this group (``lossy``: or the cold
        tier)."""
        host, cold = self.host_tier, self.cold_tier
        if not lossy or not cold.capacity:
            return len(host.leading_hits(self.keys(hashes))) if host.capacity else 0
        run = 0
        for key in self.keys(hashes):
            if key not in host and key not in cold:
                break
            run += 1
        return run

    def admission(self, hits: list[int], host_hits: list[bytes], cached: int, num_tokens: int) -> Admission:
        """This group's admission of ``hits`` and then ``host_hits`` (chain hashes; ``cached``
        tokens in all) reserving ``num_tokens``; from its first lossy block on (a device hit keyed
        lossy, or one the cold tier holds) the request's KV is lossy (``Admission.lossy_from``)."""
        keys = self.keys(host_hits)
        lossy_from, cold = None, 0
        if self.cold_tier.capacity:
            hash_of, host = self.pool.hash_of, self.host_tier
            lossy = [is_lossy_key(hash_of[block]) for block in hits] + [key not in host for key in keys]
            cold = sum(lossy[len(hits):])
            lossy_from = lossy.index(True) if True in lossy else None
        return Admission(hits, keys, len(host_hits), cached, num_tokens, lossy_from, cold)

    # --- fresh blocks an operation needs here (the coordinator checks and peeks them) ----------
    def admit_needs(self, hits: list[int], num_tokens: int) -> int:
        return self.layout.logical_pages_for(num_tokens) - len(hits)

    def fork_needs(self, partial: bool) -> int:
        """Fresh blocks a fork takes here: a copy of the parent's partial last block."""
        return int(partial)

    def fits_admission(self, hits: list[int], total: int) -> bool:
        """Whether this group alone (no other group drawing on its pool) could admit a request
        of ``total`` tokens whose hits here are ``hits``."""
        return self.memory.fits(self.admit_needs(hits, total), hits)

    def grow_needs(self, alloc: Allocation, num_new_tokens: int) -> int:
        """New blocks for ``num_new_tokens`` more positions (lookahead blocks count as held)."""
        return max(-(-(alloc.num_tokens + num_new_tokens) // self.tokens_per_page) - len(alloc.blocks), 0)

    # --- plans, given the fresh blocks ------------------------------------------------------------
    def plan_admit(self, hits: list[int], slot: int | None, fresh: list[int]) -> Plan:
        behind = hits.count(RELEASED)  # a windowed hit: blocks before its window need not be held
        live = hits[behind:]
        return Plan(self.choose_slot(hits, behind, slot), behind, behind, live + fresh, 0, live, fresh)

    def plan_grow(self, alloc: Allocation, num_new_tokens: int, fresh: list[int]) -> Plan | None:
        """What growing by ``num_new_tokens`` maps and takes; None inside the mapped blocks.
        Lookahead blocks are normally mapped already; one whose background mapping was refused
        is mapped again here, so no position is ever written through a stale mapping."""
        tokens_per_page, blocks, num_tokens = self.tokens_per_page, alloc.blocks, alloc.num_tokens
        first = -(-num_tokens // tokens_per_page)
        end = -(-(num_tokens + num_new_tokens) // tokens_per_page)
        if end <= first:
            return None
        return Plan(alloc.slot, 0, first, blocks[first:end] + fresh, len(blocks), [], fresh)

    def swap_in_revivals(self, alloc: Allocation, hashes: list[bytes]) -> dict[int, int]:
        """Swapped full blocks still in the prefix cache (index -> block: taken, not copied
        back); the rest need fresh blocks."""
        revive = {}
        for index, _ in alloc.swapped:
            if index < alloc.num_registered:
                block = self.pool.lookup(self.key(hashes[index]))
                if block is not None:
                    revive[index] = block
        return revive

    def plan_swap_in(self, alloc: Allocation, slot: int | None, revived: dict[int, int],
                     fresh: list[int]) -> Plan:
        """Fresh blocks take the other swapped blocks' places in ``alloc.swapped``'s order."""
        copies = [index for index, _ in alloc.swapped if index not in revived]
        blocks = list(alloc.blocks)
        for index, block in zip(copies, fresh):
            blocks[index] = block
        for index, block in revived.items():
            blocks[index] = block
        behind = alloc.num_released
        return Plan(self.choose_slot(blocks, behind, slot), behind, behind, blocks[behind:], 0,
                    list(revived.values()), fresh)

    def choose_slot(self, blocks: list[int], behind: int, slot: int | None = None) -> int:
        """The free slot for a request whose block list is ``blocks`` (``slot`` when given): one
        already mapping its first block when there is one (``SlotBinder.choose``); a request
        with blocks behind its window maps none there, so any."""
        return self.slots.choose(blocks[0] if blocks and not behind else None, slot)

    # --- carrying plans out (the coordinator takes the fresh blocks between map and finish) -----
    def map_and_bind(self, plan: Plan) -> None:
        """A planned binding (admit, fork, swap in): the chosen slot's pages behind the window
        read nothing (a free slot's stale mappings: nobody reads them), the plan is mapped (the
        step the mapping budget may refuse, changing no mapping anyone owns), and the slot is
        bound. The caller then changes the pool and the request."""
        self.slots.unmap_behind(plan.slot, plan.behind)
        self.slots.map_blocks(plan.slot, plan.first, plan.mapped, plan.keep)
        self.slots.bind(slot=plan.slot, behind=plan.behind)

    def finish_admit(self, alloc: Allocation, admission: Admission, plan: Plan, claimed: list) -> None:
        """After the take: copy the host tier's ``claimed`` entries into the first fresh blocks
        (registered again) and bind the allocation."""
        self.promote(plan.take, admission.promote, claimed)
        cached = admission.cached
        alloc.bind(plan.slot, admission.hits + plan.take, admission.num_tokens, cached,
                   cached // self.tokens_per_page, plan.behind)
        alloc.lossy_from = admission.lossy_from

    def map_grow(self, plan: Plan | None) -> None:
        if plan is not None:  # crosses into blocks not mapped yet
            self.slots.map_blocks(plan.slot, plan.first, plan.mapped, plan.keep)  # may be refused

    def register(self, alloc: Allocation, index: int, token_ids: list[int], hashes: list[bytes],
                 root: bytes) -> None:
        """Offer full block ``index`` to the prefix cache, with its tokens and parent (for KV
        events and the partial-page hit count)."""
        tokens = token_ids[index * self.tokens_per_page:(index + 1) * self.tokens_per_page]
        self.pool.register(alloc.blocks[index], self.registered_key(alloc, index, hashes), tokens,
                           self.registered_key(alloc, index - 1, hashes) if index else None,
                           None if index else self.key(root))

    def registered_key(self, alloc: Allocation, index: int, hashes: list[bytes]) -> bytes:
        """The key block ``index`` of ``alloc`` is offered under: lossy from the first block of
        the request that read lossy KV (its later blocks were computed from it)."""
        key = self.key(hashes[index])
        lossy_from = alloc.lossy_from
        return key if lossy_from is None or index < lossy_from else lossy_key(key)

    def register_full(self, alloc: Allocation, full: int, token_ids: list[int], hashes: list[bytes],
                      root: bytes) -> None:
        """Offer the full blocks from ``alloc.num_registered`` to ``full`` (not hashed yet) to
        the prefix cache."""
        blocks, hash_of = alloc.blocks, self.pool.hash_of
        for index in range(alloc.num_registered, full):
            if hash_of[blocks[index]] is None:
                self.register(alloc, index, token_ids, hashes, root)
        alloc.register(full)

    def release_behind_window(self, alloc: Allocation) -> None:
        """Give back the running request's blocks that no later query reads (none here)."""

    def free(self, alloc: Allocation) -> None:
        """Give back what the request holds here (deepest first, so a shared prefix outlives its
        tails in the LRU queue); its slot keeps its mappings."""
        if alloc.swapped is not None:
            swapped = {index for index, _ in alloc.swapped}
            self.swap.discard([host for _, host in alloc.swapped])
            self.pool.release(reversed([b for i, b in enumerate(alloc.blocks)
                                        if i not in swapped and b != RELEASED]))
        else:
            self.pool.release(reversed(alloc.blocks[alloc.num_released:]))
            self.slots.release(alloc.slot)
        alloc.reset()

    # --- preemption ----------------------------------------------------------------------------
    def private_blocks(self, alloc: Allocation) -> list[int]:
        """Indices of the reserved blocks only this request holds (what a swap copies out)."""
        return [i for i, b in enumerate(self.reserved_blocks(alloc))
                if b != RELEASED and self.pool.ref[b] == 1]

    def swap_out(self, alloc: Allocation) -> int:
        """Copy the private blocks to host rows, give them back and unbind the slot (the caller
        checked the room). Returns the bytes copied."""
        private = self.private_blocks(alloc)
        self.trim_lookahead(alloc)
        host = self.swap.store(self.memory.block_window(), [alloc.blocks[i] for i in private])
        self.pool.release(reversed([alloc.blocks[i] for i in private]))
        self.slots.release(alloc.slot)
        alloc.swap_out(list(zip(private, host)))
        return len(private) * self.layout.block_bytes

    def finish_swap_in(self, alloc: Allocation, plan: Plan, revive: dict[int, int],
                       token_ids: list[int], hashes: list[bytes], root: bytes) -> int:
        """After the take: copy the swapped blocks back into the fresh ones and register the
        full ones again. Returns the bytes copied back."""
        copied = [host for index, host in alloc.swapped if index not in revive]  # plan.take's order
        self.swap.load(self.memory.block_window(), copied, plan.take)
        self.swap.discard([host for index, host in alloc.swapped if index in revive])
        behind = plan.behind
        alloc.swap_in(plan.slot, alloc.blocks[:behind] + plan.mapped)
        for index, block in zip(range(behind, alloc.num_registered), alloc.blocks[behind:]):
            if self.pool.hash_of[block] is None:
                self.register(alloc, index, token_ids, hashes, root)
        return len(copied) * self.layout.block_bytes

    # --- lookahead -----------------------------------------------------------------------------
    def lookahead_blocks(self, alloc: Allocation, end: int) -> int:
        """Blocks a request needs to cover ``end`` positions past those it holds (<= 0: none)."""
        return self.layout.logical_pages_for(end) - len(alloc.blocks)

    def add_lookahead(self, alloc: Allocation, needed: int) -> MapJob:
        first = len(alloc.blocks)
        new = self.pool.allocate(needed)
        alloc.add_lookahead(new)
        return MapJob(alloc.slot, first, new, group=self.index)

    def trim_lookahead(self, alloc: Allocation) -> None:
        """Release blocks past the reservation (given early by a lookahead)."""
        needed = self.layout.logical_pages_for(alloc.num_tokens)
        if len(alloc.blocks) > needed:
            self.pool.release(reversed(alloc.drop_from(needed)))

    # --- helpers -------------------------------------------------------------------------------
    def reserved_blocks(self, alloc: Allocation) -> list[int]:
        """The request's blocks without lookahead ones."""
        return alloc.blocks[: self.layout.logical_pages_for(alloc.num_tokens)]

    def promote(self, blocks: list[int], host_keys: list[bytes], claimed: list) -> None:
        """Copy the lower tiers' ``claimed`` entries (of ``host_keys``) into the first of the
        just-taken ``blocks``, registered in the device pool again (a cold tier's as lossy)."""
        if not host_keys:
            return
        promoted = blocks[:len(host_keys)]
        for block, key, (origin, lossy) in zip(promoted, host_keys,
                                              self.memory.promote(host_keys, claimed, promoted)):
            self.pool.register(block, lossy_key(key) if lossy else key, origin.token_ids,
                               origin.parent_hash, origin.root)

    # --- copy-on-write sharing: fork, reorder, truncate (sharing.py has them over every group) ---
    def plan_fork(self, parent: Allocation, slot: int | None, fresh: list[int]) -> Plan:
        """``fresh``: a block for the parent's partial last block (none when it is full)."""
        reserved = self.reserved_blocks(parent)
        behind = parent.num_released  # the child's window is the parent's: none shared behind
        shared = reserved[behind:-1] if fresh else reserved[behind:]
        return Plan(self.choose_slot(reserved, behind, slot), behind, behind, shared + fresh, 0,
                    shared, fresh)

    def plan_reorder(self, rows: list[Allocation], sources: list[Allocation], copied: list[bool],
                     fresh: list[int]) -> tuple[list[list[int]], list[int], list[MapJob]]:
        """Reorder's plan: each row's new block list (its source's, with a block of ``fresh``
        where it copies the partial block), the pages behind each row's new window (its
        source's), and the mapping jobs."""
        fresh = iter(fresh)
        blocks = [self.reserved_blocks(source) for source in sources]
        blocks = [row_blocks[:-1] + [next(fresh)] if copy else list(row_blocks)
                  for row_blocks, copy in zip(blocks, copied)]
        behind = [source.num_released for source in sources]  # a row takes its source's window
        jobs = [MapJob(row.slot, count, row_blocks[count:], keep=len(row.blocks), group=self.index)
                for row, row_blocks, count in zip(rows, blocks, behind)]
        return blocks, behind, jobs

    def truncate_copy(self, alloc: Allocation, num_tokens: int) -> int | None:
        """The logical page truncating to ``num_tokens`` must copy to a private block before the
        request writes it again (its new last block, when partial and shared or cached), or None."""
        keep = self.layout.logical_pages_for(num_tokens)
        last = alloc.blocks[keep - 1] if keep and num_tokens % self.tokens_per_page else None
        if last is None or (self.pool.ref[last] == 1 and self.pool.hash_of[last] is None):
            return None
        return keep - 1

    def truncations_fit(self, rows: list[Allocation], num_tokens: int, free: int) -> int | None:
        """The free blocks left after truncating ``rows`` to ``num_tokens`` in order, starting
        from ``free``, or None when a copy (``truncate_copy``'s rule) finds none. A block an
        earlier row gives back is free for a later one, and a last block an earlier row copied
        away from may be the later row's alone."""
        keep = self.layout.logical_pages_for(num_tokens)
        partial = keep and num_tokens % self.tokens_per_page
        dropped: dict[int, int] = {}  # references the earlier rows give back
        for row in rows:
            given_back = row.blocks[keep:]
            last = row.blocks[keep - 1] if partial else None
            if last is not None and (self.pool.ref[last] - dropped.get(last, 0) > 1
                                     or self.pool.hash_of[last] is not None):
                if not free:
                    return None
                free -= 1
                given_back = given_back + [last]
            for block in given_back:
                dropped[block] = dropped.get(block, 0) + 1
                free += self.pool.ref[block] == dropped[block]
        return free

    def fork_copies(self, parent: Allocation, plan: Plan) -> list[tuple[int, int]]:
        """The block copy a fork makes after the take: the parent's partial last block (the one
        after the shared ones) onto the fresh one; none when it is full."""
        if not plan.take:
            return []
        return [(parent.blocks[plan.behind + len(plan.share)], plan.take[0])]

    def finish_fork(self, parent: Allocation, child: Allocation, plan: Plan) -> None:
        """After the take: the child holds the shared blocks and its copy of the partial one."""
        behind = plan.behind  # the child's window is the parent's: nothing is shared behind it
        child.copy_from(parent, plan.slot, parent.blocks[:behind] + plan.share + plan.take, behind)

    def map_reorder(self, rows: list[Allocation], plan: tuple) -> None:
        """Map every row's new blocks, then unmap behind each row's new window (the caller
        checked the mapping budget takes both)."""
        _, behind, jobs = plan
        self.slots.map_jobs(jobs)
        for row, count in zip(rows, behind):  # after map_jobs (a row reads these until now)
            self.slots.unmap_behind(row.slot, count)

    def reorder_copies(self, sources: list[Allocation], copied: list[bool], plan: tuple) -> list[tuple[int, int]]:
        """The block copies a reorder makes after the take: each copying row's source's partial
        last block onto the row's fresh one."""
        blocks_of = plan[0]
        return [(self.reserved_blocks(source)[-1], blocks[-1])
                for source, blocks, copy in zip(sources, blocks_of, copied) if copy]

    def finish_reorder(self, rows: list[Allocation], sources: list[Allocation], copied: list[bool],
                       plan: tuple) -> None:
        """After the take and the copies: share the sources' blocks, give the rows' old blocks
        back and make each row its source's copy."""
        blocks_of, behind, _ = plan
        snapshots = [source.snapshot() for source in sources]
        for blocks, copy, count in zip(blocks_of, copied, behind):
            self.pool.acquire(blocks[count:-1] if copy else blocks[count:])
        for row in rows:  # their old blocks, lookahead included
            self.pool.release(reversed(row.blocks[row.num_released:]))
        for row, blocks, count, snapshot in zip(rows, blocks_of, behind, snapshots):
            row.copy_from(snapshot, row.slot, blocks, count)
            self.slots.set_behind(row.slot, count)

    def truncate_jobs(self, alloc: Allocation, num_tokens: int, fresh: list[int]) -> list[MapJob]:
        """What truncating maps: a private copy (into ``fresh``) of the new last block, or nothing."""
        page = self.truncate_copy(alloc, num_tokens)
        if page is None:
            return []
        return [MapJob(alloc.slot, page, fresh, keep=len(alloc.blocks), group=self.index)]

    def map_truncate(self, alloc: Allocation, jobs: list[MapJob]) -> None:
        for job in jobs:
            self.slots.map_blocks(alloc.slot, job.first, job.blocks, keep=job.keep)

    @staticmethod
    def truncate_copies(alloc: Allocation, jobs: list[MapJob]) -> list[tuple[int, int]]:
        """The block copy a truncate makes after the take: the new last block onto its private copy."""
        return [(alloc.blocks[job.first], job.blocks[0]) for job in jobs]

    def finish_truncate(self, alloc: Allocation, num_tokens: int, jobs: list[MapJob]) -> None:
        """After the take and the copy: the private copy replaces the new last block, then the
        tail is forgotten."""
        for job in jobs:
            self.pool.release([alloc.replace_block(job.first, job.blocks[0])])
        full = num_tokens // self.tokens_per_page
        self.pool.release(reversed(alloc.truncate(num_tokens, self.layout.logical_pages_for(num_tokens), full)))

    def block_window(self) -> torch.Tensor:
        return self.memory.block_window()

    def kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Group layer ``layer``'s K and V over every slot (its index among ``layers``)."""
        return self.slots.kv_views(layer)

    def kv_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.slots.kv_scale_views(layer)

    def block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slots.block_views(layer)

    def block_scale_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.slots.block_scale_views(layer)

    def state_views(self, layer: int) -> list[torch.Tensor]:
        raise ConfigError(f"layer {self.layers[layer]} holds {self.spec.describe()}, not a "
                          "recurrent state; read it with kv_views")

    def block_table(self, request) -> list[int]:
        """``request``'s blocks in this group (``RELEASED`` behind the window)."""
        return list(request.allocations[self.index].blocks)

    # --- invariants ----------------------------------------------------------------------------
    def check(self, allocations: list[tuple[str, Allocation, int]]) -> tuple[list, list[int], list[int]]:
        """Assert the invariants of this group's slots and each ``(name, allocation, hashes
        known)``; returns the bound slots (None for swapped requests), the blocks the requests
        hold here (one entry a reference) and the host rows of their swapped blocks, for the
        memory's check."""
        pool, tokens_per_page = self.pool, self.tokens_per_page
        bound, writers, held_all, rows = [], {}, [], []
        for name, held_by, num_hashes in allocations:
            name = f"{name} (layer group {self.index})" if self.index else name
            blocks, released, num_tokens = held_by.blocks, held_by.num_released, held_by.num_tokens
            swapped = {i for i, _ in held_by.swapped} if held_by.swapped is not None else set()
            assert all(b == RELEASED for b in blocks[:released]), f"{name}: released run"
            assert RELEASED not in blocks[released:], f"{name}: a hole past the released run"
            assert released <= self.spec.first_needed_block(held_by.num_computed, tokens_per_page), (
                f"{name}: released {released} blocks, its next query reads one of them")
            held_all += [b for i, b in enumerate(blocks) if i not in swapped and i >= released]
            assert held_by.num_computed <= num_tokens <= len(blocks) * tokens_per_page
            # Blocks past the reservation are lookahead: mapped early, private, unhashed (below).
            assert len(blocks) >= self.layout.logical_pages_for(num_tokens), (
                f"{name}: {len(blocks)} blocks for {num_tokens} tokens")
            assert held_by.num_registered <= num_hashes
            if held_by.swapped is not None:
                assert len(blocks) == self.layout.logical_pages_for(num_tokens)
                assert held_by.slot is None
                bound.append(None)
                rows += [host for _, host in held_by.swapped]
                continue
            bound.append(held_by.slot)
            self.slots.check_request(held_by.slot, blocks, released)
            for block in blocks[held_by.num_computed // tokens_per_page:]:  # writable pages
                assert pool.hash_of[block] is None, f"{name} can write hashed block {block}"
                assert pool.ref[block] == 1, f"{name} can write shared block {block}"
                assert block not in writers, f"block {block} writable by {writers.get(block)} and {name}"
                writers[block] = name
        for block in set(held_all):  # a block holds one group's layers: no other group's key
            key = pool.hash_of[block]
            assert key is None or exact_key(key)[HASH_BYTES:] == self.tag, (
                f"block {block} of group {self.index} has another group's key")
        running = [slot for slot in bound if slot is not None]
        assert len(set(running)) == len(running), "two requests share a slot"
        assert not set(running) & set(self.slots.free_slots()), "a bound slot is also free"
        assert len(running) + self.slots.num_free == self.slots.num_slots, "a slot was lost"
        return bound, held_all, rows


class FullAttentionGroup(KVCacheGroup):
    """Layers that read every earlier position: a prefix hit is the leading run of cached
    blocks, and nothing is released while a request runs."""

    def cached_blocks(self, hashes: list[bytes], lossy: bool = False) -> list[int]:
        lookup, hits = self.pool.lookup, []
        lossy = lossy and self.cold_tier.capacity > 0  # lossy blocks come only from there
        for key in self.keys(hashes):
            block = lookup(key)
            if block is None and lossy:
                block = lookup(lossy_key(key))  # an exact copy is taken first
            if block is None:
                break
            hits.append(block)
        return hits

    def capped_hits(self, hashes: list[bytes], hits: list[int], max_blocks: int) -> list[int]:
        return hits[:max_blocks]


class MLALatentGroup(FullAttentionGroup):
    """Multi-head latent attention layers: read as full attention, over one latent row per
    token per layer (``kv_views`` gives that row as K and as V)."""

    @staticmethod
    def check_config(config: CacheConfig, spec: KVCacheSpec) -> None:
        if not config.latent or config.head_dim != spec.row_width:
            raise ConfigError(f"{spec.describe()} need a latent layout of rows of {spec.row_width} "
                              f"values; CacheConfig has latent={config.latent} and head_dim "
                              f"{config.head_dim}: set latent=True and head_dim to the row's width")


class LocalAttentionGroup(KVCacheGroup):
    """Layers whose queries read a bounded span ending at themselves (a sliding window, attention
    chunks): blocks wholly before the next query's first read (``spec.first_read``) go back while
    a request runs, and a prefix hit needs only the blocks its next query reads."""

    def cached_blocks(self, hashes: list[bytes], lossy: bool = False) -> list[int]:
        """``RELEASED`` before the first block the next query reads, then cached blocks
        (``KVCacheSpec.prefix_hits``)."""
        lookup, keys = self.pool.lookup, self.keys(hashes)
        num_hits, first = self.spec.prefix_hits(len(keys), lambda i: lookup(keys[i]) is not None,
                                                self.tokens_per_page)
        return [RELEASED] * first + [lookup(key) for key in keys[first:num_hits]]

    def capped_hits(self, hashes: list[bytes], hits: list[int], max_blocks: int) -> list[int]:
        """The longest hit within ``max_blocks`` blocks: a shorter prefix's next query reads from
        earlier on, so it is looked up again."""
        return hits if len(hits) <= max_blocks else self.cached_blocks(hashes[:max_blocks])

    def admission(self, hits: list[int], host_hits: list[bytes], cached: int, num_tokens: int) -> Admission:
        """Host hits wholly before the next query's first read would be copied in only to be
        released at the first commit, so they (and the hits before them) stay ``RELEASED``."""
        promote = self.keys(host_hits)
        if host_hits:
            skip = self.spec.first_needed_block(cached, self.tokens_per_page) - len(hits)
            if skip > 0:
                hits, promote = [RELEASED] * (len(hits) + skip), promote[skip:]
        return Admission(hits, promote, len(host_hits), cached, num_tokens)

    def release_behind_window(self, alloc: Allocation) -> None:
        """Give back the running request's blocks wholly before its next query's first read
        (cached ones stay in the prefix cache's LRU) and unmap them from its slot. Opportunistic:
        if the mapping budget refuses the unmap, nothing changes and a later commit tries again."""
        released = alloc.num_released
        first = min(self.spec.first_needed_block(alloc.num_computed, self.tokens_per_page),
                    len(alloc.blocks))
        if first <= released:
            return
        try:
            self.slots.release_behind(alloc.slot, first)
        except MappingLimitError:
            return
        # oldest first into the LRU queue: a windowed prefix hit needs the blocks near its end,
        # so the earliest ones are the first to be evicted
        self.pool.release(alloc.release_behind(first))
        self.stats.blocks_released_behind_window += first - released


class SlidingWindowGroup(LocalAttentionGroup):
    """Sliding-window layers (``SlidingWindowSpec``)."""


class ChunkedLocalGroup(LocalAttentionGroup):
    """Chunked local attention layers (``ChunkedLocalSpec``)."""


class SavedBlock(NamedTuple):
    """The prompt block a state is saved after: its chain hash, its parent's, its tokens."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: list[int]


class SavedState(list):
    """A state group's prefix hit: the blocks of the state saved after the first ``num_blocks``
    prompt blocks (empty, 0: no hit), or, saved on the host tier, the keys of its entries
    (``promote``; no device blocks)."""

    def __init__(self, blocks: list[int] = (), num_blocks: int = 0, promote: list[bytes] = ()):
        super().__init__(blocks)
        self.num_blocks = num_blocks
        self.promote = list(promote)


class RecurrentStateGroup(KVCacheGroup):
    """Recurrent layers (``RecurrentStateSpec``): each request holds ``state_blocks`` blocks
    from admission to its end, its state of every layer of the group, contiguous in its slot
    (one virtual range ``[num_slots, state bytes]``: ``state_views``). Its config's layout has one
    "token" per page (``state_config``), so a slot's ``max_model_len`` is its pages. The running
    state is rewritten at every step: never shared, copied whole by a fork, swapped whole, dropped
    by recompute. Prefix caching saves copies of it: when a commit ends on a multiple of
    ``save_every`` prompt blocks, the state is copied into ``state_blocks`` pool blocks keyed by
    the chain hash there (``state_keys``), cached in the pool's LRU like any hashed block; an
    admission whose prefix ends at a saved state (``SavedState``) copies it into its own blocks,
    else its state is zeroed."""

    grows = False
    holds_state = True
    save_every = 0  # prompt blocks between saved states (the coordinator's; 0: none saved)

    def __init__(self, index: int, config: CacheConfig, layers: tuple[int, ...], spec: KVCacheSpec,
                 memory: KVMemory):
        super().__init__(index, config, layers, spec, memory)
        self.state_blocks = config.max_model_len
        self.state_bytes = self.state_blocks * self.layout.page_size  # one request's, or one saved
        self._views = [self._layer_views(layer) for layer in range(len(layers))]

    @staticmethod
    def state_config(config: CacheConfig, spec: KVCacheSpec, num_layers: int, page_size: int,
                     saved_states: int = 0) -> CacheConfig:
        """The config of a state group of ``num_layers`` layers in pages of ``page_size`` bytes
        out of the model's ``config``: enough blocks for every slot and ``saved_states`` saved
        states, swap room for every slot's state when the model has swap space (the coordinator
        gives it its share of the host tier)."""
        pages = -(-spec.bytes_per_layer * num_layers // page_size)
        blocks = (config.max_num_seqs + saved_states) * pages
        slot_blocks = config.max_num_seqs * pages
        return dataclasses.replace(
            config, num_layers=1, num_kv_heads=1, head_dim=page_size, dtype=torch.uint8, latent=True,
            page_size=page_size, max_model_len=pages, num_blocks=blocks, sliding_window=None,
            attention_chunk_size=None, host_cache_bytes=0, kv_pool=None,
            kv_cache_dtype="auto",  # the parts' own dtypes, however the attention layers store K/V
            swap_space_bytes=slot_blocks * page_size if config.swap_space_bytes else 0)

    @staticmethod
    def check_config(config: CacheConfig, spec: KVCacheSpec) -> None:
        if config.kv_backend != "vmem":
            raise ConfigError(f"{spec.describe()} is kept in virtual memory only; set "
                              "kv_backend='vmem'")

    def _layer_views(self, layer: int) -> list[torch.Tensor]:
        """Layer ``layer``'s parts over every slot, strided by the slot's pages."""
        slots, spec = self.slots, self.spec
        slot_bytes = self.state_blocks * self.layout.page_size
        base = layer * spec.bytes_per_layer
        views = []
        for part, offset in zip(spec.parts, spec.offsets()):
            itemsize = torch.empty((), dtype=part.dtype).element_size()
            strides, stride = [], 1
            for size in reversed(part.shape):
                strides.insert(0, stride)
                stride *= size
            views.append(self.backend.tensor(slots.vrange, part.dtype, (slots.num_slots, *part.shape),
                                             (slot_bytes // itemsize, *strides), base + offset))
        return views

    def state_views(self, layer: int) -> list[torch.Tensor]:
        return self._views[layer]

    def kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise ConfigError(f"layer {self.layers[layer]} holds {self.spec.describe()}, no K/V; "
                          "read it with state_views")

    block_views = kv_scale_views = block_scale_views = kv_views

    def blocks_for_tokens(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        return self.state_blocks

    # --- saved states: prefix hits at the positions where one was saved ------------------------
    def state_keys(self, block_hash: bytes) -> list[bytes]:
        """The prefix-index keys of the blocks of the state saved after the block hashed
        ``block_hash`` (one per block: the pool keys every block by its own)."""
        return [block_hash + index.to_bytes(STATE_KEY_INDEX_BYTES, "little")
                for index in range(self.state_blocks)]

    def saved_state(self, block_hash: bytes) -> list[int] | None:
        """The blocks of the state saved after the block hashed ``block_hash``, if all cached."""
        blocks = [self.pool.lookup(key) for key in self.state_keys(block_hash)]
        return None if None in blocks else blocks

    def cached_blocks(self, hashes: list[bytes], lossy: bool = False) -> SavedState:
        """The state saved at the longest prefix of ``hashes`` that has one."""
        if self.save_every:
            for length in range(len(hashes) // self.save_every * self.save_every, 0, -self.save_every):
                blocks = self.saved_state(hashes[length - 1])
                if blocks is not None:
                    return SavedState(blocks, length)
        return SavedState()

    def capped_hits(self, hashes: list[bytes], hits: list[int], max_blocks: int) -> list[int]:
        return hits if self.hit_length(hits) <= max_blocks else self.cached_blocks(hashes[:max_blocks])

    def hit_length(self, hits: list[int]) -> int:
        return hits.num_blocks if isinstance(hits, SavedState) else 0

    def host_run(self, hashes: list[bytes], lossy: bool = False) -> int:
        return 0

    def saved_at(self, block_hash: bytes, num_blocks: int) -> SavedState | None:
        """The state saved after the first ``num_blocks`` prompt blocks (the last hashed
        ``block_hash``): on the device, else on the host tier (every block of it), else None."""
        blocks = self.saved_state(block_hash)
        if blocks is not None:
            return SavedState(blocks, num_blocks)
        keys = self.state_keys(block_hash)
        if self.host_tier.capacity and all(key in self.host_tier for key in keys):
            return SavedState([], num_blocks, keys)
        return None

    def admission(self, hits: list[int], host_hits: list[bytes], cached: int, num_tokens: int) -> Admission:
        """The attention groups' host hits are not this group's: its hit is one saved state, on
        the device (``hits``) or on the host (``hits.promote``, copied into its own blocks)."""
        promote = hits.promote if isinstance(hits, SavedState) else []
        return Admission(hits, promote, len(promote), cached, num_tokens)

    def register_full(self, alloc, full, token_ids, hashes, root) -> None:
        """A running state's blocks are never offered to the prefix cache (``save_state`` copies
        them)."""

    def save_state(self, alloc: Allocation, at: SavedBlock) -> None:
        """Save the request's state, computed up to the end of the prompt block ``at``, unless
        saved already. Best effort: skipped (changing nothing) when the pool has no room
        besides the running states; else it may evict the least recently used saved ones."""
        if self.saved_state(at.block_hash) is not None or not self.memory.fits(self.state_blocks):
            return
        pool = self.pool
        saved = pool.allocate(self.state_blocks)
        self.memory.copy_blocks(list(zip(alloc.blocks, saved)), count=False)
        for index, (block, key) in enumerate(zip(saved, self.state_keys(at.block_hash))):
            # the first block carries the prompt block's tokens and parent (its events tell them;
            # the host tier keeps them with the entry)
            pool.register(block, key, *((at.token_ids, at.parent_hash) if index == 0 else ()))
        pool.release(saved)  # into the LRU queue, in order: evicted together
        self.stats.states_saved += 1
        self.stats.state_bytes_saved += self.state_bytes

    # --- its blocks: all of them at admission, none later -----------------------------------------
    def admit_needs(self, hits: list[int], num_tokens: int) -> int:
        return self.state_blocks

    def grow_needs(self, alloc: Allocation, num_new_tokens: int) -> int:
        return 0

    def plan_grow(self, alloc: Allocation, num_new_tokens: int, fresh: list[int]) -> Plan:
        return Plan(alloc.slot, 0, 0, [], len(alloc.blocks), [], [])  # nothing to map

    def map_grow(self, plan: Plan | None) -> None:
        """Nothing is mapped as a request grows."""

    def plan_admit(self, hits: list[int], slot: int | None, fresh: list[int]) -> Plan:
        """Map fresh blocks; a saved state's blocks are held (``share``) until copied."""
        return Plan(self.choose_slot([], 0, slot), 0, 0, fresh, 0, list(hits), fresh)

    def finish_admit(self, alloc: Allocation, admission: Admission, plan: Plan, claimed: list) -> None:
        """Bind the state blocks with the request's counts: a copy of the saved state of its
        prefix hit (given back to the LRU queue after; from the host tier: loaded into its
        blocks, then saved on the device again, as a promoted attention block is cached again),
        or zeros (a fresh request's)."""
        alloc.bind(plan.slot, plan.take, admission.num_tokens, admission.cached, 0, 0)
        if plan.share:
            self.memory.copy_blocks(list(zip(plan.share, plan.take)), count=False)
            self.pool.release(plan.share)
            self.stats.state_hits += 1
            return
        if admission.promote:
            origin = self.host_tier.promote(self.memory.block_window(), admission.promote, claimed,
                                            plan.take)[0]
            self.stats.state_hits += 1
            self.stats.state_host_hits += 1
            block_hash = admission.promote[0][:-STATE_KEY_INDEX_BYTES]  # state_keys' chain hash
            self.save_state(alloc, SavedBlock(block_hash, origin.parent_hash, list(origin.token_ids)))
            return
        for views in self._views:
            for view in views:
                view[plan.slot].zero_()

    def reserved_blocks(self, alloc: Allocation) -> list[int]:
        return alloc.blocks

    def trim_lookahead(self, alloc: Allocation) -> None:
        """No lookahead blocks here."""

    # --- fork: a copy of the whole state ----------------------------------------------------------
    def fork_needs(self, partial: bool) -> int:
        return self.state_blocks

    def plan_fork(self, parent: Allocation, slot: int | None, fresh: list[int]) -> Plan:
        return Plan(self.choose_slot(fresh, 0, slot), 0, 0, fresh, 0, [], fresh)

    def fork_copies(self, parent: Allocation, plan: Plan) -> list[tuple[int, int]]:
        return list(zip(parent.blocks, plan.take))

    def finish_fork(self, parent: Allocation, child: Allocation, plan: Plan) -> None:
        child.copy_from(parent, plan.slot, list(plan.take), 0)
        child.num_registered = 0

    # --- invariants -------------------------------------------------------------------------------
    def check(self, allocations: list[tuple[str, Allocation, int]]) -> tuple[list, list[int], list[int]]:
        """Each request holds its ``state_blocks`` blocks, privately (or on the host while swapped)."""
        bound, held_all, rows = [], [], []
        for name, alloc, _ in allocations:
            name = f"{name} (state group {self.index})"
            assert len(alloc.blocks) == self.state_blocks, f"{name}: {len(alloc.blocks)} state blocks"
            assert alloc.num_registered == 0 and alloc.num_released == 0, f"{name}: state registered"
            if alloc.swapped is not None:
                assert alloc.slot is None and len(alloc.swapped) == self.state_blocks, f"{name}: swap"
                bound.append(None)
                rows += [host for _, host in alloc.swapped]
                continue
            bound.append(alloc.slot)
            self.slots.check_request(alloc.slot, alloc.blocks, 0)
            for block in alloc.blocks:
                assert self.pool.ref[block] == 1 and self.pool.hash_of[block] is None, (
                    f"{name}: state block {block} shared or hashed")
            held_all += alloc.blocks
        running = [slot for slot in bound if slot is not None]
        assert len(set(running)) == len(running), "two requests share a slot"
        assert len(running) + self.slots.num_free == self.slots.num_slots, "a slot was lost"
        return bound, held_all, rows
