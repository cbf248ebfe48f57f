"""BlockPool: reference counts, the LRU free queue, the content-hash index, lazy eviction."""

from __future__ import annotations

from collections import Counter, OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vmemkv import BlockPool, BlockStateError, OutOfBlocksError


def h(i: int) -> bytes:
    return f"hash-{i}".encode()


def snapshot(pool: BlockPool):
    return (list(pool.ref), list(pool.hash_of), dict(pool.block_of_hash), sorted(pool._clean),
            pool.free_queue(), pool.evictions, pool.counters())


def cache(pool: BlockPool, blocks: list[int], first_hash: int = 0) -> None:
    """Register each (in-use) block under a distinct hash and release them in order."""
    for i, block in enumerate(blocks):
        assert pool.register(block, h(first_hash + i))
    pool.release(blocks)


def test_fresh_pool_hands_out_clean_blocks_lowest_id_first():
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.refcount(0) == 1 and pool.num_in_use == 3 and pool.num_clean == 5
    pool.release([1])
    assert pool.allocate(2) == [1, 3]  # the lowest clean id, whatever order it came back in
    pool.release([0, 2, 3, 1])
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.check()


def test_cached_blocks_are_evicted_in_lru_order_after_clean_ones_with_hashes_dropped():
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    cache(pool, [2, 0, 3], first_hash=10)  # released 2, 0, 3 in that order
    assert pool.free_queue() == [2, 0, 3]
    assert pool.num_clean == 2 and pool.num_cached == 3 and pool.num_free == 5
    assert pool.lookup(h(10)) == 2
    # two clean blocks (4, 5) first, then the least recently used cached blocks 2 and 0
    assert pool.allocate(4) == [4, 5, 2, 0]
    assert pool.evictions == 2
    assert pool.hash_of[2] is None and pool.hash_of[0] is None
    assert pool.lookup(h(10)) is None and pool.lookup(h(11)) is None
    assert pool.lookup(h(12)) == 3  # still cached
    assert pool.free_queue() == [3]
    assert blocks[1] == 1 and pool.refcount(1) == 1
    pool.check()


def test_acquire_revives_a_cached_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(4)
    pool.allocate(4)
    cache(pool, [0, 1, 2, 3])
    assert isinstance(pool._lru, OrderedDict)  # O(1) removal from anywhere in the queue
    pool.acquire([2])
    assert pool.free_queue() == [0, 1, 3]
    assert pool.refcount(2) == 1 and pool.hash_of[2] == h(2)
    pool.acquire([2, 1])  # in use already (no queue change) and cached (leaves the queue)
    assert pool.refcount(2) == 2 and pool.refcount(1) == 1
    assert pool.free_queue() == [0, 3]
    # a revived block released again goes to the tail: most recently used
    pool.release([2, 2, 1])
    assert pool.free_queue() == [0, 3, 2, 1]
    pool.check()


def test_acquire_of_a_clean_block_is_refused_without_side_effects():
    pool = BlockPool(4)
    pool.allocate(2)
    cache(pool, [0])
    before = snapshot(pool)
    with pytest.raises(BlockStateError, match="clean"):
        pool.acquire([0, 3])  # 0 is cached (fine), 3 is clean: nothing changes
    with pytest.raises(BlockStateError, match="outside"):
        pool.acquire([1, 7])
    assert snapshot(pool) == before


def test_release_order_is_lru_order_and_unhashed_blocks_go_back_clean():
    pool = BlockPool(6)
    pool.allocate(6)
    for block in (0, 1, 2, 4):
        pool.register(block, h(block))
    pool.release([4, 3, 1, 5, 0, 2])
    assert pool.free_queue() == [4, 1, 0, 2]
    assert sorted(pool._clean) == [3, 5]
    # shared blocks join the queue only when their last reference goes
    pool.acquire([1, 0])
    pool.acquire([1])
    pool.release([1, 0])
    assert pool.free_queue() == [4, 2, 0]
    pool.release([1])
    assert pool.free_queue() == [4, 2, 0, 1]
    pool.check()


def test_register_duplicates_and_rules():
    pool = BlockPool(4)
    pool.allocate(3)
    assert pool.register(0, h(1)) is True
    assert pool.register(0, h(1)) is True  # the same content again: fine
    assert pool.register(1, h(1)) is False  # another block already holds it
    assert pool.hash_of[1] is None and pool.lookup(h(1)) == 0
    with pytest.raises(BlockStateError, match="other hashed content"):
        pool.register(0, h(2))
    with pytest.raises(BlockStateError, match="free"):
        pool.register(3, h(3))
    pool.release([1])
    assert pool.num_clean == 2  # the duplicate was never hashed, so it came back clean
    pool.check()


def test_reset_cache_forgets_cached_and_in_use_hashes():
    pool = BlockPool(5)
    pool.allocate(4)
    cache(pool, [1, 2])
    pool.register(0, h(9))
    assert pool.reset_cache() == 2
    assert pool.free_queue() == [] and sorted(pool._clean) == [1, 2, 4]
    assert pool.block_of_hash == {} and pool.hash_of == [None] * 5
    assert pool.refcount(0) == 1  # in-use blocks stay in use
    pool.release([0])
    assert pool.num_clean == 4  # its hash is gone, so it returns clean
    pool.check()


