"""Saved recurrent states on the prefix cache's host tier: a saved state the device pool evicts is
demoted whole; an admission whose prefix ends where a state waits on the host loads it into its
own state blocks (bit-exact) and saves it on the device again; a refused admission leaves the tier
as it was; KV events tell each tier's whole states."""

from __future__ import annotations

import dataclasses

import pytest

from vmemkv import KVCacheManager, KVEventBuffer
from vmemkv.cache.events import BlockRemoved, BlockStored

from conftest import manager_state
from test_state_cache import SPEC, fill, holds, make_manager
from test_engine_correctness import assert_clean, make_engine, prompts, run
from test_mla_engine import assert_matches_hf
from test_state_engine import STATE_MIXERS_ROUTED
from test_state_events import events_of


def make_host_manager(events=None) -> KVCacheManager:
    config = make_manager().config  # the state tests' model, with a host tier beside its pools
    config = dataclasses.replace(config, host_cache_bytes=4 << 20)
    return KVCacheManager(config, layer_windows=[SPEC, None, SPEC, None], events=events)


def save_and_free(manager: KVCacheManager, request_id: str, tokens: list[int], value: float) -> None:
    """Compute ``tokens`` (40) in chunks of 16: states saved at 16 and 32, the state ``value``."""
    manager.admit(request_id, tokens, num_new_tokens=16)
    fill(manager, request_id, value)
    manager.commit(request_id)
    assert manager.allocate(request_id, 16)
    manager.commit(request_id)
    manager.free(request_id)


def prompt(n: int) -> list[int]:
    return [1000 * n + t for t in range(40)]


def test_the_host_tier_is_shared_by_the_pools_bytes():
    with make_host_manager() as manager:
        attention, state = manager.memories
        assert attention.host_tier.capacity > 0 and state.host_tier.capacity > 0
        device = [m.pool.num_blocks * m.layout.block_bytes for m in manager.memories]
        host = [m.host_tier.capacity * m.layout.block_bytes for m in manager.memories]
        assert abs(host[0] / host[1] - device[0] / device[1]) < 0.2 * device[0] / device[1]


def test_an_evicted_state_waits_on_the_host_and_a_hit_loads_it_exactly():
    buffer, log = KVEventBuffer(), []
    with make_host_manager(buffer) as manager:
        state = manager.groups[1]
        save_and_free(manager, "a", prompt(0), 2.5)
        for n in range(1, 6):  # other prompts' states push a's out of the device pool
            save_and_free(manager, f"x{n}", prompt(n), n)
        assert state.saved_state(state_hash(manager, prompt(0), 2)) is None  # gone from the device
        assert state.saved_at(state_hash(manager, prompt(0), 2), 2).promote  # whole on the host
        events_of(buffer, log)
        log.clear()
        assert manager.admit("b", prompt(0)[:32] + [7] * 8) == 32
        assert holds(manager, "b", 2.5)  # a's state at 32, bit for bit
        stats = manager.cache_stats()
        assert stats.state_host_hits == 1 and stats.prefix_hit_tokens >= 32
        assert state.saved_state(state_hash(manager, prompt(0), 2)) is not None  # saved again
        events_of(buffer, log)
        told = [(type(e).__name__, e.medium) for e in log if e.group_idx == state.index]
        assert ("BlockRemoved", "CPU") in told and ("BlockStored", "GPU") in told
        manager.free("b")
        manager.check()


def state_hash(manager: KVCacheManager, tokens: list[int], blocks: int) -> bytes:
    """The chain hash of ``tokens``' block ``blocks`` - 1 (where a state saved after it is keyed)."""
    return manager.match_prefix(tokens[:blocks * manager.tokens_per_page] + [0])[1][blocks - 1]


def test_a_refused_admission_with_a_host_state_hit_changes_nothing():
    with make_host_manager() as manager:
        save_and_free(manager, "a", prompt(0), 3)
        for n in range(1, 6):
            save_and_free(manager, f"x{n}", prompt(n), n)
        state = manager.groups[1]
        assert state.saved_at(state_hash(manager, prompt(0), 2), 2).promote
        for slot in range(3):  # every slot taken
            manager.admit(f"busy{slot}", [5000 + slot] * 3)
        tiers = lambda: [m.host_tier.hashes() for m in manager.memories]  # noqa: E731
        before, held = manager_state(manager), tiers()
        assert manager.admit("b", prompt(0)[:32] + [7] * 8) is None
        assert manager.last_refusal.reason == "no_free_slot"
        assert manager_state(manager) == before and tiers() == held
        manager.free("busy0")
        assert manager.admit("b", prompt(0)[:32] + [7] * 8) == 32 and holds(manager, "b", 3)
        manager.check()


@STATE_MIXERS_ROUTED
@pytest.mark.parametrize("model", ["tiny-lfm2", "tiny-qwen3-next"])
def test_the_engine_hits_states_on_the_host_and_tokens_still_match(model):
    probe = make_engine(model)
    page = probe.manager.tokens_per_page
    probe.close()
    engine = make_engine(model, state_cache_interval=page, host_cache_bytes=64 << 20, max_num_seqs=2)
    systems = [prompts(1, lengths=(2 * page + 3,), offset=10 + n)[0] for n in range(6)]
    first = [system + [3, 4, 5] for system in systems]
    again = [system + [9, 8] for system in systems]
    outputs = run(engine, first) + run(engine, again)  # the later states pushed the first ones out
    stats = engine.manager.cache_stats()
    assert stats.state_host_hits > 0, stats
    assert all(output.num_cached_tokens == 2 * page for output in outputs[len(first):])
    assert_matches_hf(model, first + again, outputs)
    assert_clean(engine)
