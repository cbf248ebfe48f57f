"""One way to list a manager's layer groups: ``layout_groups`` holds one ``KVCacheGroup`` of
every layer for a model whose layers read alike, and the full-attention group then the local one
for a manager over ``layer_windows``; the per-layer windows a ``VmemkvCache`` reads follow each
layer's group; groups whose blocks have the same bytes draw from one memory (pool and backend)
unless ``local_blocks`` fixes each group's share, and ``KVCacheManager.for_layers`` makes each
memory's backend with the caller's factory, from the memory's config (as tensor parallelism
records them)."""

from __future__ import annotations

import dataclasses

import torch

from vmemkv import CacheConfig, KVCacheManager
from vmemkv.cache.attention_spec import AttentionSpec
from vmemkv.cache.group import KVCacheGroup
from vmemkv.cache.memory import backend_pages
from vmemkv_transformers import layer_windows
from vmemkv.cache.layer_groups import LayerGroups, group_configs
from vmemkv.memory.vmm import create_backend

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
    # two layers each, of one shape: one memory (pool and backend) holding both groups' blocks;
    # each group keeps its own virtual tensors
    assert manager.memories == (full.memory,) and local.memory is full.memory
    assert full.memory.groups == [full, local]
    assert full.pool is manager.pool and local.pool is manager.pool and local.backend is full.backend
    assert local.slots is not full.slots
    split = group_configs(config(), LayerGroups.from_windows(WINDOWS), 16)
    assert manager.pool.num_blocks == sum(c.num_blocks for c in split)
    assert [manager.layer_group(layer) for layer in range(4)] == [full, local, local, full]
    assert layer_windows(manager) == WINDOWS
    manager.close()
    # a fixed local share (the static split): each group its own memory of its own blocks
    manager = KVCacheManager(config(), layer_windows=WINDOWS, chunk_tokens=16, local_blocks=6)
    full, local = manager.layout_groups
    assert manager.memories == (full.memory, local.memory) and local.memory is not full.memory
    assert full.pool is manager.pool and local.pool is not manager.pool and local.backend is not full.backend
    assert (full.num_blocks, local.num_blocks) == (sum(c.num_blocks for c in split) - 6, 6)
    assert [manager.layer_group(layer) for layer in range(4)] == [full, local, local, full]
    assert layer_windows(manager) == WINDOWS
    manager.close()


def memory_config(configs: list[CacheConfig]) -> CacheConfig:
    """The config of one memory holding the blocks of the groups of ``configs`` (of one layout):
    the first's, with the blocks, swap and host bytes of all of them and the local group's window."""
    return dataclasses.replace(configs[0], num_blocks=sum(c.num_blocks for c in configs),
                               swap_space_bytes=sum(c.swap_space_bytes for c in configs),
                               host_cache_bytes=sum(c.host_cache_bytes for c in configs),
                               sliding_window=next(c.sliding_window for c in configs if c.sliding_window))


def test_for_layers_makes_each_groups_backend_with_the_factory():
    asked, made = [], []

    def backend(memory: CacheConfig):
        layout = memory.make_layout()
        asked.append(memory)
        made.append(create_backend(memory.device, layout.page_size, backend_pages(memory, layout)[0]))
        return made[-1]

    manager = KVCacheManager.for_layers(config(), WINDOWS, chunk_tokens=16, backends=backend)
    expected = group_configs(config(), LayerGroups.from_windows(WINDOWS), 16)
    # the two groups share one memory: the factory is asked once, for all of their blocks
    assert asked == [memory_config(expected)] and asked[0].num_blocks == 32
    assert manager.memories[0].config == asked[0]
    assert [group.backend for group in manager.layout_groups] == [made[0], made[0]]
    manager.close()
    # separate memories (a fixed local share): one backend each, from each group's config
    manager = KVCacheManager(config(), layer_windows=WINDOWS, chunk_tokens=16, local_blocks=6,
                             backends=backend)
    expected = group_configs(config(), LayerGroups.from_windows(WINDOWS), 16, local_blocks=6)
    assert asked[1:] == expected
    assert [group.backend for group in manager.layout_groups] == made[1:]
    manager.close()
    single = KVCacheManager.for_layers(config(), None, backends=backend)  # no mix of kinds: one group
    assert len(single.layout_groups) == 1
    assert len(asked) == 4 and asked[-1] == config()  # the factory made its backend from the whole config
    assert single.backend is made[-1]
    single.close()
