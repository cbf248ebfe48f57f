"""Behaviour specs of KVCacheManager with a tiny pool and exact block ids.

In the spirit of vLLM's tests/v1/core/test_prefix_caching.py. Every manager here: 10 blocks of 4
tokens (4 KiB pages), 4 slots, ``max_model_len`` 40; the ``make_manager`` fixture asserts
``check()`` and no leaked block at the end of each test.
"""

from __future__ import annotations

import pytest

from vmemkv import (CacheKeys, MultimodalItem, RequestStateError, PrefixCacheBusyError, Refusal,
                    RequestTooLongError, UnknownRequestError, WrongRequestStateError)
from vmemkv.cache.swap import OutOfSwapSpaceError
from vmemkv.errors import InvalidInputError

from conftest import manager_state

PAGE_BYTES = 4096


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run(manager, request_id, token_ids, **kwargs):
    """Admit and compute a prompt (commit); returns the cached token count."""
    cached = manager.admit(request_id, token_ids, **kwargs)
    assert cached is not None, f"{request_id} was not admitted"
    manager.commit(request_id)
    return cached


def decode(manager, request_id, token_id) -> bool:
    ok = manager.allocate(request_id, 1, [token_id])
    if ok:
        manager.commit(request_id)
    return ok


def refs(manager, blocks):
    return [manager.pool.refcount(b) for b in blocks]


state = manager_state


# --- prefill and prefix hits ------------------------------------------------------------------


def test_cold_prefill(make_manager):
    m = make_manager()
    assert m.admit("a", tokens(0, 10)) == 0
    assert m.block_table("a") == [0, 1, 2]
    assert m.slot_of("a") == 0
    assert (m.num_tokens("a"), m.num_computed_tokens("a")) == (10, 0)
    assert refs(m, range(4)) == [1, 1, 1, 0]
    assert m.pool.num_free == 7
    stats = m.snapshot_stats()
    assert stats["map_calls"] == 1 and stats["pages_mapped"] == 3  # consecutive: one call
    assert m.pool.hash_of[0] is None  # nothing is cached before it is computed
    m.commit("a")
    assert m.num_computed_tokens("a") == 10
    assert m.pool.hash_of[0] is not None and m.pool.hash_of[1] is not None
    assert m.pool.hash_of[2] is None  # the partial page is never cached
    assert m.pool.free_queue() == []
    stats = m.snapshot_stats()
    assert (stats["prefix_queried_tokens"], stats["prefix_hit_tokens"]) == (10, 0)
    assert m.usage() == pytest.approx(0.3)


def test_second_request_shares_the_prefix_while_the_first_runs(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 10))
    assert m.admit("b", tokens(0, 8) + [100, 101, 102]) == 8
    assert m.block_table("b") == [0, 1, 3]
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert m.slot_of("b") == 1
    assert (m.num_tokens("b"), m.num_computed_tokens("b")) == (11, 8)
    stats = m.snapshot_stats()
    assert (stats["prefix_queried_tokens"], stats["prefix_hit_tokens"]) == (21, 8)
    assert stats["prefix_hit_rate"] == pytest.approx(8 / 21)
    assert stats["map_calls"] == 3 and stats["pages_mapped"] == 6  # hits [0,1] + new [3]
    m.commit("b")
    assert m.pool.hash_of[3] is None  # 11 tokens: page 2 is partial


def test_free_queue_order_and_the_order_later_allocations_take_pages(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 10))
    run(m, "b", tokens(0, 8) + [100, 101, 102])
    m.free("a")
    assert m.pool.free_queue() == []  # b still holds the prefix
    assert refs(m, [0, 1, 2, 3]) == [1, 1, 0, 1]
    m.free("b")
    # released deepest first: the shared prefix (page 0) outlives its tails
    assert m.pool.free_queue() == [1, 0]
    assert sorted(m.pool._clean) == [2, 3, 4, 5, 6, 7, 8, 9]
    # clean pages go first, lowest id first ...
    assert m.admit("c", tokens(200, 32)) == 0
    assert m.block_table("c") == [2, 3, 4, 5, 6, 7, 8, 9]
    assert m.pool.evictions == 0 and m.pool.free_queue() == [1, 0]
    assert m.match_prefix(tokens(0, 9))[0] == [0, 1]
    # ... then cached pages in queue order, their hashes dropped
    assert m.admit("d", tokens(300, 8)) == 0
    assert m.block_table("d") == [1, 0]
    assert m.pool.evictions == 2
    assert m.pool.hash_of[0] is None and m.pool.hash_of[1] is None  # a reused page has no hash
    assert m.match_prefix(tokens(0, 9))[0] == []


def test_a_hit_on_pages_in_the_free_queue_takes_them_out(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 12))
    m.free("a")
    assert m.pool.free_queue() == [2, 1, 0]
    assert m.admit("b", tokens(0, 12) + [50]) == 12
    assert m.block_table("b") == [0, 1, 2, 3]
    assert m.pool.free_queue() == []
    assert refs(m, [0, 1, 2, 3]) == [1, 1, 1, 1]
    m.commit("b")
    assert m.admit("c", tokens(0, 4) + [7] * 5) == 4
    assert m.block_table("c") == [0, 4, 5]
    assert refs(m, [0]) == [2]


