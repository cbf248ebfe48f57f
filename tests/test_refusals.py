"""Regression tests: a refused operation changes nothing, and no write lands in another request.

Each test is one of the reliability bugs found by fuzzing the manager: lookahead past a slot's
end, and refusals (the mapping budget, swap space) that used to leave half a change. K/V is
written through the slot views with conftest's patterns, so a page written by another request
reads back wrong.
"""

from __future__ import annotations

import pytest
import torch

from conftest import close_manager, manager_state, read_kv_matches, tiny_config, write_kv
from vmemkv import KVCacheManager, MappingLimitError
from vmemkv.cache.swap import OutOfSwapSpaceError
from vmemkv.memory.vmm import CpuBackend

LAYOUTS = ["token_major", "per_layer"]


# 1 layer x 2 heads x 128 dim x fp32 (4 KiB a token-major page): 4 tokens a block
FP32 = dict(num_layers=1, num_kv_heads=2, head_dim=128, dtype=torch.float32)


def fp32(**overrides):
    return tiny_config(**FP32, **overrides)


@pytest.fixture
def budgeted():
    """``budgeted(**config)``: a manager on a CPU backend whose mapping budget a test can pinch
    (``backend.max_mappings``); leak-checked and closed at the end."""
    made = []

    def make(**overrides):
        config = fp32(**overrides)
        backend = CpuBackend(config.make_layout().page_size,
                             config.num_blocks * config.make_layout().pages_per_block,
                             max_mappings=1000)
        manager = KVCacheManager(config, backend=backend)
        made.append(manager)
        return manager, backend

    yield make
    for manager in made:
        manager.check()
        close_manager(manager)


def computed(m, request_id, token_ids, **kwargs):
    """Admit, write the K/V pattern of every reserved position, commit."""
    cached = m.admit(request_id, token_ids, **kwargs)
    assert cached is not None
    write_kv(m, request_id, cached, m.num_tokens(request_id))
    m.commit(request_id)


def all_read_back(m) -> bool:
    """Every running request reads back its K/V (from its first block not released behind a
    sliding window: those are unmapped)."""
    return all(read_kv_matches(m, r, start=m.request(r).num_released_blocks * m.tokens_per_page)
               for r in m.request_ids() if not m.is_swapped(r))


def pinch(backend) -> None:
    """No kernel mapping to spare from now on."""
    backend.max_mappings = backend.mappings_in_use


# --- 1. lookahead never maps past the slot's end --------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("full_slot", [0, 1])  # the full request in the first or the last slot
def test_lookahead_stops_at_max_model_len(make_manager, layout, full_slot):
    m = make_manager(**FP32, num_blocks=8, max_num_seqs=2, max_model_len=8, layout=layout)
    computed(m, "a", [1] * 8, slot=full_slot)
    computed(m, "b", [2] * 4, slot=1 - full_slot)
    jobs = m.allocate_lookahead(["a", "b"], 4)
    assert [job.slot for job in jobs] == [1 - full_slot]  # a is at max_model_len: nothing
    m.map_lookahead(jobs)
    m.check()
    assert all_read_back(m)
    # a margin far past max_model_len reaches max_model_len and no further
    assert m.allocate_lookahead(["b"], 1000) == []
    assert len(m.block_table("b")) == 2


# --- 2./3. reorder and truncate are all or nothing under the mapping budget -------------------------
def test_reorder_refused_by_the_mapping_budget_changes_nothing(budgeted):
    m, backend = budgeted(max_model_len=16)  # full slots: a's and b's pages make one run
    computed(m, "a", list(range(16)))
    computed(m, "b", list(range(100, 116)))
    pinch(backend)  # swapping the slots' pages splits that run in two
    before = manager_state(m)
    with pytest.raises(MappingLimitError):
        m.reorder(["a", "b"], ["b", "a"])
    assert manager_state(m) == before
    m.check()
    assert all_read_back(m)
    backend.max_mappings = 1000
    assert m.reorder(["a", "b"], ["b", "a"])
    assert m.token_ids("a") == list(range(100, 116)) and all_read_back(m)


