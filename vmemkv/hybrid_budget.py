"""The mapping budget of an operation on both layout groups of a hybrid model, asked before
either group changes.

Each group's ``KVCacheManager`` is all or nothing on its own: it plans, maps (the one step the
OS limit on mappings, ``vm.max_map_count``, can refuse) and only then takes blocks. Two groups
applied one after the other are not: the second could be refused after the first took blocks,
and cached blocks it evicted cannot be put back. So ``HybridKVCacheManager`` plans what each
group will map (the functions below follow the manager's own plan for admit, growth, fork and
swap-in: same blocks from ``pool.peek``, same slot), and ``check_budget`` asks both groups'
mappers whether the process's budget takes both, in order, before applying either.
"""

from __future__ import annotations

from typing import Iterable

from .errors import MappingLimitError
from .manager import KVCacheManager
from .request import RELEASED, KVRequest
from .slots import MapJob

Plan = tuple[KVCacheManager, list[MapJob], int]  # group, jobs, pages behind the window first


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


def first_block_slot(group: KVCacheManager, blocks: list[int], behind: int) -> int:
    """The slot the group's ``slots.choose`` gives a request whose first block is ``blocks[0]``."""
    return group.slots.choose(blocks[0] if blocks and not behind else None)


def _fits(plans: Iterable[Plan]) -> bool:
    charged = 0  # mappings the plans before this one add to the process's budget
    for group, jobs, behind in plans:
        if not jobs:  # nothing to map (a decode inside its block)
            continue
        room = group.slots.mapping_room(charged)
        if room is None:  # no budget (CUDA, block tables)
            continue
        peak, added = group.slots.mapping_cost(jobs, behind)
        if peak > room:
            return False
        charged += added
    return True


def check_budget(plans: list[Plan], what: str) -> None:
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
        costs = [group.slots.mapping_cost(jobs, behind)[0] for group, jobs, behind in plans]
        rooms = [group.slots.mapping_room() for group, _, _ in plans]
        raise MappingLimitError(
            f"refused to {what}: the layout groups need {costs} more kernel mappings (VMAs) and "
            f"have room for {rooms} (the process's budget is shared); nothing was changed. Use a "
            "larger page_size, fewer slots or a shorter max_model_len, or raise vm.max_map_count")