def test_chunked_prefill_with_a_token_budget(make_manager):
    m = make_manager()
    assert m.admit("a", tokens(0, 10), token_budget=4) == 0
    assert (m.block_table("a"), m.num_tokens("a")) == ([0], 4)
    m.commit("a")
    assert m.pool.hash_of[0] is not None
    assert m.allocate("a", 6)  # the rest of the prompt: its ids are known already
    assert m.block_table("a") == [0, 1, 2]
    m.commit("a", 8)
    assert m.pool.hash_of[1] is not None
    with pytest.raises(RequestStateError, match="cannot mark 11"):
        m.commit("a", 11)
    m.commit("a")
    assert m.token_ids("a") == tokens(0, 10)


# --- decode -----------------------------------------------------------------------------------


def test_decode_maps_one_block_when_crossing_a_page_boundary_and_none_otherwise(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 8))
    calls, mapped = m.backend.stats.map_calls, m.snapshot_stats()["pages_mapped"]
    assert m.blocks_needed("a", 1) == 1 and m.can_allocate("a", 1)
    assert decode(m, "a", 8)  # token 9: a new page
    assert m.block_table("a") == [0, 1, 2]
    assert m.backend.stats.map_calls == calls + 1
    assert m.snapshot_stats()["pages_mapped"] == mapped + 1
    for token in (9, 10, 11):  # tokens 10-12 fill that page: no mapping
        assert m.blocks_needed("a", 1) == 0
        assert decode(m, "a", token)
    assert m.block_table("a") == [0, 1, 2]
    assert m.backend.stats.map_calls == calls + 1
    assert m.pool.hash_of[2] is not None  # full now, so cached
    assert m.match_prefix(tokens(0, 13))[0] == [0, 1, 2]
    assert decode(m, "a", 12)
    assert m.block_table("a") == [0, 1, 2, 3]
    assert m.backend.stats.map_calls == calls + 2
    assert m.token_ids("a") == tokens(0, 13)


def test_a_requests_own_hits_are_not_evicted_to_make_room_for_it(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 8))  # [0, 1]
    run(m, "e", tokens(100, 5))  # [2, 3]; page 2 cached
    run(m, "x", tokens(200, 24))  # [4 .. 9]
    m.free("a")
    m.free("e")
    assert m.pool.free_queue() == [1, 0, 2] and sorted(m.pool._clean) == [3]
    # 17 tokens: 2 hits + 3 new pages, but only 2 free pages remain once the hits are taken
    before = state(m)
    assert not m.can_admit(tokens(0, 8) + tokens(300, 9))
    assert m.admit("big", tokens(0, 8) + tokens(300, 9)) is None
    assert state(m) == before
    # 13 tokens: 2 hits + 2 new pages: the clean page, then page 2 (evicted), never 0 or 1
    assert m.admit("b", tokens(0, 8) + tokens(300, 5)) == 8
    assert m.block_table("b") == [0, 1, 3, 2]
    assert m.pool.evictions == 1
    assert m.match_prefix(tokens(100, 5))[0] == []


def test_failed_admission_and_allocation_change_nothing(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 18))  # 5 blocks, the last partial
    run(m, "b", tokens(100, 20))  # 5 full blocks
    assert m.pool.num_free == 0
    before = state(m)
    assert not m.can_admit(tokens(200, 3))
    assert m.admit("c", tokens(200, 3)) is None
    assert m.admit("c", tokens(0, 17)) is None  # 4 hits but still one block short
    assert not m.can_allocate("b", 1)
    assert m.allocate("b", 1, [7]) is False
    assert m.fork("a", "a2") is None  # the partial page needs a copy
    assert state(m) == before
    assert "c" not in m.request_ids() and "a2" not in m.request_ids()
    # a, with room left in its last page, may still grow
    assert m.allocate("a", 2, [1, 2])
    m.commit("a")
    # no free slot: refused even though blocks are free
    m.free("b")
    for request_id in ("s1", "s2", "s3"):
        run(m, request_id, [ord(request_id[1])])
    before = state(m)
    assert m.num_free_slots == 0
    assert not m.can_admit(tokens(500, 2))
    assert m.admit("s4", tokens(500, 2)) is None
    assert m.fork("s1", "s5") is None
    assert state(m) == before


def test_requests_longer_than_max_model_len_are_refused(make_manager):
    m = make_manager()
    with pytest.raises(RequestTooLongError, match="max_model_len is 40"):
        m.admit("a", tokens(0, 41))
    with pytest.raises(RequestTooLongError):
        m.admit("a", tokens(0, 30), num_new_tokens=41)
    run(m, "a", tokens(0, 38))
    before = state(m)
    with pytest.raises(RequestTooLongError):
        m.allocate("a", 3)
    assert state(m) == before
    assert m.allocate("a", 2, [1, 2])
    m.commit("a")


