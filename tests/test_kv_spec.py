"""Kinds of KV memory as types (``vmemkv/cache/kv_spec.py``): each kind's spec, the group class the
coordinator builds for it (``coordinator.GROUP_CLASSES``), its bytes, and ``AttentionSpec(kind,
size)`` as the spelling users pass in ``layer_windows``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vmemkv import CacheConfig, ConfigError, KVCacheManager
from vmemkv.attention.variants import causal_chunk_mask, causal_window_mask
from vmemkv.cache import coordinator
from vmemkv.cache.attention_spec import CHUNKED, FULL, SLIDING, AttentionSpec
from vmemkv.cache.group import (ChunkedLocalGroup, FullAttentionGroup, MLALatentGroup,
                                SlidingWindowGroup)
from vmemkv.cache.kv_spec import (ChunkedLocalSpec, FullAttentionSpec, MLALatentSpec, SlidingWindowSpec,
                                  spec_of_config)

from conftest import close_manager, tiny_config

SPECS = [FullAttentionSpec(), SlidingWindowSpec(5), ChunkedLocalSpec(6), MLALatentSpec(48, 16)]


def test_attention_spec_makes_the_spec_of_its_kind():
    assert AttentionSpec() == FullAttentionSpec()
    assert AttentionSpec(SLIDING, 4) == SlidingWindowSpec(4)
    assert AttentionSpec(kind=CHUNKED, size=8) == ChunkedLocalSpec(8)
    assert (FullAttentionSpec().kind, SlidingWindowSpec(4).kind, ChunkedLocalSpec(8).kind) == (FULL, SLIDING, CHUNKED)
    assert AttentionSpec.of(chunk_size=8) == ChunkedLocalSpec(8)


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.kind)
def test_first_read_of_a_tensor_of_positions_is_that_of_each_position(spec):
    positions = torch.arange(40)
    assert [int(p) for p in torch.as_tensor(spec.first_read(positions)).expand(40)] == \
        [spec.first_read(p) for p in range(40)]


@pytest.mark.parametrize("size", [1, 3, 8])
def test_the_attention_masks_follow_the_specs_rule(size):
    """A query at ``q`` sees key ``k`` exactly when ``first_read(q) <= k <= q``."""
    for spec, mask in ((SlidingWindowSpec(size), causal_window_mask(5, 7, 2, size, "cpu")),
                       (ChunkedLocalSpec(size), causal_chunk_mask(5, 7, 2, size, "cpu"))):
        expected = [[spec.first_read(q) <= k <= q for k in range(2, 12)] for q in range(5, 12)]
        assert mask.tolist() == expected


def test_the_coordinator_builds_the_group_class_of_each_kind():
    config = tiny_config(num_layers=3, num_blocks=40)
    manager = KVCacheManager(config, layer_windows=[None, 8, AttentionSpec(CHUNKED, 8)], chunk_tokens=8)
    try:
        assert [type(group) for group in manager.layout_groups] == [FullAttentionGroup, SlidingWindowGroup,
                                                                    ChunkedLocalGroup]
    finally:
        close_manager(manager)
    latent = KVCacheManager(tiny_config(num_kv_heads=1, head_dim=64, latent=True))
    try:
        assert type(latent.groups[0]) is MLALatentGroup and latent.spec == MLALatentSpec(64)
    finally:
        close_manager(latent)


@dataclass(frozen=True)
class _UnservedSpec(FullAttentionSpec):
    """A kind no group class is registered for."""


def test_a_kind_without_a_group_class_is_refused_until_it_is_registered(monkeypatch):
    config = tiny_config(num_layers=2)
    with pytest.raises(ConfigError, match="no layer group serves _UnservedSpec.*GROUP_CLASSES"):
        KVCacheManager(config, layer_windows=[_UnservedSpec(), 4], chunk_tokens=8)
    monkeypatch.setitem(coordinator.GROUP_CLASSES, _UnservedSpec, FullAttentionGroup)  # registered once
    manager = KVCacheManager(config, layer_windows=[_UnservedSpec(), 4], chunk_tokens=8)
    try:
        assert manager.layout_groups[0].spec == _UnservedSpec()
    finally:
        close_manager(manager)


def test_each_kind_knows_its_bytes_per_token_and_per_page():
    attention = tiny_config().make_layout()
    assert spec_of_config(tiny_config()).bytes_per_token_per_layer(attention) \
        == attention.kv_bytes_per_token_per_layer == 2 * 2 * 64 * 2
    latent = CacheConfig(**{**vars(tiny_config()), "num_kv_heads": 1, "head_dim": 576, "latent": True,
                            "dtype": torch.bfloat16})
    layout = latent.make_layout()
    deepseek_v3 = MLALatentSpec(kv_lora_rank=512, rope_dim=64)
    assert deepseek_v3.bytes_per_token_per_layer(layout) == layout.kv_bytes_per_token_per_layer == 576 * 2
    assert deepseek_v3.page_bytes(layout) == layout.block_bytes
    with pytest.raises(ConfigError, match="latent layout of rows of 576"):
        KVCacheManager(tiny_config(), layer_windows=[deepseek_v3] * 2, chunk_tokens=8)
    with pytest.raises(ConfigError, match="MLA latent rows of 576 and full attention.*at most one"):
        KVCacheManager(latent, layer_windows=[deepseek_v3, None], chunk_tokens=8)
