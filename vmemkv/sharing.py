"""Copy-on-write sharing: ``fork`` (a new request sharing a running one's full blocks), ``reorder``
(beam search: rows become copies of other rows by remapping blocks) and ``truncate`` (forget the
tail of a request, copying its new last block first if someone else can see it).

Full blocks are immutable once written, so they are shared by reference (``pool.acquire``); only
a partial last block, the one a request still writes, is ever copied. Part of
:class:`vmemkv.KVCacheManager` (see ``manager_state.py`` for the state these methods work on and
``plans.py`` for fork's planning step).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from . import validation as check
from .errors import InvalidInputError, RequestStateError
from .kv_metrics import timed
from .plans import OperationPlans, Plan, fit_or_reclaim, reorder_copies, reorder_mapping_cost
from .request import KVRequest
from .slots import MapJob


class SharingOps(OperationPlans):
    """fork, reorder, truncate (mixed into KVCacheManager)."""

    @timed
    def fork(self, parent: "KVRequest | str", child: "KVRequest | str",
             slot: int | None = None) -> KVRequest | None:
        """Start ``child`` as a copy of ``parent`` in another slot (``slot`` when given): full
        blocks shared, the partial last block copied. ``child`` is a KVRequest not admitted yet
        (its token ids become a copy of the parent's, in its own list, and its keys the parent's)
        or a new id, for which the manager makes one. Returns the child's KVRequest, or None,
        changing nothing, without a slot (or not ``slot``) or a block."""
        parent = self._running(parent)
        slot = check.slot_index(slot, self.slots.num_slots)
        child_id = self._fork_child_id(parent, child)
        partial = parent.allocation.num_tokens % self.tokens_per_page != 0
        if not self._slot_available(slot) or (partial and not self.pool.num_free):
            return None
        return self._execute_fork(parent, child, child_id, self._plan_fork(parent, slot))

    def _fork_child_id(self, parent: KVRequest, child: "KVRequest | str") -> str:
        """The id of a fork's ``child`` once it is checked (a KVRequest not admitted, with a
        token list of its own, or a new id); the parent must be committed."""
        if isinstance(child, KVRequest):
            self._check_not_foreign(child)
            if child.token_ids is parent.token_ids:
                raise InvalidInputError(f"fork child {child.request_id!r} has its parent's token "
                                        "list; give it a list of its own (a fork appends its own tokens)")
            child_id = child.request_id
        else:
            child_id = check.request_id(child, "child")
        if child_id in self._requests:
            raise RequestStateError(f"request {child_id!r} already exists")
        self._require_committed(parent)
        return child_id

    def _execute_fork(self, parent: KVRequest, child: "KVRequest | str", child_id: str,
                      plan: Plan) -> KVRequest:
        """Carry out ``plan`` (``_plan_fork`` of ``parent``; the mapping may be refused,
        changing nothing) and start the child (``_fork_child_id`` checked it)."""
        self._map_and_bind(plan)
        self.pool.acquire(plan.share)
        behind = plan.behind  # the child's window is the parent's: nothing is shared behind it
        copy = []
        if plan.take:  # the parent's partial last block, the one after the shared ones
            last = parent.allocation.blocks[behind + len(plan.share)]
            copy = [self._copy_of(last, *self.pool.take(plan.take))]
        if not isinstance(child, KVRequest):
            child = KVRequest(child_id, [], parent.keys)
        child.token_ids[:] = parent.token_ids
        child.chain.copy_from(parent.chain)  # the parent's keys, hashes and owner (this manager)
        child.allocation.copy_from(parent.allocation, plan.slot,
                                   parent.allocation.blocks[:behind] + plan.share + copy, behind)
        self._requests[child_id] = child
        self.stats.forks += 1
        return child

    @timed
    def reorder(self, requests: "Sequence[KVRequest | str]", sources: "Sequence[KVRequest | str]") -> bool:
        """Beam-search reorder: request ``requests[i]`` becomes a copy of ``sources[i]`` (as they
        were before the call). Full blocks are remapped, never copied; a partial block is copied
        only when more than one request takes it. Each request keeps its object and its token
        list, whose contents are replaced. Returns False, changing nothing, when the copies need
        more free blocks than there are."""
        rows, sources = self._check_reorder_rows(requests, sources)
        copied = reorder_copies(self.tokens_per_page, rows, sources)
        if sum(copied) > self.pool.num_free:
            return False
        # Plan every row's blocks, map all rows at once (refusable), then move the references.
        reserved = [self._reserved_blocks(s) for s in sources]
        plans, behind, jobs = self._plan_reorder(rows, sources, copied)
        self._check_reorder_room(jobs, behind)  # the unmaps below must not be refused
        self.slots.map_jobs(jobs)
        for row, count in zip(rows, behind):  # after map_jobs (a row reads these until now),
            self.slots.unmap_behind(row.allocation.slot, count)  # within the room checked above
        snapshots = [(list(s.token_ids), s.allocation.snapshot(), s.chain.snapshot()) for s in sources]
        self.pool.take([blocks[-1] for blocks, copy in zip(plans, copied) if copy])
        for blocks, source_blocks, copy, count in zip(plans, reserved, copied, behind):
            self.pool.acquire(blocks[count:-1] if copy else blocks[count:])
            if copy:
                self._copy_of(source_blocks[-1], blocks[-1])
        for row in rows:  # their old blocks, lookahead included
            self.pool.release(reversed(row.allocation.blocks[row.allocation.num_released:]))
        for row, blocks, count, (tokens, allocation, chain) in zip(rows, plans, behind, snapshots):
            # the keys travel with the content: later block hashes continue the source's chain
            row.token_ids[:] = tokens  # in place: the caller's list stays the request's
            row.chain.copy_from(chain)
            row.allocation.copy_from(allocation, row.allocation.slot, blocks, count)
            self.slots.set_behind(row.allocation.slot, count)
        return True

    def _check_reorder_rows(self, requests: "Sequence[KVRequest | str]",
                            sources: "Sequence[KVRequest | str]") -> tuple[list[KVRequest], list[KVRequest]]:
        """``reorder``'s rows and sources, running; RequestStateError unless the rows are
        distinct, one source each, and every source is committed."""
        rows = self._running_list(requests, "requests")
        sources = self._running_list(sources, "sources")
        if len(rows) != len(sources) or len({id(row) for row in rows}) != len(rows):
            raise RequestStateError(
                f"reorder needs distinct requests, one source each; got "
                f"{[r.request_id for r in rows]} from {[s.request_id for s in sources]}")
        for source in sources:
            self._require_committed(source)
        return rows, sources

    def _check_reorder_room(self, jobs: list[MapJob], behind: list[int]) -> None:
        """Refuse (MappingLimitError, nothing changed) unless the mapping budget holds reorder's
        mappings and then its unmaps behind each row's new window: those come after ``map_jobs``
        (a row reads its old pages until then), so the budget is asked for both first
        (``plans.fit_or_reclaim``: stale mappings are reclaimed first when they do not fit)."""
        def shortfall() -> str | None:
            room = self.slots.mapping_room()
            if room is None:
                return None
            needed = reorder_mapping_cost(self.slots, jobs, behind)[0]
            if needed <= room:
                return None
            return f"it needs {needed} more kernel mappings (VMAs) and the budget has room for {room}"

        fit_or_reclaim(shortfall, [(self.slots, jobs)], "reorder")

    @timed
    def truncate(self, request: "KVRequest | str", num_tokens: int) -> bool:
        """Forget every position from ``num_tokens`` on (rejected speculative tokens, a cropped
        cache). Blocks past the new end are released; if the new last block is partial and shared
        or cached, it is copied to a private block first, since the request will write it again.
        Returns False, changing nothing, when that copy finds no free block."""
        req = self._running(request)
        num_tokens = self._check_truncate(req, num_tokens)
        allocation = req.allocation
        page = self._truncate_copy(req, num_tokens)
        if page is not None:
            if not self.pool.num_free:
                return False
            copy, last = self.pool.peek(1), allocation.blocks[page]
            self.slots.map_blocks(allocation.slot, page, copy, keep=len(allocation.blocks))
            self.pool.release([allocation.replace_block(page, self._copy_of(last, self.pool.take(copy)[0]))])
        full = num_tokens // self.tokens_per_page
        dropped = allocation.truncate(num_tokens, self.layout.logical_pages_for(num_tokens), full)
        self.pool.release(reversed(dropped))
        del req.token_ids[num_tokens:]  # in place: the caller's list stays the request's
        req.chain.truncate(num_tokens, full)
        return True

    def _check_truncate(self, req: KVRequest, num_tokens: int, layers: str = "") -> int:
        """``num_tokens`` checked for ``truncate(req, num_tokens)``: RequestStateError unless
        ``req`` is running, committed, has that many tokens, and keeps every position a query at
        ``num_tokens`` reads (none released behind its window). ``layers`` names whose window,
        for the message (a hybrid manager's "local layers' ")."""
        req = self._running(req)
        self._require_committed(req)
        num_tokens = check.count(num_tokens, "num_tokens")
        if not num_tokens <= req.allocation.num_tokens:
            raise RequestStateError(f"request {req.request_id!r} has {req.allocation.num_tokens} tokens; "
                                    f"cannot truncate it to {num_tokens}")
        if req.allocation.num_released > self.spec.first_needed_block(num_tokens, self.tokens_per_page):
            raise RequestStateError(
                f"request {req.request_id!r}: cannot truncate it to {num_tokens} tokens; its "
                f"{layers}first {req.allocation.num_released * self.tokens_per_page} positions were released "
                f"behind its {self.spec.describe()}, and a query at {num_tokens} reads some")
        return num_tokens

    @timed
    def can_truncate(self, requests: "Sequence[KVRequest | str]", num_tokens: int) -> bool:
        """Whether ``truncate(r, num_tokens)`` for every ``r`` of ``requests``, one after another,
        finds a free block for every copy it makes (each request checked as ``truncate`` checks
        it: RequestStateError). Changes nothing."""
        rows = list({id(row): row for row in map(self._running, requests)}.values())  # once each
        for row in rows:
            num_tokens = self._check_truncate(row, num_tokens)
        return self._truncations_fit(rows, num_tokens)

    def _truncations_fit(self, rows: list[KVRequest], num_tokens: int) -> bool:
        """Whether truncating ``rows`` to ``num_tokens`` in order finds a free block for each copy
        (``_truncate_copy``'s rule: the new last block, partial and shared or cached). A block an
        earlier row gives back is free for a later one, and a last block an earlier row copied
        away from may be the later row's alone."""
        keep = self.layout.logical_pages_for(num_tokens)
        partial = keep and num_tokens % self.tokens_per_page
        free, dropped = self.pool.num_free, Counter()  # references the earlier rows give back
        for row in rows:
            given_back = row.allocation.blocks[keep:]
            last = row.allocation.blocks[keep - 1] if partial else None
            if last is not None and (self.pool.ref[last] - dropped[last] > 1
                                     or self.pool.hash_of[last] is not None):
                if not free:
                    return False
                free -= 1
                given_back = given_back + [last]
            for block in given_back:
                dropped[block] += 1
                free += self.pool.ref[block] == dropped[block]
        return True
