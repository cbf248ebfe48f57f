"""``CacheConfig.hash_seed``: None draws a random seed per manager (its hasher), so two managers
in one process name the same tokens with different block hashes; the same seed gives the same
hashes; a hybrid model's manager has one hasher, so with no seed given the same tokens get one
chain of hashes within the manager, and every layer group caches them under it (keyed by it in
its pool's prefix index; a later group of a shared pool adds its index, ``group.key``)."""

from __future__ import annotations

import pytest
import torch

from test_hybrid_groups import THREE_KINDS, WINDOWS, close, make_hybrid, run
from vmemkv import CacheConfig, KVCacheManager, KVRequest
from vmemkv.cache.request import RELEASED

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


def cached_hashes(group, req) -> list[tuple[int, bytes]]:
    """``(index, key)`` of each full block ``req`` holds in ``group`` (of TOKENS' two): its key in
    the group's prefix index (``group.key`` of its hash: a later group of a shared pool tags it)."""
    return [(index, group.pool.hash_of[block]) for index, block in enumerate(req.group_block_table(group.index)[:2])
            if block != RELEASED]


@pytest.mark.parametrize("windows", [WINDOWS, THREE_KINDS], ids=["two-kinds", "three-kinds"])
def test_a_hybrid_model_names_one_content_with_one_hash_in_every_group_with_a_drawn_seed(windows):
    manager, other = make_hybrid(windows, hash_seed=None), make_hybrid(windows, hash_seed=None)
    try:
        hashes = manager.match_prefix(TOKENS)[1]
        assert len(hashes) == 2 and manager.match_prefix(list(TOKENS))[1] == hashes  # one hasher
        req = run(manager, "a", TOKENS)
        assert list(req.block_hashes) == hashes  # the request's chain is the manager's
        groups = manager.layout_groups
        assert len(groups) == len({str(spec) for spec in windows})
        for memory in manager.memories:  # one pool's index: each of its groups' keys of the chain
            assert set(memory.pool.block_of_hash) == {key for group in memory.groups for key in group.keys(hashes)}
        for group in groups:  # every group caches the content under the request's one chain
            assert cached_hashes(group, req) == list(enumerate(group.keys(hashes)))[req.group_released_blocks(group.index):]
        manager.free(req)
        again = KVRequest("b", TOKENS + [1])
        assert manager.admit(again) == 32  # every group hits the blocks its next query reads
        for group in groups:
            released = again.group_released_blocks(group.index)  # the chunked group reads from 32
            assert released == (2 if group.spec.kind == "chunked_local" else 0)
            assert cached_hashes(group, again) == list(enumerate(group.keys(hashes)))[released:]
        other_hashes = other.match_prefix(TOKENS)[1]  # another manager draws its own seed
        assert len(other_hashes) == 2 and not set(other_hashes) & set(hashes)
    finally:
        close(manager)
        close(other)
