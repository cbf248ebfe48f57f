"""The mapping budget of an operation on both layout groups of a hybrid model, asked before
either group changes.

Each group's ``KVCacheManager`` is all or nothing on its own: it plans, maps (the one step the
OS limit on mappings, ``vm.max_map_count``, can refuse) and only then takes blocks. Two groups
applied one after the other are not: the second could be refused after the first took blocks,
and cached blocks it evicted cannot be put back. So ``HybridKVCacheManager`` plans each group's
operation once (``plans.py``: ``_plan_admit``, ``_plan_grow``, ``_plan_fork``, ``_plan_swap_in``;
``_plan_reorder``, ``_truncate_copy``; ``planned``, ``reorder_plan`` and ``truncate_plan`` show
them to the budget), ``check_budget``
asks both groups' mappers whether the process's budget takes both, in order, and only then does
each group execute the plan the budget approved (``_execute_admit``, ``_execute_grow``, ...).
"""

from __future__ import annotations

from typing import Iterable

from .manager import KVCacheManager
from .plans import Plan
from .plans import fit_or_reclaim, reorder_mapping_cost
from .request import KVRequest
from .slots import MapJob

GroupJobs = tuple[KVCacheManager, list[MapJob], int]  # group, jobs, pages behind the window first
# reorder maps every row first and then unmaps behind each row's new window: one count per job
ReorderJobs = tuple[KVCacheManager, list[MapJob], list[int]]


def planned(group: KVCacheManager, plan: Plan | None) -> GroupJobs:
    """The budget's view of one group's plan (``plans.py``: the plan its operation then
    executes; None: nothing to map)."""
    return (group, [], 0) if plan is None else (group, plan.jobs, plan.behind)


def reorder_plan(group: KVCacheManager, rows: list[KVRequest], sources: list[KVRequest],
                 copied: list[bool]) -> ReorderJobs:
    """What ``reorder`` maps: each row its source's blocks (a fresh block where it copies)."""
    _, behind, jobs = group._plan_reorder(rows, sources, copied)
    return group, jobs, behind


def truncate_plan(group: KVCacheManager, req: KVRequest, num_tokens: int) -> GroupJobs | None:
    """What ``truncate`` maps: a private copy of the new last block when it is partial and shared
    or cached (``_truncate_copy``), else nothing; None when that copy has no free block."""
    page = group._truncate_copy(req, num_tokens)
    if page is None:
        return group, [], 0
    if not group.pool.num_free:
        return None
    return group, [MapJob(req.allocation.slot, page, group.pool.peek(1), keep=len(req.allocation.blocks))], 0


def _cost(group: KVCacheManager, jobs: list[MapJob], behind: "int | list[int]") -> tuple[int, int]:
    """(The most mappings held extra at any step, those held extra at the end) of a plan: unmap
    ``behind`` then map (an int), or reorder's map-then-unmap (a list)."""
    if isinstance(behind, int):
        return group.slots.mapping_cost(jobs, behind)
    return reorder_mapping_cost(group.slots, jobs, behind)


def _first_misfit(plans: "Iterable[GroupJobs | ReorderJobs]") -> tuple[int, int, int] | None:
    """(Which plan, the mappings it needs at its peak, the room it has) for the first plan the
    budget does not take when the plans are applied in order, or None when it takes them all."""
    charged = 0  # mappings the plans before this one add to the process's budget
    for index, (group, jobs, behind) in enumerate(plans):
        if not jobs:  # nothing to map (a decode inside its block)
            continue
        room = group.slots.mapping_room(charged)
        if room is None:  # no budget (CUDA, block tables)
            continue
        peak, added = _cost(group, jobs, behind)
        if peak > room:
            return index, peak, room
        charged += added
    return None


def check_budget(plans: "list[GroupJobs | ReorderJobs]", what: str) -> None:
    """Refuse (MappingLimitError) unless every plan's mappings fit the budget, applied in order.
    Stale mappings (free slots, pages past what the planned slots keep) are reclaimed first when
    they do not (``plans.fit_or_reclaim``): mapping state that no request owns."""
    def shortfall() -> str | None:
        misfit = _first_misfit(plans)
        if misfit is None:
            return None
        index, peak, room = misfit
        group = ("the global layout group", "the local layout group")[index] if len(plans) == 2 \
            else f"layout group {index}"
        after = " after the global group's" if index else ""
        return (f"{group} needs {peak} more kernel mappings (VMAs) and has room for {room}{after} "
                "(the process's budget is shared)")

    fit_or_reclaim(shortfall, [(group.slots, jobs) for group, jobs, _ in plans], what)