def test_double_free_raises_with_nothing_changed():
    pool = BlockPool(4)
    pool.allocate(3)
    pool.register(0, h(0))
    pool.acquire([0])
    before = snapshot(pool)
    with pytest.raises(BlockStateError, match="double free"):
        pool.release([2, 1, 1])  # 2 and the first 1 would be fine; nothing may change
    with pytest.raises(BlockStateError, match="double free"):
        pool.release([0, 0, 0])
    with pytest.raises(BlockStateError, match="double free"):
        pool.release([3])
    with pytest.raises(BlockStateError, match="outside"):
        pool.release([1, -1])
    assert snapshot(pool) == before
    pool.check()


def test_exhausting_the_pool_raises_with_nothing_changed():
    pool = BlockPool(4)
    pool.allocate(2)
    cache(pool, [1])
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError, match="asked for 4 blocks, 3 free"):
        pool.allocate(4)
    assert snapshot(pool) == before
    assert pool.allocate(3) == [2, 3, 1]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert pool.allocate(0) == []
    pool.check()


def test_a_pool_needs_blocks():
    with pytest.raises(BlockStateError):
        BlockPool(0)


def test_check_catches_a_corrupted_state():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.ref[1] = 1  # a clean block that claims a reference
    with pytest.raises(AssertionError):
        pool.check()


# --- a random walk against a reference model ------------------------------------------------------

NUM_BLOCKS = 8


class PoolMachine(RuleBasedStateMachine):
    """The pool against a few lines of obviously-correct bookkeeping."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.ref = [0] * NUM_BLOCKS
        self.hash_of: dict[int, bytes] = {}
        self.lru: list[int] = []  # cached blocks, next victim first
        self.evictions = 0

    # --- the model's view ---
    def clean(self) -> list[int]:
        return sorted(p for p in range(NUM_BLOCKS) if self.ref[p] == 0 and p not in self.hash_of)

    def in_use(self) -> list[int]:
        return [p for p in range(NUM_BLOCKS) if self.ref[p] > 0]

    # --- rules ---
    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n):
        clean = self.clean()
        if n > len(clean) + len(self.lru):
            before = snapshot(self.pool)
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(n)
            assert snapshot(self.pool) == before
            return
        expected = clean[:n]
        while len(expected) < n:
            victim = self.lru.pop(0)
            del self.hash_of[victim]
            self.evictions += 1
            expected.append(victim)
        assert self.pool.allocate(n) == expected
        for block in expected:
            self.ref[block] = 1

    @rule(data=st.data())
    def acquire(self, data):
        candidates = self.in_use() + self.lru + self.clean()
        blocks = data.draw(st.lists(st.sampled_from(candidates), max_size=4))
        if any(self.ref[p] == 0 and p not in self.hash_of for p in blocks):
            before = snapshot(self.pool)
            with pytest.raises(BlockStateError):
                self.pool.acquire(blocks)
            assert snapshot(self.pool) == before
            return
        self.pool.acquire(blocks)
        for block in blocks:
            if self.ref[block] == 0:
                self.lru.remove(block)
            self.ref[block] += 1

    @rule(data=st.data())
    def release(self, data):
        blocks = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=5))
        if not blocks or any(count > self.ref[p] for p, count in Counter(blocks).items()):
            if blocks:  # a release of more references than held
                before = snapshot(self.pool)
                with pytest.raises(BlockStateError):
                    self.pool.release(blocks)
                assert snapshot(self.pool) == before
            return
        self.pool.release(blocks)
        for block in blocks:
            self.ref[block] -= 1
            if self.ref[block] == 0 and block in self.hash_of:
                self.lru.append(block)

    @precondition(lambda self: self.in_use())
    @rule(data=st.data(), content=st.integers(0, 5))
    def register(self, data, content):
        block = data.draw(st.sampled_from(self.in_use()))
        digest = h(content)
        if block in self.hash_of:
            if self.hash_of[block] != digest:
                with pytest.raises(BlockStateError):
                    self.pool.register(block, digest)
            else:
                assert self.pool.register(block, digest) is True
            return
        if digest in self.hash_of.values():
            assert self.pool.register(block, digest) is False
            return
        assert self.pool.register(block, digest) is True
        self.hash_of[block] = digest

    @rule(data=st.data())
    def register_free_block_is_refused(self, data):
        free = self.lru + self.clean()
        if free:
            with pytest.raises(BlockStateError):
                self.pool.register(data.draw(st.sampled_from(free)), h(99))

    @rule()
    def reset_cache(self):
        assert self.pool.reset_cache() == len(self.lru)
        self.lru.clear()
        self.hash_of.clear()

    @rule(content=st.integers(0, 5))
    def lookup(self, content):
        owners = [p for p, d in self.hash_of.items() if d == h(content)]
        assert self.pool.lookup(h(content)) == (owners[0] if owners else None)

    @invariant()
    def agrees_with_the_model(self):
        self.pool.check()
        assert self.pool.ref == self.ref
        assert self.pool.free_queue() == self.lru
        assert sorted(self.pool._clean) == self.clean()
        assert {p: d for p, d in enumerate(self.pool.hash_of) if d is not None} == self.hash_of
        assert self.pool.evictions == self.evictions
        counters = self.pool.counters()
        assert (counters.in_use, counters.cached, counters.clean) == (
            len(self.in_use()), len(self.lru), len(self.clean()))
        assert counters.free == self.pool.num_free == NUM_BLOCKS - counters.in_use


PoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestPoolMachine = PoolMachine.TestCase