def test_unknown_and_duplicate_requests(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 5))
    with pytest.raises(RequestStateError, match="already admitted"):
        m.admit("a", tokens(0, 5))
    with pytest.raises(UnknownRequestError):
        m.free("nope")
    with pytest.raises(UnknownRequestError):
        m.allocate("nope", 1)
    with pytest.raises(WrongRequestStateError):
        m.swap_in("a")  # running, not swapped
    with pytest.raises(RequestStateError, match="already exists"):
        m.fork("a", "a")
    before = state(m)
    with pytest.raises(InvalidInputError, match="num_new_tokens is -1"):
        m.allocate("a", -1)
    with pytest.raises(InvalidInputError, match="num_new_tokens is -2"):
        m.admit("b", tokens(0, 5), num_new_tokens=-2)
    with pytest.raises(InvalidInputError, match="token_budget is -1"):
        m.admit("b", tokens(0, 5), token_budget=-1)
    assert state(m) == before
    m.allocate("a", 1, [9])
    with pytest.raises(RequestStateError, match="commit"):
        m.fork("a", "b")  # a reserved position that is not computed yet
    m.commit("a")
    m.free("a")
    with pytest.raises(UnknownRequestError):
        m.free("a")


def test_swap_in_of_a_running_request_is_a_state_error_that_names_its_state(make_manager):
    m = make_manager(swap_space_bytes=4 * PAGE_BYTES)
    run(m, "a", tokens(0, 5))
    before = state(m)
    for call in (m.swap_in, m.can_swap_in):
        with pytest.raises(WrongRequestStateError) as refused:
            call("a")
        # a state error of ours, still caught where an UnknownRequestError was
        assert isinstance(refused.value, RequestStateError) and isinstance(refused.value, UnknownRequestError)
        assert str(refused.value) == ("request 'a' is running (slot 0), not swapped out; swap_in() brings "
                                      "back only a request preempt(req, 'swap') took off the device")
    assert state(m) == before
    with pytest.raises(UnknownRequestError) as unknown:
        m.swap_in("nope")
    assert str(unknown.value).startswith("request 'nope' is not swapped out")  # not in a KeyError's quotes
    m.preempt("a", "swap")
    with pytest.raises(WrongRequestStateError, match="swapped out, not running"):
        m.allocate("a", 1)
    assert m.swap_in("a")


def test_a_refused_call_says_why_in_last_refusal(make_manager):
    """admit, fork, swap_in and allocate still return None / None / False and change nothing;
    ``last_refusal`` tells which limit stopped the last refused one."""
    m = make_manager(max_num_seqs=2, swap_space_bytes=4 * PAGE_BYTES)
    assert m.last_refusal is None
    run(m, "a", tokens(0, 30))  # 8 of the 10 blocks, slot 0

    def refused(call, *args, **kwargs) -> Refusal:
        before = state(m)
        assert call(*args, **kwargs) in (None, False)
        assert state(m) == before
        return m.last_refusal

    why = refused(m.admit, "b", tokens(100, 12))
    assert (why.operation, why.request_id, why.reason) == ("admit", "b", "out_of_blocks")
    assert (why.blocks_needed, why.blocks_available, why.group) == (3, 2, None)
    assert str(why) == ("admit('b') was refused: it needs 3 fresh KV blocks and the pool can hand out 2; "
                        "free or preempt a request, or raise CacheConfig.num_blocks")
    why = refused(m.admit, "b", tokens(100, 5), slot=0)
    assert (why.reason, why.slot) == ("slot_taken", 0)
    assert "slot 0 holds another request" in str(why)
    run(m, "b", tokens(100, 5))  # the last 2 blocks, slot 1
    why = refused(m.admit, "c", tokens(200, 3))
    assert (why.operation, why.reason) == ("admit", "no_free_slot")
    assert "raise CacheConfig.max_num_seqs" in str(why)
    assert refused(m.fork, "b", "c").reason == "no_free_slot"
    why = refused(m.allocate, "b", 4)
    assert (why.operation, why.reason, why.blocks_needed, why.blocks_available) == ("allocate", "out_of_blocks", 1, 0)
    m.preempt("b", "swap")  # its 2 blocks go to host memory
    run(m, "c", tokens(200, 5))  # takes slot 1
    assert refused(m.swap_in, "b").reason == "no_free_slot"
    m.free("c")
    assert m.swap_in("b")


# --- caching rules ----------------------------------------------------------------------------


def test_caching_disabled(make_manager):
    m = make_manager(enable_prefix_caching=False)
    assert run(m, "a", tokens(0, 12)) == 0
    assert m.pool.hash_of == [None] * 10
    assert run(m, "b", tokens(0, 12)) == 0
    assert m.block_table("b") == [3, 4, 5]
    m.free("a")
    assert m.pool.free_queue() == [] and m.pool.num_clean == 7
    assert m.match_prefix(tokens(0, 12)) == ([], [])
    stats = m.snapshot_stats()
    assert stats["prefix_queried_tokens"] == 0 and stats["prefix_hit_rate"] == 0.0


