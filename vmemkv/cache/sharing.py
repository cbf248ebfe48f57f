"""Copy-on-write sharing: ``fork`` (a new request sharing a running one's full blocks), ``reorder``
(beam search: rows become copies of other rows by remapping blocks) and ``truncate`` (forget the
tail of a request, copying its new last block first if someone else can see it).

Full blocks are immutable once written, so they are shared by reference (``pool.acquire``); only
a partial last block, the one a request still writes, is ever copied. Each operation plans in
every layer group, checks every plan, then carries each out (``KVCacheGroup``). A part the
:class:`vmemkv.KVCacheManager` holds: it finds requests through the manager's
:class:`RequestRegistry` and blocks through its :class:`KVCacheCoordinator`.
"""

from __future__ import annotations

from typing import Sequence

from vmemkv import validation as check
from vmemkv.errors import InvalidInputError, RequestStateError
from vmemkv.cache.config import CacheStats
from vmemkv.cache.coordinator import KVCacheCoordinator
from vmemkv.cache.registry import RequestRegistry
from vmemkv.cache.plans import check_mapping_budget, check_plans_budget, reorder_copies
from vmemkv.cache.request import KVRequest


class Sharing:
    """fork, reorder, truncate and can_truncate over every group (``KVCacheManager`` calls them
    with its arguments unchecked; each checks them before any change)."""

    def __init__(self, registry: RequestRegistry, coordinator: KVCacheCoordinator, stats: CacheStats):
        self.registry, self.coordinator, self.stats = registry, coordinator, stats
        self.tokens_per_page = coordinator.tokens_per_page
        self.num_slots = coordinator.first.slots.num_slots

    def fork(self, parent: "KVRequest | str", child: "KVRequest | str",
             slot: int | None = None) -> KVRequest | None:
        parent = self.registry.running(parent)
        slot = check.slot_index(slot, self.num_slots)
        child_id = self._fork_child_id(parent, child)
        exact = child.exact if isinstance(child, KVRequest) else parent.exact
        if exact:
            check_exact_copies([child_id], [parent])
        partial = parent.allocation.num_tokens % self.tokens_per_page != 0
        groups = self.coordinator.groups
        needs = [group.fork_needs(partial) for group in groups]  # a copy of the partial last block
        if not self.coordinator.slot_available(slot) or not self.coordinator.fits(needs):
            return self.coordinator.refused("fork", child_id, slot, needs)
        fresh = self.coordinator.peek(needs)
        plans = []
        for group, alloc in zip(groups, parent.allocations):  # the first group chooses the slot
            plans.append(group.plan_fork(alloc, slot, fresh[group.index]))
            slot = plans[0].slot
        if len(groups) > 1:
            check_plans_budget(groups, plans, "fork")
        if not isinstance(child, KVRequest):
            child = KVRequest(child_id, [], parent.keys, parent.exact)
        child.hold_groups(len(groups))
        for group, plan in zip(groups, plans):
            group.map_and_bind(plan)  # the one refusable step
        for group, plan in zip(groups, plans):
            group.pool.acquire(plan.share)
        self.coordinator.take(fresh)
        self.coordinator.copy([group.fork_copies(alloc, plan) for group, alloc, plan in zip(groups, parent.allocations, plans)])
        for group, parent_alloc, child_alloc, plan in zip(groups, parent.allocations, child.allocations, plans):
            group.finish_fork(parent_alloc, child_alloc, plan)
        child.token_ids[:] = parent.token_ids
        child.chain.copy_from(parent.chain)  # the parent's keys, hashes and owner (this manager)
        self.registry.requests[child_id] = child  # admitted, as the parent's copy
        self.stats.forks += 1
        return child

    def _fork_child_id(self, parent: KVRequest, child: "KVRequest | str") -> str:
        """The id of a fork's ``child`` once it is checked (a KVRequest not admitted, with a
        token list of its own, or a new id); the parent must be committed."""
        if isinstance(child, KVRequest):
            self.registry.check_not_foreign(child)
            if child.token_ids is parent.token_ids:
                raise InvalidInputError(f"fork child {child.request_id!r} has its parent's token "
                                        "list; give it a list of its own (a fork appends its own tokens)")
            child_id = child.request_id
        else:
            child_id = check.request_id(child, "child")
        if child_id in self.registry.requests:
            raise RequestStateError(f"request {child_id!r} already exists")
        self.registry.require_committed(parent)
        return child_id

    def reorder(self, requests: "Sequence[KVRequest | str]", sources: "Sequence[KVRequest | str]") -> bool:
        rows, sources = self._check_reorder_rows(requests, sources)
        exact = [(row, source) for row, source in zip(rows, sources) if row.exact]
        check_exact_copies([row.request_id for row, _ in exact], [source for _, source in exact])
        self.coordinator.refuse_state("reorder")
        copied = reorder_copies(self.tokens_per_page, rows, sources)
        groups = self.coordinator.groups
        needs = [sum(copied)] * len(groups)
        if not self.coordinator.fits(needs):
            return False
        # Plan every group's rows, check the budget for all (the unmaps after the maps must not
        # be refused), map every group, take the copies' blocks, then move the references.
        fresh = self.coordinator.peek(needs)
        per_group = [([row.allocations[group.index] for row in rows],
                      [source.allocations[group.index] for source in sources]) for group in groups]
        plans = [group.plan_reorder(row_allocs, source_allocs, copied, fresh[group.index])
                 for group, (row_allocs, source_allocs) in zip(groups, per_group)]
        check_mapping_budget([(group.slots, jobs, behind) for group, (_, behind, jobs) in zip(groups, plans)],
                             "reorder")
        snapshots = [(list(s.token_ids), s.chain.snapshot()) for s in sources]
        for group, (row_allocs, _), plan in zip(groups, per_group, plans):
            group.map_reorder(row_allocs, plan)
        self.coordinator.take(fresh)
        self.coordinator.copy([group.reorder_copies(source_allocs, copied, plan)
                    for group, (_, source_allocs), plan in zip(groups, per_group, plans)])
        for group, (row_allocs, source_allocs), plan in zip(groups, per_group, plans):
            group.finish_reorder(row_allocs, source_allocs, copied, plan)
        for row, (tokens, chain) in zip(rows, snapshots):
            # the keys travel with the content: later block hashes continue the source's chain
            row.token_ids[:] = tokens  # in place: the caller's list stays the request's
            row.chain.copy_from(chain)
        return True

    def _check_reorder_rows(self, requests: "Sequence[KVRequest | str]",
                            sources: "Sequence[KVRequest | str]") -> tuple[list[KVRequest], list[KVRequest]]:
        """``reorder``'s rows and sources, running; RequestStateError unless the rows are
        distinct, one source each, and every source is committed."""
        rows = self.registry.running_list(requests, "requests")
        sources = self.registry.running_list(sources, "sources")
        if len(rows) != len(sources) or len({id(row) for row in rows}) != len(rows):
            raise RequestStateError(
                f"reorder needs distinct requests, one source each; got "
                f"{[r.request_id for r in rows]} from {[s.request_id for s in sources]}")
        for source in sources:
            self.registry.require_committed(source)
        return rows, sources

    def truncate(self, request: "KVRequest | str", num_tokens: int) -> bool:
        req = self.registry.running(request)
        num_tokens = self._check_truncate(req, num_tokens)
        self.coordinator.refuse_state("truncate")
        groups = self.coordinator.groups
        needs = [int(group.truncate_copy(alloc, num_tokens) is not None)
                 for group, alloc in zip(groups, req.allocations)]
        if not self.coordinator.fits(needs):
            return False
        fresh = self.coordinator.peek(needs)
        jobs = [group.truncate_jobs(alloc, num_tokens, fresh[group.index])
                for group, alloc in zip(groups, req.allocations)]
        if len(groups) > 1:
            check_mapping_budget([(group.slots, group_jobs, 0) for group, group_jobs in zip(groups, jobs)],
                                 "truncate")
        for group, alloc, group_jobs in zip(groups, req.allocations, jobs):
            group.map_truncate(alloc, group_jobs)  # the one refusable step
        self.coordinator.take(fresh)
        self.coordinator.copy([group.truncate_copies(alloc, group_jobs) for group, alloc, group_jobs in zip(groups, req.allocations, jobs)])
        for group, alloc, group_jobs in zip(groups, req.allocations, jobs):
            group.finish_truncate(alloc, num_tokens, group_jobs)
        del req.token_ids[num_tokens:]  # in place: the caller's list stays the request's
        req.chain.truncate(num_tokens, num_tokens // self.tokens_per_page)
        return True

    def _check_truncate(self, req: KVRequest, num_tokens: int) -> int:
        """``num_tokens`` checked for ``truncate(req, num_tokens)``: RequestStateError unless
        ``req`` is running, committed, has that many tokens, and keeps every position a query at
        ``num_tokens`` reads in every group (none released behind its window)."""
        req = self.registry.running(req)
        self.registry.require_committed(req)
        num_tokens = check.count(num_tokens, "num_tokens")
        if not num_tokens <= req.allocation.num_tokens:
            raise RequestStateError(f"request {req.request_id!r} has {req.allocation.num_tokens} tokens; "
                                    f"cannot truncate it to {num_tokens}")
        for group, alloc in zip(self.coordinator.groups, req.allocations):
            if alloc.num_released > group.spec.first_needed_block(num_tokens, self.tokens_per_page):
                layers = "" if len(self.coordinator.groups) == 1 else f"{group.spec.describe()} layers' "
                raise RequestStateError(
                    f"request {req.request_id!r}: cannot truncate it to {num_tokens} tokens; its "
                    f"{layers}first {alloc.num_released * self.tokens_per_page} positions were "
                    f"released behind its {group.spec.describe()}, and a query at {num_tokens} reads some")
        return num_tokens

    def can_truncate(self, requests: "Sequence[KVRequest | str]", num_tokens: int) -> bool:
        rows = list({id(row): row for row in map(self.registry.running, requests)}.values())  # once each
        for row in rows:
            num_tokens = self._check_truncate(row, num_tokens)
        if self.coordinator.has_state:  # a state is not rewound (truncate refuses it)
            return False
        for memory in self.coordinator.memories:  # the groups of one pool draw on one count of free blocks
            free = memory.pool.num_available
            for group in memory.groups:
                free = group.truncations_fit([row.allocations[group.index] for row in rows], num_tokens, free)
                if free is None:
                    return False
        return True


def check_exact_copies(names: list[str], sources: list[KVRequest]) -> None:
    """Refuse (``InvalidInputError``) to give a request demanding exact KV (``names[i]``) a copy of
    ``sources[i]`` where that holds lossy KV (the cold tier's)."""
    for name, source in zip(names, sources):
        if source.allocation.lossy_from is not None:
            raise InvalidInputError(
                f"request {name!r} demands exact KV (exact=True) but would copy {source.request_id!r}, "
                "which holds lossy KV from the cold tier; copy an exact request, or make it exact=False")
