"""The manager's public queries (what the engine and the integrations ask instead of reading its
parts), the Hugging Face adapter, and where the package puts the integrations."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from vmemkv import CacheConfig, CacheStats, InvalidInputError
from vmemkv.engine.models.hf_support import cache_config_for, kv_shape

# conftest's TINY: 4 tokens per page, 10 blocks, 4 slots, max_model_len 40.


def test_sizes_and_counts_follow_the_pool_and_slots(make_manager):
    m = make_manager()
    assert (m.num_blocks, m.num_free_blocks, m.num_blocks_in_use, m.num_cached_blocks) == (10, 10, 0, 0)
    assert m.block_bytes == m.layout.block_bytes
    assert m.num_slots == 4 and m.free_slots() == [0, 1, 2, 3]
    assert m.admit("a", list(range(9))) == 0  # 3 blocks, one slot
    slot = m.slot_of("a")
    assert (m.num_free_blocks, m.num_blocks_in_use) == (7, 3)
    assert not m.is_slot_free(slot) and slot not in m.free_slots()
    m.commit("a")
    m.free("a")  # its two full pages stay cached
    assert (m.num_free_blocks, m.num_blocks_in_use, m.num_cached_blocks) == (10, 0, 2)
    with pytest.raises(InvalidInputError):
        m.is_slot_free(4)


def test_can_ever_fit_is_the_pool_and_max_model_len():
    from conftest import tiny_config
    from vmemkv import KVCacheManager

    with KVCacheManager(tiny_config(num_blocks=5)) as m:
        assert m.blocks_for_tokens(20) == 5 and m.blocks_for_tokens(21) == 6
        assert m.can_ever_fit(20) and m.why_never_fits(20) is None
        assert not m.can_ever_fit(21)
        assert "pool has 5" in m.why_never_fits(21) and "num_blocks" in m.why_never_fits(21)
    with KVCacheManager(tiny_config()) as m:
        assert m.can_ever_fit(40) and not m.can_ever_fit(41)
        assert "max_model_len 40" in m.why_never_fits(41)


def test_cache_stats_is_a_copy(make_manager):
    m = make_manager()
    m.admit("a", list(range(9)))
    m.commit("a")
    assert m.fork("a", "b")
    stats = m.cache_stats()
    assert isinstance(stats, CacheStats) and stats.forks == 1 and stats.blocks_copied == 1
    stats.forks = 99
    assert m.cache_stats().forks == 1


def test_pool_usage_and_growth_are_answered_per_pool_without_changing_anything(make_manager):
    from conftest import manager_state

    m = make_manager()
    assert m.pool_usage() == [(0, 10, 0, m.block_bytes)]  # in use, free, copied, block bytes
    m.admit("a", list(range(9)))  # 3 blocks of 4 tokens
    m.admit("b", list(range(100, 104)))  # 1 full block
    m.commit("a")
    m.commit("b")
    before = manager_state(m)
    # a: 9 -> 13 tokens takes a fourth block; b: 4 -> 5 a second one; nothing for 0 tokens
    assert m.blocks_to_grow(["a", "b"], [4, 1]) == [2]
    assert m.blocks_to_grow([m.request("a")], [0]) == [0] and m.blocks_needed("a", 4) == 1
    usage = m.pool_usage()
    assert [(p.blocks_in_use, p.blocks_free) for p in usage] == [(4, 6)]
    assert sum(p.blocks_in_use * p.block_bytes for p in usage) == m.kv_bytes_in_use
    for bad in ((["a", "b"], [1]), ("a", [1]), (["a"], [-1])):
        with pytest.raises(InvalidInputError):
            m.blocks_to_grow(*bad)
    assert manager_state(m) == before, "a query changed the cache"
    assert m.fork("a", "c")  # copies a's partial last block
    assert m.pool_usage()[0].blocks_copied == 1


def test_fragmentation_is_the_blocks_bytes_past_the_tokens_they_hold(make_manager):
    m = make_manager()
    assert m.fragmentation([]) == (0, 0)
    m.admit("a", list(range(9)))  # 9 tokens in 3 blocks of 4
    a = m.request("a")
    token_bytes = m.layout.token_bytes
    assert m.fragmentation([a]) == (3 * m.block_bytes - 9 * token_bytes, 9 * token_bytes)


def test_the_views_a_manager_gives_its_readers_only_read(make_manager):
    from vmemkv.engine.core.kv_manager import KVViews

    m = make_manager()
    views = m.views()
    assert isinstance(views, KVViews)
    assert (views.config, views.layout, views.tokens_per_page) == (m.config, m.layout, m.tokens_per_page)
    assert views.layout_groups == m.layout_groups and views.layer_group(0) is m.layer_group(0)
    assert all(got.data_ptr() == want.data_ptr() for got, want in zip(views.kv_views(1), m.kv_views(1)))
    assert not any(hasattr(views, name) for name in ("admit", "allocate", "commit_all", "free", "memories"))


def _fake_model(**text):
    config = types.SimpleNamespace(num_hidden_layers=3, num_attention_heads=8, hidden_size=256,
                                   vocab_size=100, **text)
    return types.SimpleNamespace(config=config, dtype=torch.float16, device=torch.device("cpu"))


def test_hf_adapter_shapes_a_cache_config_for_a_model():
    assert kv_shape(_fake_model().config) == (3, 8, 32)  # no KV heads / head_dim: from the heads
    assert kv_shape(_fake_model(num_key_value_heads=2, head_dim=64).config) == (3, 2, 64)
    model = _fake_model(num_key_value_heads=2)
    cfg = cache_config_for(model, max_num_seqs=2, max_model_len=64, tokens_per_page=16)
    per_slot = cfg.make_layout().logical_pages_for(64)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (3, 2, 32)
    assert (cfg.dtype, cfg.device, cfg.vocab_size) == (torch.float16, "cpu", None)
    assert cfg.num_blocks == 2 * per_slot  # every slot at full length
    spare = cache_config_for(model, 2, 64, spare_blocks_per_slot=1, check_token_ids=True,
                             tokens_per_page=16)
    assert spare.num_blocks == 2 * (per_slot + 1) and spare.vocab_size == 100
    assert cache_config_for(model, 2, 64, num_blocks=7).num_blocks == 7
    assert isinstance(cfg, CacheConfig)


def test_engine_config_derives_its_cache_config():
    from vmemkv.engine.core.config import CACHE_FIELDS, EngineConfig

    model = _fake_model(num_key_value_heads=2)
    model.parameters = lambda: iter([torch.zeros(1, dtype=torch.bfloat16)])
    engine = EngineConfig(max_num_seqs=3, max_model_len=32, swap_space_bytes=0, layout="per_layer")
    cfg = engine.cache_config(model)
    assert all(getattr(cfg, name) == getattr(engine, name)
               for name in CACHE_FIELDS if name != "num_blocks")
    assert cfg.dtype == torch.bfloat16 and cfg.vocab_size == 100
    assert cfg.num_blocks == 3 * cfg.make_layout().logical_pages_for(32)


def test_the_integrations_install_as_packages_of_their_own():
    """``integrations/`` is a folder of adapter packages, installed with vmemkv, not a package."""
    spec = importlib.util.find_spec("vmemkv_transformers")
    assert spec is not None and Path(spec.origin).parent.parent.name == "integrations"
    from importlib.metadata import distribution
    top_level = set(distribution("vmemkv").read_text("top_level.txt").split())
    assert top_level == {"vmemkv", "vmemkv_transformers"}