def test_cache_salts_adapters_and_multimodal_content_isolate(make_manager):
    m = make_manager(num_blocks=40, max_num_seqs=10)
    prompt = tokens(0, 9)
    run(m, "plain", prompt)
    salt = CacheKeys(cache_salt="tenant-1")
    assert run(m, "salted", prompt, keys=salt) == 0
    assert run(m, "salted-again", prompt, keys=salt) == 8
    assert run(m, "other-salt", prompt, keys=CacheKeys(cache_salt="tenant-2")) == 0
    assert run(m, "adapter", prompt, keys=CacheKeys(adapter_id=7)) == 0
    assert run(m, "adapter-again", prompt, keys=CacheKeys(adapter_id=7)) == 8
    # an image in positions 4..7: page 0 is plain text (hits the plain prompt), page 1 is not
    image_a = CacheKeys(multimodal=(MultimodalItem(4, 4, b"image-a"),))
    image_b = CacheKeys(multimodal=(MultimodalItem(4, 4, b"image-b"),))
    assert run(m, "image-a", prompt, keys=image_a) == 4
    assert run(m, "image-a-again", prompt, keys=image_a) == 8
    assert run(m, "image-b", prompt, keys=image_b) == 4
    assert m.block_table("image-a-again")[:2] == m.block_table("image-a")[:2]
    assert m.block_table("image-b")[0] == m.block_table("plain")[0]
    assert m.block_table("image-b")[1] != m.block_table("image-a")[1]
    assert m.match_prefix(prompt, CacheKeys(cache_salt="unknown"))[0] == []


def test_an_image_at_another_offset_in_a_block_shares_no_block(make_manager):
    """A block's multimodal key names where the item sits in it, not only its content (vLLM hashes
    ``(identifier, offset)``): the same tokens with the same one-token image at offset 0 and at
    offset 3 of block 0 share no block; the same placement again shares every full one."""
    m = make_manager()
    prompt = tokens(0, 9)
    at_0 = CacheKeys(multimodal=(MultimodalItem(0, 1, b"image"),))
    at_3 = CacheKeys(multimodal=(MultimodalItem(3, 1, b"image"),))
    assert run(m, "at-0", prompt, keys=at_0) == 0
    assert run(m, "at-3", prompt, keys=at_3) == 0
    assert set(m.block_table("at-3")).isdisjoint(m.block_table("at-0"))
    assert run(m, "at-3-again", prompt, keys=at_3) == 8
    assert m.block_table("at-3-again")[:2] == m.block_table("at-3")[:2]


def test_at_least_one_prompt_token_is_always_computed(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 8))
    m.free("a")
    assert m.pool.free_queue() == [1, 0]
    # fully cached, but the last page is computed again (into a new page)
    assert m.admit("b", tokens(0, 8)) == 4
    assert m.block_table("b") == [0, 2]
    assert (m.num_tokens("b"), m.num_computed_tokens("b")) == (8, 4)
    m.commit("b")
    assert m.pool.hash_of[2] is None  # page 1 already holds that content
    assert m.pool.free_queue() == [1]
    assert m.admit("c", tokens(0, 4)) == 0  # one page, fully cached: computed again
    assert m.block_table("c") == [3]


def test_reset_prefix_cache_is_refused_while_pages_are_in_use(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 9))
    with pytest.raises(PrefixCacheBusyError, match="3 blocks are held by 1 request"):
        m.reset_prefix_cache()
    assert m.pool.hash_of[0] is not None
    m.free("a")
    assert m.pool.free_queue() == [1, 0]
    assert m.reset_prefix_cache() == 2
    assert m.pool.free_queue() == [] and m.pool.num_clean == 10
    assert m.admit("b", tokens(0, 9)) == 0
    assert m.block_table("b") == [0, 1, 2]


def test_hit_rate_stats_count_reprefill_after_recompute_apart(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 10))
    run(m, "b", tokens(0, 8) + [70, 71])
    assert m.stats.prefix_queried_tokens == 20 and m.stats.prefix_hit_tokens == 8
    assert decode(m, "b", 72)
    assert m.preempt("b", "recompute") == "recompute"
    assert "b" not in m.request_ids() and m.stats.preemptions_recompute == 1
    assert m.pool.free_queue() == []  # a still holds the prefix; b's tail page went clean
    # re-admitted with all its tokens: the prefix hits again, counted as re-prefill
    assert m.admit("b", tokens(0, 8) + [70, 71, 72]) == 8
    m.commit("b")
    stats = m.snapshot_stats()
    assert (stats["prefix_queried_tokens"], stats["prefix_hit_tokens"]) == (20, 8)
    assert (stats["reprefill_queried_tokens"], stats["reprefill_hit_tokens"]) == (11, 8)
    assert stats["prefix_hit_rate"] == pytest.approx(0.4)
    # a second admission under a recycled id counts as a fresh one again
    m.free("b")
    run(m, "b", tokens(0, 5))
    assert m.stats.prefix_queried_tokens == 25 and m.stats.reprefill_queried_tokens == 11


