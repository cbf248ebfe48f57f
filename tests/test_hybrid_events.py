"""KV events of a hybrid model: each layer group's pool tells the manager's sink its own blocks,
tagged as vLLM's hybrid KV cache tags them (``group_idx``, ``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``), so a subscriber rebuilds each group's cached hashes from the
events alone. A request has one hash chain (one hasher), so the same content has the same hash
in every group. Specs, the wire encoding (vLLM's field order, read by a msgspec decoder of vLLM's
newer shape), a random walk over two and three kinds of layer that compares the rebuilt indexes
with every group's pool after every step, and the engine's published batches.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_hybrid_groups import BACKENDS, P, THREE_KINDS, W, WINDOWS, close, decode, make_hybrid, run
from vmemkv import BlockRemoved, BlockStored, KVEventBuffer, KVRequest
from vmemkv.cache.events import AllBlocksCleared, decode_batch, encode_batch

GLOBAL, LOCAL, CHUNKED_LOCAL = 0, 1, 2  # group_idx of each group (THREE_KINDS has the third)
THREE_KINDS_SPECS = {GLOBAL: ("full_attention", None), LOCAL: ("sliding_window", W),
                     CHUNKED_LOCAL: ("chunked_local_attention", None)}


class GroupIndex:
    """What a router knows of each group's device cache: group -> hash -> tokens, from events
    alone (``block_size`` tokens a block; the local layers' window ``window``; ``specs``: each
    group's kind and window, by default a global and a sliding-window group)."""

    def __init__(self, block_size: int = P, window: int = W, specs: dict | None = None) -> None:
        self.block_size = block_size
        self.spec = specs or {GLOBAL: ("full_attention", None), LOCAL: ("sliding_window", window)}
        self.blocks: dict[int, dict[bytes, tuple[int, ...]]] = {group: {} for group in self.spec}

    def apply(self, event) -> None:
        size = self.block_size
        if isinstance(event, BlockStored):
            assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == self.spec[event.group_idx]
            assert event.block_size == size and len(event.token_ids) == size * len(event.block_hashes)
            for i, block_hash in enumerate(event.block_hashes):
                assert block_hash not in self.blocks[event.group_idx], "stored twice"
                tokens = tuple(event.token_ids[i * size:(i + 1) * size])
                # one hash chain per request: a hash names the same tokens in every group
                assert all(blocks.get(block_hash, tokens) == tokens for blocks in self.blocks.values())
                self.blocks[event.group_idx][block_hash] = tokens
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                del self.blocks[event.group_idx][block_hash]
        else:
            assert isinstance(event, AllBlocksCleared)
            for blocks in self.blocks.values():
                blocks.clear()

    def replay(self, events: KVEventBuffer) -> None:
        batch = events.drain()
        for event in batch.events if batch else ():
            self.apply(event)

    def matches(self, manager) -> bool:
        """Whether the index holds each group's cached hashes: every pool's prefix index (shared
        by the groups of one memory, each group's blocks under its own keys, ``group.keys``) is
        its groups' hashes here, keyed so, and nothing else."""
        groups = manager.layout_groups
        return (sorted(self.blocks) == [group.index for group in groups]
                and sorted(group.index for memory in manager.memories for group in memory.groups)
                == [group.index for group in groups]
                and all(set(memory.pool.block_of_hash) == {key for group in memory.groups
                                                           for key in group.keys(list(self.blocks[group.index]))}
                        for memory in manager.memories))


@pytest.fixture
def events():
    return KVEventBuffer()


@pytest.mark.parametrize("windows", [WINDOWS, THREE_KINDS], ids=["two-kinds", "three-kinds"])
def test_each_group_stores_its_blocks_under_one_hash_per_content(events, windows):
    manager = make_hybrid(windows, events=events, hash_seed=None)  # one random seed, one hasher
    try:
        a = run(manager, "a", list(range(2 * P + 3)))
        stored = events.drain().events
        groups = range(len(manager.layout_groups))
        assert [(e.group_idx, len(e.block_hashes)) for e in stored] == [(g, 2) for g in groups]
        for event in stored:  # the same content, the same hash: the request's one chain
            assert event.block_hashes == stored[0].block_hashes == list(a.block_hashes)
            assert event.token_ids == list(range(2 * P)) and event.parent_block_hash is None
        # each pool's prefix index holds each of its groups' blocks once, under the group's keys
        # of that chain (groups of one block layout share a pool: three kinds' local groups)
        memories = [[group.index for group in memory.groups] for memory in manager.memories]
        assert memories == ([[GLOBAL], [LOCAL, CHUNKED_LOCAL]] if windows is THREE_KINDS else [[GLOBAL], [LOCAL]])
        for memory in manager.memories:
            assert list(memory.pool.block_of_hash) == [key for group in memory.groups
                                                       for key in group.keys(list(a.block_hashes))]
        manager.free(a)
    finally:
        close(manager)


def test_evictions_name_their_group(events):
    manager = make_hybrid(events=events, local_blocks=4)  # the local group evicts first
    index = GroupIndex()
    try:
        manager.free(run(manager, "a", list(range(3 * P))))
        index.replay(events)
        manager.free(run(manager, "b", list(range(500, 500 + 3 * P))))
        batch = events.drain().events
        removed = [e for e in batch if isinstance(e, BlockRemoved)]
        assert removed and {e.group_idx for e in removed} == {LOCAL}
        for event in batch:
            index.apply(event)
        assert index.matches(manager)
    finally:
        close(manager)


def test_grouped_events_encode_in_vllms_field_order_and_decode_back():
    stored = BlockStored([b"h1"], None, [1, 2], 2, None, "GPU", LOCAL, "sliding_window", 20)
    removed = BlockRemoved([b"h1"], "GPU", GLOBAL)
    batch = decode_batch(encode_batch(type("B", (), {"ts": 1.0, "events": [stored, removed]})))
    assert batch.events == [stored, removed]
    fields = encode_batch(batch)[1]
    assert fields[0] == ["BlockStored", [b"h1"], None, [1, 2], 2, None, "GPU", None, None, LOCAL,
                         "sliding_window", 20]
    assert fields[1] == ["BlockRemoved", [b"h1"], "GPU", GLOBAL]


def test_a_decoder_of_vllms_grouped_shape_reads_them(events):
    """msgspec structs of vLLM's newer shape (``lora_name``, ``extra_keys``, ``group_idx``, the
    spec kind and window after ``medium``; ``group_idx`` after ``BlockRemoved.medium``) decode a
    hybrid model's events."""
    msgspec = pytest.importorskip("msgspec", reason="this check decodes with msgspec, as vLLM does")
    msgpack = pytest.importorskip("msgpack", reason="the publisher encodes with msgpack")
    shape = {"array_like": True, "omit_defaults": True, "tag": True}
    hash_type = bytes | int
    stored_type = msgspec.defstruct("BlockStored", [
        ("block_hashes", list[hash_type]), ("parent_block_hash", hash_type | None),
        ("token_ids", list[int]), ("block_size", int), ("lora_id", int | None),
        ("medium", str | None), ("lora_name", str | None), ("extra_keys", list | None, None),
        ("group_idx", int | None, None), ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None)], **shape)
    removed_type = msgspec.defstruct("BlockRemoved", [
        ("block_hashes", list[hash_type]), ("medium", str | None), ("group_idx", int | None, None)], **shape)
    cleared_type = msgspec.defstruct("AllBlocksCleared", [], **shape)
    batch_type = msgspec.defstruct("KVEventBatch", [
        ("ts", float), ("events", list[stored_type | removed_type | cleared_type])],
        array_like=True, omit_defaults=True)

    manager = make_hybrid(events=events, local_blocks=4)
    try:
        manager.free(run(manager, "a", list(range(3 * P))))
        manager.free(run(manager, "b", list(range(500, 500 + 3 * P))))
        batch = events.drain(ts=2.0)
        decoded = msgspec.msgpack.decode(msgpack.packb(encode_batch(batch)), type=batch_type)
        assert len(decoded.events) == len(batch.events)
        for ours, theirs in zip(batch.events, decoded.events):
            assert (theirs.block_hashes, theirs.medium, theirs.group_idx) == (
                ours.block_hashes, ours.medium, ours.group_idx)
            if isinstance(ours, BlockStored):
                assert (theirs.token_ids, theirs.kv_cache_spec_kind, theirs.kv_cache_spec_sliding_window) == (
                    ours.token_ids, *GroupIndex().spec[ours.group_idx])
        assert {type(e).__name__ for e in decoded.events} == {"BlockStored", "BlockRemoved"}
    finally:
        close(manager)


