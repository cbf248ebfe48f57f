"""A hybrid model's request bookkeeping: one ``KVRequest`` per request, with one allocation in
each layer group (``request.allocations``), bound in every group or in none. Queries, refused
calls and another KVRequest object carrying a running request's id change nothing (no allocation
replaced, freed or left holding anything; nothing registered); ``check`` finds a request whose
groups disagree and a block some group holds for no request. Lookahead serves a request listed
twice once, as one group does; ``reset_prefix_cache`` and the per-request queries answer for
every group. ``VmemkvCache`` on a hybrid manager: the local group is sized for a whole batch's
prefill, a refusal names the group that is short, and the peak bytes count every group."""

from __future__ import annotations

import pytest
import torch

from vmemkv import CacheConfig, InvalidInputError, KVCacheManager, KVRequest, PrefixCacheBusyError
from vmemkv.cache.allocation import Allocation
from vmemkv.errors import OutOfBlocksError, RequestStateError
from vmemkv_transformers import VmemkvCache

from test_hybrid_groups import P, close, decode, make_hybrid, reads_back, run, write


@pytest.fixture(params=["vmem", "paged"])
def hybrid(request):
    manager = make_hybrid(kv_backend=request.param)
    yield manager
    close(manager)


def blocks(manager) -> tuple[int, ...]:
    """Each group's free blocks, then each group's cached blocks."""
    groups = manager.layout_groups
    return (tuple(group.num_free_blocks for group in groups)
            + tuple(group.num_cached_blocks for group in groups))


def holds_nothing(req: KVRequest) -> bool:
    """No group binds a slot or holds a block for ``req``."""
    return all(alloc.slot is None and not alloc.blocks and alloc.swapped is None
               for alloc in req.allocations)


def group_tables(req: KVRequest) -> tuple:
    """The request's blocks and counts in every group."""
    return tuple((alloc.slot, tuple(alloc.blocks), alloc.num_tokens, alloc.num_computed)
                 for alloc in req.allocations)


# --- one request, one allocation per group ---------------------------------------------------------

def test_another_object_with_a_running_id_changes_nothing(hybrid):
    running = run(hybrid, "r1", list(range(40)))
    allocations, tables, before = list(running.allocations), group_tables(running), blocks(hybrid)
    impostor = KVRequest("r1", list(range(10)))
    hybrid.match_prefix(impostor)
    hybrid.can_admit(impostor)
    with pytest.raises(RequestStateError, match="already admitted"):
        hybrid.admit(impostor)
    assert hybrid.request("r1") is running and running.token_ids == list(range(40))
    assert all(now is then for now, then in zip(running.allocations, allocations, strict=True))
    assert group_tables(running) == tables and holds_nothing(impostor)
    assert blocks(hybrid) == before
    hybrid.check()
    assert decode(hybrid, running, 7) and reads_back(hybrid, running)
    hybrid.check()


def test_another_object_with_a_swapped_id_is_refused_before_anything(hybrid):
    swapped = run(hybrid, "r1", list(range(40)))
    assert hybrid.preempt(swapped, "swap") == "swap"
    before = blocks(hybrid)
    with pytest.raises(RequestStateError, match="already admitted"):
        hybrid.admit(KVRequest("r1", list(range(10))))
    assert blocks(hybrid) == before and hybrid.is_swapped("r1")
    assert hybrid.swap_in(swapped) and reads_back(hybrid, swapped)
    hybrid.check()


def test_a_request_of_another_manager_is_refused_before_anything(hybrid):
    other = make_hybrid()
    foreign = KVRequest("f", list(range(40)))
    other.match_prefix(foreign)  # its hash chain is the other manager's now
    before = blocks(hybrid)
    for call in (hybrid.match_prefix, hybrid.can_admit, hybrid.admit):
        with pytest.raises(InvalidInputError, match="another KVCacheManager"):
            call(foreign)
    assert hybrid.request_ids() == [] and blocks(hybrid) == before and holds_nothing(foreign)
    assert foreign.chain.owner is other
    hybrid.check()
    close(other)


@pytest.mark.parametrize("bad", [dict(num_new_tokens=-5), dict(num_new_tokens=1.5),
                                 dict(num_new_tokens="x"), dict(token_budget=-3), dict(slot=99),
                                 dict(max_cached_tokens=-1)])
