"""KV events of a state group: one ``BlockStored`` per saved state, by the chain hash of the prompt
block it was saved after (the attention group's hash there), and one ``BlockRemoved`` when it
stops being usable; replaying them rebuilds the positions where a saved state can be hit."""

from __future__ import annotations

from vmemkv import KVEventBuffer
from vmemkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch

from test_state_cache import fill, make_manager


def events_of(buffer: KVEventBuffer, log: list) -> list:
    batch = buffer.drain()
    if batch is not None:
        log += decode_batch(encode_batch(batch)).events  # through vLLM's wire form
    return log


def replay(log: list, group_idx: int) -> set[bytes]:
    held: set[bytes] = set()
    for event in log:
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif event.group_idx != group_idx:
            continue
        elif isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
    return held


def test_replaying_the_state_groups_events_rebuilds_its_saved_states():
    buffer, log = KVEventBuffer(), []
    with make_manager(events=buffer) as manager:
        attention, state = manager.groups
        page = manager.tokens_per_page

        def check() -> None:
            events_of(buffer, log)
            stored = {h: e for e in log if isinstance(e, BlockStored) and e.group_idx == 0
                      for h in e.block_hashes}  # every chain hash the attention group cached
            usable = {h for h in stored if state.saved_state(h) is not None}
            assert replay(log, state.index) == usable
            for event in log:
                if isinstance(event, BlockStored) and event.group_idx == state.index:
                    (block_hash,) = event.block_hashes
                    assert len(block_hash) == 32 and event.kv_cache_spec_kind == "mamba"
                    assert event.block_size == page
                    first = stored[block_hash]  # the attention group's event of that block
                    index = first.block_hashes.index(block_hash)
                    assert event.token_ids == first.token_ids[index * page:(index + 1) * page]
                    parent = first.block_hashes[index - 1] if index else first.parent_block_hash
                    assert event.parent_block_hash == parent

        saved = 0
        for prompt in range(5):  # each saves at 16 and 32; the pool cannot keep all ten
            tokens = [100 * prompt + t for t in range(40)]
            manager.admit(f"r{prompt}", tokens, num_new_tokens=16)
            fill(manager, f"r{prompt}", prompt)
            manager.commit(f"r{prompt}")
            assert manager.allocate(f"r{prompt}", 16)
            manager.commit(f"r{prompt}")
            manager.free(f"r{prompt}")
            check()
            saved += 2
        assert manager.cache_stats().states_saved == saved
        stored = [e for e in log if isinstance(e, BlockStored) and e.group_idx == state.index]
        removed = [h for e in log if isinstance(e, BlockRemoved) and e.group_idx == state.index
                   for h in e.block_hashes]
        # one event a state, not a block; the pool kept what it could and evicted the rest
        assert len(stored) == saved and 0 < len(removed) == saved - len(replay(log, state.index))
        assert manager.admit("hit", [400 + t for t in range(36)]) == 32  # a hit moves nothing
        manager.free("hit")
        check()
        manager.reset_prefix_cache()
        check()
        assert replay(log, state.index) == set()
        manager.check()