# --- a random walk ------------------------------------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["admit", "admit", "decode", "free", "swap", "recompute",
                                          "swap_in", "readmit", "fork"]),
                         st.integers(0, 5), st.integers(1, 60)), min_size=10, max_size=30)


@pytest.mark.parametrize("local_blocks", [6, None], ids=["fixed-split", "demand-split"])
@pytest.mark.parametrize("windows", [WINDOWS, THREE_KINDS], ids=["two-kinds", "three-kinds"])
@pytest.mark.parametrize("kv_backend", BACKENDS)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(ops=OPS)
def test_events_rebuild_every_groups_cached_hashes(kv_backend, windows, local_blocks, ops):
    """``local_blocks`` fixed: every group its own small pool; None: three kinds' local groups
    (one layer each) share one pool, whose events name each group's plain hashes."""
    events = KVEventBuffer()
    index = GroupIndex(specs=THREE_KINDS_SPECS if windows is THREE_KINDS else None)
    manager = make_hybrid(windows, num_blocks=8, kv_backend=kv_backend, events=events, local_blocks=local_blocks)
    shared = local_blocks is None and windows is THREE_KINDS
    assert len(manager.memories) == (2 if shared else len(manager.layout_groups))
    running, swapped, preempted = {}, {}, {}
    try:
        for number, (op, pick, size) in enumerate(ops):
            names = sorted(running)
            name = names[pick % len(names)] if names else None
            if op == "admit":
                req = KVRequest(f"r{number}", [(pick * 13 + i) % 40 for i in range(size)])  # shared prefixes
                if manager.admit(req) is not None:
                    manager.commit(req)
                    running[req.request_id] = req
            elif op == "decode" and name:
                for step in range(size):
                    if not decode(manager, running[name], step % 5):
                        break
            elif op == "free" and name:
                manager.free(running.pop(name))
            elif op in ("swap", "recompute") and name:
                if op == "swap" and not manager.estimate_preemption(running[name]).swap_fits:
                    continue
                manager.preempt(running[name], op)
                (swapped if op == "swap" else preempted)[name] = running.pop(name)
            elif op == "swap_in" and swapped:
                key = sorted(swapped)[pick % len(swapped)]
                if manager.swap_in(swapped[key]):
                    running[key] = swapped.pop(key)
            elif op == "readmit" and preempted:
                key = sorted(preempted)[pick % len(preempted)]
                if manager.admit(preempted[key]) is not None:
                    manager.commit(preempted[key])
                    running[key] = preempted.pop(key)
            elif op == "fork" and name:
                child = manager.fork(running[name], KVRequest(f"c{number}", []))
                if child is not None:
                    running[child.request_id] = child
            index.replay(events)
            assert index.matches(manager)
            manager.check()
        for req in list(running.values()) + list(swapped.values()):
            manager.free(req)
        for req in preempted.values():
            manager.discard(req)
        index.replay(events)
        assert index.matches(manager)
    finally:
        close(manager)


