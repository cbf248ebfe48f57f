"""Beam-search reorders and truncation on a model with a local and a global layer group (one
``KVCacheManager`` over two ``KVCacheGroup``s: ``reorder`` / ``truncate``): both groups change
together or not at all. Rows read back their source's K/V bit-exact (every global position, every
local one from the first held block), token lists follow the content, a truncation the local
window forbids or a copy either group cannot make is refused with both groups unchanged, the
mapping budget of either group refuses before anything changes, and a random walk over admit /
decode / fork / reorder / truncate / free keeps both groups in step (the same refusals over three
kinds of layer, and for every other operation, are in ``test_hybrid_refusals.py``)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_hybrid_groups import (P, W, close, decode, free_all, held, make_hybrid, reads_back, run,
                                snapshot, write)
from test_hybrid_refusals import GROUPS, pinch, state, unpinch
from vmemkv import KVRequest, MappingLimitError, RequestStateError


@pytest.fixture
def hybrid():
    manager = make_hybrid(num_blocks=16)
    yield manager
    manager.check()
    close(manager)


def beams(manager, prefix_len: int, count: int) -> list[KVRequest]:
    """``count`` requests forked from one prompt, each then decoding its own token."""
    first = run(manager, "b0", [(i * 7) % 50 for i in range(prefix_len)])
    rows = [first] + [manager.fork(first, KVRequest(f"b{i}", [])) for i in range(1, count)]
    for index, row in enumerate(rows):
        assert decode(manager, row, 100 + index)
    return rows


# --- reorder ------------------------------------------------------------------------------------

def test_reorder_moves_each_rows_content_and_tokens_in_both_groups(hybrid):
    rows = beams(hybrid, W + P + 2, 3)  # past the window: local blocks released
    assert rows[0].group_released_blocks(1) > 0
    lists = [row.token_ids for row in rows]
    expected = [list(rows[s].token_ids) for s in (2, 2, 0)]
    assert hybrid.reorder(rows, [rows[2], rows[2], rows[0]])
    for row, tokens, own in zip(rows, expected, lists):
        assert row.token_ids == tokens and row.token_ids is own  # in place, the content's tokens
        assert all(alloc.num_tokens == len(tokens) for alloc in row.allocations)  # in every group
        assert reads_back(hybrid, row)
    for step in range(2 * P):  # the rows keep decoding apart, each into its own blocks
        for index, row in enumerate(rows):
            assert decode(hybrid, row, (step + index) % 9)
    for row in rows:
        assert reads_back(hybrid, row)
        assert held(hybrid.block_table(row, 0)) <= -(-W // P) + 2
    hybrid.check()


def test_a_swap_of_two_rows_is_a_permutation_not_a_double_swap(hybrid):
    """Each row has one token list for every group: reordering the groups one after another must
    not swap it back."""
    rows = beams(hybrid, 10, 2)
    first, second = list(rows[0].token_ids), list(rows[1].token_ids)
    assert hybrid.reorder(rows, [rows[1], rows[0]])
    assert (rows[0].token_ids, rows[1].token_ids) == (second, first)
    assert all(reads_back(hybrid, row) for row in rows)


def test_a_reorder_the_local_group_cannot_copy_for_changes_nothing():
    manager = make_hybrid(num_blocks=16, local_blocks=6, max_num_seqs=5)
    try:
        rows = beams(manager, W + 3, 3)  # partial last blocks: rows taking one source copy it
        local, first = manager.layout_groups[1], manager.layout_groups[0]
        while local.num_free_blocks:  # fill the local pool with another request
            run(manager, f"filler{local.num_free_blocks}", [300 + i for i in range(2)])
        assert first.num_free_blocks > 0
        before, tokens = snapshot(manager), [list(row.token_ids) for row in rows]
        before_state = state(manager)  # every group's pool, slots, mappings and each row's allocations
        assert not manager.reorder(rows, [rows[0], rows[0], rows[0]])
        assert snapshot(manager) == before and [row.token_ids for row in rows] == tokens
        assert state(manager) == before_state
        assert all(reads_back(manager, row) for row in rows)
        manager.check()
    finally:
        close(manager)


def test_reorder_input_errors_change_nothing(hybrid):
    rows = beams(hybrid, 10, 2)
    before = state(hybrid)
    with pytest.raises(RequestStateError, match="distinct"):
        hybrid.reorder([rows[0], rows[0]], rows)
    with pytest.raises(RequestStateError, match="distinct"):
        hybrid.reorder(rows, rows[:1])
    assert state(hybrid) == before
    rows[0].token_ids.append(5)
    assert hybrid.allocate(rows[0], 1)  # reserved, not committed: not a source yet
    before = state(hybrid)
    with pytest.raises(RequestStateError, match="commit"):
        hybrid.reorder(rows, [rows[0], rows[0]])
    assert state(hybrid) == before


@pytest.mark.parametrize("refusing", GROUPS)
def test_reorder_refused_by_either_groups_budget_changes_nothing(refusing):
    manager = make_hybrid(num_blocks=16)
    try:
        rows = beams(manager, W + P + 3, 2)
        pinch(manager, refusing)
        before, tokens = state(manager), [list(row.token_ids) for row in rows]
        with pytest.raises(MappingLimitError, match="reorder"):
            manager.reorder(rows, [rows[1], rows[1]])
        assert state(manager) == before and [row.token_ids for row in rows] == tokens
        unpinch(manager)
        assert manager.reorder(rows, [rows[1], rows[1]])
        assert rows[0].token_ids == rows[1].token_ids == tokens[1]
        assert all(reads_back(manager, row) for row in rows)
        manager.check()
    finally:
        close(manager)


# --- truncate -----------------------------------------------------------------------------------

def test_truncate_inside_the_window_then_decode_reads_back(hybrid):
    req = run(hybrid, "a", list(range(W + P + 4)))  # next query at 40 reads from 21: block 0 released
    assert req.group_released_blocks(1) == 1
    assert hybrid.truncate(req, W + P + 1)  # a query at 37 reads from 18: in block 1, held
    assert req.num_tokens == len(req.token_ids) == W + P + 1
    assert [alloc.num_tokens for alloc in req.allocations] == [W + P + 1] * 2  # in both groups
    for step in range(5):
        assert decode(hybrid, req, 200 + step)
    assert reads_back(hybrid, req)


def test_truncate_behind_the_local_window_is_refused_and_changes_nothing(hybrid):
    req = run(hybrid, "a", list(range(3 * P)))  # next query at 48 reads from 29: local blocks 0 released
    before, tokens = state(hybrid), list(req.token_ids)
    with pytest.raises(RequestStateError, match="window"):
        hybrid.truncate(req, P)  # a query at 16 would read from 0, released
    with pytest.raises(RequestStateError, match="cannot truncate"):
        hybrid.truncate(req, 3 * P + 1)
    assert state(hybrid) == before and req.token_ids == tokens
    assert hybrid.truncate(req, W + P)  # a query at 36 reads from 17: block 1 on, held


def test_truncating_a_fork_copies_the_shared_last_block_in_both_groups(hybrid):
    parent = run(hybrid, "a", list(range(4 * P)))  # full blocks, shared by the fork
    child = hybrid.fork(parent, KVRequest("child", []))
    free = [group.num_free_blocks for group in hybrid.layout_groups]
    assert hybrid.truncate(child, 4 * P - 4)  # its last block, shared, becomes partial
    assert [group.num_free_blocks for group in hybrid.layout_groups] == [free[0] - 1, free[1] - 1]
    assert decode(hybrid, child, 77)  # writes into its own copy
    assert reads_back(hybrid, child) and reads_back(hybrid, parent)


def test_a_truncation_that_cannot_copy_changes_nothing():
    manager = make_hybrid(num_blocks=16, local_blocks=6, max_num_seqs=8)
    try:
        parent = run(manager, "a", list(range(4 * P)))
        child = manager.fork(parent, KVRequest("child", []))
        local = manager.layout_groups[1]
        while local.num_free_blocks:
            run(manager, f"filler{local.num_free_blocks}", [300 + i for i in range(2)])
        before, tokens = state(manager), list(child.token_ids)
        assert not manager.truncate(child, 4 * P - 4)
        assert state(manager) == before and child.token_ids == tokens
    finally:
        close(manager)


@pytest.mark.parametrize("refusing", GROUPS)
def test_truncate_refused_by_either_groups_budget_changes_nothing(refusing):
    manager = make_hybrid(num_blocks=16)
    try:
        parent = run(manager, "a", list(range(4 * P)))
        child = manager.fork(parent, KVRequest("child", []))
        pinch(manager, refusing)
        before = state(manager)
        with pytest.raises(MappingLimitError, match="truncate"):
            manager.truncate(child, 4 * P - 4)
        assert state(manager) == before
        unpinch(manager)
        assert manager.truncate(child, 4 * P - 4)
        assert reads_back(manager, child) and reads_back(manager, parent)
        manager.check()
    finally:
        close(manager)


# --- a random walk ----------------------------------------------------------------------------------

EXERCISED: Counter = Counter()
OPS = st.lists(st.tuples(st.sampled_from(["admit", "decode", "decode", "fork", "reorder", "reorder",
                                          "truncate", "free"]),
                         st.integers(0, 7), st.integers(1, 40)), min_size=10, max_size=30)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(ops=OPS)
def test_random_walk_with_reorders_and_truncations(ops):
    manager = make_hybrid(num_blocks=7, max_num_seqs=4)
    running: dict[str, KVRequest] = {}
    counter = 0
    try:
        for op, pick, size in ops:
            names = sorted(running)
            name = names[pick % len(names)] if names else None
            before = state(manager), {n: list(r.token_ids) for n, r in running.items()}
            if op == "admit":
                counter += 1
                req = KVRequest(f"r{counter}", [(pick * 11 + i) % 30 for i in range(size)])
                if manager.admit(req) is None:
                    assert state(manager) == before[0]
                    continue
                write(manager, req, req.num_computed_tokens, req.num_tokens)
                manager.commit(req)
                running[req.request_id] = req
                EXERCISED[op] += 1
            elif op == "decode" and name:
                for step in range(size):
                    if not decode(manager, running[name], (step + pick) % 5):
                        EXERCISED["refused decode"] += 1
                        break
                    EXERCISED[op] += 1
            elif op == "fork" and name:
                counter += 1
                child = manager.fork(running[name], KVRequest(f"r{counter}", []))
                if child is not None:
                    running[child.request_id] = child
                    EXERCISED[op] += 1
            elif op == "reorder" and name:
                rows = [running[n] for n in names[: 1 + pick % len(names)]]
                sources = [rows[(pick * (i + 3)) % len(rows)] for i in range(len(rows))]
                expected = [list(s.token_ids) for s in sources]
                if manager.reorder(rows, sources):
                    assert [row.token_ids for row in rows] == expected
                    EXERCISED[op] += 1
                    EXERCISED["reorder behind the window"] += any(
                        row.group_released_blocks(1) for row in rows)
                else:
                    assert (state(manager), {n: list(r.token_ids) for n, r in running.items()}) == before
                    EXERCISED["refused reorder"] += 1
            elif op == "truncate" and name:
                req = running[name]
                length = req.num_tokens - size % (req.num_tokens + 1)
                try:
                    done = manager.truncate(req, length)
                except RequestStateError:
                    done = None
                    EXERCISED["truncate behind the window"] += 1
                if done:
                    assert req.num_tokens == len(req.token_ids) == length
                    EXERCISED[op] += 1
                else:
                    assert (state(manager), {n: list(r.token_ids) for n, r in running.items()}) == before
            elif op == "free" and name:
                manager.free(running.pop(name))
            manager.check()
            for req in running.values():
                assert reads_back(manager, req)
        free_all(manager, list(running.values()))
    finally:
        close(manager)


def test_the_random_walk_exercised_reorders_and_truncations():
    """Run after the walk (file order)."""
    if not EXERCISED:
        pytest.skip("the random walk did not run in this test run (run the whole file)")
    expected = {"admit", "decode", "fork", "reorder", "refused reorder", "reorder behind the window",
                "truncate", "truncate behind the window"}
    assert expected <= {op for op, count in EXERCISED.items() if count}, EXERCISED
