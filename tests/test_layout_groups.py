"""One way to list a manager's layout groups: ``layout_groups`` is ``(manager,)`` for a
``KVCacheManager`` and ``(global_group, local_group)`` for a ``HybridKVCacheManager``; the
per-layer windows a ``VmemkvCache`` reads follow each layer's group, and ``hybrid_manager``
makes each group's backend with the caller's factory (as tensor parallelism records them)."""

from __future__ import annotations

import torch

from vmemkv import CacheConfig, KVCacheManager
from vmemkv.hybrid import HybridKVCacheManager, hybrid_manager
from vmemkv.integrations.transformers_cache import layer_windows
from vmemkv.layer_groups import LayerGroups, group_configs
from vmemkv.manager_state import backend_pages
from vmemkv.vmm import create_backend

WINDOWS = [None, 8, 8, None]  # global, local, local, global


def config(**overrides) -> CacheConfig:
    return CacheConfig(**{**dict(num_layers=4, num_kv_heads=1, head_dim=128, dtype=torch.float32,
                                 num_blocks=16, max_num_seqs=2, max_model_len=64, tokens_per_page=4,
                                 hash_seed=b"groups"), **overrides})


def test_a_single_manager_is_its_one_layout_group():
    for window in (None, 8):
        manager = KVCacheManager(config(sliding_window=window))
        assert manager.layout_groups == (manager,)
        assert layer_windows(manager) == [window] * 4
        manager.close()


def test_a_hybrid_manager_lists_its_global_then_local_group():
    manager = HybridKVCacheManager(config(), WINDOWS, chunk_tokens=16)
    assert manager.layout_groups == (manager.global_group, manager.local_group)
    assert [manager.layer_group(layer) for layer in range(4)] == [
        manager.global_group, manager.local_group, manager.local_group, manager.global_group]
    assert layer_windows(manager) == WINDOWS
    manager.close()


def test_hybrid_manager_makes_each_groups_backend_with_the_factory():
    asked, made = [], []

    def backend(group: CacheConfig):
        layout = group.make_layout()
        asked.append(group)
        made.append(create_backend(group.device, layout.page_size, backend_pages(group, layout)[0]))
        return made[-1]

    manager = hybrid_manager(config(), WINDOWS, chunk_tokens=16, backends=backend)
    expected = group_configs(config(), LayerGroups.from_windows(WINDOWS), 16)
    assert [(c.num_layers, c.sliding_window, c.num_blocks) for c in asked] == [
        (c.num_layers, c.sliding_window, c.num_blocks) for c in expected]
    assert [group.backend for group in manager.layout_groups] == made
    manager.close()
    assert hybrid_manager(config(), None, backends=backend) is None  # no mix of kinds: no groups
    assert len(asked) == 2
