"""Overlapped mapping: give decoding requests the blocks they will reach next *before* they
reach them, and map them on another thread while the device computes.

``allocate_lookahead`` (step thread) takes clean blocks and appends them past each request's
reservation, in every layer group or in none; ``map_lookahead`` (any thread) maps them, touching
only mapping state past every reserved position; if it raises (the mapping budget),
``cancel_lookahead`` (step thread) gives the blocks back in every group before the requests grow
again. A lookahead block that was never mapped is mapped inline by ``allocate`` when reached.
A part the :class:`vmemkv.KVCacheManager` holds.
"""

from __future__ import annotations

from typing import Sequence

from vmemkv import validation as check
from vmemkv.errors import RequestStateError
from vmemkv.cache.config import CacheConfig
from vmemkv.cache.coordinator import KVCacheCoordinator
from vmemkv.cache.registry import RequestRegistry
from vmemkv.cache.request import KVRequest
from vmemkv.memory.slots import MapJob


class Lookahead:
    """allocate, map and cancel lookahead blocks, over every group."""

    def __init__(self, registry: RequestRegistry, coordinator: KVCacheCoordinator, config: CacheConfig):
        self.registry, self.coordinator, self.config = registry, coordinator, config

    def allocate(self, requests: "Sequence[KVRequest | str]", margin_tokens: int,
                 keep_free: int = 0) -> list[MapJob]:
        self.registry.check_open()
        margin_tokens = check.count(margin_tokens, "margin_tokens")
        keep_free = check.count(keep_free, "keep_free")
        running = self.registry.running_list(requests, "requests")
        groups, first = self.coordinator.groups, self.coordinator.groups[0]
        memories = self.coordinator.memories
        keep = [-(-keep_free * memory.pool.num_blocks // first.num_blocks) for memory in memories]
        jobs = []
        for req in running:
            end = min(req.allocation.num_tokens + margin_tokens, self.config.max_model_len)
            needed = first.lookahead_blocks(req.allocation, end)  # as many in every group
            if needed <= 0 or not all(
                    needed * memory.num_growing <= memory.pool.num_clean_available
                    and memory.pool.num_available - needed * memory.num_growing >= kept
                    for memory, kept in zip(memories, keep)):
                continue
            for group, alloc in zip(groups, req.allocations):
                if not group.grows:  # a state group holds its blocks from admission on
                    continue
                job = group.add_lookahead(alloc, needed)
                job.group = group.index
                jobs.append(job)
        return jobs

    def map(self, jobs: list[MapJob]) -> None:
        """Map each group's jobs (all or none in a group)."""
        for group in self.coordinator.groups:
            group_jobs = [job for job in jobs if job.group == group.index]
            if group_jobs:
                group.slots.map_jobs(group_jobs)

    def cancel(self, jobs: list[MapJob]) -> None:
        by_slot = {req.allocation.slot: req for req in self.registry.running_requests()}
        for job in jobs:
            req = by_slot.get(job.slot)
            alloc = None if req is None else req.allocations[job.group]
            if alloc is None or alloc.blocks[job.first:] != job.blocks:
                raise RequestStateError(f"lookahead job {job} is not the tail of its request's "
                                        "blocks any more; cancel right after map_lookahead raised")
            self.coordinator.groups[job.group].pool.release(reversed(alloc.drop_from(job.first)))