def test_bad_admission_arguments_are_refused_before_anything(hybrid, bad):
    req = KVRequest("r1", list(range(40)))
    before = blocks(hybrid)
    with pytest.raises(InvalidInputError):
        hybrid.admit(req, **bad)
    assert blocks(hybrid) == before and hybrid.request_ids() == [] and req.chain.owner is None
    assert holds_nothing(req)
    other = make_hybrid()  # the request binds to no manager: another one still admits it
    assert other.admit(req) == 0
    other.check()
    close(other)
    hybrid.check()


def test_a_closed_hybrid_manager_answers_no_query():
    from vmemkv import ManagerClosedError
    manager = make_hybrid()
    close(manager)
    for call in (manager.match_prefix, manager.can_admit, manager.admit):
        with pytest.raises(ManagerClosedError):
            call(KVRequest("r1", list(range(40))))


def test_admit_takes_a_kv_request():
    manager = make_hybrid()
    with pytest.raises(InvalidInputError, match="KVRequest"):
        manager.admit("r1")
    manager.check()
    close(manager)


def test_discarding_another_object_with_a_running_id_frees_nothing(hybrid):
    running = run(hybrid, "r1", list(range(40)))
    before = blocks(hybrid)
    tables = group_tables(running)
    hybrid.discard(KVRequest("r1", list(range(10))))
    assert hybrid.request("r1") is running and hybrid.request_ids() == ["r1"]
    assert group_tables(running) == tables  # still bound and holding its blocks in every group
    assert all(alloc.slot == running.slot is not None for alloc in running.allocations)
    assert blocks(hybrid) == before
    hybrid.check()
    assert decode(hybrid, running, 7) and reads_back(hybrid, running)
    hybrid.discard(running)  # the request itself: every group's part goes
    assert hybrid.request_ids() == [] and holds_nothing(running)
    assert all(group.num_blocks_in_use == 0 for group in hybrid.layout_groups)
    hybrid.check()


def test_discarding_by_id_frees_every_group_running_or_swapped(hybrid):
    running = run(hybrid, "a", list(range(40)))
    swapped = run(hybrid, "b", list(range(100, 140)))
    hybrid.preempt(swapped, "swap")
    for request_id in ("a", "b"):
        hybrid.discard(request_id)
    assert hybrid.request_ids() == [] and holds_nothing(running) and holds_nothing(swapped)
    assert all(group.num_blocks_in_use == 0 for group in hybrid.layout_groups)
    assert all(group.swap.num_free == group.swap.num_blocks for group in hybrid.layout_groups)
    hybrid.check()


def test_queries_and_refused_admissions_leave_nothing_behind():
    manager = make_hybrid(num_blocks=16)
    before = blocks(manager)
    waiting = []
    for i in range(50):
        waiting.append(KVRequest(f"q{i}", list(range(200))))
        manager.can_admit(waiting[-1])
        manager.match_prefix(waiting[-1])
    assert manager.request_ids() == [] and blocks(manager) == before
    assert all(holds_nothing(req) for req in waiting)
    big = KVRequest("big", list(range(250)))
    assert manager.admit(big) is None  # more blocks than there are
    assert manager.request_ids() == [] and blocks(manager) == before and holds_nothing(big)
    assert manager.num_free_slots == manager.num_slots
    manager.check()
    close(manager)


def test_a_recompute_preemption_empties_every_group_and_readmission_binds_every_group(
        hybrid, monkeypatch):
    req = run(hybrid, "r1", list(range(40)))
    hybrid.preempt(req, "recompute")
    assert hybrid.request_ids() == [] and holds_nothing(req)
    hybrid.check()
    hashes = req.block_hashes
    hashed = []  # blocks hashed from here on
    block_hashes = hybrid.hasher.block_hashes
    monkeypatch.setattr(hybrid.hasher, "block_hashes",
                        lambda *args, **kwargs: hashed.extend(out := block_hashes(*args, **kwargs)) or out)
    assert hybrid.admit(req) == 32  # the two full blocks the preemption left cached
    assert req.block_hashes == hashes and hashed == []  # one chain, not hashed again
    assert all(alloc.slot == req.slot is not None and alloc.num_tokens == 40 and alloc.num_computed == 32
               for alloc in req.allocations)
    hybrid.check()


def test_check_finds_a_group_out_of_step_with_the_request(hybrid):
    req = run(hybrid, "r1", list(range(40)))
    hybrid.check()
    local = req.allocations[1]
    req.allocations[1] = Allocation()  # the local group's part of r1 as if never admitted
    with pytest.raises(AssertionError, match="r1"):
        hybrid.check()
    req.allocations[1] = local
    hybrid.check()


