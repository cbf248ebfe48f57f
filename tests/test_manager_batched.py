"""The manager's batched step entries (``allocate_each``, ``commit_all``) do what one call per
request does and refuse without changing anything (``test_scheduler_batched.py``: the scheduler's
use of them schedules and preempts exactly as one call per sequence).

Managers from the ``make_manager`` fixture: 10 blocks of 4 tokens, 4 slots, max_model_len 40."""

from __future__ import annotations

import pytest

from conftest import manager_state as state
from vmemkv import RequestStateError, RequestTooLongError, UnknownRequestError
from vmemkv.errors import InvalidInputError, MappingLimitError


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def three_running(m) -> None:
    for name, start in (("a", 0), ("b", 100), ("c", 200)):
        m.admit(name, tokens(start, 6))
        m.commit(name)


def test_allocate_each_grants_a_prefix_and_leaves_the_refused_and_the_rest_unchanged(make_manager):
    batched, one_by_one = make_manager(), make_manager()
    for m in (batched, one_by_one):
        three_running(m)  # 6 blocks held, 4 free
    # a: +2 tokens (fits its page), b: +6 (1 new block), c: +16 (4 new: refused, 3 are free),
    # then a: +1 (would fit, but comes after the refusal)
    requests, counts = ["a", "b", "c", "a"], [2, 6, 16, 1]
    assert batched.allocate_each(requests, counts) == 2
    assert one_by_one.allocate("a", 2) and one_by_one.allocate("b", 6)
    assert state(batched) == state(one_by_one)
    assert batched.num_tokens("c") == 6 and batched.num_tokens("a") == 8
    assert batched.allocate_each([], []) == 0
    assert batched.allocate_each(["a", "c"], [1, 1]) == 2


def test_allocate_each_refuses_bad_input_before_any_change(make_manager):
    m = make_manager()
    three_running(m)
    before = state(m)
    with pytest.raises(RequestTooLongError):
        m.allocate_each(["a", "b"], [1, 35])  # b would pass max_model_len 40
    with pytest.raises(InvalidInputError):
        m.allocate_each(["a", "b"], [1, -1])
    with pytest.raises(ValueError, match="2 requests but 1 counts"):
        m.allocate_each(["a", "b"], [1])
    with pytest.raises(UnknownRequestError, match="'nobody'"):
        m.allocate_each(["a", "nobody"], [1, 1])
    assert state(m) == before


def test_allocate_each_stops_at_a_mapping_the_os_budget_refuses(make_manager):
    m = make_manager()
    three_running(m)
    map_blocks = m.slots.map_blocks
    refused_slot = m.slot_of("b")

    def refuse_b(slot, *args):
        if slot == refused_slot:
            raise MappingLimitError("refused for the test")
        return map_blocks(slot, *args)

    m.slots.map_blocks = refuse_b
    before_b = (m.block_table("b"), m.num_tokens("b"))
    assert m.allocate_each(["a", "b", "c"], [4, 4, 4]) == 1
    assert (m.block_table("b"), m.num_tokens("b")) == before_b
    assert m.num_tokens("a") == 10 and m.num_tokens("c") == 6
    m.slots.map_blocks = map_blocks


def test_commit_all_is_one_commit_per_request_and_checks_them_all_first(make_manager):
    batched, one_by_one = make_manager(), make_manager()
    for m in (batched, one_by_one):
        three_running(m)
        for name, start in (("a", 6), ("b", 106)):
            assert m.allocate(name, 3, tokens(start, 3))  # 9 tokens: 2 full pages now
    batched.commit_all(["a", "b"])
    one_by_one.commit("a")
    one_by_one.commit("b")
    assert state(batched) == state(one_by_one)
    assert [batched.num_computed_tokens(r) for r in "abc"] == [9, 9, 6]
    assert batched.match_prefix(tokens(0, 9))[0] == batched.block_table("a")[:2]  # registered
    # c reserves a position whose token is not known yet: refused, and a is not committed either
    assert batched.allocate("a", 1, [9]) and batched.allocate("c", 1)
    before = state(batched)
    with pytest.raises(RequestStateError, match="'c'"):
        batched.commit_all(["a", "c"])
    assert state(batched) == before and batched.num_computed_tokens("a") == 9
    batched.request("c").token_ids.append(206)
    batched.commit_all(["a", "c"])
    assert [batched.num_computed_tokens(r) for r in "ac"] == [10, 7]
