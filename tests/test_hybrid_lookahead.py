"""Lookahead on a hybrid model: ``KVCacheManager.allocate_lookahead`` gives a decoding request
its next blocks in every layer group or in none (one ``MapJob`` per group, each naming its
``group``), ``map_lookahead`` maps them all, and a mapping refused in any group is cancelled in
every group, leaving every group as it was. The engine's ``LookaheadMapper`` then runs on hybrid
models and still gives Hugging Face's tokens."""

from __future__ import annotations

import pytest

from test_hybrid_groups import BACKENDS, P, THREE_KINDS, WINDOWS, close, decode, make_hybrid, reads_back, run
from test_hybrid_refusals import pinch, state, unpinch
from vmemkv import MappingLimitError


@pytest.fixture(params=BACKENDS)
def hybrid(request):
    manager = make_hybrid(num_blocks=12, kv_backend=request.param)
    yield manager
    manager.check()
    close(manager)


def free_blocks(manager) -> tuple[int, ...]:
    return tuple(group.num_free_blocks for group in manager.layout_groups)


def running(manager) -> list:
    return [req for req in map(manager.request, manager.request_ids()) if not req.is_swapped]


def by_group(jobs) -> list[list]:
    """The jobs of each group (``job.group``), in order."""
    groups = sorted({job.group for job in jobs})
    return [[job for job in jobs if job.group == group] for group in groups]


def test_a_request_at_a_block_boundary_gets_its_next_block_in_every_group(hybrid):
    a = run(hybrid, "a", list(range(2 * P)))  # full pages: the next token needs a new block
    before = free_blocks(hybrid)
    jobs = hybrid.allocate_lookahead([a], 1)
    assert [(job.group, job.slot, len(job.blocks)) for job in jobs] == [(0, a.slot, 1), (1, a.slot, 1)]
    assert free_blocks(hybrid) == (before[0] - 1, before[1] - 1)
    hybrid.map_lookahead(jobs)
    hybrid.check()
    ahead = jobs[0].blocks[0], jobs[1].blocks[0]
    assert decode(hybrid, a, 7)  # grows into the blocks given ahead: nothing more is taken
    assert free_blocks(hybrid) == (before[0] - 1, before[1] - 1)
    assert (hybrid.block_table(a, 3)[-1], hybrid.block_table(a, 0)[-1]) == ahead
    assert reads_back(hybrid, a)
    hybrid.free(a)


def test_a_request_inside_its_block_gets_nothing(hybrid):
    a = run(hybrid, "a", list(range(P + 3)))
    before = state(hybrid)
    assert not hybrid.allocate_lookahead([a], 1)
    assert state(hybrid) == before
    hybrid.free(a)


def test_a_request_the_local_group_cannot_serve_gets_nothing_in_any_group():
    """The local group (sized for its peak) has one clean block left (lookahead never evicts a
    cached one): the request that needs two gets no block in the global group either, and the
    one after it in the list, needing one, gets its own in both."""
    manager = make_hybrid(num_blocks=12, local_blocks=6)
    try:
        a = run(manager, "a", list(range(2 * P)))  # needs two blocks for P + 1 more tokens
        b = run(manager, "b", list(range(100, 100 + P + 3)))  # needs one
        manager.free(run(manager, "f", list(range(900, 900 + P))))  # a cached block in each group
        assert manager.layout_groups[1].pool.num_clean == 1 < manager.layout_groups[0].pool.num_clean
        tables = manager.block_table(a, 3), manager.block_table(a, 0)
        jobs = manager.allocate_lookahead([a, b], P + 1)
        assert [(job.group, job.slot) for job in jobs] == [(0, b.slot), (1, b.slot)]
        assert (manager.block_table(a, 3), manager.block_table(a, 0)) == tables
        manager.map_lookahead(jobs)
        manager.check()
    finally:
        close(manager)