# --- copy-on-write ----------------------------------------------------------------------------


def test_fork_shares_full_pages_and_copies_the_partial_one(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 10))
    assert m.fork("a", "b")
    assert m.block_table("b") == [0, 1, 3]
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert m.slot_of("b") == 1
    assert m.token_ids("b") == m.token_ids("a")
    assert (m.num_tokens("b"), m.num_computed_tokens("b")) == (10, 10)
    assert m.stats.forks == 1 and m.stats.blocks_copied == 1
    assert decode(m, "b", 99) and decode(m, "a", 98)  # each writes its own partial page
    assert m.block_table("a") == [0, 1, 2] and m.block_table("b") == [0, 1, 3]
    # page-aligned: everything shared, nothing copied
    run(m, "c", tokens(100, 8))
    assert m.fork("c", "d")
    assert m.block_table("d") == m.block_table("c") == [4, 5]
    assert refs(m, [4, 5]) == [2, 2]
    assert m.stats.blocks_copied == 1
    assert decode(m, "d", 1)
    assert m.block_table("d") == [4, 5, 6] and m.block_table("c") == [4, 5]


def test_reorder_remaps_full_pages_and_copies_a_partial_one_only_when_taken_twice(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 6))  # [0, 1]: one full page, one partial
    assert m.fork("a", "b")  # [0, 2]
    assert decode(m, "a", 10) and decode(m, "b", 20)  # 7 tokens each
    copied = m.stats.blocks_copied
    # both beams continue from a: b shares a's full page and gets a copy of its partial one
    assert m.reorder(["a", "b"], ["a", "a"])
    assert m.block_table("a") == [0, 1] and m.block_table("b") == [0, 3]
    assert refs(m, [0, 1, 2, 3]) == [2, 1, 0, 1]
    assert m.token_ids("b") == m.token_ids("a") == tokens(0, 6) + [10]
    assert m.stats.blocks_copied == copied + 1
    assert decode(m, "b", 21)
    # a swap of two beams: pages move, nothing is copied
    a_blocks, b_blocks = m.block_table("a"), m.block_table("b")
    a_tokens, b_tokens = m.token_ids("a"), m.token_ids("b")
    assert m.reorder(["a", "b"], ["b", "a"])
    assert (m.block_table("a"), m.block_table("b")) == (b_blocks, a_blocks)
    assert (m.token_ids("a"), m.token_ids("b")) == (b_tokens, a_tokens)
    assert m.stats.blocks_copied == copied + 1
    # page-aligned beams: full pages are shared, never copied
    assert m.num_tokens("a") == 8 and m.block_table("a") == [0, 3]
    assert m.reorder(["a", "b"], ["a", "a"])
    assert m.block_table("b") == m.block_table("a") == [0, 3]
    assert refs(m, [0, 3]) == [2, 2]
    assert m.stats.blocks_copied == copied + 1
    assert decode(m, "a", 31) and decode(m, "b", 32)
    assert m.block_table("a") != m.block_table("b")


def test_reorder_from_a_request_that_is_not_reordered_copies_its_partial_page(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 6))
    run(m, "b", tokens(100, 3))
    copied = m.stats.blocks_copied
    assert m.reorder(["b"], ["a"])  # a keeps running with its partial page: b needs a copy
    assert m.block_table("a") == [0, 1]
    assert m.block_table("b")[0] == 0 and m.block_table("b")[1] not in (0, 1)
    assert m.stats.blocks_copied == copied + 1
    m.check()


def test_reorder_without_room_for_copies_changes_nothing(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 6))
    assert m.fork("a", "b") and m.fork("a", "c")
    run(m, "filler", tokens(100, 20))  # a, b, c: 4 blocks; filler 5; one left
    assert m.pool.num_free == 1
    before = state(m)
    assert m.reorder(["a", "b", "c"], ["a", "a", "a"]) is False  # two copies needed
    assert state(m) == before
    assert m.reorder(["a", "b", "c"], ["a", "a", "c"])  # one copy: fits
    assert m.pool.num_free == 1  # b's old partial page was released
    with pytest.raises(UnknownRequestError):
        m.reorder(["a"], ["nope"])
    before = state(m)
    with pytest.raises(RequestStateError, match="distinct"):
        m.reorder(["a", "a"], ["b", "c"])  # would release a's pages twice
    with pytest.raises(RequestStateError, match="one source each"):
        m.reorder(["a", "b"], ["c"])
    assert state(m) == before


# --- preemption -------------------------------------------------------------------------------


