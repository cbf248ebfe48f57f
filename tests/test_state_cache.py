"""The recurrent state kind (``RecurrentStateSpec``, ``RecurrentStateGroup``): a fixed state per
request per layer, held from admission to the end of the request, beside the attention groups."""

from __future__ import annotations

import pytest
import torch

from vmemkv import (NO_MEMORY, CacheConfig, ConfigError, InvalidInputError, KVCacheManager,
                    RecurrentStateSpec, StatePart)
from vmemkv.cache.coordinator import GROUP_CLASSES
from vmemkv.cache.group import RecurrentStateGroup

from conftest import manager_state

SPEC = RecurrentStateSpec((StatePart("conv", (8, 3), torch.bfloat16),
                           StatePart("recurrent", (2, 4, 4), torch.float32)))


def make_manager(num_blocks=16, swap=True, events=None) -> KVCacheManager:
    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8, num_blocks=num_blocks,
                         max_num_seqs=3, max_model_len=64, dtype=torch.float32, device="cpu",
                         tokens_per_page=4, hash_seed=b"state", swap_space_bytes=(1 << 20) if swap else 0,
                         state_cache_interval=16)  # 16 tokens a page here: a state saved at every page
    return KVCacheManager(config, layer_windows=[SPEC, None, SPEC, None], events=events)


@pytest.mark.parametrize("first", [SPEC, None])
def test_a_layer_without_memory_belongs_to_no_group(first):
    """Nemotron-H's MLP-only layers: in no group, their bytes in no block, their views refused."""
    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8, num_blocks=16, max_num_seqs=3,
                         max_model_len=64, dtype=torch.float32, device="cpu", tokens_per_page=4)
    with KVCacheManager.for_layers(config, [first, NO_MEMORY, None, None]) as manager:
        attention = manager.groups[0]
        assert attention.layers == ((2, 3) if first else (0, 2, 3))
        assert [group.layers for group in manager.groups[1:]] == ([(0,)] if first else [])
        assert attention.config.num_layers == len(attention.layers)
        for views in (manager.kv_views, manager.state_views):
            with pytest.raises(InvalidInputError, match="layer 1 holds no memory"):
                views(1)
        assert manager.admit("a", list(range(9))) == 0
        manager.free("a")


def test_a_layer_with_attention_and_a_state_is_in_both_groups():
    """Falcon-H1's layers: a pair (attention entry, state spec) puts the layer in both groups."""
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=16, max_num_seqs=3,
                         max_model_len=64, dtype=torch.float32, device="cpu", tokens_per_page=4)
    with KVCacheManager.for_layers(config, [(None, SPEC), (None, SPEC)]) as manager:
        attention, state = manager.groups
        assert attention.layers == state.layers == (0, 1)
        assert manager.layer_group(1) is attention
        assert tuple(manager.kv_views(1)[0].shape) == (3, 64, 2, 8)
        assert [tuple(v.shape) for v in manager.state_views(1)] == [(3, 8, 3), (3, 2, 4, 4)]
    for bad in [(SPEC, SPEC), (None,), (None, SPEC, SPEC), (NO_MEMORY, SPEC)]:
        with pytest.raises(ConfigError, match="a layer_windows pair"):
            KVCacheManager.for_layers(config, [bad, None])


def fill(manager, request_id, value):
    slot = manager.slot_of(request_id)
    for layer in (0, 2):
        for view in manager.state_views(layer):
            view[slot] = value * (layer + 1)


def holds(manager, request_id, value) -> bool:
    slot = manager.slot_of(request_id)
    return all(bool((view[slot] == value * (layer + 1)).all())
               for layer in (0, 2) for view in manager.state_views(layer))


