"""A ``VmemkvCache`` step or crop refused for lack of blocks changes nothing: not the rows, not
the cache's length, not any layer group's pool.

Both used to loop over the rows and stop at the first the manager refused, with the rows before
it already grown (``_reserve``) or truncated (``crop``) and the cache's length unchanged. Here the
pool is pinched so that row 0 fits and row 1 does not (with one layer group, and with a manager
of a local and a global group whose local group is the short one); the whole state is compared
before and after, and
then, with room again, the same step or crop goes through and every row reads back its K/V. The
cache is driven by hand (``observe`` + ``update`` per layer), with K/V that name their row and
position, so what is read back shows where it was written. ``can_truncate``, which the crop asks
first, is checked against truncating the requests one after another (random forks, cached and
uncached blocks, few free blocks).
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import manager_state
from test_hybrid_refusals import state as groups_state
from vmemkv import CacheConfig, KVCacheManager, KVRequest, OutOfBlocksError
from vmemkv.errors import ConfigError, RequestStateError
from vmemkv_transformers import VmemkvCache

HEADS, DIM, P = 1, 128, 4  # float32: 1 KiB a token and layer; 4 KiB pages hold 4 tokens of a layer
WINDOW = 8  # the hybrid's local layer: wider than the crops below reach back


def config(num_layers: int, num_blocks: int, **overrides) -> CacheConfig:
    return CacheConfig(**{**dict(num_layers=num_layers, num_kv_heads=HEADS, head_dim=DIM,
                                 dtype=torch.float32, num_blocks=num_blocks, max_num_seqs=4,
                                 max_model_len=64, tokens_per_page=P, hash_seed=b"refusals"), **overrides})


def single(num_blocks: int = 16, **overrides) -> KVCacheManager:
    manager = KVCacheManager(config(1, num_blocks, **overrides))
    assert manager.tokens_per_page == P
    return manager


def hybrid(local_blocks: int, num_blocks: int = 16) -> KVCacheManager:
    """One global layer and one local layer (window ``WINDOW``), ``local_blocks`` local blocks."""
    manager = KVCacheManager(config(2, num_blocks), layer_windows=[None, WINDOW], chunk_tokens=16,
                             local_blocks=local_blocks)
    assert manager.tokens_per_page == P and manager.layout_groups[1].num_blocks == local_blocks
    return manager


def kv(rows: list[int], start: int, count: int) -> torch.Tensor:
    """K/V ``[rows, heads, count, dim]`` whose values name each row (``rows[i]``) and position."""
    positions = torch.arange(start, start + count, dtype=torch.float32)
    values = torch.tensor(rows, dtype=torch.float32)[:, None] * 1000 + positions
    return values[:, None, :, None].expand(len(rows), HEADS, count, DIM).contiguous()


def forward(cache: VmemkvCache, ids: list[list[int]], rows: list[int]) -> None:
    """One forward of ``ids`` (``[rows, new tokens]``) through every layer of the cache."""
    start, count = cache.get_seq_length(), len(ids[0])
    cache.observe(torch.tensor(ids), None)
    for layer in range(cache.manager.config.num_layers):
        cache.update(kv(rows, start, count), -kv(rows, start, count), layer)


def reads_back(cache: VmemkvCache, rows: list[int]) -> None:
    """Every layer's K/V views hold what ``forward`` wrote for ``rows`` (a local layer's from
    its window start)."""
    length = cache.get_seq_length()
    for layer in range(cache.manager.config.num_layers):
        keys, values = cache.layer_views(layer)
        start = length - keys.shape[2]
        assert start == (0 if not cache.is_layer_sliding(layer) else max(length - WINDOW + 1, 0))
        torch.testing.assert_close(keys, kv(rows, start, length - start))
        torch.testing.assert_close(values, -kv(rows, start, length - start))


def state(cache: VmemkvCache) -> tuple:
    """The cache's rows and length, and the manager's whole state in every layer group
    (``test_hybrid_refusals.state``: each group's pool, slots, mappings and swap, each request's
    allocation in every group)."""
    rows = [(row.kv.request_id, list(row.kv.token_ids), row.kv.num_tokens, row.masked)
            for row in cache._rows]
    return (cache.get_seq_length(), rows, groups_state(cache.manager))


def settle(cache: VmemkvCache) -> None:
    """Commit the last forward (as the next call that changes the rows does), so that the state
    compared is the one a refusal must keep."""
    cache.reorder_cache(torch.arange(len(cache._rows)))


def block_all_but(manager, free: int, group_index: int = 0) -> KVRequest:
    """Admit a request holding every free block of layer group ``group_index`` but ``free``."""
    group = manager.layout_groups[group_index]
    blocker = KVRequest("blocker", list(range(900, 900 + (group.num_free_blocks - free) * P)))
    assert manager.admit(blocker) == 0
    assert group.num_free_blocks == free
    return blocker


def close(cache: VmemkvCache, *requests: KVRequest) -> None:
    for request in requests:
        cache.manager.free(request)
    cache.release()
    cache.manager.check()
    assert all(group.num_blocks_in_use == 0 for group in cache.manager.layout_groups)
    cache.manager.close()


# --- a step's growth: every row or none --------------------------------------------------------------

def test_a_step_refused_at_row_one_grows_no_row():
    cache = VmemkvCache(single())
    forward(cache, [[1, 2, 3, 4], [5, 6, 7, 8]], [0, 1])  # one full block each
    settle(cache)
    blocker = block_all_but(cache.manager, 1)  # the next token needs a block in each row
    before = state(cache)
    with pytest.raises(OutOfBlocksError, match="needs 2 more block"):
        forward(cache, [[9], [10]], [0, 1])
    assert state(cache) == before
    cache.manager.free(blocker)
    forward(cache, [[9], [10]], [0, 1])  # the same step, with room
    assert cache.get_seq_length() == 5 and [row.kv.token_ids for row in cache._rows] == [
        [1, 2, 3, 4, 9], [5, 6, 7, 8, 10]]
    reads_back(cache, [0, 1])
    close(cache)


def test_a_hybrid_step_refused_by_the_local_group_grows_no_row():
    cache = VmemkvCache(hybrid(local_blocks=3))
    forward(cache, [[1, 2, 3, 4], [5, 6, 7, 8]], [0, 1])
    settle(cache)
    manager = cache.manager
    assert manager.layout_groups[1].num_free_blocks == 1 < manager.layout_groups[0].num_free_blocks
    before = state(cache)
    with pytest.raises(OutOfBlocksError, match="the sliding window of 8 layers' group has 1 pages free"):
        forward(cache, [[9], [10]], [0, 1])
    assert state(cache) == before
    # the rows drop to one; its step fits now, in both groups
    cache.batch_select_indices(torch.tensor([1]))
    forward(cache, [[10]], [1])
    reads_back(cache, [1])
    close(cache)


def test_a_step_fed_other_ids_than_row_ones_prompt_grows_no_row():
    cache = VmemkvCache(single())
    # rows admitted with their whole prompts, the first 2 positions reserved (as cache.generate
    # admits a prompt); the forward feeds 3, and row 1 feeds other ids than its prompt's
    cache._admit([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [frozenset()] * 2, num_new_tokens=2)
    before = state(cache)
    with pytest.raises(ConfigError, match="row 1 is fed other token ids"):
        forward(cache, [[1, 2, 3], [6, 7, 99]], [0, 1])
    assert state(cache) == before
    close(cache)


# --- a crop: every row or none -----------------------------------------------------------------------

def forked_rows(manager) -> VmemkvCache:
    """A cache of two rows (forks of one) sharing two full, cached blocks in every group."""
    cache = VmemkvCache(manager)
    forward(cache, [list(range(1, 9))], [0])
    cache.batch_repeat_interleave(2)
    assert cache._rows[0].kv.block_table == cache._rows[1].kv.block_table
    return cache


def test_a_crop_refused_at_row_one_truncates_no_row():
    cache = forked_rows(single())
    blocker = block_all_but(cache.manager, 1)  # row 0's copy fits; then row 1's does not
    before = state(cache)
    with pytest.raises(OutOfBlocksError, match="cropping 2 row"):
        cache.crop(-2)  # to 6 positions: the shared, cached second block is copied in each row
    assert state(cache) == before
    cache.manager.free(blocker)
    cache.crop(-2)
    assert cache.get_seq_length() == 6
    assert [row.kv.token_ids for row in cache._rows] == [list(range(1, 7))] * 2
    reads_back(cache, [0, 0])
    close(cache)


def test_a_hybrid_crop_refused_by_the_local_group_truncates_no_row():
    cache = forked_rows(hybrid(local_blocks=3))  # the rows share 2 local blocks: 1 is free
    manager = cache.manager
    assert manager.layout_groups[1].num_free_blocks == 1 < manager.layout_groups[0].num_free_blocks
    before = state(cache)
    with pytest.raises(OutOfBlocksError, match="the sliding window of 8 layers' group has 1 pages free"):
        cache.crop(-2)
    assert state(cache) == before
    cache.batch_select_indices(torch.tensor([0]))  # one row: its copy fits
    cache.crop(-2)
    reads_back(cache, [0])
    close(cache)


def test_a_crop_counts_the_blocks_earlier_rows_give_back():
    # Two rows with private cached blocks and one free block: row 0's copy takes it, and row 0
    # gives back its old (cached) block and its tail, so row 1's copy finds one. Counting every
    # row's copy against the free blocks up front would refuse a crop that fits.
    cache = VmemkvCache(single(num_blocks=6))
    forward(cache, [list(range(1, 9)), list(range(11, 19))], [0, 1])
    settle(cache)
    blocker = block_all_but(cache.manager, 1)
    cache.crop(-2)
    assert cache.get_seq_length() == 6
    reads_back(cache, [0, 1])
    close(cache, blocker)


def test_a_crop_of_rows_sharing_an_uncached_block_copies_it_once():
    # Without prefix caching the shared block is not cached: once row 0 has copied it away,
    # row 1 holds it alone and writes it in place. One free block is enough.
    cache = forked_rows(single(enable_prefix_caching=False))
    blocker = block_all_but(cache.manager, 1)
    copied = cache.manager.cache_stats().blocks_copied
    cache.crop(-2)
    assert cache.manager.cache_stats().blocks_copied == copied + 1
    reads_back(cache, [0, 0])
    close(cache, blocker)


def test_can_truncate_checks_every_request_and_changes_nothing():
    manager = single()
    manager.admit("a", list(range(8)))
    manager.commit("a")
    manager.fork("a", "b")  # shares both of a's full (cached) blocks
    blocker = block_all_but(manager, 1)
    before = manager_state(manager)
    assert not manager.can_truncate(["a", "b"], 6)  # each copies the shared second block
    assert manager.can_truncate(["a", "a"], 6)  # one request listed twice is truncated once
    assert manager.can_truncate(["a", "b"], 8)  # no partial block: nothing to copy
    with pytest.raises(RequestStateError, match="cannot truncate it to 9"):
        manager.can_truncate(["a", "b"], 9)
    assert manager_state(manager) == before
    for request in ("a", "b", blocker):
        manager.free(request)
    manager.close()


@pytest.mark.parametrize("seed", range(40))
def test_can_truncate_answers_what_truncating_in_order_does(seed):
    # Reference: truncate the requests one after another; can_truncate must have said whether
    # every one of them would go through (forks share blocks, prefix caching hashes full ones).
    rng = random.Random(seed)
    manager = single(num_blocks=16, max_num_seqs=8, enable_prefix_caching=rng.random() < 0.7)
    names = []
    for i in range(rng.randint(1, 3)):  # at most 3 x 3 blocks, and 3 forks' partial blocks
        name = f"r{i}"
        assert manager.admit(name, [rng.randrange(50) for _ in range(rng.randint(5, 12))]) is not None
        manager.commit(name)
        names.append(name)
        if rng.random() < 0.6 and manager.num_free_blocks:
            manager.fork(name, f"{name}-fork")
            names.append(f"{name}-fork")
    blocker = block_all_but(manager, rng.randint(0, min(2, manager.num_free_blocks)))
    rng.shuffle(names)
    length = rng.randint(0, min(manager.num_tokens(name) for name in names))
    predicted = manager.can_truncate(names, length)
    assert predicted == all(manager.truncate(name, length) for name in names)
    manager.check()
    for name in names + [blocker]:
        manager.free(name)
    manager.close()
