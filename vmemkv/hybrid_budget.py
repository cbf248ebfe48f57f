"""The mapping budget of an operation on both layout groups of a hybrid model, asked before
either group changes.

Each group's ``KVCacheManager`` is all or nothing on its own: it plans, maps (the one step the
OS limit on mappings, ``vm.max_map_count``, can refuse) and only then takes blocks. Two groups
applied one after the other are not: the second could be refused after the first took blocks,
and cached blocks it evicted cannot be put back. So ``HybridKVCacheManager`` plans each group's
operation once (``plans.py``: ``_plan_admit``, ``_plan_grow``, ``_plan_fork``, ``_plan_swap_in``;
``planned`` shows one to the budget; reorder and truncate are planned here), ``check_budget``
asks both groups' mappers whether the process's budget takes both, in order, and only then does
each group execute the plan the budget approved (``_execute_admit``, ``_execute_grow``, ...).
"""

from __future__ import annotations

from typing import Iterable

from .manager import KVCacheManager
from .plans import Plan as OperationPlan
from .plans import fit_or_reclaim, reorder_mapping_cost
from .request import KVRequest
from .slots import MapJob

Plan = tuple[KVCacheManager, list[MapJob], int]  # group, jobs, pages behind the window first
# reorder maps every row first and then unmaps behind each row's new window: one count per job
ReorderPlan = tuple[KVCacheManager, list[MapJob], list[int]]


def planned(group: KVCacheManager, plan: OperationPlan | None) -> Plan:
    """The budget's view of one group's plan (``plans.py``: the plan its operation then
    executes; None: nothing to map)."""
    return (group, [], 0) if plan is None else (group, plan.jobs, plan.behind)


def reorder_plan(group: KVCacheManager, rows: list[KVRequest], sources: list[KVRequest],
                 copied: list[bool]) -> ReorderPlan:
    """What ``reorder`` maps: each row its source's blocks (a fresh block where it copies)."""
    _, behind, jobs = group._plan_reorder(rows, sources, copied)
    return group, jobs, behind


def truncate_plan(group: KVCacheManager, req: KVRequest, num_tokens: int) -> Plan | None:
    """What ``truncate`` maps: a private copy of the new last block when it is partial and shared
    or cached (the request writes it again), else nothing; None when that copy has no free block."""
    keep = group.layout.logical_pages_for(num_tokens)
    last = req._blocks[keep - 1] if keep and num_tokens % group.tokens_per_page else None
    if last is None or (group.pool.ref[last] == 1 and group.pool.hash_of[last] is None):
        return group, [], 0
    if not group.pool.num_free:
        return None
    return group, [MapJob(req._slot, keep - 1, group.pool.peek(1), keep=len(req._blocks))], 0


def _cost(group: KVCacheManager, jobs: list[MapJob], behind: "int | list[int]") -> tuple[int, int]:
    """(The most mappings held extra at any step, those held extra at the end) of a plan: unmap
    ``behind`` then map (an int), or reorder's map-then-unmap (a list)."""
    if isinstance(behind, int):
        return group.slots.mapping_cost(jobs, behind)
    return reorder_mapping_cost(group.slots, jobs, behind)


def _fits(plans: "Iterable[Plan | ReorderPlan]") -> bool:
    charged = 0  # mappings the plans before this one add to the process's budget
    for group, jobs, behind in plans:
        if not jobs:  # nothing to map (a decode inside its block)
            continue
        room = group.slots.mapping_room(charged)
        if room is None:  # no budget (CUDA, block tables)
            continue
        peak, added = _cost(group, jobs, behind)
        if peak > room:
            return False
        charged += added
    return True


def check_budget(plans: "list[Plan | ReorderPlan]", what: str) -> None:
    """Refuse (MappingLimitError) unless every plan's mappings fit the budget, applied in order.
    Stale mappings (free slots, pages past what the planned slots keep) are reclaimed first when
    they do not (``plans.fit_or_reclaim``): mapping state that no request owns."""
    def shortfall() -> str | None:
        if _fits(plans):
            return None
        costs = [_cost(group, jobs, behind)[0] for group, jobs, behind in plans]
        rooms = [group.slots.mapping_room() for group, _, _ in plans]
        return (f"the layout groups need {costs} more kernel mappings (VMAs) and have room for "
                f"{rooms} (the process's budget is shared)")

    fit_or_reclaim(shortfall, [(group.slots, jobs) for group, jobs, _ in plans], what)
