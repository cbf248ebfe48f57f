"""Lookahead (the engine's overlapped mapping) on a hybrid model's two layout groups: a decoding
request gets its next blocks in both groups or in neither, both groups' jobs are mapped together
(on the mapping worker, or inline on CPU), and a mapping refused in either group is cancelled in
both. Part of :class:`vmemkv.hybrid.HybridKVCacheManager`; each group's own
``allocate_lookahead`` / ``map_lookahead`` / ``cancel_lookahead`` (``lookahead.py``) does the work.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from . import validation as check
from .manager import KVCacheManager
from .request import KVRequest
from .slots import MapJob


@dataclasses.dataclass
class GroupLookahead:
    """``allocate_lookahead``'s jobs for each group (``MapJob`` lists, one per request, in the
    same order); false when there are none."""

    global_jobs: list[MapJob]
    local_jobs: list[MapJob]

    def __bool__(self) -> bool:
        return bool(self.global_jobs)


class HybridLookaheadOps:
    """allocate_lookahead, map_lookahead, cancel_lookahead (mixed into HybridKVCacheManager)."""

    global_group: KVCacheManager
    local_group: KVCacheManager

    def allocate_lookahead(self, requests: "Sequence[KVRequest | str]", margin_tokens: int,
                           keep_free: int = 0) -> "GroupLookahead":
        """``KVCacheManager.allocate_lookahead`` in both groups, all or nothing per request: a
        request gets its next blocks in both groups or in neither (its two halves have as many
        logical blocks, so it needs as many in each). ``keep_free`` counts the global group's
        blocks; the local group keeps the same share of its own pool free. Plan first (which
        requests both groups can serve, in order), then take: nothing is taken back."""
        margin_tokens = check.count(margin_tokens, "margin_tokens")
        keep_free = check.count(keep_free, "keep_free")
        groups = (self.global_group, self.local_group)
        keep = (keep_free, -(-keep_free * self.local_group.num_blocks // self.global_group.num_blocks))
        clean = [group.pool.num_clean for group in groups]
        free = [group.pool.num_free for group in groups]
        layout, limit = self.global_group.layout, self.config.max_model_len
        # A request listed twice is served once, as by one group (whose second look finds the
        # blocks already taken); planning it twice would promise its blocks twice.
        running = {req.request_id: req for req in self.global_group._running_list(requests, "requests")}
        chosen = []
        for req, local in map(self._pair, running.values()):
            end = min(req.num_tokens + margin_tokens, limit)
            needed = layout.logical_pages_for(end) - len(req.allocation.blocks)
            if needed <= 0 or not all(needed <= clean[g] and free[g] - needed >= keep[g] for g in (0, 1)):
                continue
            for g in (0, 1):
                clean[g] -= needed
                free[g] -= needed
            chosen.append((req, local))
        jobs = GroupLookahead(*(group.allocate_lookahead([pair[g] for pair in chosen], margin_tokens, keep[g])
                                for g, group in enumerate(groups)))
        if not len(jobs.global_jobs) == len(jobs.local_jobs) == len(chosen):
            raise AssertionError("a group refused a lookahead block both said it had")
        return jobs

    def map_lookahead(self, jobs: "GroupLookahead") -> None:
        """Map both groups' jobs (any thread, as ``KVCacheManager.map_lookahead``). If this
        raises, call ``cancel_lookahead(jobs)`` on the step thread: both groups give their
        blocks back (a group that had mapped its jobs keeps those mappings, past every
        reservation: stale, as a freed slot's, and remapped before anyone writes there)."""
        self.global_group.map_lookahead(jobs.global_jobs)
        self.local_group.map_lookahead(jobs.local_jobs)

    def cancel_lookahead(self, jobs: "GroupLookahead") -> None:
        """Give back both groups' lookahead blocks (right after ``map_lookahead`` raised)."""
        self.global_group.cancel_lookahead(jobs.global_jobs)
        self.local_group.cancel_lookahead(jobs.local_jobs)
