"""The prefix cache's host tier: a cached block evicted from the device pool is copied to host
memory and a later hit copies it back, bit for bit, without recomputing it.

K/V is written through the slot views with conftest's patterns (a function of the token prefix
and the tenant), so a promoted block that lost a byte, landed in the wrong place, or came from
another tenant reads back wrong. Specs on a tiny manager (demotion, promotion, events, stats, LRU,
tenants, refusals that change nothing, the store shared with swap), and on a GPU the side
stream's ordering. The random walk is in ``test_host_tier_walk.py``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import check_and_close, manager_state, read_kv_matches, tiny_config, write_kv
from vmemkv import (AllBlocksCleared, BlockRemoved, BlockStored, CacheKeys, KVCacheManager,
                    KVEventBuffer, MappingLimitError)
from vmemkv.cache.events import MEDIUM_DEVICE, MEDIUM_HOST
from vmemkv.memory.vmm import CpuBackend

TOKENS_PER_PAGE = 4
FP32 = dict(num_layers=1, num_kv_heads=2, head_dim=128, dtype=torch.float32,
            tokens_per_page=TOKENS_PER_PAGE)
BLOCK_BYTES = 2 * 2 * 128 * 4 * TOKENS_PER_PAGE
TENANTS = {None: 0, "tenant-a": 1, "tenant-b": 2}  # cache salt -> the K/V pattern's salt


@pytest.fixture
def made():
    """``made(num_blocks, host_blocks, swap_blocks=0, max_mappings=None, **config)``: a manager
    with a host tier and an event buffer (``m.events``); invariants checked and closed at the end."""
    managers = []

    def make(num_blocks, host_blocks, swap_blocks=0, max_mappings=None, **overrides):
        config = tiny_config(**{**FP32, "num_blocks": num_blocks, "max_model_len": 32,
                                "host_cache_bytes": host_blocks * BLOCK_BYTES,
                                "swap_space_bytes": swap_blocks * BLOCK_BYTES, **overrides})
        backend = None
        if max_mappings is not None:
            layout = config.make_layout()
            backend = CpuBackend(layout.page_size, num_blocks * layout.pages_per_block,
                                 max_mappings=max_mappings)
        m = KVCacheManager(config, backend=backend, events=KVEventBuffer())
        managers.append(m)
        return m

    yield make
    check_and_close(managers)


def computed(m, request_id, tokens, salt=None) -> int:
    """Admit, write the K/V of every position not hit (a forward pass), commit; returns the hit."""
    cached = m.admit(request_id, tokens, keys=CacheKeys(cache_salt=salt))
    assert cached is not None
    write_kv(m, request_id, cached, m.num_tokens(request_id), TENANTS[salt])
    m.commit(request_id)
    return cached


def tier_state(m) -> tuple:
    entries = [(h, e.row, e.origin) for h, e in m.host_tier._entries.items()]
    return entries, bytes(m.swap.storage[[e[1] for e in entries]].numpy()) if entries else b""


A_PROMPT = list(range(1, 10))  # two full blocks and one token
OTHER = list(range(20, 33))  # three full blocks and one token


def test_an_evicted_block_is_demoted_and_a_hit_promotes_it_bit_exact(made):
    m = made(num_blocks=4, host_blocks=4)
    computed(m, "a", A_PROMPT)
    a_hashes = [m.pool.hash_of[b] for b in m.block_table("a")[:2]]
    m.free("a")
    m.events.drain()
    computed(m, "b", OTHER)  # needs all 4 blocks: a's two cached blocks are evicted
    events = m.events.drain().events
    assert events[0] == BlockRemoved([a_hashes[1], a_hashes[0]], MEDIUM_DEVICE)  # deeper first
    demoted = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_HOST]
    assert [e.block_hashes for e in demoted] == [[a_hashes[1]], [a_hashes[0]]]
    assert demoted[1].token_ids == [1, 2, 3, 4] and demoted[1].parent_block_hash is None
    assert demoted[0].token_ids == [5, 6, 7, 8] and demoted[0].parent_block_hash == a_hashes[0]
    assert set(m.host_tier.hashes()) == set(a_hashes) and not set(a_hashes) & set(m.pool.block_of_hash)
    m.free("b")
    m.events.drain()

    assert m.admit("c", list(A_PROMPT)) == 8  # both blocks come back from the host tier
    assert read_kv_matches(m, "c")  # bytes read through the slot views: what "a" wrote
    stats = m.cache_stats()
    assert (stats.prefix_hit_tokens_host, stats.prefix_hit_tokens_device) == (8, 0)
    # c's three blocks evicted two of b's cached blocks: demoted in turn
    assert (stats.host_demotions, stats.host_promotions) == (2 + 2, 2)
    assert (stats.host_bytes_demoted, stats.host_bytes_promoted) == (4 * BLOCK_BYTES, 2 * BLOCK_BYTES)
    assert [m.pool.hash_of[b] for b in m.block_table("c")[:2]] == a_hashes  # cached on device again
    assert not set(a_hashes) & set(m.host_tier.hashes())
    events = m.events.drain().events
    assert BlockRemoved(a_hashes, MEDIUM_HOST) in events
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_DEVICE]
    assert [h for e in stored for h in e.block_hashes] == a_hashes
    write_kv(m, "c", 8, 9)
    m.commit("c")
    assert read_kv_matches(m, "c")
    # a device hit on the promoted blocks afterwards is a plain device hit
    assert computed(m, "d", A_PROMPT[:8] + [99]) == 8
    assert m.cache_stats().prefix_hit_tokens_device == 8 and read_kv_matches(m, "d")


def test_a_host_hit_never_crosses_tenants(made):
    m = made(num_blocks=4, host_blocks=4)
    computed(m, "a", A_PROMPT, salt="tenant-a")
    m.free("a")
    computed(m, "b", OTHER)  # evicts tenant a's blocks to the host tier
    m.free("b")
    assert len(m.host_tier) == 2
    assert computed(m, "c", A_PROMPT, salt="tenant-b") == 0  # same tokens, another tenant
    m.free("c")
    assert computed(m, "d", A_PROMPT) == 0  # nor unsalted
    m.free("d")
    assert m.cache_stats().prefix_hit_tokens_host == 0
    # every block is cached and some of tenant a's may have left the tier: whatever still hits
    # for tenant a reads back tenant a's bytes
    hit = computed(m, "e", A_PROMPT, salt="tenant-a")
    assert read_kv_matches(m, "e", TENANTS["tenant-a"])
    assert m.cache_stats().prefix_hit_tokens == hit


def test_the_tier_is_lru_bounded_and_host_evictions_send_events(made):
    m = made(num_blocks=4, host_blocks=2)
    computed(m, "a", A_PROMPT)
    m.free("a")
    computed(m, "b", OTHER)  # a's two blocks: the tier is full
    m.free("b")
    a_hashes = m.host_tier.hashes()
    b_hashes = [m.pool.hash_of[b] for b in m.pool.free_queue()]
    m.events.drain()
    computed(m, "c", list(range(40, 53)))  # evicts b's three cached blocks
    events = m.events.drain().events
    host_removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_HOST
                    for h in e.block_hashes]
    # a's two (least recent) make room for two of b's; the third finds the tier full of this
    # eviction's own blocks and is dropped, as without a tier
    assert set(host_removed) == set(a_hashes) and m.cache_stats().host_evictions == 2
    assert m.host_tier.hashes() == b_hashes[:2] and m.cache_stats().host_demotions == 2 + 2


def test_a_refused_admission_leaves_the_tier_and_the_pool_as_they_were(made):
    m = made(num_blocks=6, host_blocks=6, max_num_seqs=2, max_mappings=1000)
    computed(m, "a", A_PROMPT)
    m.free("a")
    computed(m, "b", list(range(20, 41)))  # 5 full blocks and one token: a's blocks are demoted
    assert len(m.host_tier) == 2

    def unchanged(call, *args, raises=None):
        before, tier, events = manager_state(m), tier_state(m), len(m.events)
        if raises is None:
            assert call(*args) is None
        else:
            with pytest.raises(raises):
                call(*args)
        assert (manager_state(m), tier_state(m), len(m.events)) == (before, tier, events)
        m.check()

    # too few blocks: 1 free, the hit needs 2 promoted + 1
    unchanged(m.admit, "c", list(A_PROMPT))
    m.free("b")  # b's 5 full blocks are cached now
    computed(m, "x", [7, 7, 7, 7, 7])
    computed(m, "y", [8, 8, 8, 8, 8])
    # no slot
    unchanged(m.admit, "c", list(A_PROMPT))
    m.free("y")
    # the mapping budget refuses the slot's mappings
    m.backend.max_mappings = m.backend.mappings_in_use
    unchanged(m.admit, "c", list(A_PROMPT), raises=MappingLimitError)
    m.backend.max_mappings = 1000
    assert computed(m, "c", list(A_PROMPT)) == 8 and read_kv_matches(m, "c")


def block_hashes_of(m, tokens) -> list[bytes]:
    """The hashes of ``tokens``' full blocks under no cache keys."""
    return m.hasher.block_hashes(tokens, TOKENS_PER_PAGE, CacheKeys())


