"""Overlapped mapping: give decoding requests the blocks they will reach next *before* they
reach them, and map them on another thread while the device computes.

``allocate_lookahead`` (step thread) takes clean blocks and appends them past each request's
reservation; ``map_lookahead`` (any thread) maps them, touching only mapping state past every
reserved position; if it raises (the mapping budget), ``cancel_lookahead`` (step thread) gives
the blocks back before the requests grow again. A lookahead block that was never mapped is mapped
inline by ``allocate`` when reached. Part of :class:`vmemkv.KVCacheManager` (state in
``manager_state.py``).
"""

from __future__ import annotations

from typing import Sequence

from . import validation as check
from .errors import RequestStateError
from .kv_metrics import timed
from .manager_state import ManagerState
from .request import KVRequest
from .slots import MapJob


class LookaheadOps(ManagerState):
    """allocate_lookahead, map_lookahead, cancel_lookahead (mixed into KVCacheManager)."""

    @timed
    def allocate_lookahead(self, requests: "Sequence[KVRequest | str]", margin_tokens: int,
                           keep_free: int = 0) -> list[MapJob]:
        """Give each request whose reservation ends within ``margin_tokens`` of its last block's
        end the blocks that cover ``margin_tokens`` more positions (never past ``max_model_len``)
        now, without mapping them, while more than ``keep_free`` blocks stay free. Only clean
        blocks are taken, so no cached prefix is evicted for a guess. Returns the jobs for
        ``map_lookahead``, which may run on another thread while the device computes: it touches
        only mapping state, and only pages past every reserved position."""
        self._check_open()
        margin_tokens = check.count(margin_tokens, "margin_tokens")
        keep_free = check.count(keep_free, "keep_free")
        running = self._running_list(requests, "requests")
        jobs = []
        for req in running:
            end = min(req.allocation.num_tokens + margin_tokens, self.config.max_model_len)
            needed = self.layout.logical_pages_for(end) - len(req.allocation.blocks)
            if needed <= 0 or needed > self.pool.num_clean or self.pool.num_free - needed < keep_free:
                continue
            first = len(req.allocation.blocks)
            new = self.pool.allocate(needed)
            req.allocation.add_lookahead(new)
            jobs.append(MapJob(req.allocation.slot, first, new))
        return jobs

    def map_lookahead(self, jobs: list[MapJob]) -> None:
        """Map the jobs of ``allocate_lookahead``, all or none. If this raises, call
        ``cancel_lookahead(jobs)`` on the step thread before the requests grow again. With a
        metrics collector, its backend mapping counts as background mapping (not an operation
        of the step thread)."""
        if self.metrics is None:
            self.slots.map_jobs(jobs)
            return
        with self.metrics.background():
            self.slots.map_jobs(jobs)

    @timed
    def cancel_lookahead(self, jobs: list[MapJob]) -> None:
        """Give back the blocks of lookahead jobs whose mapping was refused; call it right after
        ``map_lookahead`` raised, before the requests change."""
        by_slot = {req.allocation.slot: req for req in self._requests.values()
                   if req.allocation.swapped is None}
        for job in jobs:
            req = by_slot.get(job.slot)
            if req is None or req.allocation.blocks[job.first:] != job.blocks:
                raise RequestStateError(f"lookahead job {job} is not the tail of its request's "
                                     "blocks any more; cancel right after map_lookahead raised")
            self.pool.release(reversed(req.allocation.drop_from(job.first)))