def test_preempt_by_swap_and_swap_in_into_another_slot(make_manager):
    m = make_manager(swap_space_bytes=4 * PAGE_BYTES)
    run(m, "a", tokens(0, 10))  # [0, 1, 2], slot 0
    run(m, "b", tokens(0, 8) + [50, 51])  # [0, 1, 3], slot 1
    assert m.preempt("b", "swap") == "swap"
    assert m.is_swapped("b") and "b" in m.request_ids()
    assert m.stats.preemptions_swap == 1 and m.stats.swap_out_bytes == PAGE_BYTES  # only page 3
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 0]  # the shared prefix stays held
    assert m.swap.num_free == 3
    with pytest.raises(UnknownRequestError):
        m.slot_of("b")
    run(m, "c", tokens(100, 5))  # takes slot 1 and blocks 3, 4
    assert m.slot_of("c") == 1 and m.block_table("c") == [3, 4]
    assert m.swap_in("b")
    assert not m.is_swapped("b")
    assert m.slot_of("b") == 2
    assert m.block_table("b") == [0, 1, 5]
    assert m.stats.swap_in_bytes == PAGE_BYTES and m.swap.num_free == 4
    assert decode(m, "b", 52)
    assert m.token_ids("b") == tokens(0, 8) + [50, 51, 52]


def test_swap_in_takes_still_cached_pages_instead_of_copying_them(make_manager):
    m = make_manager(swap_space_bytes=4 * PAGE_BYTES)
    run(m, "a", tokens(0, 9))  # [0, 1, 2], pages 0 and 1 cached
    m.preempt("a", "swap")
    assert m.stats.swap_out_bytes == 3 * PAGE_BYTES and m.swap.num_free == 1
    assert m.pool.free_queue() == [1, 0] and m.pool.num_in_use == 0
    assert m.swap_in("a")
    assert m.block_table("a") == [0, 1, 2]  # 0, 1 revived from the cache; 2 copied back
    assert m.stats.swap_in_bytes == PAGE_BYTES
    # evicted meanwhile: copied back into new pages, and cached again
    m.preempt("a", "swap")
    run(m, "x", tokens(100, 32))  # takes 2..9: all clean pages, no eviction yet
    run(m, "y", tokens(200, 2))  # evicts page 1
    m.free("x")
    assert m.pool.evictions == 1
    assert m.swap_in("a")
    assert m.block_table("a")[0] == 0 and m.block_table("a")[1] != 1
    assert m.pool.hash_of[m.block_table("a")[1]] is not None
    assert m.match_prefix(tokens(0, 9))[0] == m.block_table("a")[:2]


def test_swap_refusals_change_nothing(make_manager):
    m = make_manager(swap_space_bytes=2 * PAGE_BYTES)
    run(m, "a", tokens(0, 9))  # 3 private blocks, 2 host blocks
    before = state(m)
    with pytest.raises(OutOfSwapSpaceError):
        m.preempt("a", "swap")
    assert state(m) == before
    run(m, "b", tokens(100, 7))  # [3, 4]
    m.preempt("b", "swap")
    assert m.pool.free_queue() == [3]
    for request_id in ("c", "d", "e"):
        run(m, request_id, [ord(request_id)])
    before = state(m)
    assert m.num_free_slots == 0
    assert m.swap_in("b") is False  # no slot
    assert state(m) == before
    for request_id in ("c", "d", "e"):
        m.free(request_id)
    run(m, "x", tokens(200, 28))  # 7 blocks: every clean one, then evicts b's cached page 3
    assert m.pool.num_free == 0 and m.pool.evictions == 1
    before = state(m)
    assert m.swap_in("b") is False  # no blocks
    assert state(m) == before
    m.free("a")
    assert m.swap_in("b")
    assert m.block_table("b") == [2, 1]  # clean first, then the LRU head
    assert m.stats.swap_in_bytes == 2 * PAGE_BYTES
    with pytest.raises(ValueError):
        m.preempt("b", "sideways")


def test_preempt_by_recompute_and_readmit_hits_cached_pages(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 10))
    for token in (10, 11, 12):
        assert decode(m, "a", token)
    all_tokens = m.token_ids("a")
    assert m.block_table("a") == [0, 1, 2, 3]
    assert m.preempt("a", "recompute") == "recompute"
    assert "a" not in m.request_ids()
    assert m.pool.free_queue() == [2, 1, 0]  # 3 full pages cached, deepest first; 3 clean
    assert m.admit("a", all_tokens) == 12
    assert m.block_table("a") == [0, 1, 2, 3]
    m.commit("a")
    assert m.stats.reprefill_hit_tokens == 12 and m.stats.preemptions_recompute == 1
    with pytest.raises(RequestStateError, match="commit"):
        m.allocate("a", 1, [5])
        m.preempt("a")