def test_a_hit_too_long_for_the_free_blocks_is_shortened_not_refused(made):
    m = made(num_blocks=6, host_blocks=8)
    computed(m, "a", A_PROMPT)
    m.free("a")
    computed(m, "b", list(range(20, 41)))  # all six blocks: a's two are demoted
    m.free("b")
    computed(m, "x", [5] * 16)  # holds four blocks: two stay free
    a_hashes = block_hashes_of(m, A_PROMPT)
    assert set(a_hashes) <= set(m.host_tier.hashes())
    # with a one-token budget, promoting both of a's blocks needs three blocks: one is promoted
    assert m.admit("c", list(A_PROMPT), token_budget=1) == 4
    assert read_kv_matches(m, "c")
    assert m.cache_stats().host_promotions == 1
    assert a_hashes[0] not in m.host_tier and a_hashes[1] in m.host_tier  # still there for later
    write_kv(m, "c", 4, 5)
    m.commit("c")
    assert read_kv_matches(m, "c")


def test_swap_and_the_tier_share_one_host_store(made):
    m = made(num_blocks=6, host_blocks=2, swap_blocks=2)
    assert m.swap.num_blocks == 4  # swap's rows beside the tier's
    computed(m, "a", A_PROMPT)
    m.free("a")
    computed(m, "b", list(range(20, 42)))  # 6 blocks: a's two are demoted; the tier is full
    assert len(m.host_tier) == 2 and m.swap.num_free == 2
    m.free("b")
    computed(m, "s", [5, 5, 5, 5, 5])  # b's partial block and one cached: demoted over a's
    assert len(m.host_tier) == 2 and m.cache_stats().host_evictions == 1
    assert m.preempt("s", "swap") == "swap"  # swap still has its own two rows
    assert m.swap.num_free == 0
    m.check()
    assert m.swap_in("s") and read_kv_matches(m, "s")
    assert m.swap.num_free == 2


