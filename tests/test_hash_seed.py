"""``CacheConfig.hash_seed``: None draws a random seed per manager (its hasher), so two managers
in one process name the same tokens with different block hashes; the same seed gives the same
hashes; a hybrid model's two layout groups share one seed even when none is given."""

from __future__ import annotations

import torch

from test_hybrid_groups import close, make_hybrid
from vmemkv import CacheConfig, KVCacheManager

TOKENS = list(range(40))  # two full 16-token blocks and a partial one


def hashes(seed: bytes | None) -> list[bytes]:
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                         tokens_per_page=16, num_blocks=8, max_num_seqs=2, max_model_len=64,
                         hash_seed=seed)
    with KVCacheManager(config) as manager:
        return manager.match_prefix(TOKENS)[1]


def test_no_seed_is_a_random_seed_per_manager():
    first, second = hashes(None), hashes(None)
    assert len(first) == 2 and first != second
    assert not set(first) & set(second)


def test_one_seed_gives_one_hash_per_content_across_managers():
    assert hashes(b"shared") == hashes(b"shared") != hashes(b"other")


def test_a_hybrid_models_groups_share_the_seed_they_draw():
    manager = make_hybrid(hash_seed=None)
    try:
        assert manager.global_group.hasher.seed == manager.local_group.hasher.seed
        assert manager.global_group.match_prefix(TOKENS)[1] == manager.local_group.match_prefix(TOKENS)[1]
    finally:
        close(manager)
