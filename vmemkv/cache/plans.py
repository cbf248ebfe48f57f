"""The checks an operation's plans pass before anything changes, over every layer group.

Each group plans its part of an operation (``KVCacheGroup.plan_*``: what it maps, shares and
takes). The blocks are checked per group by the operation itself; the one other limit is the
process's budget of kernel mappings (``vm.max_map_count`` on CPU), which every group's mapper
draws from. A group's own map step refuses before that group changes anything, but the groups are
carried out one after another: so with more than one group, or where an operation unmaps after it
maps (reorder), ``check_mapping_budget`` asks whether the budget takes every plan, in order, first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from vmemkv.errors import MappingLimitError
from vmemkv.cache.request import KVRequest
from vmemkv.memory.slots import MapJob, SlotBinder, kept_pages

@dataclass(slots=True)
class Plan:
    """One group's part of a planned binding or growth (``plan_admit``, ``plan_grow``,
    ``plan_fork``, ``plan_swap_in``): it makes the slot's leading ``behind`` logical pages
    (behind the request's window) read nothing, then points logical pages ``first ..`` at
    ``mapped`` (``keep``: pages someone owns meanwhile, as in ``MapJob``). It takes one more
    reference on each block of ``share`` and the fresh blocks ``take`` (peeked by the
    coordinator, in order) from the pool."""

    slot: int
    behind: int
    first: int
    mapped: list[int]
    keep: int
    share: list[int]
    take: list[int]

    @property
    def jobs(self) -> list[MapJob]:
        """The mapping as ``slots.map_jobs`` and ``slots.mapping_cost`` take it (empty: none)."""
        return [MapJob(self.slot, self.first, self.mapped, self.keep)] if self.mapped else []


@dataclass(slots=True)
class Admission:
    """What ``admit`` reuses and reserves in one group, before its plan: the device prefix
    ``hits`` (``RELEASED`` behind the window), the host tier's blocks it copies in after them
    (``promote``, hashes) out of ``host_blocks`` host hits (with a window, hits wholly behind the
    next query's window are reused without a copy: ``RELEASED``), the tokens already computed
    (``cached``) and the tokens reserved (``num_tokens``); the first of its blocks holding lossy
    KV (``lossy_from``: a lossy device hit or a cold tier's block; None: none) and how many of
    ``promote`` come from the cold tier (``cold_blocks``)."""

    hits: list[int]
    promote: list[bytes]
    host_blocks: int
    cached: int
    num_tokens: int
    lossy_from: int | None = None
    cold_blocks: int = 0


# One group's part for the budget: its mapper, its jobs, and the pages behind the window it
# unmaps first (an int), or, for reorder, after each job's mapping (a list, one per job).
BudgetPart = tuple[SlotBinder, list[MapJob], "int | list[int]"]


def reorder_copies(tokens_per_page: int, rows: list[KVRequest],
                   sources: list[KVRequest]) -> list[bool]:
    """Which rows of ``reorder`` get a copy of their source's partial block. A source's partial
    block moves (no copy) to the first row that takes it, itself first, but only when the source
    is reordered too (its own reference is dropped): a source that keeps running keeps writing
    that block, so whoever takes it gets a copy."""
    owner: dict[int, int] = {}  # id(source) -> the row that takes its partial block
    for i, (row, source) in enumerate(zip(rows, sources)):
        if row is source:
            owner[id(source)] = i
    reordered = {id(row) for row in rows}
    for i, source in enumerate(sources):
        if id(source) in reordered:
            owner.setdefault(id(source), i)
    return [source.allocation.num_tokens % tokens_per_page != 0 and owner.get(id(source)) != i
            for i, source in enumerate(sources)]


def reorder_mapping_cost(slots: SlotBinder, jobs: list[MapJob], behind: list[int]) -> tuple[int, int]:
    """(The most mappings held extra at any step, those held extra at the end) of reorder's
    jobs: every row is mapped first, then unmapped behind its new window (a row reads its old
    pages until the maps are done)."""
    mapped = [slots.mapping_cost([job])[1] for job in jobs]
    final = [slots.mapping_cost([job], count)[1] for job, count in zip(jobs, behind)]
    held = total = sum(mapped)
    for before, after in zip(mapped, final):
        total += after - before
        held = max(held, total)
    return held, total


def _cost(slots: SlotBinder, jobs: list[MapJob], behind: "int | list[int]") -> tuple[int, int]:
    if isinstance(behind, int):
        return slots.mapping_cost(jobs, behind)
    return reorder_mapping_cost(slots, jobs, behind)


def _most_added(slots: SlotBinder, jobs: list[MapJob], behind: "int | list[int]") -> int:
    """A bound on the mappings a part can add: a page mapped or unmapped alone in a run splits
    it, adding at most two mappings."""
    behind_pages = behind * len(jobs) if isinstance(behind, int) else sum(behind)
    return 2 * slots.layout.pages_per_block * (sum(len(job.blocks) for job in jobs) + behind_pages)


def _first_misfit(parts: list[BudgetPart]) -> tuple[int, int, int] | None:
    """(Which part, the mappings it needs at its peak, the room it has) for the first part the
    budget does not take when the parts are carried out in order, or None. Far from the limit
    the exact counts (numpy over the page tables) are not needed: when the tightest backend has
    room for every part's bound together, each part fits whatever the parts before it add."""
    bound = sum(_most_added(slots, jobs, behind) for slots, jobs, behind in parts if jobs)
    if not bound:
        return None
    rooms = [room for room in (slots.mapping_room() for slots, jobs, _ in parts if jobs) if room is not None]
    if not rooms or bound <= min(rooms):
        return None
    return _exact_misfit(parts)


def _exact_misfit(parts: list[BudgetPart]) -> tuple[int, int, int] | None:
    """``_first_misfit`` counted exactly: each part's peak against its room after the parts
    before it."""
    charged = 0  # mappings the parts before this one add to the process's budget
    by_backend: dict[int, int] = {}  # ... and to each backend's own (groups sharing a pool share one)
    for index, (slots, jobs, behind) in enumerate(parts):
        if not jobs:  # nothing to map (a decode inside its block)
            continue
        here = by_backend.get(id(slots.backend), 0)
        room = slots.mapping_room(charged - here, here)
        if room is None:  # no budget (CUDA, block tables)
            continue
        peak, added = _cost(slots, jobs, behind)
        if peak > room:
            return index, peak, room
        charged += added
        by_backend[id(slots.backend)] = here + added
    return None


def check_plans_budget(groups, plans: list[Plan], what: str) -> None:
    """``check_mapping_budget`` of one operation's plans, ``plans[g]`` group ``groups[g]``'s
    (each with its ``slots``). Far from the limit (nearly always) the plans' sizes answer it
    alone, as ``_first_misfit``'s bound: no MapJob is made, no page table read, and groups
    sharing a backend ask its room once."""
    bound, mappers = 0, {}
    for group, plan in zip(groups, plans):
        if plan.mapped:
            slots = group.slots
            bound += 2 * slots.layout.pages_per_block * (len(plan.mapped) + plan.behind)
            mappers.setdefault(id(slots.backend), slots)
    if not bound:
        return
    rooms = [room for room in (slots.mapping_room() for slots in mappers.values()) if room is not None]
    if rooms and bound > min(rooms):
        check_mapping_budget([(group.slots, plan.jobs, plan.behind) for group, plan in zip(groups, plans)],
                             what)


def check_mapping_budget(parts: list[BudgetPart], what: str) -> None:
    """Refuse (MappingLimitError, nothing changed) unless the mapping budget takes every group's
    part of an operation, carried out in order. Stale mappings (free slots, pages past what the
    planned slots keep) are reclaimed first when it does not (``fit_or_reclaim``)."""
    def shortfall() -> str | None:
        misfit = _first_misfit(parts)
        if misfit is None:
            return None
        index, peak, room = misfit
        where = f"layer group {index} " if len(parts) > 1 else ""
        after = " after the groups before it" if index else ""
        return (f"{where}needs {peak} more kernel mappings (VMAs) and the budget has room for "
                f"{room}{after} (the process's budget is shared)")

    fit_or_reclaim(shortfall, [(slots, jobs) for slots, jobs, _ in parts], what)


def fit_or_reclaim(shortfall: Callable[[], str | None],
                   mappers: Iterable[tuple[SlotBinder, list[MapJob]]], what: str) -> None:
    """Refuse (MappingLimitError) unless an operation's mappings fit the process's budget;
    nothing is changed but mapping state no request owns. ``shortfall()`` says what does not fit
    (None: it fits). When something does not, each mapper's stale mappings (free slots, and pages
    past what its ``jobs`` keep of their slots) are reclaimed first, as ``SlotMapper.map_jobs``
    would on a refusal, and the budget is asked again."""
    if shortfall() is None:
        return
    for slots, jobs in mappers:
        slots.reclaim_stale(kept_pages(jobs))
    short = shortfall()
    if short is not None:
        raise MappingLimitError(
            f"refused to {what}: {short}; nothing was changed. Use a larger page_size, fewer slots "
            "or a shorter max_model_len, or raise vm.max_map_count")
