"""A hybrid manager's request bookkeeping: each admitted request has one local-group twin, made
on the side and stored only once both groups took it. Queries, refused calls and another
KVRequest object carrying a running request's id change nothing (no twin replaced, freed or
left behind); ``check`` finds a twin of a request that is not admitted. Lookahead serves a
request listed twice once, as one group does; ``reset_prefix_cache`` and the per-request queries
answer for both groups. ``VmemkvCache`` on a hybrid manager: the local group is sized for a whole
batch's prefill, a refusal names the group that is short, and the peak bytes count both groups."""

from __future__ import annotations

import pytest
import torch

from vmemkv import CacheConfig, InvalidInputError, KVCacheManager, KVRequest, PrefixCacheBusyError
from vmemkv.errors import OutOfBlocksError, RequestStateError
from vmemkv.integrations.transformers_cache import VmemkvCache

from test_hybrid_groups import P, close, decode, make_hybrid, reads_back, run, write


@pytest.fixture(params=["vmem", "paged"])
def hybrid(request):
    manager = make_hybrid(kv_backend=request.param)
    yield manager
    close(manager)


def blocks(manager) -> tuple[int, int, int, int]:
    """Each group's free and cached blocks."""
    return (manager.global_group.num_free_blocks, manager.local_group.num_free_blocks,
            manager.global_group.num_cached_blocks, manager.local_group.num_cached_blocks)


# --- one twin per admitted request ---------------------------------------------------------------

def test_another_object_with_a_running_id_changes_nothing(hybrid):
    running = run(hybrid, "r1", list(range(40)))
    twin, before = hybrid.local_request(running), blocks(hybrid)
    impostor = KVRequest("r1", list(range(10)))
    hybrid.match_prefix(impostor)
    hybrid.can_admit(impostor)
    with pytest.raises(RequestStateError, match="already admitted"):
        hybrid.admit(impostor)
    assert hybrid.local_request(running) is twin and twin.token_ids is running.token_ids
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
    for call in (hybrid.match_prefix, hybrid.can_admit, hybrid.admit):
        with pytest.raises(InvalidInputError, match="another KVCacheManager"):
            call(foreign)
    assert hybrid._local == {}
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
    assert blocks(hybrid) == before and hybrid._local == {} and req.chain.owner is None
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
    hybrid.discard(KVRequest("r1", list(range(10))))
    assert hybrid.request("r1") is running and hybrid.local_group.request_ids() == ["r1"]
    assert blocks(hybrid) == before
    hybrid.check()
    assert decode(hybrid, running, 7) and reads_back(hybrid, running)
    hybrid.discard(running)  # the request itself: both halves go
    assert hybrid.request_ids() == hybrid.local_group.request_ids() == []
    hybrid.check()


def test_discarding_by_id_frees_both_groups_running_or_swapped(hybrid):
    run(hybrid, "a", list(range(40)))
    swapped = run(hybrid, "b", list(range(100, 140)))
    hybrid.preempt(swapped, "swap")
    for request_id in ("a", "b"):
        hybrid.discard(request_id)
    assert hybrid.request_ids() == hybrid.local_group.request_ids() == []
    assert hybrid.num_blocks_in_use == hybrid.local_group.num_blocks_in_use == 0
    hybrid.check()


def test_queries_and_refused_admissions_leave_no_twin():
    manager = make_hybrid(num_blocks=16)
    for i in range(50):
        waiting = KVRequest(f"q{i}", list(range(200)))
        manager.can_admit(waiting)
        manager.match_prefix(waiting)
    assert manager._local == {}
    assert manager.admit(KVRequest("big", list(range(250)))) is None  # more blocks than there are
    assert manager._local == {}
    manager.check()
    close(manager)


def test_a_recompute_preemption_drops_the_twin_and_readmission_makes_one(hybrid):
    req = run(hybrid, "r1", list(range(40)))
    hybrid.preempt(req, "recompute")
    assert hybrid._local == {}
    hybrid.check()
    hashes = req.block_hashes
    assert hybrid.admit(req) == 32  # the two full blocks the preemption left cached
    assert hybrid.local_request(req).block_hashes == hashes  # one chain, not hashed again
    hybrid.check()


def test_check_finds_a_twin_of_a_request_not_admitted(hybrid):
    run(hybrid, "r1", list(range(40)))
    hybrid.check()
    hybrid._local["gone"] = KVRequest("gone", [1, 2, 3])
    with pytest.raises(AssertionError, match="gone"):
        hybrid.check()
    del hybrid._local["gone"]


# --- lookahead ---------------------------------------------------------------------------------

def test_lookahead_serves_a_request_listed_twice_once_as_one_group_does(hybrid):
    req = run(hybrid, "r1", list(range(31)))
    free = blocks(hybrid)[:2]
    jobs = hybrid.allocate_lookahead([req, req, "r1"], 16)
    assert len(jobs.global_jobs) == len(jobs.local_jobs) == 1
    assert blocks(hybrid)[:2] == (free[0] - 1, free[1] - 1)
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

