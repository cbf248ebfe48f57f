"""On real mapped memory: every request reads back exactly what was written for its tokens, after
prefix hits, decode, fork, swap out/in, eviction and recompute, beam reorder and slot reuse, and
no other request's writes show through. Both layouts.

K/V is written through ``manager.kv_views(layer)`` narrowed to the request's slot and positions,
as the engine's forward pass does; the pattern (conftest.kv_patterns) is a function of the token
prefix, layer, K/V and element, like real K/V.
"""

from __future__ import annotations

import pytest
import torch

from conftest import read_kv_matches, write_kv

BLOCK_BYTES = 16384  # both layouts below: 4 tokens a block


@pytest.fixture(params=["token_major", "per_layer"])
def manager(request, make_manager):
    # 2 layers x 2 heads x 128 dim x fp32: token-major 4 KiB rows in 16 KiB pages, per-layer
    # 1 KiB rows in 4 KiB pages (4 pages a block); 4 tokens a block either way.
    m = make_manager(num_layers=2, num_kv_heads=2, head_dim=128, dtype=torch.float32,
                     tokens_per_page=4, num_blocks=16, max_num_seqs=4, max_model_len=32,
                     swap_space_bytes=8 * BLOCK_BYTES, layout=request.param)
    assert m.layout.kind == request.param
    assert m.tokens_per_page == 4 and m.layout.block_bytes == BLOCK_BYTES
    return m


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def prefill(m, request_id, token_ids) -> int:
    cached = m.admit(request_id, token_ids)
    assert cached is not None
    write_kv(m, request_id, cached, m.num_tokens(request_id))
    m.commit(request_id)
    return cached


def step(m, request_id, token_id) -> None:
    assert m.allocate(request_id, 1, [token_id])
    n = m.num_tokens(request_id)
    write_kv(m, request_id, n - 1, n)
    m.commit(request_id)


def verify(m) -> None:
    m.check()
    for request_id in m.request_ids():
        if not m.is_swapped(request_id):
            assert read_kv_matches(m, request_id), f"{request_id} reads what it did not write"


def test_shared_prefixes_and_decode(manager):
    m = manager
    assert prefill(m, "a", tokens(0, 10)) == 0
    assert prefill(m, "b", tokens(0, 8) + [100, 101]) == 8
    assert prefill(m, "c", tokens(500, 7)) == 0
    verify(m)
    for i in range(7):
        for n, request_id in enumerate(("a", "b", "c")):
            step(m, request_id, 1000 * (n + 1) + i)
        verify(m)
    assert m.block_table("a")[:2] == m.block_table("b")[:2]


def test_the_patterns_catch_a_wrong_page(manager):
    m = manager
    prefill(m, "a", tokens(0, 6))
    prefill(m, "b", tokens(100, 6))
    verify(m)
    # simulate a bug: b's slot maps a's second block
    m.slots.map_blocks(m.slot_of("b"), 1, [m.block_table("a")[1]])
    assert read_kv_matches(m, "a") and not read_kv_matches(m, "b")
    m.slots.map_blocks(m.slot_of("b"), 1, [m.block_table("b")[1]])
    verify(m)


def test_fork_child_reads_the_parents_prefix_then_its_own_tokens(manager):
    m = manager
    prefill(m, "a", tokens(0, 10))
    assert m.fork("a", "b")
    assert m.slot_of("b") != m.slot_of("a")
    verify(m)  # b reads a's 10 positions through its own slot
    for i in range(7):  # across two page boundaries
        step(m, "a", 2000 + i)
        step(m, "b", 3000 + i)
        verify(m)
    prefill(m, "c", tokens(700, 8))  # page-aligned: nothing copied
    assert m.fork("c", "d")
    step(m, "d", 1)
    step(m, "c", 2)
    verify(m)


