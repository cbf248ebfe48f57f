"""Giving KV memory back: free clean blocks' pages go back to the OS (punched out of the memfd),
held and cached blocks keep theirs bit-exact, a floor of backed blocks stays for the next
allocations, and a block given back is written and read again like any other. The OS's own count
(the memfd's allocated bytes) is the reference."""

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import close_manager, read_kv_matches, tiny_config, write_kv
from vmemkv import KVCacheManager
from vmemkv.cache.backing import BACKED
from vmemkv.cache.memory import backend_pages
from vmemkv.memory.vmm.cpu import CpuBackend

FP32 = dict(dtype=torch.float32)  # the K/V patterns are 4-byte elements


def admit_written(manager, request_id, tokens):
    manager.admit(request_id, tokens)
    write_kv(manager, request_id, manager.num_computed_tokens(request_id), len(tokens))
    manager.commit(request_id)


def resident(manager) -> int:
    return manager.memories[0].backend.resident_bytes()


def test_free_clean_blocks_go_back_and_the_os_count_falls(make_manager):
    manager = make_manager(**FP32, enable_prefix_caching=False, num_blocks=16, max_model_len=32)
    block = manager.block_bytes
    for i in range(3):
        admit_written(manager, f"r{i}", list(range(100 * i, 100 * i + 15)))  # 4 blocks each
    assert manager.kv_bytes_resident == 12 * block
    for i in range(3):
        manager.free(f"r{i}")
    before = resident(manager)
    assert manager.release_free_memory() == 12 * block
    assert before - resident(manager) == 12 * block  # the OS took back exactly those pages
    assert manager.kv_bytes_resident == 0
    stats = manager.snapshot_stats()
    assert stats["blocks_given_back"] == 12 and stats["blocks_backed"] == 0
    assert manager.release_free_memory() == 0  # nothing left to give


def test_cached_and_held_blocks_keep_their_bytes(make_manager):
    manager = make_manager(**FP32, num_blocks=16, max_model_len=32)
    system = list(range(1, 13))  # three full blocks, cached when the request ends
    admit_written(manager, "cached", system + [50, 51])
    admit_written(manager, "held", list(range(200, 210)))
    admit_written(manager, "gone", list(range(300, 306)))
    manager.free("cached")
    manager.free("gone")  # its partial block goes back clean; its full block stays cached
    assert manager.release_free_memory() > 0
    assert read_kv_matches(manager, "held")
    cached = manager.admit("again", system + [60])
    assert cached == 12  # the cached blocks hit, and hold what was written
    assert read_kv_matches(manager, "again")  # the hit's 12 positions: the bytes "cached" wrote
    write_kv(manager, "again", 12, 13)
    manager.commit("again")
    assert read_kv_matches(manager, "again")


def test_a_floor_of_backed_blocks_stays_for_the_next_allocations(make_manager):
    manager = make_manager(**FP32, enable_prefix_caching=False, num_blocks=16, max_model_len=32)
    for i in range(3):
        admit_written(manager, f"r{i}", list(range(100 * i, 100 * i + 15)))
    for i in range(3):
        manager.free(f"r{i}")
    manager.release_free_memory(keep_blocks=4)
    assert manager.kv_bytes_resident == 4 * manager.block_bytes
    admit_written(manager, "next", list(range(500, 515)))  # 4 blocks: the kept ones
    assert manager.snapshot_stats()["blocks_taken_again"] == 0
    admit_written(manager, "more", list(range(600, 615)))  # 4 more: given back before
    assert manager.snapshot_stats()["blocks_taken_again"] == 4
    assert read_kv_matches(manager, "next") and read_kv_matches(manager, "more")


def test_a_block_given_back_reads_zeros_until_written_again(make_manager):
    manager = make_manager(**FP32, enable_prefix_caching=False, num_blocks=8, max_model_len=16)
    admit_written(manager, "a", list(range(1, 5)))
    (block,) = manager.block_table("a")
    manager.free("a")
    window = manager.memories[0].block_window()
    assert window[block].any()
    manager.release_free_memory()
    assert not window[block].any()  # punched out: the page reads zeros
    admit_written(manager, "b", list(range(9, 13)))
    assert manager.block_table("b") == [block] and read_kv_matches(manager, "b")


class TakesPagesBackLikeCuda(CpuBackend):
    """The CPU backend giving pages back as the CUDA one does (``cuMemRelease``): every mapping of
    a page given back goes, and the page has no memory until taken back: by ``take_pages``, or by
    a map or a copy naming it (as CUDA's). What it cannot see, a write through the pool window
    (swap-in, the host tier), is why every block the pool counts as backed must have its pages:
    ``unbacked_pages_of_backed_blocks`` says which do not."""

    takes_pages_back = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given_back: set[int] = set()
        self.pages_taken_back = 0

    def discard_pages(self, pages) -> int:
        going = sorted(set(map(int, pages)) - self.given_back)
        for state in list(self._ranges.values()):
            mapped = np.flatnonzero(np.isin(state.vrange.page_table, going))
            if mapped.size:
                self.unmap(state.vrange, mapped)
        self.given_back.update(going)
        return super().discard_pages(going)

    def take_pages(self, pages) -> None:
        back = set(np.asarray(pages).tolist()) & self.given_back
        self.given_back -= back
        self.pages_taken_back += len(back)

    def map(self, vrange, virtual_pages, physical_pages) -> None:
        self.take_pages(physical_pages)
        super().map(vrange, virtual_pages, physical_pages)

    def copy_pages(self, src, dst) -> None:
        assert not set(np.asarray(src).tolist()) & self.given_back, "copied from a page given back"
        self.take_pages(dst)
        super().copy_pages(src, dst)