def test_truncate_refused_by_the_mapping_budget_keeps_the_shared_page(budgeted):
    m, backend = budgeted()
    computed(m, "a", list(range(8)))
    assert m.fork("a", "b")  # b shares both full pages
    pinch(backend)
    before = manager_state(m)
    with pytest.raises(MappingLimitError):
        m.truncate("a", 6)  # would copy the shared page and remap it
    assert manager_state(m) == before
    m.check()
    # a still cannot write the page it shares: it is full, so growing maps a new one
    backend.max_mappings = 1000
    assert m.truncate("a", 6)
    assert m.allocate("a", 1, [99])
    write_kv(m, "a", 6, 7)
    m.commit("a")
    assert all_read_back(m)


# --- 4. a refused lookahead mapping is rolled back ---------------------------------------------------
def test_a_refused_lookahead_mapping_is_cancelled_and_changes_nothing(budgeted):
    m, backend = budgeted()
    computed(m, "a", list(range(4)))  # block 0
    computed(m, "b", list(range(50, 54)))  # block 1: a's next block will not extend its run
    before = manager_state(m)
    jobs = m.allocate_lookahead(["a"], 1)
    assert [job.blocks for job in jobs] == [[2]]
    pinch(backend)
    with pytest.raises(MappingLimitError):
        m.map_lookahead(jobs)
    m.cancel_lookahead(jobs)
    assert manager_state(m) == before
    m.check()


def test_growing_into_a_lookahead_block_whose_mapping_was_refused_maps_it(budgeted):
    m, backend = budgeted()
    computed(m, "a", list(range(4)))
    computed(m, "b", list(range(50, 54)))
    jobs = m.allocate_lookahead(["a"], 1)
    pinch(backend)
    with pytest.raises(MappingLimitError):
        m.map_lookahead(jobs)
    backend.max_mappings = 1000
    # no cancel: allocate still never writes through a stale mapping
    assert m.allocate("a", 1, [4])
    m.check()
    write_kv(m, "a", 4, 5)
    m.commit("a")
    assert all_read_back(m)