def test_swap_out_and_in_is_bit_exact(manager):
    m = manager
    prefill(m, "a", tokens(0, 10))
    prefill(m, "b", tokens(0, 8) + [50, 51])
    step(m, "b", 52)
    step(m, "b", 53)  # b: 12 tokens, 3 blocks, its last two private
    b_slot = m.slot_of("b")
    assert m.preempt("b", "swap") == "swap"
    # others take b's old blocks and its slot, and overwrite them
    prefill(m, "c", tokens(300, 13))
    prefill(m, "d", tokens(400, 9))
    for i in range(3):
        step(m, "a", 900 + i)
    verify(m)
    m.free("c")
    assert m.swap_in("b")
    assert m.slot_of("b") != b_slot or m.slot_of("d") != b_slot
    verify(m)
    for i in range(5):
        step(m, "b", 60 + i)
        verify(m)
    # all private, two pages cached: revived on the way in where still cached, copied otherwise
    assert m.preempt("d", "swap") == "swap"
    prefill(m, "e", tokens(800, 11))
    assert m.swap_in("d")
    verify(m)


def test_evict_and_recompute(manager):
    m = manager
    prefill(m, "a", tokens(0, 14))
    for i in range(3):
        step(m, "a", 70 + i)
    all_tokens = m.token_ids("a")
    m.preempt("a", "recompute")
    assert m.pool.num_cached == 4
    prefill(m, "x", tokens(200, 32))  # 8 blocks
    prefill(m, "y", tokens(300, 20))  # 5 more: the last 4 clean ones, then a's deepest page
    assert m.pool.evictions == 1
    verify(m)
    m.free("x")
    assert prefill(m, "a", all_tokens) == 12  # pages 0-2 still cached, page 3 recomputed
    verify(m)
    step(m, "a", 99)
    verify(m)


def test_beam_reorder(manager):
    m = manager
    prefill(m, "a", tokens(0, 6))
    assert m.fork("a", "b") and m.fork("a", "c")
    for i, request_id in enumerate(("a", "b", "c")):
        step(m, request_id, 100 * (i + 1))
    verify(m)
    expected = {"a": m.token_ids("b"), "b": m.token_ids("b"), "c": m.token_ids("a")}
    assert m.reorder(["a", "b", "c"], ["b", "b", "a"])
    assert {r: m.token_ids(r) for r in expected} == expected
    verify(m)
    for i in range(6):
        for n, request_id in enumerate(("a", "b", "c")):
            step(m, request_id, 1000 * (n + 1) + i)
        verify(m)
    assert m.reorder(["a", "b", "c"], ["c", "a", "b"])  # a rotation: nothing copied
    verify(m)
    # a source that is not reordered keeps its partial page; the taker writes a copy
    assert m.reorder(["c"], ["a"])
    step(m, "a", 1)
    step(m, "c", 2)
    verify(m)


def test_slot_reuse_shows_no_stale_data(manager):
    m = manager
    prefill(m, "a", tokens(0, 12))
    prefill(m, "a2", tokens(50, 12))
    a_slot, a2_slot = m.slot_of("a"), m.slot_of("a2")
    m.free("a2")
    prefill(m, "b", tokens(100, 6))  # cold, in the lowest free slot: maps over a2's pages
    assert m.slot_of("b") == a2_slot
    verify(m)
    m.free("a")
    saved = m.snapshot_stats()["map_calls_saved"]
    prefill(m, "c", tokens(0, 12) + [7])  # hits a's cached prefix in the slot that still maps it
    assert m.slot_of("c") == a_slot
    assert m.snapshot_stats()["map_calls_saved"] == saved + 3 * m.layout.pages_per_block
    verify(m)
    for i in range(4):
        step(m, "b", 10 + i)
        step(m, "c", 20 + i)
        verify(m)
    m.free("b")
    m.free("c")
    prefill(m, "d", tokens(0, 5))  # hits the first page only; the rest is new
    step(m, "d", 3)
    verify(m)