def test_estimate_preemption(make_manager):
    m = make_manager(swap_space_bytes=2 * PAGE_BYTES)
    run(m, "a", tokens(0, 10))
    run(m, "b", tokens(0, 8) + [50, 51])
    before = state(m)
    estimate = m.estimate_preemption("b")
    assert state(m) == before
    assert estimate.swap_bytes == PAGE_BYTES  # only its tail page is private
    assert estimate.recompute_tokens == 2  # the shared, cached prefix will hit again
    assert estimate.swap_seconds == pytest.approx(2 * PAGE_BYTES / m.config.swap_bytes_per_second)
    assert estimate.recompute_seconds == pytest.approx(2 / m.config.prefill_tokens_per_second)
    assert estimate.swap_fits and estimate.cheaper == "swap"
    m.free("b")
    estimate = m.estimate_preemption("a")  # all private now: 3 pages, 10 tokens
    assert (estimate.swap_bytes, estimate.recompute_tokens) == (3 * PAGE_BYTES, 10)
    assert not estimate.swap_fits and estimate.cheaper == "recompute"
    assert m.preempt("a") == "recompute"  # auto picks the estimate's choice


def test_preempt_auto_picks_swap_when_cheaper(make_manager):
    m = make_manager(swap_space_bytes=4 * PAGE_BYTES, prefill_tokens_per_second=1.0)
    run(m, "a", tokens(0, 10))
    assert m.estimate_preemption("a").cheaper == "swap"
    assert m.preempt("a") == "swap"
    assert m.swap_in("a")


# --- slots and deferred reclamation -----------------------------------------------------------


def test_a_new_request_in_a_reused_slot_maps_only_differing_pages(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 12))  # [0, 1, 2] in slot 0
    run(m, "x", tokens(100, 3))  # [3] in slot 1
    m.free("a")
    m.free("x")  # slot 1 is now the most recently released
    saved, calls = m.snapshot_stats()["map_calls_saved"], m.backend.stats.map_calls
    # the slot that still maps the prefix is chosen: the 3 hit pages need no map call
    assert m.admit("b", tokens(0, 12) + [99]) == 12
    assert m.slot_of("b") == 0
    assert m.block_table("b") == [0, 1, 2, 3]
    assert m.snapshot_stats()["map_calls_saved"] == saved + 3
    assert m.backend.stats.map_calls == calls + 1  # only page 3, at logical page 3
    # a cold request that gets the block its slot already maps: no map call at all
    run(m, "c", tokens(500, 3))  # [4] in slot 1
    m.free("c")
    saved, calls = m.snapshot_stats()["map_calls_saved"], m.backend.stats.map_calls
    assert m.admit("d", tokens(600, 3)) == 0
    assert (m.slot_of("d"), m.block_table("d")) == (1, [4])
    assert m.snapshot_stats()["map_calls_saved"] == saved + 1
    assert m.backend.stats.map_calls == calls
    m.commit("d")


def test_the_hash_chain_continues_from_any_page():
    """commit() hashes only the pages that just filled, continuing the chain: the result must
    equal hashing the whole prefix at once, multimodal positions included."""
    from vmemkv.cache.hashing import PrefixHasher

    hasher = PrefixHasher(seed=b"chain")
    token_ids = tokens(0, 23)
    for keys in (CacheKeys(), CacheKeys(multimodal=(MultimodalItem(9, 6, b"img"),))):
        whole = hasher.block_hashes(token_ids, 4, keys)
        assert len(whole) == 5
        for start in range(1, 5):
            rest = hasher.block_hashes(token_ids, 4, keys, start_block=start, parent=whole[start - 1])
            assert whole[:start] + rest == whole
            assert hasher.block_hashes(token_ids, 4, keys, start_block=start, parent=whole[start - 1],
                                      end_block=start + 1) == [whole[start]]
        assert hasher.block_hashes(token_ids, 4, keys, end_block=2) == whole[:2]
        assert hasher.block_hashes(token_ids, 4, keys, start_block=5, parent=whole[4]) == []
    plain = hasher.block_hashes(token_ids, 4, CacheKeys())
    image = hasher.block_hashes(token_ids, 4, CacheKeys(multimodal=(MultimodalItem(9, 6, b"img"),)))
    assert plain[:2] == image[:2] and plain[2] != image[2]  # the image starts in page 2
    assert PrefixHasher(seed=b"other").block_hashes(token_ids, 4, CacheKeys()) != plain
    assert PrefixHasher("blake2b", seed=b"chain").block_hashes(token_ids, 4, CacheKeys()) != plain


