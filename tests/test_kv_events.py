"""KV events: the pool tells its sink every hash it stores and forgets, so a subscriber that only
reads the events knows exactly what the prefix cache can hit.

Specs on a tiny manager (exact events for admission, hits, eviction, reset), the wire encoding
(vLLM's array-like structs through msgpack), and a random walk (admit with shared prefixes and two
tenants' salts, decode, free, preempt by swap and recompute, swap in, reset) that rebuilds the set
of cached hashes from the events alone and compares it with the pool's index after every step;
each stored block's token ids and parent are checked by recomputing its hash from them. The same
walk with a host tier rebuilds each tier's hashes from the events of its medium.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vmemkv import (AllBlocksCleared, BlockRemoved, BlockStored, CacheConfig, CacheKeys,
                    ConfigError, KVCacheManager, KVEventBuffer)
from vmemkv.cache.events import MEDIUM_DEVICE, MEDIUM_HOST, decode_batch, encode_batch

TOKENS_PER_PAGE = 4


def make_manager(events, num_blocks: int = 8, swap_blocks: int = 0,
                 host_blocks: int = 0) -> KVCacheManager:
    block_bytes = 2 * 2 * 128 * 4 * TOKENS_PER_PAGE  # 1 layer x 2 heads x 128 dim x fp32
    config = CacheConfig(num_layers=1, num_kv_heads=2, head_dim=128, dtype=torch.float32,
                         tokens_per_page=TOKENS_PER_PAGE, num_blocks=num_blocks, max_num_seqs=4,
                         max_model_len=32, swap_space_bytes=swap_blocks * block_bytes,
                         host_cache_bytes=host_blocks * block_bytes, hash_seed=b"kv-events")
    return KVCacheManager(config, events=events)


def run_prompt(m: KVCacheManager, request_id: str, tokens: list[int], keys=CacheKeys()) -> int:
    cached = m.admit(request_id, tokens, keys=keys)
    assert cached is not None
    m.commit(request_id)
    return cached


class EventIndex:
    """What a router knows of one tier (``medium``): hash -> (parent, token ids), rebuilt from
    events only; events of another tier are not its business."""

    def __init__(self, medium: str = MEDIUM_DEVICE) -> None:
        self.medium = medium
        self.blocks: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}

    def apply(self, event) -> None:
        if isinstance(event, (BlockStored, BlockRemoved)) and event.medium != self.medium:
            assert event.medium in (MEDIUM_DEVICE, MEDIUM_HOST)
            return
        if isinstance(event, BlockStored):
            assert event.block_size == TOKENS_PER_PAGE
            assert len(event.token_ids) == TOKENS_PER_PAGE * len(event.block_hashes)
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                assert block_hash not in self.blocks, "stored twice without a removal between"
                tokens = event.token_ids[i * TOKENS_PER_PAGE:(i + 1) * TOKENS_PER_PAGE]
                self.blocks[block_hash] = (parent, tuple(tokens))
                parent = block_hash
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                assert block_hash in self.blocks, "removed a hash never stored"
                del self.blocks[block_hash]
        else:
            assert isinstance(event, AllBlocksCleared)
            self.blocks.clear()


# ---- specs ------------------------------------------------------------------------------------

def test_prefill_stores_each_full_block_once_with_parent_and_tokens():
    events, seen = KVEventBuffer(), []
    m = make_manager(lambda event: (seen.append(event), events(event)))
    prompt = list(range(1, 11))  # two full blocks and a partial one
    run_prompt(m, "a", prompt)
    first, second = seen  # one event per block to a plain callback
    assert first == BlockStored([m.pool.hash_of[m.block_table("a")[0]]], None, [1, 2, 3, 4],
                                TOKENS_PER_PAGE, None, MEDIUM_DEVICE)
    assert second == BlockStored([m.pool.hash_of[m.block_table("a")[1]]], first.block_hashes[0],
                                 [5, 6, 7, 8], TOKENS_PER_PAGE, None, MEDIUM_DEVICE)
    # the buffer joins a run of blocks into one event, as vLLM sends a prefill
    assert events.drain().events == [BlockStored(first.block_hashes + second.block_hashes, None,
                                                 list(range(1, 9)), TOKENS_PER_PAGE)]
    # decode fills the third block: stored then, never the partial one before
    for token in (11, 12):
        assert m.allocate("a", 1, [token])
        m.commit("a")
    (third,) = events.drain().events
    assert third.token_ids == [9, 10, 11, 12] and third.parent_block_hash == second.block_hashes[0]


def test_a_hit_or_a_duplicate_block_stores_nothing():
    events = KVEventBuffer()
    m = make_manager(events)
    run_prompt(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    events.drain()
    assert run_prompt(m, "b", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8  # both blocks hit
    assert events.drain() is None
    # "c" computes its own copy of "d"'s first block (admitted before it was cached)
    m.admit("c", [7, 7, 7, 7, 1])
    m.admit("d", [7, 7, 7, 7, 2])
    m.commit("c")
    m.commit("d")  # the same content: the pool keeps "c"'s block, no second event
    assert len(events.drain().events) == 1


def test_eviction_removes_exactly_the_hashes_the_pool_forgets():
    events = KVEventBuffer()
    m = make_manager(events, num_blocks=4)
    run_prompt(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 2 hashed blocks + 1 partial
    m.free("a")
    (stored_event,) = events.drain().events
    stored = stored_event.block_hashes
    # 4 blocks: the two clean ones, then the cached ones, the deeper first (freed first)
    run_prompt(m, "b", list(range(20, 33)))  # 4 blocks, 3 of them full
    batch = events.drain().events
    removed = [e for e in batch if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved([stored[1], stored[0]], MEDIUM_DEVICE)]
    assert not set(stored) & set(m.pool.block_of_hash)
    assert sum(len(e.block_hashes) for e in batch if isinstance(e, BlockStored)) == 3


def test_reset_clears_all_and_a_sink_must_be_callable():
    events = KVEventBuffer()
    m = make_manager(events)
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    m.free("a")
    events.drain()
    assert m.reset_prefix_cache() == 1
    assert events.drain().events == [AllBlocksCleared()]
    with pytest.raises(ConfigError, match="callable"):
        make_manager(events=[])


def test_a_plain_callback_is_a_sink():
    seen = []
    m = make_manager(seen.append)
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    assert [type(e) for e in seen] == [BlockStored]


def test_salted_tenants_store_separate_chains():
    events = KVEventBuffer()
    m = make_manager(events)
    prompt = [1, 2, 3, 4, 5]
    run_prompt(m, "a", prompt, CacheKeys(cache_salt="tenant-a"))
    assert run_prompt(m, "b", prompt, CacheKeys(cache_salt="tenant-b")) == 0
    a, b = events.drain().events
    assert a.token_ids == b.token_ids and a.block_hashes != b.block_hashes


def test_wire_format_is_vllm_array_like_msgpack():
    msgpack = pytest.importorskip("msgpack", reason="the wire format test needs msgpack")
    events = KVEventBuffer()
    m = make_manager(events, num_blocks=2)
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    m.free("a")
    run_prompt(m, "b", [6, 7, 8, 9, 10])  # evicts "a"'s block
    m.free("b")
    m.reset_prefix_cache()
    batch = events.drain(ts=123.5)
    wire = msgpack.unpackb(msgpack.packb(encode_batch(batch)))
    h_a, h_b = batch.events[0].block_hashes[0], batch.events[2].block_hashes[0]
    assert wire == [123.5, [["BlockStored", [h_a], None, [1, 2, 3, 4], 4, None, "GPU"],
                            ["BlockRemoved", [h_a], "GPU"],
                            ["BlockStored", [h_b], None, [6, 7, 8, 9], 4, None, "GPU"],
                            ["AllBlocksCleared"]]]
    assert decode_batch(wire) == batch


# ---- the random walk --------------------------------------------------------------------------

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9]]
SALTS = [None, "tenant-a"]


class EventMachine(RuleBasedStateMachine):
    host_blocks = 0  # no host tier

    def __init__(self):
        super().__init__()
        self.events = KVEventBuffer()
        self.m = make_manager(self.events, num_blocks=10, swap_blocks=4, host_blocks=self.host_blocks)
        self.index = EventIndex()
        self.host_index = EventIndex(MEDIUM_HOST)
        self.keys: dict[str, CacheKeys] = {}  # request -> its keys
        self.swapped: set[str] = set()
        self.recomputed: dict[str, list[int]] = {}  # preempted by recompute: its tokens
        self.next_id = 0

    def running(self) -> list[str]:
        return sorted(r for r in self.keys if r not in self.swapped and r not in self.recomputed)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), min_size=1, max_size=6),
          salt=st.sampled_from(SALTS))
    def admit(self, prefix, suffix, salt):
        self.next_id += 1
        request_id, keys = f"r{self.next_id}", CacheKeys(cache_salt=salt)
        if self.m.admit(request_id, prefix + suffix, keys=keys) is not None:
            self.m.commit(request_id)
            self.keys[request_id] = keys

    @precondition(lambda self: self.recomputed)
    @rule(data=st.data())
    def readmit(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.recomputed)))
        if self.m.admit(request_id, self.recomputed[request_id],
                        keys=self.keys[request_id]) is not None:
            self.m.commit(request_id)
            del self.recomputed[request_id]

    @precondition(lambda self: self.running())
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        request_id = data.draw(st.sampled_from(self.running()))
        if self.m.num_tokens(request_id) < 32 and self.m.allocate(request_id, 1, [token]):
            self.m.commit(request_id)

    @precondition(lambda self: self.keys.keys() - self.recomputed.keys())
    @rule(data=st.data())
    def free(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.keys.keys() - self.recomputed.keys())))
        self.m.free(request_id)
        del self.keys[request_id]
        self.swapped.discard(request_id)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), mode=st.sampled_from(["swap", "recompute"]))
    def preempt(self, data, mode):
        request_id = data.draw(st.sampled_from(self.running()))
        tokens = self.m.token_ids(request_id)
        try:
            done = self.m.preempt(request_id, mode)
        except Exception as exc:  # no swap space: refused, nothing changed
            assert type(exc).__name__ == "OutOfSwapSpaceError", exc
            return
        if done == "swap":
            self.swapped.add(request_id)
        else:
            self.recomputed[request_id] = tokens

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.m.swap_in(request_id):
            self.swapped.discard(request_id)

    @precondition(lambda self: self.m.num_blocks_in_use == 0)
    @rule()
    def reset(self):
        self.m.reset_prefix_cache()

    @invariant()
    def events_rebuild_the_index(self):
        batch = self.events.drain()
        for event in batch.events if batch else ():
            self.index.apply(event)
            self.host_index.apply(event)
            if isinstance(event, BlockStored):
                self.check_hash(event)
        assert set(self.index.blocks) == set(self.m.pool.block_of_hash)
        assert set(self.host_index.blocks) == set(self.m.host_tier.hashes())
        self.m.check()

    def check_hash(self, event: BlockStored) -> None:
        """The event's tokens and parent give back its run of hashes under a tenant's keys."""
        hasher = self.m.hasher
        roots = [event.parent_block_hash] if event.parent_block_hash else [
            hasher.root(CacheKeys(cache_salt=salt)) for salt in SALTS]
        assert any(hasher.block_hashes(event.token_ids, TOKENS_PER_PAGE, CacheKeys(), parent=root)
                   == event.block_hashes for root in roots)

    def teardown(self):
        self.m.close()


test_events_rebuild_the_cache_index = pytest.mark.filterwarnings("ignore")(EventMachine.TestCase)
EventMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])


class HostTierEventMachine(EventMachine):
    """The same walk with a host tier: evicted blocks move to it and hits bring them back."""
    host_blocks = 6


test_events_rebuild_each_tier_with_a_host_tier = pytest.mark.filterwarnings("ignore")(
    HostTierEventMachine.TestCase)
HostTierEventMachine.TestCase.settings = EventMachine.TestCase.settings


def test_a_decoder_written_for_vllm_reads_the_wire_format():
    """msgspec structs of vLLM's shape (array-like, tagged by class name, fields in vLLM's
    order) decode what the publisher sends."""
    msgspec = pytest.importorskip("msgspec", reason="this check decodes with msgspec, as vLLM does")
    msgpack = pytest.importorskip("msgpack", reason="the publisher encodes with msgpack")

    # defstruct, not class syntax: this module's annotations are strings (PEP 563)
    shape = {"array_like": True, "omit_defaults": True}
    hash_type = bytes | int
    stored_type = msgspec.defstruct("BlockStored", [
        ("block_hashes", list[hash_type]), ("parent_block_hash", hash_type | None),
        ("token_ids", list[int]), ("block_size", int), ("lora_id", int | None),
        ("medium", str | None)], tag=True, **shape)
    removed_type = msgspec.defstruct("BlockRemoved", [
        ("block_hashes", list[hash_type]), ("medium", str | None)], tag=True, **shape)
    cleared_type = msgspec.defstruct("AllBlocksCleared", [], tag=True, **shape)
    batch_type = msgspec.defstruct("KVEventBatch", [
        ("ts", float), ("events", list[stored_type | removed_type | cleared_type]),
        ("data_parallel_rank", int | None, None)], **shape)

    events = KVEventBuffer()
    m = make_manager(events, num_blocks=3)
    run_prompt(m, "a", list(range(1, 10)))
    m.free("a")
    run_prompt(m, "b", [5, 5, 5, 5, 5])
    m.free("b")
    m.reset_prefix_cache()
    batch = events.drain(ts=7.0)
    decoded = msgspec.msgpack.decode(msgpack.packb(encode_batch(batch)), type=batch_type)
    stored, removed, stored_b, cleared = decoded.events
    assert (decoded.ts, decoded.data_parallel_rank) == (7.0, None)
    assert stored.block_hashes == batch.events[0].block_hashes and stored.parent_block_hash is None
    assert (stored.token_ids, stored.block_size, stored.medium) == (list(range(1, 9)), 4, "GPU")
    assert removed.block_hashes == batch.events[1].block_hashes and removed.medium == "GPU"
    assert stored_b.token_ids == [5, 5, 5, 5] and isinstance(cleared, cleared_type)
