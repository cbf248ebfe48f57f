"""Models mixing local (sliding-window, chunked) and global layers keep each kind in its own layer
group of one ``KVCacheManager`` (``layer_windows``): a local group's blocks behind the window go
back to its pool while the global group grows. The grouping, the routing of views, the bound on
local blocks, prefix hits that need the global prefix and the local window, refusals that change
nothing, groups of one block layout drawing from one pool (by demand, and never hitting each
other's cached blocks), a random walk with K/V read back bit-exact over two and three kinds of
layer, on both KV backends (slots and block tables; the engine's side is in
``test_hybrid_engine.py``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vmemkv import CacheConfig, ConfigError, KVCacheManager, KVRequest
from vmemkv.cache.attention_spec import CHUNKED, AttentionSpec
from vmemkv.engine.models.hf_support import hybrid_layer_windows
from vmemkv.cache.layer_groups import LayerGroups
from vmemkv.cache.request import RELEASED

from conftest import close_manager, group_view, groups_read_back, read_kv_matches, write_groups, write_kv
from test_sliding_window_models import build, prompts, reference

P = 16  # tokens per page of each group below (one 4 KiB page of 256 B rows)
W = 20  # the local layers' window
WINDOWS = [W, W, W, None]  # three local layers, one global (as Gemma-3 interleaves them)
C = 32  # attention chunks of a third kind of layer
THREE_KINDS = [W, AttentionSpec(CHUNKED, C), None, None]  # sliding, chunked local, two global
ONE_TO_ONE = [W, None]  # one local layer, one global (as Gemma-2 interleaves them): one block layout


def make_hybrid(windows=WINDOWS, **overrides) -> KVCacheManager:
    options = dict(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, num_blocks=40,
                   max_num_seqs=3, max_model_len=256, swap_space_bytes=64 << 10, hash_seed=b"hybrid")
    local_blocks, events = overrides.pop("local_blocks", None), overrides.pop("events", None)
    config = CacheConfig(**{**options, **overrides})
    return KVCacheManager(config, layer_windows=windows, chunk_tokens=32, local_blocks=local_blocks,
                          events=events)


def close(manager: KVCacheManager) -> None:
    close_manager(manager)


BACKENDS = ["vmem", "paged"]  # virtually contiguous slots, block tables (the same groups and pools)


@pytest.fixture(params=BACKENDS)
def hybrid(request):
    manager = make_hybrid(kv_backend=request.param)
    yield manager
    close(manager)


def write(manager: KVCacheManager, req: KVRequest, start: int, end: int) -> None:
    """Write positions [start, end) of every layer, as a forward pass would."""
    write_groups(manager, req.request_id, start, end)


def reads_back(manager: KVCacheManager, req: KVRequest) -> bool:
    """Every global position and every local one from the first held block reads back its own
    bytes."""
    return groups_read_back(manager, req.request_id)


def run(manager: KVCacheManager, request_id: str, token_ids: list[int]) -> KVRequest:
    req = KVRequest(request_id, list(token_ids))
    cached = manager.admit(req)
    assert cached is not None
    write(manager, req, cached, req.num_tokens)
    manager.commit(req)
    return req


def decode(manager: KVCacheManager, req: KVRequest, token: int) -> bool:
    req.token_ids.append(token)
    if not manager.allocate(req, 1):
        req.token_ids.pop()
        return False
    write(manager, req, req.num_tokens - 1, req.num_tokens)
    manager.commit(req)
    return True


def free_all(manager: KVCacheManager, requests: list[KVRequest]) -> None:
    """Free every request; then both groups hold no block."""
    for req in requests:
        manager.free(req)
    manager.check()
    assert all(group.num_blocks_in_use == 0 for group in manager.layout_groups)


def held(table) -> int:
    return sum(block != RELEASED for block in table)


# --- the groups ---------------------------------------------------------------------------------

def test_layers_are_grouped_by_kind_full_attention_first():
    groups = LayerGroups.from_windows([8, None, 8, None, 8])
    assert groups == LayerGroups((AttentionSpec(), AttentionSpec("sliding_window", 8)), ((1, 3), (0, 2, 4)))
    three = LayerGroups.from_windows([8, 16, None, AttentionSpec(CHUNKED, 4)])
    assert [spec.describe() for spec in three.specs] == [
        "full attention", "sliding window of 8", "sliding window of 16", "attention chunks of 4"]
    assert three.layers == ((2,), (0,), (1,), (3,))
    assert LayerGroups.from_windows([8, 8]).layers == ((0, 1),)  # one kind: one group


def test_hybrid_windows_come_from_the_model_config():
    assert hybrid_layer_windows(build("gemma2").config, 64) == [3, None]
    assert hybrid_layer_windows(build("gemma2").config, 3) is None  # the window covers everything
    assert hybrid_layer_windows(build("mistral").config, 64) is None  # every layer slides


def test_windows_for_every_layer_and_per_layer_are_not_both_given():
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=8, max_num_seqs=2,
                         max_model_len=64, sliding_window=8)
    with pytest.raises(ConfigError, match="per layer"):
        KVCacheManager(config, layer_windows=[8, None])
    with pytest.raises(ConfigError, match="entries"):
        KVCacheManager(CacheConfig(**{**config.__dict__, "sliding_window": None}), layer_windows=[8])


def test_the_engine_gets_layer_groups_only_where_the_groups_can_share_one_page():
    options = dict(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, num_blocks=8,
                   max_num_seqs=2, max_model_len=64)
    manager = KVCacheManager.for_layers(CacheConfig(**options), WINDOWS)
    assert len(manager.layout_groups) == 2
    manager.close()
    manager = KVCacheManager.for_layers(CacheConfig(**options), None)  # not a hybrid model
    assert len(manager.layout_groups) == 1 and manager.window is None
    manager.close()
    # 16 KiB pages: 64 tokens of the one global layer, not a whole number of three layers' rows
    odd = CacheConfig(**options, page_size=16 << 10)
    manager = KVCacheManager.for_layers(odd, WINDOWS)
    assert len(manager.layout_groups) == 1  # every layer keeps every block
    manager.close()
    with pytest.raises(ConfigError, match="page size"):
        KVCacheManager(odd, layer_windows=WINDOWS)


def test_each_layer_reads_its_groups_views(hybrid):
    assert hybrid.tokens_per_page == P
    views = "kv_views" if hybrid.config.kv_backend == "vmem" else "block_views"
    local_group, global_group = hybrid.layout_groups[1], hybrid.layout_groups[0]
    for layer, (group, index) in enumerate([(local_group, 0), (local_group, 1),
                                            (local_group, 2), (global_group, 0)]):
        for view, own in zip(getattr(hybrid, views)(layer), getattr(group, views)(index)):
            assert (view.data_ptr(), view.stride(), view.shape) == (own.data_ptr(), own.stride(), own.shape)


# --- release, hits, refusals ------------------------------------------------------------------------

def test_local_blocks_stay_within_the_window_while_the_global_group_grows(hybrid):
    req = run(hybrid, "a", list(range(30)))
    most_local = 0
    for step in range(180):
        assert decode(hybrid, req, step % 7)
        global_table, local_table = hybrid.block_table(req, 3), hybrid.block_table(req, 0)
        assert held(global_table) == -(-req.num_tokens // P)  # every global block
        most_local = max(most_local, held(local_table))
        assert held(local_table) <= -(-W // P) + 2
        hybrid.check()
    assert reads_back(hybrid, req)
    assert most_local <= -(-W // P) + 2 and held(hybrid.block_table(req, 3)) == 14
    assert hybrid.cache_stats().blocks_released_behind_window == req.group_released_blocks(1) > 0
    hybrid.free(req)
    hybrid.check()


def test_a_prefix_hit_needs_the_global_prefix_and_the_local_window(hybrid):
    first = run(hybrid, "a", list(range(100)))  # its next query reads from 81: local blocks 0-4 go
    assert first.group_released_blocks(1) == 5
    hybrid.free(first)
    second = KVRequest("b", list(range(100)) + [7])
    # global blocks 0-5 are cached; a query at 96 reads from 77: local blocks 4-5, still cached
    assert hybrid.admit(second) == 96
    assert hybrid.block_table(second, 0)[:5] == [RELEASED] * 4 + [second.group_block_table(1)[4]]
    assert second.group_block_table(1)[4] != RELEASED
    assert hybrid.block_table(second, 3)[:6] == list(second.block_table[:6])
    write(hybrid, second, 96, 101)
    hybrid.commit(second)
    assert reads_back(hybrid, second)
    hybrid.free(second)
    hybrid.check()


@pytest.mark.parametrize("kv_backend", BACKENDS)
def test_a_hit_is_cut_to_the_local_window_that_is_still_cached(kv_backend):
    manager = make_hybrid(local_blocks=7, kv_backend=kv_backend)
    try:
        hybrid_prefix = list(range(100))
        hybrid_req = run(manager, "a", hybrid_prefix)
        manager.free(hybrid_req)
        filler = run(manager, "b", [500 + i for i in range(100)])  # evicts a's local blocks 4-5
        manager.free(filler)
        hashes = manager.match_prefix(hybrid_prefix + [1])[1]
        assert len(manager.layout_groups[0].cached_blocks(hashes[:6])) == 6  # global: all hit
        again = KVRequest("c", hybrid_prefix + [1])
        cached = manager.admit(again)
        assert cached < 96  # the local window of a 96-token hit is gone
        write(manager, again, cached, again.num_tokens)
        manager.commit(again)
        assert reads_back(manager, again)
        manager.free(again)
        manager.check()
    finally:
        close(manager)


def snapshot(manager: KVCacheManager) -> tuple:
    return (manager.request_ids(), manager.num_free_slots,
            tuple(group.pool.counters() for group in manager.layout_groups))


@pytest.mark.parametrize("kv_backend", BACKENDS)
def test_an_admission_the_local_group_cannot_take_changes_nothing(kv_backend):
    manager = make_hybrid(local_blocks=4, kv_backend=kv_backend)
    try:
        running = run(manager, "a", list(range(40)))  # 3 blocks of 4 in the local group
        before = snapshot(manager)
        assert manager.layout_groups[0].fits_admission([], 40)  # the global group has room
        assert not manager.can_admit(KVRequest("x", list(range(100, 140))))
        assert manager.admit(KVRequest("b", list(range(100, 140)))) is None
        assert snapshot(manager) == before
        manager.check()
        manager.free(running)
    finally:
        close(manager)


# --- one pool for the groups of one block layout ----------------------------------------------------

def make_one_to_one(**overrides) -> KVCacheManager:
    """``ONE_TO_ONE`` on 8 blocks of both layers: 16 blocks of one layer, shared by both groups
    (or split between them with ``local_blocks``)."""
    return make_hybrid(ONE_TO_ONE, **{**dict(num_layers=2, num_blocks=8), **overrides})


@pytest.mark.parametrize("kv_backend", BACKENDS)
def test_a_one_to_one_model_draws_both_groups_from_one_pool(kv_backend):
    """Without ``local_blocks`` the local and the global group of a 1:1 model share one memory,
    whose free blocks go to whichever group needs them: an admission the static split's local
    share refuses, and a decode its global share refuses, both go through, the decode into the
    blocks the local group gave back behind its window."""
    shared = make_one_to_one(kv_backend=kv_backend)
    split_admit = make_one_to_one(kv_backend=kv_backend, local_blocks=4)  # 12 global, 4 local
    split_decode = make_one_to_one(kv_backend=kv_backend, local_blocks=8)  # 8 global, 8 local
    try:
        full, local = shared.layout_groups
        assert shared.memories == (full.memory,) and local.memory is full.memory
        assert local.pool is full.pool and local.backend is full.backend and full.num_blocks == 16
        for split, local_blocks in ((split_admit, 4), (split_decode, 8)):  # the same bytes, split
            assert len(split.memories) == 2
            assert [group.num_blocks for group in split.layout_groups] == [16 - local_blocks, local_blocks]

        # an admission of 5 blocks in each group: more than the split's 4 local blocks
        prompt = list(range(5 * P))
        before = snapshot(split_admit)
        assert split_admit.layout_groups[0].fits_admission([], len(prompt))  # the global share has room
        assert not split_admit.can_admit(prompt)
        assert split_admit.admit(KVRequest("a", prompt)) is None
        assert snapshot(split_admit) == before
        split_admit.check()
        assert shared.can_admit(prompt)
        a = run(shared, "a", prompt)
        assert [held(a.group_block_table(g)) for g in (0, 1)] == [5, 2]  # the local group's first 3 went back
        assert full.num_blocks_in_use == 7 and reads_back(shared, a)
        shared.free(a)
        shared.check()

        # 8 blocks of a prompt in each group, then a decode into a 9th global block
        for manager in (split_decode, shared):
            b = run(manager, "b", [1000 + i for i in range(8 * P)])
            assert b.group_released_blocks(1) == 6  # its next query reads from 109: local blocks 6-7
            assert reads_back(manager, b)
        global_split, local_split = split_decode.layout_groups
        assert (global_split.num_free_blocks, local_split.num_free_blocks) == (0, 6)
        b = split_decode.request("b")
        before, tables = snapshot(split_decode), [b.group_block_table(0), b.group_block_table(1)]
        assert not split_decode.can_allocate(b, 1)
        assert not decode(split_decode, b, 7)  # the global share is spent, the local one is not
        assert snapshot(split_decode) == before and [b.group_block_table(0), b.group_block_table(1)] == tables
        split_decode.check()

        b = shared.request("b")
        released = set(local.pool.free_queue())  # the only free blocks: the local group's, behind its window
        assert full.num_free_blocks == 6 and local.pool.num_clean == 0
        assert released and not released & set(b.group_block_table(0))
        assert shared.can_allocate(b, 1) and decode(shared, b, 7)
        grown = b.group_block_table(0)
        assert len(grown) == 9 and grown[8] in released  # the global group grew into a local block
        assert b.group_block_table(1)[8] in released and grown[8] != b.group_block_table(1)[8]
        assert reads_back(shared, b)
        shared.check()
        free_all(shared, [b])
        free_all(split_decode, [split_decode.request("b")])
    finally:
        for manager in (shared, split_admit, split_decode):
            close(manager)


def write_apart(manager: KVCacheManager, req: KVRequest, start: int, end: int) -> None:
    """``write``, each group with a salt of its own: the groups' layers (one of one shape each in
    ``ONE_TO_ONE``) would otherwise hold the same bytes for the same tokens, and a block read
    through the other group would read back as its own."""
    for group in manager.layout_groups:
        write_kv(group_view(manager, group.index), req.request_id, start, end, salt=group.index)


def reads_back_apart(manager: KVCacheManager, req: KVRequest) -> bool:
    """``reads_back`` of what ``write_apart`` wrote."""
    return all(read_kv_matches(group_view(manager, group.index), req.request_id, salt=group.index,
                               start=req.group_released_blocks(group.index) * group.tokens_per_page)
               for group in manager.layout_groups)


def run_apart(manager: KVCacheManager, request_id: str, token_ids: list[int]) -> KVRequest:
    req = KVRequest(request_id, list(token_ids))
    cached = manager.admit(req)
    assert cached is not None
    write_apart(manager, req, cached, req.num_tokens)
    manager.commit(req)
    return req


@pytest.mark.parametrize("kv_backend", BACKENDS)
def test_a_block_cached_in_one_group_never_hits_in_the_other_group_of_its_pool(kv_backend):
    """The two groups of a shared pool key the same tokens apart (the later group: the hash and its
    index), so the same prompt's blocks cached in one group are never the other's hits: with one
    group's copies evicted and the other's still cached, neither lookup nor admission crosses over,
    and every group's K/V reads back its own bytes."""
    for cached_group in (0, 1):  # the group whose copies stay cached
        manager = make_one_to_one(kv_backend=kv_backend)
        try:
            full, local = manager.layout_groups
            pool = full.pool
            assert local.pool is pool
            if cached_group == 0:
                # a keeps its global blocks; its local ones behind the window (0-2) are cached, then
                # evicted by two fillers: the first takes the clean blocks and two of them, the
                # second the third
                a = run_apart(manager, "a", list(range(70)))
                hashes = list(a.block_hashes)
                assert len(hashes) == 4 and a.group_released_blocks(1) == 3
                assert [pool.hash_of[b] for b in a.group_block_table(0)[:4]] == hashes
                assert [pool.hash_of[b] for b in a.group_block_table(1)[3:4]] == [local.key(hashes[3])]
                assert local.key(hashes[3]) != hashes[3]
                manager.free(run_apart(manager, "f1", [500 + i for i in range(4 * P)]))
                f2 = run_apart(manager, "f2", [700 + i for i in range(10)])
                assert all(h in pool.block_of_hash for h in hashes)
                assert not any(local.key(h) in pool.block_of_hash for h in hashes[:3])
                assert full.cached_blocks(hashes) == list(a.group_block_table(0)[:4])
                assert local.cached_blocks(hashes) == []  # its window's blocks are gone: no hit
                manager.free(f2)
                again = KVRequest("again", list(range(3 * P)) + [1])
                held_elsewhere = set(a.group_block_table(0))
            else:
                # a freed prompt: its global blocks go first into the free queue, so a filler of
                # the clean blocks and two more evicts them and leaves the local ones cached
                b = run_apart(manager, "b", list(range(2 * P)))
                hashes = list(b.block_hashes)
                local_blocks = list(b.group_block_table(1))
                manager.free(b)
                manager.free(run_apart(manager, "f", [500 + i for i in range(7 * P)]))
                assert not any(h in pool.block_of_hash for h in hashes)
                assert [pool.block_of_hash.get(local.key(h)) for h in hashes] == local_blocks
                assert local.cached_blocks(hashes) == local_blocks
                assert full.cached_blocks(hashes) == []  # no hit on the local group's blocks
                again = KVRequest("again", list(range(2 * P)) + [1])
                held_elsewhere = set()  # b's local blocks are free: taking one evicts it (no hit)
            # the prompt again: the group with its blocks gone has no hit, so neither has the request
            assert manager.match_prefix(list(again.token_ids))[0] == []
            assert manager.admit(again) == 0
            for group in manager.layout_groups:  # fresh blocks only: no hit, shared or revived
                table = again.group_block_table(group.index)
                assert all(pool.ref[b] == 1 and pool.hash_of[b] is None for b in table)
                assert not held_elsewhere & set(table)
            write_apart(manager, again, 0, again.num_tokens)
            manager.commit(again)
            manager.check()  # also: no block of one group carries the other's key
            assert reads_back_apart(manager, again)
            if cached_group == 0:
                assert reads_back_apart(manager, a)
                manager.free(a)
            manager.free(again)
            manager.check()
        finally:
            close(manager)