# --- the engine ----------------------------------------------------------------------------------------

def test_the_engine_publishes_every_groups_events(monkeypatch):
    pytest.importorskip("zmq", reason="the engine's KV event publisher needs pyzmq")
    pytest.importorskip("msgpack", reason="the engine's KV event publisher needs msgpack")
    from test_hybrid_engine import generate, hf_tokens, hybrid_engine
    from test_sliding_window_models import WINDOW, prompts

    engine = hybrid_engine("gemma2", monkeypatch, kv_events_endpoint="tcp://127.0.0.1:*", num_blocks=16)
    groups = engine.manager.layout_groups  # one local, one global layer: one shared pool
    assert engine.manager.memories == (groups[0].memory,) and groups[1].memory is groups[0].memory
    published = []
    monkeypatch.setattr(engine.kv_event_publisher, "publish", published.append)
    system = prompts((33,), offset=5)[0]
    batch = [system + tail for tail in prompts((2, 5, 3, 9, 12))] + prompts((40, 45), offset=9)
    final = generate(engine, batch)
    for i, prompt in enumerate(batch):
        assert final[str(i)].outputs[0].token_ids == hf_tokens("gemma2", prompt)
    events = [event for wire in published for event in decode_batch(encode_batch(wire)).events]
    assert {e.group_idx for e in events if isinstance(e, BlockStored)} == {GLOBAL, LOCAL}
    assert any(isinstance(e, BlockRemoved) for e in events)  # a small pool: blocks were evicted
    index = GroupIndex(engine.manager.tokens_per_page, WINDOW)
    for event in events:
        index.apply(event)
    assert index.matches(engine.manager)
    engine.manager.check()
    engine.close()
