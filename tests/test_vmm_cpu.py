"""Behaviour of the CPU virtual-memory backend: real mmap of memfd pages into reservations."""

from __future__ import annotations

import gc
import mmap
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmemkv.errors import ConfigError, MappingError, MappingLimitError
from vmemkv.memory.vmm import CpuBackend, MapStats, VirtualMemoryBackend, VirtualRange, create_backend
from vmemkv.memory.vmm.cpu import count_range_mappings, huge_page_info, process_mapping_budget

# A machine that did not build the C extension (a GPU box) skips this file instead of erroring.
_native = pytest.importorskip("vmemkv._native", reason="the C extension vmemkv._native is not built")

PAGE = mmap.PAGESIZE  # the smallest legal page keeps tests fast
INTS_PER_PAGE = PAGE // 4


@pytest.fixture
def backend():
    with CpuBackend(PAGE, 32) as b:
        fill_pages_with_their_index(b)
        yield b


def fill_pages_with_their_index(backend: CpuBackend) -> None:
    """Every int32 of physical page p holds a value unique to (p, position)."""
    window = backend.pool_window().view(torch.int32)
    positions = torch.arange(window.shape[1], dtype=torch.int32)
    for page in range(backend.num_pages):
        window[page] = page_pattern(page, positions)


def page_pattern(page: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    if positions is None:
        positions = torch.arange(INTS_PER_PAGE, dtype=torch.int32)
    return positions + page * 1_000_003


def pages_view(backend: CpuBackend, vrange: VirtualRange) -> torch.Tensor:
    """The range as int32 [num_pages, ints per page]; only mapped rows may be read."""
    ints = vrange.page_size // 4
    return backend.tensor(vrange, torch.int32, [vrange.num_pages, ints], [ints, 1])


def kernel_mappings(vrange: VirtualRange) -> int:
    """How many VMAs of /proc/self/maps overlap the range: what the kernel really holds."""
    start, end = vrange.address, vrange.address + vrange.size
    count = 0
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            count += hi > start and lo < end
    return count


def kernel_layout(vrange: VirtualRange) -> list[str]:
    start, end = vrange.address, vrange.address + vrange.size
    lines = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if hi > start and lo < end:
                lines.append(line)
    return lines


# ------------------------------------------------------------------ the same bytes at many addresses


def test_backend_implements_the_interface(backend):
    assert isinstance(backend, VirtualMemoryBackend)
    assert backend.device == torch.device("cpu")
    assert isinstance(backend.stats, MapStats)
    assert backend.pool_window().shape == (32, PAGE)
    assert backend.pool_window().dtype == torch.uint8


def test_one_physical_page_shows_the_same_bytes_at_every_address(backend):
    first, second = backend.reserve(4), backend.reserve(4)
    backend.map(first, [0, 2], [7, 7])
    backend.map(second, [3], [7])
    view_first, view_second = pages_view(backend, first), pages_view(backend, second)

    view_first[0, :10] = -5
    assert view_first[2, :10].tolist() == [-5] * 10
    assert view_second[3, :10].tolist() == [-5] * 10
    assert backend.pool_window().view(torch.int32)[7, :10].tolist() == [-5] * 10
    assert torch.equal(view_second[3, 10:], page_pattern(7)[10:])


def test_unmap_then_map_another_page_at_the_same_address(backend):
    vrange = backend.reserve(4)
    backend.map(vrange, [1], [3])
    view = pages_view(backend, vrange)
    assert torch.equal(view[1], page_pattern(3))
    backend.unmap(vrange, [1])
    assert vrange.page_table.tolist() == [-1, -1, -1, -1]
    backend.map(vrange, [1], [9])
    assert torch.equal(view[1], page_pattern(9))


def test_remap_replaces_the_page_and_leaves_the_old_one_intact(backend):
    vrange = backend.reserve(2)
    backend.map(vrange, [0], [4])
    view = pages_view(backend, vrange)
    view[0, 0] = 123
    backend.map(vrange, [0], [5])  # no unmap in between
    assert vrange.page_table.tolist() == [5, -1]
    assert torch.equal(view[0], page_pattern(5))
    assert backend.pool_window().view(torch.int32)[4, 0].item() == 123


def test_mapping_a_page_already_there_makes_no_call(backend):
    vrange = backend.reserve(4)
    backend.map(vrange, [0, 1], [2, 3])
    calls = backend.stats.map_calls
    backend.map(vrange, [0, 1], [2, 3])
    assert backend.stats.map_calls == calls
    backend.unmap(vrange, [2, 3])  # never mapped: nothing to do
    assert backend.stats.unmap_calls == 0


def test_a_repeated_virtual_page_takes_the_last_entry(backend):
    vrange = backend.reserve(4)
    backend.map(vrange, [1, 2, 1], [5, 6, 11])
    assert vrange.page_table.tolist() == [-1, 11, 6, -1]
    view = pages_view(backend, vrange)
    assert torch.equal(view[1], page_pattern(11))
    assert torch.equal(view[2], page_pattern(6))


# ------------------------------------------------------------------ coalescing and counting


def test_a_run_of_consecutive_pages_costs_one_call(backend):
    vrange = backend.reserve(16)
    backend.map(vrange, np.arange(4, 12), np.arange(20, 28))
    assert backend.stats.map_calls == 1
    assert backend.stats.pages_mapped == 8
    assert pages_view(backend, vrange)[4:12, 0].tolist() == [p * 1_000_003 for p in range(20, 28)]
    backend.unmap(vrange, np.arange(4, 12))
    assert backend.stats.unmap_calls == 1


def test_scattered_pages_cost_one_call_each(backend):
    vrange = backend.reserve(16)
    backend.map(vrange, np.arange(6), [9, 3, 17, 4, 30, 0])
    assert backend.stats.map_calls == 6
    backend.map(vrange, [8, 9, 10, 12], [1, 2, 3, 4])  # a run of three, then a lone page
    assert backend.stats.map_calls == 8
    backend.unmap(vrange, [0, 1, 2, 3, 4, 5, 8, 9, 10, 12])  # virtual runs coalesce on unmap
    assert backend.stats.unmap_calls == 3
    assert backend.stats.unmap_seconds > 0 and backend.stats.map_seconds > 0


def test_mapping_count_matches_the_kernel(backend):
    vrange = backend.reserve(16)
    steps = [
        ("map", np.arange(16), np.arange(16)),  # one run: one VMA
        ("unmap", np.array([5, 6]), None),  # split: run, gap, run
        ("map", np.array([5]), np.array([30])),
        ("map", np.array([0, 1, 2]), np.array([9, 10, 11])),
        ("unmap", np.arange(16), None),
    ]
    for op, virt, phys in steps:
        if op == "map":
            backend.map(vrange, virt, phys)
        else:
            backend.unmap(vrange, virt)
        assert count_range_mappings(vrange.page_table) == kernel_mappings(vrange)
    assert kernel_mappings(vrange) == 1


def test_accepts_lists_and_tensors_of_indices(backend):
    vrange = backend.reserve(4)
    backend.map(vrange, torch.tensor([0, 1]), torch.tensor([4, 8], dtype=torch.int32))
    backend.map(vrange, (2,), [np.int64(12)])
    assert vrange.page_table.tolist() == [4, 8, 12, -1]
    backend.map(vrange, [], [])
    backend.unmap(vrange, np.array([], dtype=np.int64))


# ------------------------------------------------------------------ tensors and copies


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float64])
def test_tensor_views_of_a_token_major_layout(dtype):
    layers, heads, dim, tokens = 3, 2, 8, 40
    itemsize = dtype.itemsize
    token_bytes = layers * 2 * heads * dim * itemsize
    num_pages = -(-tokens * token_bytes // PAGE)
    with CpuBackend(PAGE, num_pages + 2) as backend:
        vrange = backend.reserve(num_pages + 1)
        backend.map(vrange, np.arange(num_pages), np.random.default_rng(0).permutation(num_pages))
        whole = backend.tensor(vrange, dtype, [tokens, layers, 2, heads, dim],
                               [layers * 2 * heads * dim, 2 * heads * dim, heads * dim, dim, 1])
        values = torch.randn(tokens, layers, 2, heads, dim).to(dtype)
        whole.copy_(values)

        layer = 1  # the K and V of one layer, as strided [tokens, heads, dim] views
        stride = [layers * 2 * heads * dim, dim, 1]
        key = backend.tensor(vrange, dtype, [tokens, heads, dim], stride,
                             offset_bytes=(layer * 2 + 0) * heads * dim * itemsize)
        value = backend.tensor(vrange, dtype, [tokens, heads, dim], stride,
                               offset_bytes=(layer * 2 + 1) * heads * dim * itemsize)
        assert key.dtype == dtype and not key.is_contiguous()
        assert torch.equal(key, values[:, layer, 0])
        assert torch.equal(value, values[:, layer, 1])
        assert key.data_ptr() == vrange.address + (layer * 2) * heads * dim * itemsize


def test_tensor_view_reaching_the_last_byte_is_allowed(backend):
    vrange = backend.reserve(2)
    backend.map(vrange, [0, 1], [0, 1])
    last_int_of_page_0 = PAGE - 4
    view = backend.tensor(vrange, torch.int32, [2], [INTS_PER_PAGE], offset_bytes=last_int_of_page_0)
    assert view.tolist() == [page_pattern(0)[-1].item(), page_pattern(1)[-1].item()]
    assert backend.tensor(vrange, torch.int32, [0, 5], [5, 1], offset_bytes=2 * PAGE).numel() == 0


def test_creating_a_view_touches_no_memory(backend):
    vrange = backend.reserve(8)  # nothing mapped: touching any byte would crash the test process
    view = backend.tensor(vrange, torch.bfloat16, [8, PAGE // 2], [PAGE // 2, 1])
    narrow = view[2:5, 1::2]
    assert narrow.shape == (3, PAGE // 4)


def test_copy_pages_copies_whole_pages(backend):
    backend.copy_pages([1, 2, 3], [10, 3, 12])  # sources are read before any page is written
    window = backend.pool_window().view(torch.int32)
    assert torch.equal(window[10], page_pattern(1))
    assert torch.equal(window[3], page_pattern(2))
    assert torch.equal(window[12], page_pattern(3))
    assert torch.equal(window[2], page_pattern(2))
    backend.copy_pages([], [])


def test_copy_is_seen_through_a_mapped_range(backend):
    vrange = backend.reserve(2)
    backend.map(vrange, [0], [20])
    backend.copy_pages([5], [20])
    assert torch.equal(pages_view(backend, vrange)[0], page_pattern(5))


# ------------------------------------------------------------------ bad input: our error, no change


def test_page_size_must_be_a_multiple_of_the_os_page():
    for size in (PAGE + 512, 1000, 0, -PAGE):
        with pytest.raises(ConfigError, match="multiple of the OS page"):
            CpuBackend(size, 4)
    with pytest.raises(ConfigError, match="num_pages"):
        CpuBackend(PAGE, 0)


def test_huge_pages_without_os_support_is_a_config_error():
    total, _ = huge_page_info()
    if total > 0:
        pytest.skip("this machine has huge pages reserved")
    with pytest.raises(ConfigError, match="huge pages"):
        CpuBackend(2 * 1024 * 1024, 4, huge_pages=True)


def test_mapping_outside_the_reservation_changes_nothing(backend):
    vrange = backend.reserve(4)
    backend.map(vrange, [0], [1])
    before = kernel_layout(vrange)
    with pytest.raises(MappingError, match="virtual page 4 .* outside the reservation of 4 pages"):
        backend.map(vrange, [1, 4], [2, 3])
    with pytest.raises(MappingError, match="virtual page -1"):
        backend.map(vrange, [-1], [2])
    with pytest.raises(MappingError, match="outside the reservation"):
        backend.unmap(vrange, [0, 99])
    assert vrange.page_table.tolist() == [1, -1, -1, -1]
    assert kernel_layout(vrange) == before
    assert backend.stats.map_calls == 1


def test_physical_page_outside_the_pool_changes_nothing(backend):
    vrange = backend.reserve(4)
    with pytest.raises(MappingError, match="physical page 32 .* outside the pool of 32 pages"):
        backend.map(vrange, [0, 1], [3, 32])
    with pytest.raises(MappingError, match="outside the pool"):
        backend.copy_pages([0], [32])
    with pytest.raises(MappingError, match="outside the pool"):
        backend.copy_pages([-1], [2])
    assert vrange.page_table.tolist() == [-1] * 4


def test_mismatched_or_malformed_batches_are_refused(backend):
    vrange = backend.reserve(4)
    with pytest.raises(MappingError, match="physical_pages has 1"):
        backend.map(vrange, [0, 1], [3])
    with pytest.raises(MappingError, match="1-D"):
        backend.map(vrange, [[0, 1]], [[3, 4]])
    with pytest.raises(MappingError, match="one destination per source"):
        backend.copy_pages([0, 1], [2])
    with pytest.raises(MappingError, match="twice"):
        backend.copy_pages([0, 1], [2, 2])
    assert vrange.page_table.tolist() == [-1] * 4


def test_tensor_view_outside_the_range_is_refused(backend):
    vrange = backend.reserve(2)
    with pytest.raises(MappingError, match="reaches byte"):
        backend.tensor(vrange, torch.float32, [2, INTS_PER_PAGE + 1], [INTS_PER_PAGE, 1])
    with pytest.raises(MappingError, match="reaches byte"):
        backend.tensor(vrange, torch.float16, [4], [1], offset_bytes=2 * PAGE - 4)
    with pytest.raises(ConfigError, match="multiple of the element size"):
        backend.tensor(vrange, torch.float32, [4], [1], offset_bytes=2)
    with pytest.raises(ConfigError, match="same number of dimensions"):
        backend.tensor(vrange, torch.float32, [4, 4], [1])
    with pytest.raises(ConfigError, match="non-negative"):
        backend.tensor(vrange, torch.float32, [4], [-1], offset_bytes=64)


def test_released_or_foreign_ranges_are_refused(backend):
    vrange = backend.reserve(2)
    backend.map(vrange, [0], [0])
    backend.release(vrange)
    assert vrange.page_table.tolist() == [-1, -1]
    with pytest.raises(MappingError, match="not reserved by this backend"):
        backend.map(vrange, [0], [0])
    with pytest.raises(MappingError, match="not reserved by this backend"):
        backend.release(vrange)
    with CpuBackend(PAGE, 4) as other:
        foreign = other.reserve(2)
        with pytest.raises(MappingError, match="not reserved by this backend"):
            backend.tensor(foreign, torch.uint8, [1], [1])


def test_closed_backend_refuses_and_close_is_idempotent():
    backend = CpuBackend(PAGE, 4)
    vrange = backend.reserve(2)
    backend.map(vrange, [0], [1])
    backend.close()
    backend.close()
    assert vrange.page_table.tolist() == [-1, -1]
    with pytest.raises(MappingError, match="closed"):
        backend.reserve(1)
    with pytest.raises(MappingError, match="closed"):
        backend.map(vrange, [0], [1])


def test_a_view_that_outlives_its_backend_stays_valid():
    gc.collect()  # backends other tests left to the collector give their mappings back now, not below
    budget = process_mapping_budget()
    used_before = budget.used
    backend = CpuBackend(PAGE, 4)
    fill_pages_with_their_index(backend)
    vrange = backend.reserve(2)
    backend.map(vrange, [1], [3])
    view, window = pages_view(backend, vrange), backend.pool_window()
    released_copy = VirtualRange(vrange.address, vrange.num_pages, vrange.page_size, vrange.page_table)
    del backend, vrange  # no close(): garbage collection must not unmap memory under live views
    gc.collect()
    assert torch.equal(view[1], page_pattern(3))
    assert window.view(torch.int32)[2, 0].item() == page_pattern(2)[0].item()
    assert budget.used == used_before
    assert kernel_mappings(released_copy) > 0
    del view, window  # the last views gone, the memory goes too
    gc.collect()
    assert kernel_mappings(released_copy) == 0


def test_threads_mapping_one_range_keep_the_table_exact():
    with CpuBackend(PAGE, 32) as backend:
        fill_pages_with_their_index(backend)
        vrange = backend.reserve(32)

        def worker(first: int) -> None:  # each thread owns virtual pages first .. first+7
            rng = np.random.default_rng(first)
            for _ in range(100):
                virt = np.arange(first, first + 8)
                backend.map(vrange, virt, rng.integers(0, 32, 8))
                backend.unmap(vrange, virt[rng.random(8) < 0.5])

        threads = [threading.Thread(target=worker, args=(first,)) for first in range(0, 32, 8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        view = pages_view(backend, vrange)
        for v, p in enumerate(vrange.page_table.tolist()):
            if p >= 0:
                assert torch.equal(view[v], page_pattern(p))
        expected = count_range_mappings(vrange.page_table)
        assert backend.mappings_in_use - 1 == expected == kernel_mappings(vrange)


def test_native_layer_rejects_bad_buffers_without_crashing():
    table = np.full(4, -1, np.int64)
    with pytest.raises(TypeError, match="int64"):
        _native.map_batch(-1, 0, PAGE, 4, table, np.array([0], np.int32), np.array([0]), 10)
    with pytest.raises(TypeError, match="writable"):
        readonly = table.copy()
        readonly.setflags(write=False)
        _native.map_batch(-1, 0, PAGE, 4, readonly, np.array([0]), np.array([0]), 10)
    with pytest.raises(ValueError, match="OS page"):
        _native.unmap_batch(0, PAGE + 1, table, np.array([0]), 10)
    with pytest.raises(IndexError, match="outside the reservation"):
        _native.map_each(-1, 0, PAGE, 4, 4, np.array([4]), np.array([0]))


def test_a_batch_sharing_memory_with_the_page_table_is_refused(backend):
    vrange = backend.reserve(4)
    backend.map(vrange, [0, 1, 2, 3], [3, 2, 1, 0])
    with pytest.raises(MappingError, match="shares memory with page_table"):
        backend.map(vrange, vrange.page_table[1:3], [30, 31])
    with pytest.raises(MappingError, match="shares memory with page_table"):
        backend.unmap(vrange, vrange.page_table)
    assert vrange.page_table.tolist() == [3, 2, 1, 0]


# ------------------------------------------------------------------ the mapping limit


def test_mapping_limit_is_refused_before_any_system_call():
    with CpuBackend(PAGE, 32, max_mappings=5) as backend:  # the window, and 4 for the range
        fill_pages_with_their_index(backend)
        vrange = backend.reserve(8)
        backend.map(vrange, [0, 1, 2], [3, 9, 5])  # three runs + the trailing gap: 4 VMAs
        assert backend.mappings_in_use == 5 and backend.mapping_room() == 0
        table, layout, calls = vrange.page_table.copy(), kernel_layout(vrange), backend.stats.map_calls

        with pytest.raises(MappingLimitError, match=r"needs 2 more kernel mappings .* max_mappings is 5"):
            backend.map(vrange, [4], [7])  # a lone page inside the gap: a run and a new gap
        assert np.array_equal(vrange.page_table, table)
        assert kernel_layout(vrange) == layout
        assert backend.stats.map_calls == calls
        assert torch.equal(pages_view(backend, vrange)[1], page_pattern(9))
        assert backend.mappings_in_use == 5

        backend.map(vrange, [3, 4], [6, 7])  # continues the run at v2: no new VMA, fine at the limit
        assert vrange.page_table.tolist() == [3, 9, 5, 6, 7, -1, -1, -1]
        layout = kernel_layout(vrange)
        with pytest.raises(MappingLimitError, match="larger page_size"):
            backend.unmap(vrange, [3])  # a hole inside the run 5, 6, 7 splits it
        assert vrange.page_table.tolist() == [3, 9, 5, 6, 7, -1, -1, -1]
        assert kernel_layout(vrange) == layout
        assert backend.stats.unmap_calls == 0
        with pytest.raises(MappingLimitError, match="reserve"):
            backend.reserve(1)
        backend.unmap(vrange, np.arange(8))
        assert backend.mappings_in_use == 2


def test_process_budget_is_returned_on_release_and_close():
    budget = process_mapping_budget()
    assert 0 < budget.limit < budget.max_map_count
    used_before = budget.used
    backend = CpuBackend(PAGE, 16)
    vrange = backend.reserve(16)
    backend.map(vrange, np.arange(0, 16, 2), np.arange(8))
    assert budget.used == used_before + backend.mappings_in_use
    backend.release(vrange)
    assert backend.mappings_in_use == 1
    backend.reserve(4)
    backend.close()
    assert budget.used == used_before


def test_create_backend_picks_the_cpu_backend():
    with create_backend("cpu", PAGE, 4) as backend:
        assert isinstance(backend, CpuBackend)
    with pytest.raises(ConfigError, match="unknown device"):
        create_backend("tpu", PAGE, 4)


def test_the_backend_reports_its_mapping_granularity(monkeypatch):
    import mmap

    from vmemkv.memory.vmm import device_granularity

    assert CpuBackend.granularity == mmap.PAGESIZE == device_granularity("cpu")
    with CpuBackend(PAGE, 4) as backend:
        assert backend.granularity == mmap.PAGESIZE and backend.page_size % backend.granularity == 0
    # No GPU: the documented CUDA default, without asking any driver.
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert device_granularity("cuda") == device_granularity("cuda:1") == 2 << 20
    with pytest.raises(ConfigError, match="unknown device"):
        device_granularity("tpu")


# ------------------------------------------------------------------ property: the table is the truth

NUM_PHYSICAL, NUM_VIRTUAL = 12, 10
virtual_page = st.integers(0, NUM_VIRTUAL - 1)
physical_page = st.integers(0, NUM_PHYSICAL - 1)
map_op = st.tuples(st.just("map"), st.lists(st.tuples(virtual_page, physical_page), max_size=8))
run_op = st.tuples(st.just("run"), st.tuples(virtual_page, physical_page, st.integers(1, 5)))
unmap_op = st.tuples(st.just("unmap"), st.lists(virtual_page, max_size=8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(map_op, run_op, unmap_op), min_size=1, max_size=12))
def test_random_map_unmap_batches_match_a_dict_model(ops):
    with CpuBackend(PAGE, NUM_PHYSICAL) as backend:
        fill_pages_with_their_index(backend)
        vrange = backend.reserve(NUM_VIRTUAL)
        view = pages_view(backend, vrange)
        model: dict[int, int] = {}
        for kind, args in ops:
            if kind == "map":
                backend.map(vrange, [v for v, _ in args], [p for _, p in args])
                model.update(dict(args))
            elif kind == "run":  # consecutive pages, clipped to the range and the pool
                v, p, length = args
                length = min(length, NUM_VIRTUAL - v, NUM_PHYSICAL - p)
                backend.map(vrange, np.arange(v, v + length), np.arange(p, p + length))
                model.update({v + i: p + i for i in range(length)})
            else:
                backend.unmap(vrange, args)
                for v in args:
                    model.pop(v, None)
            expected = [model.get(v, -1) for v in range(NUM_VIRTUAL)]
            assert vrange.page_table.tolist() == expected
            for v, p in model.items():
                assert torch.equal(view[v], page_pattern(p))
            assert backend.mappings_in_use - 1 == count_range_mappings(vrange.page_table)
            assert count_range_mappings(vrange.page_table) == kernel_mappings(vrange)


def test_a_failing_system_call_is_reported_and_the_table_stays_exact(backend):
    vrange = backend.reserve(4)
    backend.map(vrange, [0], [1])
    good_fd, backend._fd = backend._fd, -1  # make the OS refuse: mmap of a bad file descriptor
    try:
        with pytest.raises(MappingError, match="Bad file descriptor"):
            backend.map(vrange, [2, 3], [5, 6])
    finally:
        backend._fd = good_fd
    assert vrange.page_table.tolist() == [1, -1, -1, -1]
    assert backend.mappings_in_use - 1 == count_range_mappings(vrange.page_table) == kernel_mappings(vrange)
    backend.map(vrange, [2, 3], [5, 6])
    assert torch.equal(pages_view(backend, vrange)[3], page_pattern(6))