def test_reset_clears_both_tiers_with_one_event(made):
    m = made(num_blocks=4, host_blocks=4)
    computed(m, "a", A_PROMPT)
    m.free("a")
    computed(m, "b", OTHER)
    m.free("b")
    m.events.drain()
    assert m.reset_prefix_cache() == 3 + 2  # b's three cached on device, a's two on host
    assert m.events.drain().events == [AllBlocksCleared()]
    assert len(m.host_tier) == 0 and m.swap.num_free == m.swap.num_blocks
    assert computed(m, "c", A_PROMPT) == 0


def test_without_prefix_caching_there_is_no_tier(made):
    m = made(num_blocks=4, host_blocks=4, enable_prefix_caching=False)
    assert m.host_tier.capacity == 0 and m.swap.num_blocks == 0


# ---- on a GPU: asynchronous copies on a side stream -------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_demotion_and_promotion_are_ordered_with_the_compute_stream():
    """No synchronize anywhere: a demoted block is overwritten by its next owner right after the
    asynchronous copy to host is queued, and the promoted block is read right after the copy
    back is queued; the side stream's events must order both."""
    from conftest import cuda_bindings_missing
    from vmemkv import CacheConfig

    if cuda_bindings_missing():
        pytest.skip("needs cuda-python (pip install cuda-bindings)")
    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=64, num_blocks=4, max_num_seqs=2,
                         max_model_len=4096, dtype=torch.bfloat16, device="cuda",
                         host_cache_bytes=256 << 20)
    with KVCacheManager(config) as m:
        assert m.host_tier.capacity >= 2 and m.swap.storage.is_pinned()
        page = m.tokens_per_page

        def fill(request_id, start, end, value):
            slot = m.slot_of(request_id)
            for layer in range(4):
                k, v = m.kv_views(layer)
                k[slot, start:end] = value + layer
                v[slot, start:end] = -value - layer

        shared = list(range(1, 2 * page + 2))  # two full pages and one token
        m.admit("a", shared)
        fill("a", 0, len(shared), 3.0)
        m.commit("a")
        m.free("a")
        other = [7] * (4 * page)  # all four blocks: a's two are demoted, then overwritten
        m.admit("b", other)
        fill("b", 0, len(other), 100.0)
        m.commit("b")
        m.free("b")
        assert m.cache_stats().host_demotions == 2
        assert m.admit("c", list(shared)) == 2 * page
        slot = m.slot_of("c")
        for layer in range(4):
            k, v = m.kv_views(layer)
            assert torch.equal(k[slot, :2 * page], torch.full_like(k[slot, :2 * page], 3.0 + layer))
            assert torch.equal(v[slot, :2 * page], torch.full_like(v[slot, :2 * page], -3.0 - layer))
        del k, v
        m.free("c")
        m.check()