def test_a_mapping_refused_by_the_os_limit_changes_no_ownership():
    """When even reclaiming stale mappings leaves no room under the VMA limit, allocate, admit
    and fork raise MappingLimitError and keep nothing they could not map (a block kept unmapped
    would make the next write fault)."""
    from conftest import assert_no_leaks, tiny_config
    from vmemkv import KVCacheManager, MappingLimitError
    from vmemkv.memory.vmm import CpuBackend

    config = tiny_config(num_blocks=20, swap_space_bytes=4 * PAGE_BYTES)
    backend = CpuBackend(config.make_layout().page_size, 20, max_mappings=10)
    m = KVCacheManager(config, backend=backend)

    def ownership():  # everything but stale mappings: nothing is undone, nothing was done
        return manager_state(m)

    try:
        run(m, "a", [1])
        run(m, "b", [2])
        for token in range(11):  # interleaved growth: scattered pages, 2 VMAs each
            assert decode(m, "a", token) and decode(m, "b", token)
        assert decode(m, "a", 11)  # a crosses into its 4th page; the VMA budget is now spent
        before = ownership()
        with pytest.raises(MappingLimitError):
            m.allocate("b", 1, [11])
        with pytest.raises(MappingLimitError):
            m.admit("c", tokens(100, 5))
        with pytest.raises(MappingLimitError):
            m.fork("a", "a2")
        assert ownership() == before
        assert "c" not in m.request_ids() and "a2" not in m.request_ids()
        m.check()
        # swapped out, then its slot reused: swapping in needs a fresh slot's worth of VMAs
        assert m.preempt("b", "swap") == "swap"
        assert run(m, "d", [7], slot=1) == 0
        before = ownership()
        with pytest.raises(MappingLimitError):
            m.swap_in("b")
        assert ownership() == before and m.is_swapped("b")
        m.check()
        m.free("d")
        assert m.swap_in("b")  # into slot 1 again: over d's mapping, no VMA more
        assert m.block_table("b") == [1, 3, 5]
        m.free("a")  # room again: a's slot's stale mappings can be reclaimed
        assert decode(m, "b", 11)
        assert m.block_table("b") == [1, 3, 5, 6]
        assert run(m, "c", tokens(100, 5)) == 0
        with pytest.raises(MappingLimitError):
            m.fork("c", "c2")  # 3 more VMAs: more than the budget has
        m.free("b")
        unmapped = m.snapshot_stats()["pages_unmapped"]
        # into a never-used slot: room comes from reclaiming the stale mappings b's slot kept
        assert m.fork("c", "c2", slot=3)
        assert m.snapshot_stats()["pages_unmapped"] > unmapped
        assert_no_leaks(m)
    finally:
        m.close()


def test_a_refused_mapping_reclaims_the_stale_tail_of_the_slot_being_mapped():
    from conftest import assert_no_leaks, tiny_config
    from vmemkv import KVCacheManager
    from vmemkv.memory.vmm import CpuBackend

    config = tiny_config(num_blocks=20)
    backend = CpuBackend(config.make_layout().page_size, 20, max_mappings=1000)
    m = KVCacheManager(config, backend=backend)
    try:
        run(m, "a", tokens(0, 32))  # pages 0-7: one run in slot 0
        m.free("a")
        backend.max_mappings = backend.mappings_in_use  # no VMA to spare from now on
        # c reuses slot 0; its page splits a's stale run: one more VMA, found by unmapping the
        # stale tail of slot 0 past c's only page
        assert m.admit("c", tokens(100, 3)) == 0
        assert m.slot_of("c") == 0 and m.block_table("c") == [8]
        assert m.snapshot_stats()["pages_unmapped"] == 7
        m.commit("c")
        assert_no_leaks(m)
    finally:
        m.close()


# --- explicit slots, keys moving with content, truncate ------------------------------------------


def test_admit_and_fork_into_a_chosen_slot(make_manager):
    m = make_manager()
    assert m.admit("a", tokens(0, 6), slot=2) == 0
    assert m.slot_of("a") == 2
    before = state(m)
    assert m.admit("b", tokens(50, 6), slot=2) is None  # taken: refused, nothing changed
    assert state(m) == before
    m.commit("a")
    assert m.fork("a", "a2", slot=3)
    assert m.slot_of("a2") == 3
    assert not m.fork("a", "a3", slot=3)


def test_reorder_moves_cache_keys_with_content(make_manager):
    # Less than a page each: x's first page is hashed from the root of whatever keys x has.
    m = make_manager()
    run(m, "x", tokens(0, 3), keys=CacheKeys(cache_salt="x"))
    run(m, "y", tokens(0, 3), keys=CacheKeys(cache_salt="y"))
    assert m.reorder(["x", "y"], ["y", "y"])
    decode(m, "x", 7)  # fills x's first page, now y's content: it must be hashed under y's salt
    (page,) = m.block_table("x")
    assert m.match_prefix(tokens(0, 3) + [7, 1], CacheKeys(cache_salt="y"))[0] == [page]
    assert m.match_prefix(tokens(0, 3) + [7, 1], CacheKeys(cache_salt="x"))[0] == []


def test_truncate_releases_pages_and_copies_a_shared_last_page(make_manager):
    m = make_manager()
    run(m, "a", tokens(0, 10))  # pages 0, 1 full and cached; 2 partial
    run(m, "b", tokens(0, 10))  # shares 0 and 1 (8 cached tokens)
    assert m.block_table("b")[:2] == [0, 1]
    assert m.truncate("b", 6)  # page 1 becomes b's partial page: copied, not written in place
    table = m.block_table("b")
    assert table[0] == 0 and table[1] not in (0, 1, 2)
    assert refs(m, [0, 1]) == [2, 1]
    assert m.num_tokens("b") == m.num_computed_tokens("b") == 6
    with pytest.raises(RequestStateError, match="truncate"):
        m.truncate("b", 7)
    assert m.truncate("a", 8)  # on a page boundary: nothing to copy
    assert m.block_table("a") == [0, 1]
