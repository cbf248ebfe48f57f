"""On a model with two or three layer groups, an operation refused by any one group changes nothing
in any group.

``KVCacheManager`` runs one ``KVCacheGroup`` per attention kind. Each mutating operation plans its
part in every group and checks every part (blocks, slots, swap room, the process's budget of kernel
mappings over every group's mapper) before any group changes: carried out one group after another,
a later group's refusal used to come after the earlier groups had taken blocks (evicting cached
ones that cannot be put back). Here each operation (admit, allocate, fork, swap in, reorder,
truncate, lookahead, and a swap out) is refused in turn

* by each group's mapping budget, pinched to no mapping to spare (a slot backend only: block tables
  map nothing, so no mapping budget refuses them; groups sharing a pool share its backend, so
  pinching it pinches all of them and the first of them is refused),
* by every room the process's shared budget can leave short of what it needs, from none up, so
  that a later group is refused once the earlier groups' parts are counted,
* by too few blocks in one group while the others have room (both backends),
* a swap out, by one group's swap space,

and the whole state of every group (pools: reference counts, hashes, free queue, clean blocks;
free slots, mapped pages, swap and host rows, counters; every request's allocation in each group,
its token ids and hash chain) is compared before and after. With room again the same operation
goes through and every request reads back its K/V. A random walk under a randomly tightened
budget asks the same of every step, and the queries that predict an operation (``can_admit``,
``blocks_needed``, ...) change nothing and say what it then takes in every group.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import pytest

from conftest import allocation, groups_state as state
from test_hybrid_groups import (BACKENDS, C, P, THREE_KINDS, W, WINDOWS, close, decode, make_hybrid,
                                reads_back, run, write)
from vmemkv import KVRequest, MappingLimitError, OutOfSwapSpaceError, RequestStateError
from vmemkv.cache.attention_spec import CHUNKED, AttentionSpec
from vmemkv.cache.plans import fit_or_reclaim
from vmemkv.cache.request import RELEASED
from vmemkv.memory.slots import MapJob
from vmemkv.memory.vmm.cpu import process_mapping_budget

CHUNKED_FIRST = [AttentionSpec(CHUNKED, C), W, None, None]  # groups: full, chunked local, sliding
KINDS = {"one-kind": None, "two-kinds": WINDOWS, "three-kinds": THREE_KINDS, "chunked-first": CHUNKED_FIRST}
GROUPS = [0, 1]  # the group of a two-kind manager (make_hybrid()) whose mapping budget refuses
# (kinds, the group whose mapping budget refuses): the first group, and each later one
BUDGET_CASES = [("two-kinds", 0), ("two-kinds", 1), ("three-kinds", 0), ("three-kinds", 1), ("three-kinds", 2)]
# (kinds, the one group short of blocks or swap room): the full-attention group (a long request
# holds every block there, a window's or a chunk's elsewhere) or a sliding group, first or last of
# the local ones (a request holds more blocks of its window than of its chunk: the chunked group
# keeps room)
SHORT_CASES = [("two-kinds", 0), ("two-kinds", 1), ("three-kinds", 0), ("three-kinds", 1), ("chunked-first", 2)]
LAYER_BLOCK_BYTES = P * 2 * 16 * 4 * 2  # one layer's K and V of a block (make_hybrid: 2 heads of 16 floats)


def make(kinds: str, local_blocks: int = 8, **overrides):
    """24 blocks in the full-attention group, ``local_blocks`` in each local one, 8 slots."""
    layers = 3 if kinds == "two-kinds" else 2  # the local layers' share of a block, in quarters
    num_blocks = (24 * (4 - layers) + layers * local_blocks) // 4  # the full-attention group's are 1/4 or 2/4
    manager = make_hybrid(KINDS[kinds], **{**dict(num_blocks=num_blocks, local_blocks=local_blocks,
                                                  max_num_seqs=8), **overrides})
    assert [group.num_blocks for group in manager.layout_groups] == [24] + [local_blocks] * (
        len(manager.layout_groups) - 1)
    return manager


# --- what a refusal must leave as it was -----------------------------------------------------------

def holds_nothing(req: KVRequest) -> bool:
    """A request no operation has bound (a refused admission's or fork child's)."""
    return all(allocation(alloc) == (None, [], 0, 0, 0, 0, None) for alloc in req.allocations)


def running(manager) -> list[KVRequest]:
    return [manager.request(r) for r in manager.request_ids() if not manager.is_swapped(r)]


def reclaim_stale(manager) -> None:
    """Unmap every group's stale mappings (a refusal may reclaim them: a budget pinched with them
    still mapped would not pinch)."""
    reqs = running(manager)
    for group in manager.layout_groups:
        allocs = [req.allocations[group.index] for req in reqs]
        group.slots.reclaim_stale({alloc.slot: len(alloc.blocks) for alloc in allocs})


def pinch(manager, refusing: int) -> None:
    """No kernel mapping to spare in layer group ``refusing``, stale ones reclaimed first."""
    reclaim_stale(manager)
    backend = manager.layout_groups[refusing].backend
    backend.max_mappings = backend.mappings_in_use


def unpinch(manager) -> None:
    for group in manager.layout_groups:
        group.backend.max_mappings = None


def free_blocks(manager) -> list[int]:
    """Each group's free blocks: its memory's (shared by the groups drawing from one pool)."""
    return [group.num_free_blocks for group in manager.layout_groups]


def after_taking(manager, free: list[int], each: int) -> list[int]:
    """``free`` (``free_blocks``) once every group took ``each`` blocks from its memory: a memory
    hands out ``each`` for every group drawing from it."""
    return [count - each * len(group.memory.groups) for count, group in zip(free, manager.layout_groups)]


def held_apart(manager, req: KVRequest) -> bool:
    """The groups of one memory hold distinct blocks for ``req`` (a block holds one group's layers)."""
    for memory in manager.memories:
        blocks = [b for group in memory.groups for b in req.group_block_table(group.index) if b != RELEASED]
        if len(set(blocks)) != len(blocks):
            return False
    return True


def cached_content(group) -> int:
    """Free blocks of the group's pool holding a prefix of this group's (keyed by its key: a shared
    pool holds its other groups' too)."""
    pool = group.pool
    return sum(pool.ref[block] == 0 for key, block in pool.block_of_hash.items()
               if key == group.key(key[:32]))


def private_blocks(manager, req: KVRequest, index: int) -> int:
    """Blocks only ``req`` holds in layer group ``index`` (what a swap out copies there)."""
    alloc, pool = req.allocations[index], manager.layout_groups[index].pool
    return sum(pool.ref[block] == 1 for block in alloc.blocks[alloc.num_released:])


def test_state_sees_every_group():
    """The comparison can fail: a block taken from any one group's pool, or a page of a request
    unmapped in any one group, shows (and is gone again once put back)."""
    manager = make("three-kinds")
    try:
        a = run(manager, "a", list(range(40)))
        for group in manager.layout_groups:
            before = state(manager)
            taken = group.pool.take(group.pool.peek(1))
            assert state(manager) != before
            group.pool.release(taken)
            assert state(manager) == before
            alloc = a.allocations[group.index]
            held_blocks = alloc.blocks[alloc.num_released:]
            assert held_blocks
            group.slots.unmap_behind(alloc.slot, len(alloc.blocks), alloc.num_released)
            assert state(manager) != before
            group.slots.map_blocks(alloc.slot, alloc.num_released, held_blocks, len(alloc.blocks))
            assert state(manager) == before
        manager.check()
    finally:
        close(manager)


# --- the operations, each set up to be refused --------------------------------------------------------

@dataclass
class Scenario:
    """An operation set up on a manager. ``attempt()`` tries it: True when done, False when refused
    by its return value (a refusal that raises propagates). ``done()`` checks what it did, once
    done; ``need(g)``: the blocks it takes in layer group g; ``can()``: the query that predicts it
    (None: none); ``fresh``: requests a refusal must leave holding nothing (``untouched``)."""

    attempt: Callable[[], bool]
    done: Callable[[], None]
    need: Callable[[int], int] = lambda index: 1
    can: Callable[[], bool] | None = None
    fresh: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fresh_tokens = [list(req.token_ids) for req in self.fresh]

    def untouched(self) -> bool:
        """The fresh requests hold nothing and kept their token ids (a refused admission keeps
        its prompt's hashes, so that a retry hashes nothing again)."""
        return all(holds_nothing(req) and req.token_ids == tokens
                   for req, tokens in zip(self.fresh, self.fresh_tokens))


def admit_scenario(manager) -> Scenario:
    a = run(manager, "a", list(range(40)))
    manager.free(run(manager, "old", list(range(1000, 1040))))  # cached blocks an admission evicts
    new = KVRequest("new", list(range(500, 548)))  # three blocks in every group

    def attempt() -> bool:
        cached = manager.admit(new)
        assert cached in (None, 0)
        return cached is not None

    def done() -> None:
        write(manager, new, 0, new.num_tokens)
        manager.commit(new)
        assert reads_back(manager, a) and reads_back(manager, new)

    return Scenario(attempt, done, lambda index: 3, lambda: manager.can_admit(new), [new])


def allocate_scenario(manager) -> Scenario:
    a = run(manager, "a", list(range(2 * P)))  # full pages: the next token needs a new one
    run(manager, "b", list(range(100, 100 + P)))  # a's slot is followed by b's: a new run splits

    def done() -> None:
        assert a.num_tokens == 2 * P + 1 and a.token_ids[-1] == 7
        write(manager, a, 2 * P, 2 * P + 1)
        manager.commit(a)
        assert reads_back(manager, a)

    return Scenario(lambda: manager.allocate(a, 1, [7]), done, can=lambda: manager.can_allocate(a, 1))


def fork_scenario(manager) -> Scenario:
    parent = run(manager, "a", list(range(W + P + 3)))  # a partial last page: the fork copies it
    child = KVRequest("child", [])

    def done() -> None:
        assert manager.request("child") is child and child.token_ids == parent.token_ids
        assert reads_back(manager, child) and reads_back(manager, parent)

    return Scenario(lambda: manager.fork(parent, child) is not None, done, fresh=[child])


def swap_in_scenario(manager) -> Scenario:
    a = run(manager, "a", list(range(W + P + 5)))
    assert manager.preempt(a, "swap") == "swap"

    def done() -> None:
        assert not a.is_swapped and reads_back(manager, a)

    return Scenario(lambda: manager.swap_in(a), done, lambda index: len(a.allocations[index].swapped),
                    lambda: manager.can_swap_in(a))


def two_beams(manager) -> list[KVRequest]:
    """A request of 3 pages and a bit, and its fork, each then decoding its own token: 50 tokens,
    their full pages shared, their last partial; a sliding group released their first page, a
    chunked one the first two."""
    first = run(manager, "b0", [(i * 7) % 50 for i in range(3 * P + 1)])
    rows = [first, manager.fork(first, KVRequest("b1", []))]
    for index, row in enumerate(rows):
        assert decode(manager, row, 100 + index)
    return rows


def reorder_scenario(manager) -> Scenario:
    rows = two_beams(manager)
    tokens = [list(row.token_ids) for row in rows]

    def done() -> None:
        assert rows[0].token_ids == rows[1].token_ids == tokens[1]
        assert all(reads_back(manager, row) for row in rows)

    # row 0 becomes a copy of row 1, whose partial last page it copies (in every group, beside a
    # page it keeps: the copy splits a run of mapped pages)
    return Scenario(lambda: manager.reorder(rows, [rows[1], rows[1]]), done)


def truncate_scenario(manager) -> Scenario:
    # 50 tokens, their full pages shared with a fork; truncated to 44 it keeps every position a
    # query at 44 reads (the window from 25, the chunk from 32), and its new last page, shared,
    # is copied first in every group, beside the page after it it still maps
    parent = run(manager, "a", list(range(3 * P + 2)))
    child = manager.fork(parent, KVRequest("child", []))

    def done() -> None:
        assert parent.num_tokens == len(parent.token_ids) == 3 * P - 4
        assert decode(manager, parent, 77)  # writes into its own copy
        assert reads_back(manager, child) and reads_back(manager, parent)

    return Scenario(lambda: manager.truncate(parent, 3 * P - 4), done,
                    can=lambda: manager.can_truncate([parent], 3 * P - 4))


def lookahead_scenario(manager) -> Scenario:
    a = run(manager, "a", list(range(2 * P)))  # full pages: its next block is given ahead
    run(manager, "b", list(range(100, 100 + P)))  # a's next block will not extend its run

    def attempt() -> bool:
        jobs = manager.allocate_lookahead([a], 1)
        if not jobs:
            return False
        assert sorted(job.group for job in jobs) == list(range(len(manager.layout_groups)))
        try:
            manager.map_lookahead(jobs)
        except MappingLimitError:
            manager.cancel_lookahead(jobs)  # as the engine does, before the requests grow again
            raise
        return True

    def done() -> None:
        free = free_blocks(manager)
        a.token_ids.append(7)
        assert manager.allocate(a, 1)  # into the blocks given ahead: nothing more is taken
        assert free_blocks(manager) == free
        write(manager, a, 2 * P, 2 * P + 1)
        manager.commit(a)
        assert reads_back(manager, a)

    return Scenario(attempt, done)


SCENARIOS = {"admit": admit_scenario, "allocate": allocate_scenario, "fork": fork_scenario,
             "swap_in": swap_in_scenario, "reorder": reorder_scenario, "truncate": truncate_scenario,
             "lookahead": lookahead_scenario}
OPERATIONS = list(SCENARIOS)
# what a mapping-budget refusal says: the coordinator's check over every group names the group; a
# lookahead's mapping (on another thread) is each group's own mapper, all or nothing there
REFUSAL = {"admit": "admit", "allocate": "allocate", "fork": "fork", "swap_in": "swap in",
           "reorder": "reorder", "truncate": "truncate"}


def refusal_pattern(op: str, group: int) -> str:
    if op == "lookahead":
        return "refused to map"
    return rf"refused to {REFUSAL[op]}: layer group {group} needs"


# --- refused by one group's mapping budget ----------------------------------------------------------

@pytest.mark.parametrize("kinds,refusing", BUDGET_CASES)
@pytest.mark.parametrize("op", OPERATIONS)
def test_an_operation_one_groups_mapping_budget_refuses_changes_nothing(op, kinds, refusing):
    manager = make(kinds)
    try:
        scenario = SCENARIOS[op](manager)
        groups = manager.layout_groups
        pinch(manager, refusing)
        before, mappings = state(manager), [group.backend.mappings_in_use for group in groups]
        with pytest.raises(MappingLimitError, match=refusal_pattern(op, refusing)):
            scenario.attempt()
        assert state(manager) == before and scenario.untouched()
        if op == "lookahead":  # the groups before the refusing one had mapped theirs: stale now
            assert all(group.backend.mappings_in_use > count
                       for group, count in zip(groups[:refusing], mappings))
        manager.check()
        unpinch(manager)
        assert scenario.attempt()
        scenario.done()
        manager.check()
    finally:
        close(manager)


def with_cached_prefix(manager) -> KVRequest:
    """A running request, and a freed one whose blocks stay cached (an admission evicts them)."""
    running_req = run(manager, "a", list(range(40)))
    manager.free(run(manager, "old", list(range(1000, 1040))))
    return running_req


# BUDGET_CASES on the pools a manager makes (three kinds: the sliding and the chunked group, one
# layer each, share one pool and backend), and the local groups of three kinds with pools of their
# own (``local_blocks``: the old static split), where the chunked group's budget refuses alone
EVICTION_CASES = ([pytest.param(kinds, refusing, None, id=f"{kinds}-{refusing}")
                   for kinds, refusing in BUDGET_CASES]
                  + [pytest.param("three-kinds", refusing, 12, id=f"three-kinds-{refusing}-separate")
                     for refusing in (1, 2)])


@pytest.mark.parametrize("kinds,refusing,local_blocks", EVICTION_CASES)
def test_an_admission_refused_by_any_groups_budget_evicts_no_cached_block(kinds, refusing, local_blocks):
    """What a refusal after an earlier group's part would lose: every group's admission evicts
    cached blocks (which cannot be put back)."""
    manager = make_hybrid(KINDS[kinds], num_blocks=12, max_num_seqs=3, local_blocks=local_blocks)
    try:
        groups = manager.layout_groups
        shared = kinds == "three-kinds" and local_blocks is None
        if kinds == "three-kinds":  # one memory for the one-layer local groups, unless split
            assert (groups[1].memory is groups[2].memory) == shared
        # pinching a shared backend pinches every group of its memory: the first one is refused
        named = groups[refusing].memory.groups[0].index
        assert named == (1 if shared and refusing == 2 else refusing)
        a = with_cached_prefix(manager)
        cached = [cached_content(group) for group in groups]
        pinch(manager, refusing)
        before = state(manager)
        new = KVRequest("new", list(range(500, 620)))  # more blocks than are never used: evicts
        with pytest.raises(MappingLimitError, match=refusal_pattern("admit", named)):
            manager.admit(new)
        assert state(manager) == before and holds_nothing(new)
        manager.check()
        unpinch(manager)
        assert manager.admit(new) == 0
        assert all(cached_content(group) < count for group, count in zip(groups, cached))
        write(manager, new, 0, new.num_tokens)
        manager.commit(new)
        assert reads_back(manager, a) and reads_back(manager, new)
        manager.check()
    finally:
        close(manager)


# --- every room of the process's budget, from none up ----------------------------------------------

LATER_GROUP = re.compile(r"layer group [1-9]\d* needs .* after the groups before it")


@pytest.mark.parametrize("kinds", ["two-kinds", "three-kinds"])
@pytest.mark.parametrize("op", OPERATIONS)
def test_every_room_the_process_budget_leaves_refuses_cleanly_or_does_it_all(op, kinds):
    """The groups draw on one budget of kernel mappings (``vm.max_map_count``'s share). With no
    room to spare, then one more, and so on: each try is refused with nothing changed in any group
    (among them refusals of a later group once the earlier groups' parts are counted) until it
    fits, and then it is done in every group. A plan checked other than it is carried out would
    show here: as a later group refused midway, its earlier groups changed."""
    budget = process_mapping_budget()
    manager = make(kinds)
    limit = budget.limit
    try:
        scenario = SCENARIOS[op](manager)
        groups = manager.layout_groups
        refused, later = [], 0
        for room in range(64):
            reclaim_stale(manager)
            before, mappings = state(manager), [group.backend.mappings_in_use for group in groups]
            budget.limit = budget.used + room
            try:
                done = scenario.attempt()
            except MappingLimitError as error:
                budget.limit = limit
                assert state(manager) == before and scenario.untouched(), f"room {room}"
                refused.append(room)
                if op == "lookahead":  # the first group mapped its jobs, a later one was refused
                    later += groups[0].backend.mappings_in_use > mappings[0]
                else:
                    later += bool(LATER_GROUP.search(str(error)))
                continue
            finally:
                budget.limit = limit
            assert done, f"room {room}: refused without raising"
            break
        else:
            pytest.fail("no room up to 64 mappings took it")
        assert refused == list(range(room)) and later, (refused, later)
        scenario.done()
        manager.check()
    finally:
        budget.limit = limit
        close(manager)


# --- too few blocks in one group ------------------------------------------------------------------

def starve(manager, short: int) -> list[KVRequest]:
    """Committed fillers until layer group ``short`` has no free block (none cached either), taking
    fewer of the other groups': in the full-attention group a request grown long holds every
    block, in the others a window's or a chunk's; in a sliding group a request of 4 pages holds
    two, in a chunked one none (its chunk starts at its end)."""
    group, fillers = manager.layout_groups[short], []

    def filler(length: int) -> KVRequest:
        base = 2000 + 300 * len(fillers)
        fillers.append(run(manager, f"filler{len(fillers)}", [base + i for i in range(length)]))
        return fillers[-1]

    if short == 0:
        req = filler(P)
        while group.num_free_blocks:
            if req.num_tokens + P > manager.config.max_model_len:
                req = filler(P)
                continue
            last = req.token_ids[-1]
            req.token_ids.extend(range(last + 1, last + 1 + P))
            assert manager.allocate(req, P)
            manager.commit(req)
    else:
        while group.num_free_blocks:
            filler(4 * P if group.num_free_blocks >= 4 else P)
    return fillers


@pytest.mark.parametrize("kv_backend", BACKENDS)
@pytest.mark.parametrize("kinds,short", SHORT_CASES)
@pytest.mark.parametrize("op", OPERATIONS)
def test_an_operation_one_group_has_too_few_blocks_for_changes_nothing(op, kinds, short, kv_backend):
    # the full-attention group is starved by long requests, which hold a few blocks of every
    # local group each; lookahead takes only clean blocks (never evicting a cached one), so
    # there no released block is cached, and the other groups keep clean ones
    manager = make(kinds, local_blocks=12 if short == 0 else 8, kv_backend=kv_backend,
                   enable_prefix_caching=op != "lookahead")
    try:
        scenario = SCENARIOS[op](manager)
        fillers = starve(manager, short)
        groups = manager.layout_groups
        # the short group has no block (none cached either); every other group has the blocks
        # the operation takes there (clean ones for lookahead, which evicts no cached block),
        # and a slot is free
        assert groups[short].num_free_blocks == 0 < scenario.need(short)
        for group in groups:
            if group.index != short:
                room = group.pool.num_clean if op == "lookahead" else group.num_free_blocks
                assert room >= scenario.need(group.index), (group.index, free_blocks(manager))
        assert manager.num_free_slots
        before = state(manager)
        if scenario.can is not None:
            assert not scenario.can()
            assert state(manager) == before
        assert not scenario.attempt()
        assert state(manager) == before and scenario.untouched()
        manager.check()
        for req in fillers:
            manager.free(req)
        if scenario.can is not None:
            assert scenario.can()
        assert scenario.attempt()
        scenario.done()
        manager.check()
    finally:
        close(manager)


# --- too little swap space in one group -----------------------------------------------------------

@pytest.mark.parametrize("kv_backend", BACKENDS)
@pytest.mark.parametrize("kinds,short", SHORT_CASES)
def test_a_swap_out_one_groups_swap_space_cannot_take_changes_nothing(kinds, short, kv_backend):
    rows = 2 if short == 0 else 1  # host rows of each group (its share of the swap space, by layers)
    manager = make(kinds, kv_backend=kv_backend, swap_space_bytes=rows * 4 * LAYER_BLOCK_BYTES)
    try:
        groups = manager.layout_groups
        assert [group.swap.num_blocks for group in groups] == [rows] * len(groups)
        if short == 0:
            a = run(manager, "a", list(range(100)))  # 7 private blocks in the full-attention group
        else:
            # a's full blocks are its fork's too in the full-attention group; the fork, decoded
            # past them, released them in the local groups: there they are a's alone (two of its
            # window, one of its chunk)
            a = run(manager, "a", list(range(3 * P)))
            child = manager.fork(a, KVRequest("child", []))
            for step in range(2 * P):
                assert decode(manager, child, step % 7)
        private = [private_blocks(manager, a, group.index) for group in groups]
        assert private[short] > rows >= max(count for index, count in enumerate(private) if index != short)
        before = state(manager)
        estimate = manager.estimate_preemption(a)
        assert not estimate.swap_fits
        assert estimate.swap_bytes == sum(count * group.block_bytes for count, group in zip(private, groups))
        with pytest.raises(OutOfSwapSpaceError,
                           match=f"needs {private[short]} blocks of {groups[short].block_bytes} B"):
            manager.preempt(a, "swap")
        assert state(manager) == before
        manager.check()
        assert decode(manager, a, 5) and reads_back(manager, a)  # nothing of it was lost
        assert manager.preempt(a, "recompute") == "recompute"
        manager.check()
    finally:
        close(manager)


# --- the queries change nothing and say what the operation takes -----------------------------------

@pytest.mark.parametrize("kinds", ["one-kind", "two-kinds", "three-kinds"])
def test_the_queries_change_nothing_and_say_what_each_group_takes(kinds):
    manager = make_hybrid(KINDS[kinds], num_blocks=16, max_num_seqs=3)
    try:
        groups = manager.layout_groups
        a = KVRequest("a", list(range(2 * P - 2)))  # a full page and a partial one
        before = state(manager)
        assert manager.can_admit(a) and manager.match_prefix(a)[0] == []
        assert state(manager) == before
        free = free_blocks(manager)
        assert manager.admit(a) == 0
        for group in groups:  # two fresh blocks in every group, referenced once, unhashed
            table = a.group_block_table(group.index)
            assert len(table) == 2
            assert all(group.pool.ref[b] == 1 and group.pool.hash_of[b] is None for b in table)
        assert held_apart(manager, a)  # groups of one pool: blocks of their own
        assert free_blocks(manager) == after_taking(manager, free, 2)
        write(manager, a, 0, a.num_tokens)
        manager.commit(a)

        before = state(manager)
        assert manager.blocks_needed(a, 1) == 0 and manager.can_allocate(a, 1)  # inside its last page
        assert manager.blocks_needed(a, 3) == 1 and manager.can_allocate(a, 3)  # into a third
        assert state(manager) == before
        free, tables = free_blocks(manager), [a.group_block_table(g.index) for g in groups]
        assert manager.allocate(a, 3, [1, 2, 3])
        assert free_blocks(manager) == after_taking(manager, free, 1)
        for group, table in zip(groups, tables):
            grown = a.group_block_table(group.index)
            assert grown[:-1] == table and grown[-1] not in table and group.pool.ref[grown[-1]] == 1
        assert held_apart(manager, a)
        write(manager, a, 2 * P - 2, a.num_tokens)
        manager.commit(a)

        free = free_blocks(manager)
        b = manager.fork(a, "b")  # full pages shared, the partial one copied
        assert free_blocks(manager) == after_taking(manager, free, 1)
        for group in groups:
            parent, child = a.group_block_table(group.index), b.group_block_table(group.index)
            assert child[:-1] == parent[:-1] and child[-1] not in parent and child[-1] != RELEASED
            assert all(group.pool.ref[block] == 2 for block in child[:-1] if block != RELEASED)
        assert held_apart(manager, b)
        assert reads_back(manager, b)

        estimate = manager.estimate_preemption(b)
        assert estimate.swap_bytes == sum(private_blocks(manager, b, g.index) * g.block_bytes for g in groups)
        assert manager.preempt(b, "swap") == "swap"
        before = state(manager)
        assert manager.can_swap_in(b)
        assert state(manager) == before
        assert manager.swap_in(b) and reads_back(manager, b) and reads_back(manager, a)
        manager.check()
    finally:
        close(manager)


# --- a random walk under a tight budget -------------------------------------------------------------

WALKED: Counter = Counter()  # (operation, outcome) over the walks
WALK_OPERATIONS = ("admit", "allocate", "fork", "swap_in", "reorder", "truncate", "lookahead")


def walk_step(manager, rng: random.Random, reqs: dict, swapped: dict, step: int) -> tuple[str, str]:
    """One random operation; returns (operation, outcome: done, refused, budget or skipped).
    A refusal leaves the whole state as it was; what was done is committed and written."""
    op = rng.choice(["admit", "admit", "allocate", "allocate", "allocate", "fork", "swap", "swap_in",
                     "reorder", "truncate", "truncate", "lookahead", "free"])
    names = sorted(reqs)
    name = rng.choice(names) if names else None
    before = state(manager)
    try:
        if op == "admit":
            req = KVRequest(f"r{step}", [rng.randrange(3) * 97 + i for i in range(rng.randrange(1, 70))])
            done = manager.admit(req) is not None
            if done:
                write(manager, req, req.num_computed_tokens, req.num_tokens)
                manager.commit(req)
                reqs[req.request_id] = req
            else:
                assert holds_nothing(req)
        elif op == "allocate" and name:
            req, count = reqs[name], rng.choice([1, 1, rng.randrange(2, 24)])  # a decode or a chunk
            if req.num_tokens + count > manager.config.max_model_len:
                return op, "skipped"
            done = manager.allocate(req, count, [rng.randrange(40) for _ in range(count)])
            if done:
                write(manager, req, req.num_computed_tokens, req.num_tokens)
                manager.commit(req)
        elif op == "fork" and name:
            child = KVRequest(f"r{step}", [])
            done = manager.fork(reqs[name], child) is not None
            if done:
                reqs[child.request_id] = child
            else:
                assert holds_nothing(child)
        elif op == "swap" and name:
            if not manager.estimate_preemption(reqs[name]).swap_fits:
                with pytest.raises(OutOfSwapSpaceError):
                    manager.preempt(reqs[name], "swap")
                done = False
            else:
                done = manager.preempt(reqs[name], "swap") == "swap"
                swapped[name] = reqs.pop(name)
        elif op == "swap_in" and swapped:
            key = rng.choice(sorted(swapped))
            done = manager.swap_in(swapped[key])
            if done:
                reqs[key] = swapped.pop(key)
        elif op == "reorder" and name:
            rows = rng.sample([reqs[n] for n in names], rng.randint(1, len(names)))
            sources = [rng.choice(rows) for _ in rows]
            expected = [list(source.token_ids) for source in sources]
            done = manager.reorder(rows, sources)
            if done:
                assert [row.token_ids for row in rows] == expected
        elif op == "truncate" and name:
            req = reqs[name]
            full = req.num_tokens // P * P  # mostly into its full pages: those copy (cached, shared)
            length = rng.randint(1, req.num_tokens) if rng.random() < 0.3 or full < P else \
                rng.randint(max(full - 2 * P, 0) // P, full // P - 1) * P + rng.randint(1, P - 1)
            try:
                done = manager.truncate(req, length)
            except RequestStateError:  # a window's or a chunk's positions already released
                done = False
        elif op == "lookahead" and names:
            jobs = manager.allocate_lookahead([reqs[n] for n in names], rng.randrange(1, 2 * P))
            done = bool(jobs)
            try:
                manager.map_lookahead(jobs)
            except MappingLimitError:
                manager.cancel_lookahead(jobs)
                raise
        elif op == "free" and name:
            manager.free(reqs.pop(name))
            return op, "done"
        else:
            return op, "skipped"
    except MappingLimitError:
        assert state(manager) == before, f"{op} refused by the budget changed something"
        return op, "budget"
    if not done:
        assert state(manager) == before, f"refused {op} changed something"
    return op, "done" if done else "refused"


@pytest.mark.parametrize("kinds", ["two-kinds", "three-kinds"])
@pytest.mark.parametrize("seed", range(3))
def test_a_random_walk_under_a_tight_budget_is_all_or_nothing_in_every_group(seed, kinds):
    """Admissions with shared prefixes, decodes and chunks, forks, swaps, reorders, truncations,
    lookahead and frees, each under a budget tightened at random in one group (a few mappings to
    spare, or none): every step is refused with nothing changed, or done in every group and
    every request reads back its K/V."""
    rng = random.Random(seed)
    manager = make_hybrid(KINDS[kinds], num_blocks=12, max_num_seqs=4)
    reqs, swapped = {}, {}
    try:
        for step in range(150):
            unpinch(manager)
            if rng.random() < 0.6:  # a few mappings to spare, or none, in one group
                refusing = rng.randrange(len(manager.layout_groups))
                pinch(manager, refusing)  # its stale ones reclaimed first, as a refusal would
                manager.layout_groups[refusing].backend.max_mappings += rng.randrange(3)
            WALKED[walk_step(manager, rng, reqs, swapped, step)] += 1
            unpinch(manager)
            manager.check()
            assert all(reads_back(manager, req) for req in reqs.values())
        for req in list(reqs.values()) + list(swapped.values()):
            manager.free(req)
        manager.check()
        assert all(group.num_blocks_in_use == 0 for group in manager.layout_groups)
    finally:
        close(manager)


def test_the_walks_had_every_operation_done_and_refused_by_the_budget():
    """Run after the walks (file order)."""
    if not WALKED:
        pytest.skip("the random walks did not run in this test run (run the whole file)")
    for op in WALK_OPERATIONS:
        assert WALKED[op, "done"] and WALKED[op, "budget"], (op, WALKED)


# --- fit, else reclaim stale mappings, else refuse -------------------------------------------------

class FakeMapper:
    def __init__(self):
        self.reclaimed = []

    def reclaim_stale(self, keep):
        self.reclaimed.append(keep)


def test_fit_or_reclaim_reclaims_only_when_needed_and_refuses_after_that():
    jobs = [MapJob(1, 0, [5, 6]), MapJob(1, 4, [7]), MapJob(2, 0, [8])]
    mapper = FakeMapper()
    fit_or_reclaim(lambda: None, [(mapper, jobs)], "admit")
    assert mapper.reclaimed == []  # it fits: nothing reclaimed

    answers = iter(["short", None])  # fits once stale mappings are gone
    fit_or_reclaim(lambda: next(answers), [(mapper, jobs)], "admit")
    assert mapper.reclaimed == [{1: 5, 2: 1}]  # each slot keeps the most any job keeps

    mapper.reclaimed.clear()
    with pytest.raises(MappingLimitError, match="refused to fork: it needs 3; nothing was changed"):
        fit_or_reclaim(lambda: "it needs 3", [(mapper, jobs)], "fork")
    assert len(mapper.reclaimed) == 1


# --- the cost the check asks for is the cost the backend charges ------------------------------------

@pytest.mark.parametrize("layout", ["token_major", "per_layer"])
@pytest.mark.parametrize("seed", range(6))
def test_mapping_cost_is_what_the_backend_charges(layout, seed):
    """Random jobs (with pages behind a window released first) on a sliding-window group: the
    cost ``mapping_cost`` predicts is the change in the backend's kernel mappings, at the end and
    at its peak (the release is one call, the jobs another)."""
    manager = make_hybrid(layout=layout)
    slots, rng = manager.layout_groups[1].slots, random.Random(seed)
    try:
        logical = slots.layout.logical_pages_for(slots.max_tokens)
        for _ in range(25):
            slot = rng.randrange(slots.num_slots)
            first = rng.randrange(logical)
            count = rng.randrange(1, min(logical - first, slots.num_blocks) + 1)
            start = rng.randrange(slots.num_blocks - count + 1)
            blocks = list(range(start, start + count)) if rng.random() < 0.5 else \
                rng.sample(range(slots.num_blocks), count)
            behind = rng.randrange(first + 1)
            peak, added = slots.mapping_cost([MapJob(slot, first, blocks)], behind)
            used = slots.backend.mappings_in_use
            slots.unmap_behind(slot, behind)
            middle = slots.backend.mappings_in_use - used
            slots.map_jobs([MapJob(slot, first, blocks)])
            assert (peak, added) == (max(middle, slots.backend.mappings_in_use - used),
                                     slots.backend.mappings_in_use - used)
    finally:
        close(manager)


def test_last_refusal_names_the_layer_group_short_of_blocks():
    """With a local and a global pool, the refusal says which pool had too few blocks."""
    import torch

    from vmemkv import CacheConfig, KVCacheManager

    manager = KVCacheManager(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=128, dtype=torch.float32,
                                         num_blocks=16, max_num_seqs=4, max_model_len=64, tokens_per_page=4),
                             layer_windows=[None, 8], local_blocks=3)
    try:
        assert manager.admit("a", list(range(20))) is None
        why = manager.last_refusal
        assert (why.reason, why.blocks_needed, why.blocks_available) == ("out_of_blocks", 5, 3)
        assert why.group == "the sliding window of 8 layers"
        assert "the pool of the sliding window of 8 layers can hand out 3" in str(why)
        manager.check()
    finally:
        manager.close()
