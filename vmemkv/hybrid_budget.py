"""The mapping budget of an operation on both layout groups of a hybrid model, asked before
either group changes.

Each group's ``KVCacheManager`` is all or nothing on its own: it plans, maps (the one step the
OS limit on mappings, ``vm.max_map_count``, can refuse) and only then takes blocks. Two groups
applied one after the other are not: the second could be refused after the first took blocks,
and cached blocks it evicted cannot be put back. So ``HybridKVCacheManager`` plans what each
group will map (the functions below follow the manager's own plan for admit, growth, fork,
swap-in, reorder and truncate: same blocks from ``pool.peek``, same slot), and ``check_budget`` asks both groups'
mappers whether the process's budget takes both, in order, before applying either.
"""

from __future__ import annotations

from typing import Iterable

from .errors import MappingLimitError
from .manager import KVCacheManager
from .request import RELEASED, KVRequest
from .slots import MapJob

Plan = tuple[KVCacheManager, list[MapJob], int]  # group, jobs, pages behind the window first
# reorder maps every row first and then unmaps behind each row's new window: one count per job
ReorderPlan = tuple[KVCacheManager, list[MapJob], list[int]]


def admit_plan(group: KVCacheManager, hits: list[int], num_tokens: int, slot: int) -> Plan:
    """What ``admit`` with these (capped) prefix hits maps into ``slot``."""
    behind = hits.count(RELEASED)
    live = hits[behind:]
    fresh = group.pool.peek(group.layout.logical_pages_for(num_tokens) - len(hits), exclude=live)
    return group, [MapJob(slot, behind, live + fresh)], behind


def grow_plan(group: KVCacheManager, req: KVRequest, num_new_tokens: int) -> Plan:
    """What ``allocate`` of ``num_new_tokens`` more positions maps (``ManagerState._grow``)."""
    tokens_per_page, blocks = group.tokens_per_page, req._blocks
    first = -(-req._num_tokens // tokens_per_page)
    end = -(-(req._num_tokens + num_new_tokens) // tokens_per_page)
    if end <= first:
        return group, [], 0
    fresh = group.pool.peek(end - len(blocks)) if end > len(blocks) else []
    return group, [MapJob(req._slot, first, blocks[first:end] + fresh, keep=len(blocks))], 0


def fork_plan(group: KVCacheManager, parent: KVRequest, slot: int) -> Plan:
    """What ``fork`` of ``parent`` maps into ``slot``: its full blocks and a copy of its last."""
    reserved = group._reserved_blocks(parent)
    partial = parent._num_tokens % group.tokens_per_page != 0
    shared = reserved[:-1] if partial else reserved
    behind = parent._num_released
    return group, [MapJob(slot, behind, shared[behind:] + (group.pool.peek(1) if partial else []))], behind


def swap_in_plan(group: KVCacheManager, req: KVRequest, slot: int) -> Plan:
    """What ``swap_in`` maps into ``slot``: blocks still cached are revived, the rest fresh."""
    revive, _ = group._swap_in_revivals(req)
    copy = [index for index, _ in req._swapped if index not in revive]
    blocks = list(req._blocks)
    for index, block in zip(copy, group.pool.peek(len(copy), exclude=revive.values())):
        blocks[index] = block
    for index, block in revive.items():
        blocks[index] = block
    behind = req._num_released
    return group, [MapJob(slot, behind, blocks[behind:])], behind


def reorder_copies(tokens_per_page: int, rows: list[KVRequest], sources: list[KVRequest]) -> list[bool]:
    """Which rows of ``reorder`` get a copy of their source's partial block (``SharingOps.reorder``:
    the partial block moves to the first row that takes it, itself first, when the source is a row
    too; every other taker copies it)."""
    owner: dict[int, int] = {}  # id(source) -> the row that takes its partial block
    for i, (row, source) in enumerate(zip(rows, sources)):
        if row is source:
            owner[id(source)] = i
    reordered = {id(row) for row in rows}
    for i, source in enumerate(sources):
        if id(source) in reordered:
            owner.setdefault(id(source), i)
    return [s._num_tokens % tokens_per_page != 0 and owner.get(id(s)) != i for i, s in enumerate(sources)]


def reorder_plan(group: KVCacheManager, rows: list[KVRequest], sources: list[KVRequest],
                 copied: list[bool]) -> ReorderPlan:
    """What ``reorder`` maps: each row its source's blocks (a fresh block where it copies)."""
    fresh = iter(group.pool.peek(sum(copied)))
    jobs, behind = [], []
    for row, source, copy in zip(rows, sources, copied):
        blocks = group._reserved_blocks(source)
        blocks = blocks[:-1] + [next(fresh)] if copy else blocks
        count = source._num_released
        jobs.append(MapJob(row._slot, count, blocks[count:], keep=len(row._blocks)))
        behind.append(count)
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


def first_block_slot(group: KVCacheManager, blocks: list[int], behind: int, slot: int | None = None) -> int:
    """The slot the group's ``slots.choose`` gives a request whose first block is ``blocks[0]``
    (``slot`` when the caller names one)."""
    return group.slots.choose(blocks[0] if blocks and not behind else None, slot)


def _cost(group: KVCacheManager, jobs: list[MapJob], behind: "int | list[int]") -> tuple[int, int]:
    """(The most mappings held extra at any step, those held extra at the end) of a plan: unmap
    ``behind`` then map (an int), or map every job and then unmap behind each (reorder: a list)."""
    if isinstance(behind, int):
        return group.slots.mapping_cost(jobs, behind)
    mapped = [group.slots.mapping_cost([job])[1] for job in jobs]
    final = [group.slots.mapping_cost([job], count)[1] for job, count in zip(jobs, behind)]
    held = total = sum(mapped)
    for before, after in zip(mapped, final):
        total += after - before
        held = max(held, total)
    return held, total


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
    they do not, as ``SlotMapper.map_jobs`` would: mapping state that no request owns."""
    if _fits(plans):
        return
    for group, jobs, _ in plans:
        keep: dict[int, int] = {}
        for job in jobs:
            keep[job.slot] = max(keep.get(job.slot, 0), job.keep)
        group.slots.reclaim_stale(keep)
    if not _fits(plans):
        costs = [_cost(group, jobs, behind)[0] for group, jobs, behind in plans]
        rooms = [group.slots.mapping_room() for group, _, _ in plans]
        raise MappingLimitError(
            f"refused to {what}: the layout groups need {costs} more kernel mappings (VMAs) and "
            f"have room for {rooms} (the process's budget is shared); nothing was changed. Use a "
            "larger page_size, fewer slots or a shorter max_model_len, or raise vm.max_map_count")
