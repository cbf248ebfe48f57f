"""Overlapped mapping: give decoding requests the blocks they will reach next *before* they
reach them, and map them on another thread while the device computes.

``allocate_lookahead`` (step thread) takes clean blocks and appends them past each request's
reservation, in every layer group or in none; ``map_lookahead`` (any thread) maps them, touching
only mapping state past every reserved position; if it raises (the mapping budget),
``cancel_lookahead`` (step thread) gives the blocks back in every group before the requests grow
again. A lookahead block that was never mapped is mapped inline by ``allocate`` when reached.
Part of :class:`vmemkv.KVCacheManager` (state in ``manager_state.py``).
"""

from __future__ import annotations

from typing import Sequence

from vmemkv import validation as check
from vmemkv.errors import RequestStateError
from vmemkv.cache.metrics import timed
from vmemkv.cache.manager_state import ManagerState
from vmemkv.cache.request import KVRequest
from vmemkv.memory.slots import MapJob


class LookaheadOps(ManagerState):
    """allocate_lookahead, map_lookahead, cancel_lookahead (mixed into KVCacheManager)."""

    @timed
    def allocate_lookahead(self, requests: "Sequence[KVRequest | str]", margin_tokens: int,
                           keep_free: int = 0) -> list[MapJob]:
        """Give each request whose reservation ends within ``margin_tokens`` of its last block's
        end the blocks that cover ``margin_tokens`` more positions (never past ``max_model_len``)
        now, without mapping them, while more than ``keep_free`` blocks stay free (of the first
        group's pool; every other pool keeps the same share of its blocks free). Only clean blocks
        are taken, so no cached prefix is evicted for a guess. Returns the jobs for
        ``map_lookahead`` (each names its group), which may run on another thread while the
        device computes: it touches only mapping state, and only pages past every reserved
        position."""
        self._check_open()
        margin_tokens = check.count(margin_tokens, "margin_tokens")
        keep_free = check.count(keep_free, "keep_free")
        running = self._running_list(requests, "requests")
        groups, first = self.groups, self.groups[0]
        memories = self.memories
        keep = [-(-keep_free * memory.pool.num_blocks // first.num_blocks) for memory in memories]
        jobs = []
        for req in running:
            end = min(req.allocation.num_tokens + margin_tokens, self.config.max_model_len)
            needed = first.lookahead_blocks(req.allocation, end)  # as many in every group
            if needed <= 0 or not all(
                    needed * len(memory.groups) <= memory.pool.num_clean_available
                    and memory.pool.num_available - needed * len(memory.groups) >= kept
                    for memory, kept in zip(memories, keep)):
                continue
            for group, alloc in zip(groups, req.allocations):
                job = group.add_lookahead(alloc, needed)
                job.group = group.index
                jobs.append(job)
        return jobs

    def map_lookahead(self, jobs: list[MapJob]) -> None:
        """Map the jobs of ``allocate_lookahead``, all or none in each group. If this raises,
        call ``cancel_lookahead(jobs)`` on the step thread before the requests grow again: every
        group gives its blocks back (a group that had mapped its jobs keeps those mappings, past
        every reservation: stale, as a freed slot's, and remapped before anyone writes there).
        With a metrics collector, its backend mapping counts as background mapping (not an
        operation of the step thread)."""
        if self.metrics is None:
            self._map_jobs(jobs)
            return
        with self.metrics.background():
            self._map_jobs(jobs)

    def _map_jobs(self, jobs: list[MapJob]) -> None:
        for group in self.groups:
            group_jobs = [job for job in jobs if job.group == group.index]
            if group_jobs:
                group.slots.map_jobs(group_jobs)

    @timed
    def cancel_lookahead(self, jobs: list[MapJob]) -> None:
        """Give back the blocks of lookahead jobs whose mapping was refused; call it right after
        ``map_lookahead`` raised, before the requests change."""
        by_slot = {req.allocation.slot: req for req in self._requests.values()
                   if req.allocation.swapped is None}
        for job in jobs:
            req = by_slot.get(job.slot)
            alloc = None if req is None else req.allocations[job.group]
            if alloc is None or alloc.blocks[job.first:] != job.blocks:
                raise RequestStateError(f"lookahead job {job} is not the tail of its request's "
                                        "blocks any more; cancel right after map_lookahead raised")
            self.groups[job.group].pool.release(reversed(alloc.drop_from(job.first)))