def unbacked_pages_of_backed_blocks(manager) -> set[int]:
    memory = manager.memories[0]
    backed = [b for b, state in enumerate(memory.pool.backing.state) if state == BACKED]
    pages = memory.layout.physical_pages(np.array(backed, dtype=np.int64)).tolist()
    return set(pages) & memory.backend.given_back


def manager_taking_pages_back(config) -> KVCacheManager:
    layout = config.make_layout()
    return KVCacheManager(config, backend=TakesPagesBackLikeCuda(layout.page_size,
                                                                 backend_pages(config, layout)[0]))


def test_where_pages_must_be_taken_back_a_block_handed_out_again_takes_them_first():
    """Block tables: no slot mapping takes the pages back on the way, the pool's hand-out must."""
    manager = manager_taking_pages_back(tiny_config(**FP32, enable_prefix_caching=False, kv_backend="paged",
                                                    num_blocks=8, max_model_len=16))
    try:
        backend = manager.memories[0].backend
        admit_written(manager, "a", list(range(1, 9)))  # two blocks
        manager.free("a")
        assert manager.release_free_memory() == 2 * manager.block_bytes
        assert len(backend.given_back) == 2 * manager.layout.pages_per_block
        manager.admit("b", list(range(20, 28)))  # the same two blocks, taken back when handed out
        assert not backend.given_back
        write_kv(manager, "b", 0, 8)
        manager.commit("b")
        assert read_kv_matches(manager, "b")
        assert backend.pages_taken_back == 2 * manager.layout.pages_per_block
        assert manager.snapshot_stats()["blocks_taken_again"] == 2
        manager.check()
    finally:
        close_manager(manager)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
@pytest.mark.parametrize("takes_pages_back, kv_backend", [(False, "vmem"), (True, "vmem"), (True, "paged")],
                         ids=["cpu", "like-cuda", "like-cuda-block-tables"])
def test_giving_memory_back_never_changes_what_a_request_or_the_cache_holds(takes_pages_back, kv_backend, seed):
    """Random admissions (sharing system prompts), appends, forks, frees and give-backs: every
    running request reads back what was written for it, every prefix hit reads the bytes first
    written, the invariants hold, and the OS never holds more than the blocks the pool counts as
    backed (a block given back holds no memory; a backed one may not be written yet). Also where
    giving back removes every mapping of a page and a page must be taken back before use (CUDA's
    rules), with slots and with block tables (no slot maps a block: only the pool's own
    take-back stands between a write and a page given back)."""
    rng = random.Random(seed)
    config = tiny_config(**FP32, num_blocks=24, max_num_seqs=6, max_model_len=40, kv_backend=kv_backend)
    manager = manager_taking_pages_back(config) if takes_pages_back else KVCacheManager(config)
    try:
        systems = [list(range(1000 * s, 1000 * s + 8)) for s in range(3)]
        live, fresh = [], iter(range(10**6, 10**7))
        for step in range(40):
            op = rng.choice(["admit", "admit", "grow", "fork", "free", "give_back"])
            if op == "admit" and manager.num_free_slots:
                rid = f"r{step}"
                tokens = rng.choice(systems) + [next(fresh) for _ in range(rng.randint(1, 9))]
                if manager.admit(rid, tokens) is not None:
                    write_kv(manager, rid, manager.num_computed_tokens(rid), len(tokens))
                    manager.commit(rid)
                    live.append(rid)
            elif op == "grow" and live:
                rid = rng.choice(live)
                if manager.num_tokens(rid) < 39 and manager.allocate(rid, 1, [next(fresh)]):
                    write_kv(manager, rid, manager.num_tokens(rid) - 1, manager.num_tokens(rid))
                    manager.commit(rid)
            elif op == "fork" and live and manager.num_free_slots:
                child = manager.fork(rng.choice(live), f"f{step}")
                if child is not None:
                    live.append(child.request_id)
            elif op == "free" and live:
                manager.free(live.pop(rng.randrange(len(live))))
            elif op == "give_back":
                manager.release_free_memory(keep_blocks=rng.choice([0, 0, 2]))
            manager.check()
            assert all(read_kv_matches(manager, rid) for rid in live)
            assert resident(manager) <= manager.kv_bytes_resident  # no filler read here
            assert not takes_pages_back or not unbacked_pages_of_backed_blocks(manager)
        held = {b for rid in live for b in manager.block_table(rid)}
        assert manager.kv_bytes_resident >= len(held) * manager.block_bytes
    finally:
        close_manager(manager)