def test_check_finds_a_block_a_group_holds_for_no_request(hybrid):
    req = run(hybrid, "r1", list(range(40)))
    pool = hybrid.layout_groups[1].pool
    held = req.group_block_table(1)[req.group_released_blocks(1)]  # a full block, read only
    pool.acquire([held])  # a reference no request holds (as a request the manager forgot would)
    with pytest.raises(AssertionError, match="reference counts"):
        hybrid.check()
    pool.release([held])
    hybrid.check()


# --- lookahead ---------------------------------------------------------------------------------

def test_lookahead_serves_a_request_listed_twice_once_as_one_group_does(hybrid):
    req = run(hybrid, "r1", list(range(31)))
    groups = len(hybrid.layout_groups)
    free = blocks(hybrid)[:groups]
    jobs = hybrid.allocate_lookahead([req, req, "r1"], 16)
    assert [(job.group, job.slot, len(job.blocks)) for job in jobs] == [(g, req.slot, 1) for g in range(groups)]
    assert blocks(hybrid)[:groups] == tuple(count - 1 for count in free)
    hybrid.map_lookahead(jobs)
    hybrid.check()
    # one group: the same request three times gets one block
    single = KVCacheManager(CacheConfig(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                                        num_blocks=8, max_num_seqs=2, max_model_len=256, tokens_per_page=P))
    alone = KVRequest("r1", list(range(31)))
    single.admit(alone)
    single.commit(alone)
    assert len(single.allocate_lookahead([alone, alone, "r1"], 16)) == 1
    single.close()
    with pytest.raises(InvalidInputError, match="list"):
        hybrid.allocate_lookahead("r1", 16)


# --- reset_prefix_cache and the per-request queries ----------------------------------------------

def test_reset_prefix_cache_refuses_while_any_group_holds_blocks_then_clears_every_group(hybrid):
    done = run(hybrid, "done", list(range(40)))
    hybrid.free(done)
    running = run(hybrid, "r1", list(range(100, 140)))
    groups = len(hybrid.layout_groups)
    before = blocks(hybrid)
    assert all(before[groups:])  # cached blocks in every group
    with pytest.raises(PrefixCacheBusyError, match=r"\d+ blocks are held by 1 request"):  # the global group's
        hybrid.reset_prefix_cache()
    assert blocks(hybrid) == before
    hybrid.free(running)
    cached = hybrid.num_cached_blocks
    assert hybrid.reset_prefix_cache() == cached  # the global group's, as its block counts
    assert all(group.num_cached_blocks == 0 for group in hybrid.layout_groups)
    again = KVRequest("again", list(range(40)))
    assert hybrid.admit(again) == 0  # nothing left to hit
    hybrid.check()


def test_per_request_queries_answer_for_every_group(hybrid):
    req = run(hybrid, "r1", list(range(40)))
    assert decode(hybrid, req, 9)
    assert hybrid.allocate(req, 3)  # reserved, not computed yet
    assert all(hybrid.slot_of("r1") == req.slot == alloc.slot for alloc in req.allocations)
    assert hybrid.num_tokens(req) == 44 and hybrid.num_computed_tokens("r1") == 41
    assert all((alloc.num_tokens, alloc.num_computed) == (44, 41) for alloc in req.allocations)
    assert hybrid.token_ids("r1") == list(range(40)) + [9]


def test_can_swap_in_asks_every_group():
    # room for four requests; the local group holds 6 blocks: a 40-token request keeps 2 of them
    # once committed (its first block is behind the window), 3 while its prompt is written
    manager = make_hybrid(max_num_seqs=4, local_blocks=6)
    swapped = run(manager, "a", list(range(40)))
    manager.preempt(swapped, "swap")
    assert manager.can_swap_in(swapped)
    others = [run(manager, name, list(range(start, start + 40))) for name, start in (("b", 100), ("c", 200))]
    others.append(run(manager, "d", list(range(300, 317))))  # two blocks: the local group is full
    assert manager.layout_groups[1].num_free_blocks == 0 < manager.layout_groups[0].num_free_blocks
    assert manager.num_free_slots == 1
    assert not manager.can_swap_in("a") and not manager.swap_in("a")
    manager.free(others.pop())
    assert manager.can_swap_in("a") and manager.swap_in("a") and reads_back(manager, swapped)
    manager.check()
    close(manager)


# --- VmemkvCache on a hybrid manager ------------------------------------------------------------