def test_the_spec_knows_its_bytes_and_the_registry_its_group():
    assert SPEC.parts[0].nbytes == 48 and SPEC.parts[1].nbytes == 128
    assert SPEC.offsets() == [0, 64] and SPEC.bytes_per_layer == 192
    assert GROUP_CLASSES[RecurrentStateSpec] is RecurrentStateGroup
    assert "conv [8, 3]" in SPEC.describe()
    with pytest.raises(ConfigError, match="positive shape"):
        RecurrentStateSpec((StatePart("conv", (0, 3), torch.float32),))


def test_state_layers_form_a_group_after_the_attention_layers():
    with make_manager() as manager:
        attention, state = manager.groups
        assert attention.layers == (1, 3) and state.layers == (0, 2)
        # one page per slot here, and one per saved state (as many as slots)
        assert state.state_blocks == 1 and state.num_blocks == 6
        views = manager.state_views(2)
        assert [tuple(v.shape) for v in views] == [(3, 8, 3), (3, 2, 4, 4)]
        assert [v.dtype for v in views] == [torch.bfloat16, torch.float32]
        with pytest.raises(ConfigError, match="not a recurrent state"):
            manager.state_views(1)
        with pytest.raises(ConfigError):
            manager.kv_views(0)


def test_admission_maps_a_zero_state_and_free_gives_it_back():
    with make_manager() as manager:
        manager.admit("a", list(range(10)))
        assert holds(manager, "a", 0)
        fill(manager, "a", 3)
        manager.commit("a")
        manager.free("a")
        assert manager.groups[1].num_blocks_in_use == 0
        manager.admit("b", list(range(10)))
        assert holds(manager, "b", 0)  # the slot's old state is not seen
        manager.check()


def test_a_refused_admission_changes_nothing_in_any_group():
    with make_manager(num_blocks=3) as manager:
        tokens = list(range(2 * manager.tokens_per_page))  # 2 blocks
        manager.admit("a", tokens)
        state = manager.groups[1]
        before = (manager_state(manager), list(state.pool.ref), state.pool.free_queue())
        assert manager.admit("b", [t + 1 for t in tokens]) is None  # 2 blocks, 1 free
        assert (manager_state(manager), list(state.pool.ref), state.pool.free_queue()) == before
        assert manager.last_refusal.reason == "out_of_blocks"
        manager.check()


def test_fork_copies_the_state_and_swap_brings_it_back_bit_exact():
    with make_manager() as manager:
        manager.admit("a", list(range(10)))
        fill(manager, "a", 1.25)
        manager.commit("a")
        manager.fork("a", "b")
        assert holds(manager, "b", 1.25)
        fill(manager, "b", 7.5)
        assert holds(manager, "a", 1.25)  # a copy, not shared
        assert manager.preempt("b", "swap") == "swap"
        manager.admit("c", list(range(5)))  # takes b's slot and state pages
        fill(manager, "c", -2)
        assert manager.swap_in("b")
        assert holds(manager, "b", 7.5) and holds(manager, "c", -2)
        manager.check()


def test_recompute_drops_the_state_and_hits_only_where_a_state_was_saved():
    with make_manager() as manager:
        manager.admit("a", list(range(40)))
        fill(manager, "a", 4)
        manager.commit("a")  # at 40: no save position
        assert manager.preempt("a", "recompute") == "recompute"
        assert manager.admit("a", list(range(40))) == 0  # nothing reused: the state is gone
        assert holds(manager, "a", 0)
        manager.commit("a")
        assert manager.admit("b", list(range(40))) == 0
        manager.check()


def test_a_hit_restores_the_exact_saved_bytes_into_its_own_state():
    with make_manager() as manager:
        manager.admit("a", list(range(40)), num_new_tokens=32)
        fill(manager, "a", 1.5)
        manager.commit("a")  # at 32: saved (and at no other position)
        state = manager.groups[1]
        assert manager.cache_stats().states_saved == 1 and state.num_cached_blocks == 1
        assert manager.snapshot_stats()["state_bytes_per_saved_state"] == state.block_bytes
        fill(manager, "a", 9)  # a's own state moves on; the saved copy does not
        assert manager.admit("b", list(range(32)) + [7] * 8) == 32  # attention hit, cut to the state
        assert holds(manager, "b", 1.5) and holds(manager, "a", 9)
        fill(manager, "b", -1)  # b's copy is its own
        assert manager.admit("c", list(range(36))) == 32
        assert holds(manager, "c", 1.5)
        assert manager.cache_stats().state_hits == 2 and state.num_cached_blocks == 1
        manager.check()