# --- a random walk ----------------------------------------------------------------------------------

EXERCISED: dict[str, Counter] = {backend: Counter() for backend in BACKENDS}  # what changed something, per backend
OPS = st.lists(st.tuples(st.sampled_from(["admit", "admit", "decode", "decode", "free", "swap",
                                          "recompute", "swap_in", "readmit", "fork", "lookahead"]),
                         st.integers(0, 5), st.integers(1, 60)), min_size=10, max_size=30)


@pytest.mark.parametrize("windows", [WINDOWS, THREE_KINDS], ids=["two-kinds", "three-kinds"])
@pytest.mark.parametrize("kv_backend", BACKENDS)
@settings(max_examples=60, deadline=None, derandomize=True)  # the coverage check below is stable
@given(ops=OPS)
def test_random_walk_keeps_every_group_in_step_and_bytes_exact(kv_backend, windows, ops):
    manager = make_hybrid(windows, num_blocks=8, kv_backend=kv_backend)  # global: 8 blocks; local: 8
    running: dict[str, KVRequest] = {}
    swapped: dict[str, KVRequest] = {}
    preempted: dict[str, KVRequest] = {}
    counter = 0
    try:
        for op, pick, size in ops:
            names = sorted(running)
            name = names[pick % len(names)] if names else None
            if op == "admit":
                counter += 1
                req = KVRequest(f"r{counter}", [(pick * 13 + i) % 40 for i in range(size)])  # shared prefixes
                before = snapshot(manager)
                cached = manager.admit(req)
                if cached is None:
                    assert snapshot(manager) == before
                    continue
                write(manager, req, cached, req.num_tokens)
                manager.commit(req)
                running[req.request_id] = req
                EXERCISED[kv_backend]["prefix hit" if cached else op] += 1
            elif op == "decode" and name:
                for step in range(size):
                    before = snapshot(manager)
                    if not decode(manager, running[name], step % 5):
                        assert snapshot(manager) == before
                        EXERCISED[kv_backend]["refused decode"] += 1
                        break
                    EXERCISED[kv_backend][op] += 1
            elif op == "free" and name:
                manager.free(running.pop(name))
                EXERCISED[kv_backend][op] += 1
            elif op in ("swap", "recompute") and name:
                req = running[name]
                if op == "swap" and not manager.estimate_preemption(req).swap_fits:
                    continue
                assert manager.preempt(req, op) == op
                (swapped if op == "swap" else preempted)[name] = running.pop(name)
                EXERCISED[kv_backend][op] += 1
            elif op == "swap_in" and swapped:
                key = sorted(swapped)[pick % len(swapped)]
                if manager.swap_in(swapped[key]):
                    running[key] = swapped.pop(key)
                    EXERCISED[kv_backend][op] += 1
            elif op == "readmit" and preempted:
                key = sorted(preempted)[pick % len(preempted)]
                req = preempted[key]
                cached = manager.admit(req)
                if cached is not None:
                    write(manager, req, cached, req.num_tokens)
                    manager.commit(req)
                    running[key] = preempted.pop(key)
                    EXERCISED[kv_backend][op] += 1
            elif op == "lookahead" and running:  # next blocks given (and mapped) ahead of decodes
                jobs = manager.allocate_lookahead([running[key] for key in names], size % (2 * P), pick % 3)
                manager.map_lookahead(jobs)
                EXERCISED[kv_backend][op] += bool(jobs)
            elif op == "fork" and name:
                counter += 1
                child = manager.fork(running[name], KVRequest(f"r{counter}", []))
                if child is not None:
                    running[child.request_id] = child
                    EXERCISED[kv_backend][op] += 1
            manager.check()
            EXERCISED[kv_backend]["released"] += sum(r.group_released_blocks(1) > 0 for r in running.values())
            for req in running.values():
                assert reads_back(manager, req)
                for group in manager.layout_groups[1:]:
                    span = group.spec.size + (P if group.spec.kind == CHUNKED else 0)
                    assert (held(req.group_block_table(group.index)) <= -(-span // P) + 2
                            or req.num_computed_tokens < req.num_tokens)
        for req in preempted.values():
            manager.discard(req)
        free_all(manager, list(running.values()) + list(swapped.values()))
    finally:
        close(manager)


def test_the_random_walk_exercised_every_operation():
    """Run after the walk (file order): on each backend, each operation succeeded, hits and
    releases happened."""
    if not any(EXERCISED.values()):
        pytest.skip("the random walk did not run in this test run (run the whole file)")
    expected = {"admit", "prefix hit", "decode", "refused decode", "free", "swap", "recompute",
                "swap_in", "readmit", "fork", "lookahead", "released"}
    for backend, exercised in EXERCISED.items():
        if exercised:  # (a -k filter may have run one backend's walk)
                assert expected <= {op for op, count in exercised.items() if count}, (backend, exercised)