def forward(cache: VmemkvCache, ids: torch.Tensor) -> None:
    """One forward through every layer of ``make_hybrid``'s shape, as a model would drive it."""
    cache.observe(ids)
    kv = torch.randn(ids.shape[0], 2, ids.shape[1], 16)
    for layer in range(4):
        cache.update(kv, kv, layer)


def test_a_cache_refusal_names_the_short_group_and_leaves_nothing_held():
    manager = make_hybrid(local_blocks=4)  # one 40-token prompt needs 3 local blocks at once
    cache = VmemkvCache(manager)
    ids = torch.arange(80).reshape(2, 40) + 1
    with pytest.raises(OutOfBlocksError, match=r"row 1 of 2 .*the sliding window of 20 layers' group has 1 pages "
                                               r"free of 4 \(the full attention layers' group \d+ of \d+\)"):
        forward(cache, ids)
    assert manager.request_ids() == []
    assert all(group.num_blocks_in_use == 0 for group in manager.layout_groups)
    manager.check()
    close(manager)


def test_the_cache_peak_counts_every_groups_bytes():
    manager = make_hybrid()
    cache = VmemkvCache(manager)
    forward(cache, torch.arange(80).reshape(2, 40) + 1)
    both = sum(group.num_blocks_in_use * group.block_bytes for group in manager.layout_groups)
    assert len(manager.layout_groups) == 2
    assert manager.layout_groups[1].num_blocks_in_use == 6  # every prompt block until the commit
    assert cache.peak_kv_bytes == both == manager.kv_bytes_in_use
    assert cache.peak_pages_in_use * cache.page_bytes < both  # the global group's blocks only
    cache.release()
    assert cache.peak_kv_bytes == both
    cache.reset_peak()
    assert cache.peak_kv_bytes == 0
    close(manager)


def test_a_gemma2_batch_prefilled_in_one_forward_fits_and_matches_hf():
    """Four 56-token rows prefilled in one forward: the local layers hold every row's prompt
    until the commit after it (56 blocks of 4 tokens), more than one request's prefill."""
    from test_integration_transformers import generate, prompt, window_model

    model = window_model("gemma2")
    ids = torch.cat([prompt(56, seed) for seed in range(4)]) % 250 + 1
    kwargs = dict(max_new_tokens=6, do_sample=False)
    want = generate(model, ids, **kwargs)
    with VmemkvCache.from_model(model, max_batch_size=4, max_cache_len=64, tokens_per_page=4) as cache:
        got = generate(model, ids, cache, **kwargs)
        assert torch.equal(got, want)
        assert len(cache.manager.layout_groups) == 2
        assert cache.manager.layout_groups[1].num_blocks >= 4 * 56 // 4
        cache.manager.check()


# --- an engine step's batched calls ---------------------------------------------------------------

def test_allocate_each_grants_a_prefix_in_every_group_and_leaves_the_refused_unchanged(hybrid):
    a, b = run(hybrid, "a", list(range(30))), run(hybrid, "b", list(range(100, 130)))
    global_group, local_group = hybrid.layout_groups
    free = global_group.num_free_blocks
    with pytest.raises(InvalidInputError):  # bad input raises before any change
        hybrid.allocate_each([a, b], [1, -1])
    assert (a.num_tokens, b.num_tokens, global_group.num_free_blocks) == (30, 30, free)
    a.token_ids.append(7)
    b.token_ids.extend(range(200, 400))  # 13 more blocks: more than the local group has free
    assert local_group.num_free_blocks < 13
    b_tables = group_tables(b)
    assert hybrid.allocate_each([a, b], [1, 200]) == 1
    assert a.num_tokens == 31 and b.num_tokens == 30
    assert a.allocations[1].num_tokens == 31 and b.allocations[1].num_tokens == 30
    assert group_tables(b) == b_tables
    hybrid.check()


def test_commit_all_checks_every_request_in_every_group_before_committing_any(hybrid):
    a, b = run(hybrid, "a", list(range(30))), run(hybrid, "b", list(range(100, 130)))
    for req in (a, b):
        req.token_ids.append(5)
        assert hybrid.allocate(req, 1)
        write(hybrid, req, 30, 31)
    del b.token_ids[-1]  # b reserved a position whose token id is gone: its commit is refused
    with pytest.raises(RequestStateError):
        hybrid.commit_all([a, b])
    assert [alloc.num_computed for req in (a, b) for alloc in req.allocations] == [30] * 4
    b.token_ids.append(5)
    hybrid.commit_all([a, b])
    assert [alloc.num_computed for req in (a, b) for alloc in req.allocations] == [31] * 4
    hybrid.check()