def test_reset_prefix_cache_refuses_while_either_group_holds_blocks_then_clears_both(hybrid):
    done = run(hybrid, "done", list(range(40)))
    hybrid.free(done)
    running = run(hybrid, "r1", list(range(100, 140)))
    before = blocks(hybrid)
    assert before[2] and before[3]  # cached blocks in both groups
    with pytest.raises(PrefixCacheBusyError, match="global layers' group"):
        hybrid.reset_prefix_cache()
    assert blocks(hybrid) == before
    hybrid.free(running)
    cached = hybrid.num_cached_blocks
    assert hybrid.reset_prefix_cache() == cached  # the global group's, as its block counts
    assert hybrid.num_cached_blocks == hybrid.local_group.num_cached_blocks == 0
    again = KVRequest("again", list(range(40)))
    assert hybrid.admit(again) == 0  # nothing left to hit
    hybrid.check()


def test_per_request_queries_answer_for_both_groups(hybrid):
    req = run(hybrid, "r1", list(range(40)))
    assert decode(hybrid, req, 9)
    assert hybrid.allocate(req, 3)  # reserved, not computed yet
    assert hybrid.slot_of("r1") == req.slot == hybrid.local_request(req).slot
    assert hybrid.num_tokens(req) == 44 and hybrid.num_computed_tokens("r1") == 41
    assert hybrid.token_ids("r1") == list(range(40)) + [9]


def test_can_swap_in_asks_both_groups():
    # room for four requests; the local group holds 6 blocks: a 40-token request keeps 2 of them
    # once committed (its first block is behind the window), 3 while its prompt is written
    manager = make_hybrid(max_num_seqs=4, local_blocks=6)
    swapped = run(manager, "a", list(range(40)))
    manager.preempt(swapped, "swap")
    assert manager.can_swap_in(swapped)
    others = [run(manager, name, list(range(start, start + 40))) for name, start in (("b", 100), ("c", 200))]
    others.append(run(manager, "d", list(range(300, 317))))  # two blocks: the local group is full
    assert manager.local_group.num_free_blocks == 0 < manager.global_group.num_free_blocks
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


def test_a_cache_refusal_names_the_short_group_and_leaves_no_twin():
    manager = make_hybrid(local_blocks=4)  # one 40-token prompt needs 3 local blocks at once
    cache = VmemkvCache(manager)
    ids = torch.arange(80).reshape(2, 40) + 1
    with pytest.raises(OutOfBlocksError, match=r"row 1 of 2 .*the local layers' group has 1 pages free of 4 "
                                               r"\(the global layers' group \d+ of \d+\)"):
        forward(cache, ids)
    assert manager.request_ids() == [] and manager._local == {}
    manager.check()
    close(manager)


def test_the_cache_peak_counts_both_groups_bytes():
    manager = make_hybrid()
    cache = VmemkvCache(manager)
    forward(cache, torch.arange(80).reshape(2, 40) + 1)
    both = sum(group.num_blocks_in_use * group.block_bytes for group in (manager.global_group, manager.local_group))
    assert manager.local_group.num_blocks_in_use == 6  # every prompt block until the commit
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
        assert cache.manager.local_group.num_blocks >= 4 * 56 // 4
        cache.manager.check()


# --- an engine step's batched calls ---------------------------------------------------------------

def test_allocate_each_grants_a_prefix_in_both_groups_and_leaves_the_refused_unchanged(hybrid):
    a, b = run(hybrid, "a", list(range(30))), run(hybrid, "b", list(range(100, 130)))
    free = hybrid.global_group.num_free_blocks
    with pytest.raises(InvalidInputError):  # bad input raises before any change
        hybrid.allocate_each([a, b], [1, -1])
    assert (a.num_tokens, b.num_tokens, hybrid.global_group.num_free_blocks) == (30, 30, free)
    a.token_ids.append(7)
    b.token_ids.extend(range(200, 400))  # 13 more blocks: more than the local group has free
    assert hybrid.local_group.num_free_blocks < 13
    assert hybrid.allocate_each([a, b], [1, 200]) == 1
    assert a.num_tokens == 31 and b.num_tokens == 30
    assert hybrid.local_request(a).num_tokens == 31 and hybrid.local_request(b).num_tokens == 30
    hybrid.check()


def test_commit_all_checks_every_request_in_both_groups_before_committing_any(hybrid):
    a, b = run(hybrid, "a", list(range(30))), run(hybrid, "b", list(range(100, 130)))
    for req in (a, b):
        req.token_ids.append(5)
        assert hybrid.allocate(req, 1)
        write(hybrid, req, 30, 31)
    del b.token_ids[-1]  # b reserved a position whose token id is gone: its commit is refused
    with pytest.raises(RequestStateError):
        hybrid.commit_all([a, b])
    assert a.num_computed_tokens == hybrid.local_request(a).num_computed_tokens == 30
    b.token_ids.append(5)
    hybrid.commit_all([a, b])
    assert [r.num_computed_tokens for r in (a, b, hybrid.local_request(a), hybrid.local_request(b))] == [31] * 4
    hybrid.check()
