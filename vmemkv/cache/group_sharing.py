"""A layer group's part of the copy-on-write operations (fork, reorder, truncate): what it maps,
shares and copies, given the fresh blocks the coordinator peeked (``sharing.py`` has the
operations over every group). Mixed into :class:`vmemkv.cache.group.KVCacheGroup`, whose
``slots``, ``pool``, ``layout`` and ``reserved_blocks`` these steps use.
"""

from __future__ import annotations

from vmemkv.cache.allocation import Allocation
from vmemkv.cache.plans import Plan
from vmemkv.memory.slots import MapJob


class GroupSharing:
    """fork, reorder and truncate steps of one group (mixed into KVCacheGroup)."""

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