def test_a_hit_needs_the_attention_blocks_and_a_saved_state_at_one_position():
    with make_manager() as manager:
        manager.admit("a", list(range(40)), num_new_tokens=24)
        manager.commit("a")  # 24: not a save position; blocks of 0..23 cached
        assert manager.admit("b", list(range(30))) == 0  # attention would hit 24, no state
        manager.free("b")
        assert manager.allocate("a", 8)
        manager.commit("a")  # 32: saved
        assert manager.admit("c", list(range(16)) + [5] * 20) == 0  # state at 32, blocks only to 16
        assert manager.admit("d", list(range(34)), max_cached_tokens=20) == 0  # capped before 32
        manager.free("c")
        manager.free("d")
        assert manager.admit("e", list(range(34))) == 32
        manager.check()


def test_prefill_chunks_end_where_states_are_saved():
    with make_manager() as manager:
        assert manager.aligned_chunk_end(0, 40, 100) == 32
        assert manager.aligned_chunk_end(0, 100, 100) == 96  # the last one before the last token
        assert manager.aligned_chunk_end(32, 40, 100) == 40  # none in (32, 40]
        assert manager.aligned_chunk_end(96, 100, 100) == 100
        assert manager.admit("a", list(range(50)), token_budget=40) == 0
        assert manager.num_tokens("a") == 32


def test_no_saved_states_at_interval_zero_and_a_bad_interval_is_refused():
    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=8, num_blocks=16, max_num_seqs=3,
                         max_model_len=64, dtype=torch.float32, device="cpu", tokens_per_page=4,
                         state_cache_interval=0)
    with KVCacheManager(config, layer_windows=[SPEC, None, SPEC, None]) as manager:
        assert manager.groups[1].num_blocks == 3
        manager.admit("a", list(range(40)), num_new_tokens=32)
        manager.commit("a")
        assert manager.admit("b", list(range(40))) == 0 and manager.aligned_chunk_end(0, 40, 100) == 40
    config.state_cache_interval = 24
    with pytest.raises(ConfigError, match="multiple of the 16 tokens per page"):
        KVCacheManager(config, layer_windows=[SPEC, None, SPEC, None])


def test_a_refused_admission_with_a_state_hit_changes_nothing():
    with make_manager(num_blocks=5) as manager:
        manager.admit("a", list(range(40)), num_new_tokens=32)
        manager.commit("a")
        manager.admit("x", [99] * 20)
        state = manager.groups[1]
        before = (manager_state(manager), list(state.pool.ref), state.pool.free_queue())
        assert manager.admit("b", list(range(32)) + [1] * 20) is None  # 2 hits + 2 blocks, 1 free
        assert (manager_state(manager), list(state.pool.ref), state.pool.free_queue()) == before
        manager.check()


def test_reorder_and_truncate_are_refused_changing_nothing():
    with make_manager() as manager:
        manager.admit("a", list(range(10)))
        manager.commit("a")
        before = manager_state(manager)
        with pytest.raises(ConfigError, match="cannot be rewound"):
            manager.truncate("a", 4)
        with pytest.raises(ConfigError, match="cannot be rewound"):
            manager.reorder(["a"], ["a"])
        assert not manager.can_truncate(["a"], 4)
        assert manager_state(manager) == before


def test_a_model_of_state_layers_only_is_refused():
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=4, max_num_seqs=2,
                         max_model_len=16, dtype=torch.float32, device="cpu")
    with pytest.raises(ConfigError, match="at least one attention layer"):
        KVCacheManager(config, layer_windows=[SPEC, SPEC])
