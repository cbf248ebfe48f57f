"""A hybrid model's operation refused by the mapping budget changes neither layout group.

Each group is all or nothing on its own; applied one after the other, the second group's refusal
used to come after the first had taken blocks (evicting cached ones that cannot be put back).
``hybrid_budget`` asks both groups' mappers before either applies. Here the budget of one group
is pinched so that its part of admit, fork, allocate or swap-in is refused, and the whole state
of both groups (pools, hash indexes, stats, requests, slots, mappings) is compared before and
after; then, with room again, the operation goes through and every request reads back its K/V.
Slots only: block tables map nothing, so no mapping budget can refuse them (the refusals both
backends share, for lack of blocks, are in ``test_hybrid_groups.py``).
"""

from __future__ import annotations

import random

import pytest

from conftest import manager_state
from test_hybrid_groups import P, W, close, make_hybrid, reads_back, run, write
from vmemkv import KVRequest, MappingLimitError
from vmemkv.slots import MapJob

GROUPS = ["global_group", "local_group"]  # the group whose mapping budget refuses


@pytest.fixture
def hybrid():
    manager = make_hybrid(num_blocks=12, max_num_seqs=3)
    yield manager
    manager.check()
    close(manager)


def state(manager) -> tuple:
    """Both groups' ``manager_state``, each running request's mapped pages, the requests (not
    the local twins a refused admission made: they wait with their request, as on any refusal)."""
    mapped = {}
    for name in GROUPS:
        group = getattr(manager, name)
        for request_id in group.request_ids():
            req = group.request(request_id)
            if not req.is_swapped and group.config.kv_backend == "vmem":  # block tables map nothing
                mapped[name, request_id] = group.slots.mapped_blocks(req.slot, len(req.block_table)).tolist()
    return (manager_state(manager.global_group), manager_state(manager.local_group), mapped,
            manager.request_ids(), manager.local_group.request_ids())


def pinch(manager, name: str) -> None:
    """No kernel mapping to spare in group ``name``, stale ones reclaimed first (a refusal may
    reclaim them, and then the test would not be pinched)."""
    for group in (manager.global_group, manager.local_group):
        group.slots.reclaim_stale({req.slot: len(req.block_table) for req in map(group.request, group.request_ids())
                                   if not req.is_swapped})
    backend = getattr(manager, name).backend
    backend.max_mappings = backend.mappings_in_use


def unpinch(manager) -> None:
    for group in (manager.global_group, manager.local_group):
        group.backend.max_mappings = None


def with_cached_prefix(manager) -> KVRequest:
    """A running request, and a freed one whose blocks stay cached (an admission evicts them)."""
    running = run(manager, "a", list(range(40)))
    manager.free(run(manager, "old", list(range(1000, 1040))))
    return running


@pytest.mark.parametrize("refusing", GROUPS)
def test_admit_refused_by_either_groups_budget_changes_nothing(hybrid, refusing):
    a = with_cached_prefix(hybrid)
    cached = hybrid.global_group.num_cached_blocks, hybrid.local_group.num_cached_blocks
    pinch(hybrid, refusing)
    before = state(hybrid)
    new = KVRequest("new", list(range(500, 620)))  # more blocks than are never used: evicts
    with pytest.raises(MappingLimitError, match="admit"):
        hybrid.admit(new)
    assert state(hybrid) == before
    hybrid.check()
    unpinch(hybrid)
    assert hybrid.admit(new) == 0
    # what the refusal would have lost: both groups' admissions evict cached blocks
    assert hybrid.global_group.num_cached_blocks < cached[0] and hybrid.local_group.num_cached_blocks < cached[1]
    write(hybrid, new, 0, new.num_tokens)
    hybrid.commit(new)
    assert reads_back(hybrid, a) and reads_back(hybrid, new)


@pytest.mark.parametrize("refusing", GROUPS)
def test_fork_refused_by_either_groups_budget_changes_nothing(hybrid, refusing):
    parent = run(hybrid, "a", list(range(W + P + 3)))  # a partial last page: the fork copies it
    pinch(hybrid, refusing)
    before = state(hybrid)
    with pytest.raises(MappingLimitError, match="fork"):
        hybrid.fork(parent, KVRequest("child", []))
    assert state(hybrid) == before
    unpinch(hybrid)
    child = hybrid.fork(parent, KVRequest("child", []))
    assert child is not None and reads_back(hybrid, child) and reads_back(hybrid, parent)


@pytest.mark.parametrize("refusing", GROUPS)
def test_allocate_across_a_page_boundary_refused_changes_nothing(hybrid, refusing):
    a = run(hybrid, "a", list(range(2 * P)))  # full pages: the next token needs a new one
    run(hybrid, "b", list(range(100, 100 + P)))  # a's slot is followed by b's: a new run splits
    pinch(hybrid, refusing)
    before = state(hybrid)
    with pytest.raises(MappingLimitError, match="allocate"):
        hybrid.allocate(a, 1, [7])
    assert state(hybrid) == before and a.num_tokens == 2 * P
    unpinch(hybrid)
    assert hybrid.allocate(a, 1, [7])
    write(hybrid, a, 2 * P, 2 * P + 1)
    hybrid.commit(a)
    assert reads_back(hybrid, a)


@pytest.mark.parametrize("refusing", GROUPS)
def test_swap_in_refused_by_either_groups_budget_changes_nothing(hybrid, refusing):
    a = run(hybrid, "a", list(range(W + P + 5)))
    assert hybrid.preempt(a, "swap") == "swap"
    pinch(hybrid, refusing)
    before = state(hybrid)
    with pytest.raises(MappingLimitError, match="swap in"):
        hybrid.swap_in(a)
    assert state(hybrid) == before and hybrid.is_swapped(a)
    unpinch(hybrid)
    assert hybrid.swap_in(a) and reads_back(hybrid, a)


# --- the cost the check asks for is the cost the backend charges ------------------------------------

@pytest.mark.parametrize("layout", ["token_major", "per_layer"])
@pytest.mark.parametrize("seed", range(6))
def test_mapping_cost_is_what_the_backend_charges(layout, seed):
    """Random jobs (with pages behind a window released first) on a sliding-window group: the
    cost ``mapping_cost`` predicts is the change in the backend's kernel mappings, at the end and
    at its peak (the release is one call, the jobs another)."""
    manager = make_hybrid(layout=layout)
    slots, rng = manager.local_group.slots, random.Random(seed)
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