def test_keep_free_holds_in_each_group(hybrid):
    a = run(hybrid, "a", list(range(2 * P)))
    free = free_blocks(hybrid)
    before = state(hybrid)
    assert not hybrid.allocate_lookahead([a], 1, keep_free=free[0])  # the last global block stays
    assert state(hybrid) == before
    assert hybrid.allocate_lookahead([a], 1, keep_free=free[0] - 1)
    hybrid.free(a)


@pytest.mark.parametrize("windows, refusing", [(WINDOWS, 0), (WINDOWS, 1), (THREE_KINDS, 0), (THREE_KINDS, 1),
                                               (THREE_KINDS, 2)],
                         ids=["global", "local", "three-kinds-global", "three-kinds-sliding",
                              "three-kinds-chunked"])
def test_a_mapping_refused_in_any_group_is_cancelled_in_every_group(windows, refusing):
    manager = make_hybrid(windows, num_blocks=12)
    try:
        a = run(manager, "a", list(range(2 * P)))
        run(manager, "b", list(range(100, 100 + P)))  # a's next block will not extend its run
        before = state(manager)
        jobs = manager.allocate_lookahead([a], 1)
        assert sorted(job.group for job in jobs) == list(range(len(manager.layout_groups)))
        pinch(manager, refusing)
        with pytest.raises(MappingLimitError):
            manager.map_lookahead(jobs)
        manager.cancel_lookahead(jobs)
        assert state(manager) == before
        manager.check()
        unpinch(manager)
        assert decode(manager, a, 7)  # mapped inline when reached
        assert reads_back(manager, a)
        manager.check()
    finally:
        close(manager)


def test_lookahead_of_several_requests_margin_and_the_slot_end():
    manager = make_hybrid(num_blocks=24, max_model_len=64)
    try:
        a = run(manager, "a", list(range(2 * P)))
        b = run(manager, "b", list(range(200, 200 + 4 * P - 1)))  # one token short of the slot end
        jobs = manager.allocate_lookahead([a, b], 2 * P)
        # a: two more blocks; b: none (its last block ends at max_model_len)
        assert [[(job.slot, len(job.blocks)) for job in group] for group in by_group(jobs)] == [
            [(a.slot, 2)], [(a.slot, 2)]]
        assert sorted(job.group for job in jobs) == [0, 1]
        manager.map_lookahead(jobs)
        manager.check()
        for step in range(2 * P):
            assert decode(manager, a, step % 5)
        assert decode(manager, b, 1)
        assert reads_back(manager, a) and reads_back(manager, b)
        manager.check()
    finally:
        close(manager)


def test_the_engine_maps_ahead_on_hybrid_models_and_matches_hf(monkeypatch):
    from test_hybrid_engine import generate, hf_tokens, hybrid_engine
    from test_sliding_window_models import prompts

    engine = hybrid_engine("gemma2", monkeypatch, kv_backend="vmem", lookahead_tokens=5)
    assert engine.runner.lookahead is not None
    given = []
    allocate = engine.manager.allocate_lookahead

    def counted(*args):
        jobs = allocate(*args)
        given.append(sum(job.group == 0 for job in jobs))  # the global group's jobs
        return jobs

    monkeypatch.setattr(engine.manager, "allocate_lookahead", counted)
    batch = prompts((20, 5, 11, 17))
    final = generate(engine, batch)
    assert sum(given) > 0, "no lookahead block was given"
    for index, prompt in enumerate(batch):
        assert final[str(index)].outputs[0].token_ids == hf_tokens("gemma2", prompt)
    engine.manager.check()
    engine.close()


def test_swapping_out_a_request_with_lookahead_blocks_gives_them_back(hybrid):
    a = run(hybrid, "a", list(range(2 * P)))
    free = free_blocks(hybrid)
    hybrid.map_lookahead(hybrid.allocate_lookahead([a], 1))
    assert hybrid.preempt(a, "swap") == "swap"
    hybrid.check()
    assert hybrid.swap_in(a) and reads_back(hybrid, a)
    assert free_blocks(hybrid) == free
    assert decode(hybrid, a, 3) and reads_back(hybrid, a)
    hybrid.free(a)
