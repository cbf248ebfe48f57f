"""One way to list a manager's layer groups: ``layout_groups`` holds one ``KVCacheGroup`` of
every layer for a model whose layers read alike, and the full-attention group then the local one
for a manager over ``layer_windows``; the per-layer windows a ``VmemkvCache`` reads follow each
layer's group, and ``KVCacheManager.for_layers`` makes each group's backend with the caller's
factory (as tensor parallelism records them)."""

from __future__ import annotations

import torch

from vmemkv import CacheConfig, KVCacheManager
from vmemkv.attention_spec import AttentionSpec
from vmemkv.cache_group import KVCacheGroup, backend_pages
from vmemkv.integrations.transformers_cache import layer_windows
from vmemkv.layer_groups import LayerGroups, group_configs
from vmemkv.vmm import create_backend

WINDOWS = [None, 8, 8, None]  # global, local, local, global


def config(**overrides) -> CacheConfig:
    return CacheConfig(**{**dict(num_layers=4, num_kv_heads=1, head_dim=128, dtype=torch.float32,
                                 num_blocks=16, max_num_seqs=2, max_model_len=64, tokens_per_page=4,
                                 hash_seed=b"groups"), **overrides})


def test_a_single_manager_has_one_layout_group_of_every_layer():
    for window in (None, 8):
        manager = KVCacheManager(config(sliding_window=window))
        (group,) = manager.layout_groups
        assert isinstance(group, KVCacheGroup) and group.index == 0
        assert group.layers == (0, 1, 2, 3) and group.window == window
        assert group.pool is manager.pool and group.slots is manager.slots
        assert [manager.layer_group(layer) for layer in range(4)] == [group] * 4
        assert layer_windows(manager) == [window] * 4
        manager.close()


def test_a_layered_manager_lists_its_global_then_local_group():
    manager = KVCacheManager(config(), layer_windows=WINDOWS, chunk_tokens=16)
    full, local = manager.layout_groups
    assert (full.index, full.layers, full.spec) == (0, (0, 3), AttentionSpec())
    assert (local.index, local.layers, local.window) == (1, (1, 2), 8)
    assert full.pool is manager.pool and local.pool is not manager.pool
    assert [manager.layer_group(layer) for layer in range(4)] == [full, local, local, full]
    assert layer_windows(manager) == WINDOWS
    manager.close()


def test_for_layers_makes_each_groups_backend_with_the_factory():
    asked, made = [], []

    def backend(group: CacheConfig):
        layout = group.make_layout()
        asked.append(group)
        made.append(create_backend(group.device, layout.page_size, backend_pages(group, layout)[0]))
        return made[-1]

    manager = KVCacheManager.for_layers(config(), WINDOWS, chunk_tokens=16, backends=backend)
    expected = group_configs(config(), LayerGroups.from_windows(WINDOWS), 16)
    assert [(c.num_layers, c.sliding_window, c.num_blocks) for c in asked] == [
        (c.num_layers, c.sliding_window, c.num_blocks) for c in expected]
    assert [group.backend for group in manager.layout_groups] == made
    manager.close()
    single = KVCacheManager.for_layers(config(), None, backends=backend)  # no mix of kinds: one group
    assert len(single.layout_groups) == 1
    assert len(asked) == 3 and asked[-1] == config()  # the factory made its backend from the whole config
    assert single.backend is made[-1]
    single.close()
