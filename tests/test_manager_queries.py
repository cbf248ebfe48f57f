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