def test_few_and_many_page_map_jobs_map_the_same_pages_and_skip_mapped_ones(make_manager):
    """map_jobs keeps a few token-major pages (a step's lookahead) in plain Python and many in
    numpy: both map exactly the pages whose block differs and count the others as already mapped."""
    from vmemkv.memory.slot_mapper import SMALL_MAP
    from vmemkv.memory.slots import MapJob

    for pages in (3, SMALL_MAP + 5):
        slots = make_manager(**FP32, num_blocks=128, max_model_len=128).slots
        first, second = list(range(pages // 2)), list(range(50, 50 + pages - pages // 2))
        jobs = [MapJob(0, 0, first), MapJob(1, 1, second)]
        slots.map_jobs(jobs)
        mapped, already = slots.stats.pages_mapped, slots.stats.pages_already_mapped
        second[0] = 99  # one page changes; the others are mapped as asked already
        slots.map_jobs(jobs)
        assert slots.stats.pages_mapped - mapped == 1
        assert slots.stats.pages_already_mapped - already == pages - 1
        assert slots.mapped_blocks(0, len(first)).tolist() == first
        assert slots.mapped_blocks(1, 1 + len(second)).tolist() == [-1] + second
        slots.reclaim_stale()  # the pages belong to no request: unmapped before the leak check


# --- 5. refusals that say "nothing was changed" change nothing -----------------------------------------
def test_swap_refused_for_lack_of_swap_space_keeps_the_lookahead_blocks(make_manager):
    m = make_manager(**FP32, swap_space_bytes=0)
    computed(m, "a", list(range(4)))
    m.map_lookahead(m.allocate_lookahead(["a"], 1))
    before = manager_state(m)
    with pytest.raises(OutOfSwapSpaceError):
        m.preempt("a", "swap")
    assert manager_state(m) == before


def fill_with_cached_pages(m):
    """Every block in the prefix cache's LRU queue, none clean; a slot's pages stay mapped."""
    for i in range(m.pool.num_blocks):
        computed(m, f"c{i}", list(range(1000 * i, 1000 * i + 4)))
        m.free(f"c{i}")
        if not m.pool.num_clean:
            break
    assert m.pool.num_clean == 0 and m.pool.num_cached > 0


@pytest.mark.parametrize("operation", ["admit", "allocate", "fork", "swap_in"])
def test_refused_by_the_mapping_budget_evicts_no_cached_page(budgeted, operation):
    m, backend = budgeted(num_blocks=12, swap_space_bytes=8 * 4096)
    computed(m, "a", list(range(500, 506)))  # one full page and a partial one
    computed(m, "x", [7, 7, 7])  # takes the page after a's: a's next page will not extend its run
    if operation == "swap_in":
        m.preempt("a", "swap")
    fill_with_cached_pages(m)
    pinch(backend)
    m.slots.reclaim_stale()  # the stale pages of free slots may not be the way out
    pinch(backend)
    before = manager_state(m)
    call = {"admit": lambda: m.admit("new", list(range(900, 910))),
            "allocate": lambda: m.allocate("a", 3, [1, 2, 3]),
            "fork": lambda: m.fork("a", "child"),
            "swap_in": lambda: m.swap_in("a")}[operation]
    with pytest.raises(MappingLimitError):
        call()
    assert manager_state(m) == before


@pytest.mark.parametrize("operation", ["admit", "fork", "reorder", "swap_in"])
def test_refusals_with_blocks_released_behind_a_window_change_nothing(budgeted, operation):
    """A windowed request holds no blocks behind its window (RELEASED, unmapped); a refusal by
    the mapping budget of any operation meeting them leaves everything as it was, and the same
    call then succeeds."""
    m, backend = budgeted(num_blocks=12, swap_space_bytes=8 * 4096, sliding_window=6)
    computed(m, "a", list(range(500, 520)))  # 5 blocks; the query at 20 reads 15..20
    assert m.request("a").num_released_blocks == 3
    computed(m, "b", list(range(100, 103)))  # a's next block will not extend its run
    if operation == "swap_in":
        m.preempt("a", "swap")
    m.slots.reclaim_stale()  # the stale pages of free slots may not be the way out
    pinch(backend)
    before = manager_state(m)
    call = {"admit": lambda: m.admit("c", list(range(500, 520)) + [7]),  # a windowed hit
            "fork": lambda: m.fork("a", "child"),
            "reorder": lambda: m.reorder(["a", "b"], ["b", "a"]),
            "swap_in": lambda: m.swap_in("a")}[operation]
    with pytest.raises(MappingLimitError):
        call()
    assert manager_state(m) == before
    m.check()
    assert all_read_back(m)
    backend.max_mappings = 1000
    result = call()
    assert result is not None and result is not False
    if operation == "admit":
        assert result == 20 and m.request("c").num_released_blocks == 3  # the window's blocks hit
    m.check()
    assert all_read_back(m)


# --- 6. a request preempted by recompute and then discarded leaves no trace ------------------------
def test_discarding_a_request_preempted_by_recompute_forgets_it(make_manager):
    m = make_manager()
    computed_ids = list(range(6))
    assert m.admit("a", computed_ids) == 0
    m.commit("a")
    m.preempt("a", "recompute")
    m.discard("a")
    m.discard("never-seen")  # aborting what the manager never held is fine
    queried = m.stats.prefix_queried_tokens
    assert m.admit("a", computed_ids) is not None  # a new request of the same id: a first admission
    assert m.stats.prefix_queried_tokens == queried + 6
    m.commit("a")


# --- after close ----------------------------------------------------------------------------------------
def test_close_refuses_while_views_are_held_and_later_calls_raise():
    from vmemkv.errors import ManagerClosedError

    m = KVCacheManager(fp32())
    keys, values = m.kv_views(0)
    with pytest.raises(ManagerClosedError, match="views"):
        m.close()
    m.admit("a", [1, 2, 3])  # still open and usable
    m.free("a")
    del keys, values
    m.close()
    m.close()  # twice is fine
    for call in (lambda: m.kv_views(0), lambda: m.admit("b", [1]), lambda: m.num_tokens("a"),
                 lambda: m.free("a")):
        with pytest.raises(ManagerClosedError):
            call()
