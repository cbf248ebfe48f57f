"""The CPU backend: real virtual memory with memfd pages and mmap.

Physical pages are the ``num_pages`` page-sized pieces of one ``memfd``. A virtual range is a
``mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)`` reservation; mapping physical page
``p`` at virtual page ``v`` is ``mmap(base + v * page_size, MAP_SHARED | MAP_FIXED, memfd,
p * page_size)``, so one physical page mapped at two addresses shows the same bytes, as with
``cuMemMap`` on the GPU. The batched mapper is C (``vmemkv._native``): one ``mmap`` costs ~4-5 µs
even from C, so the Python layer only checks and counts, and runs of consecutive virtual pages
backed by consecutive physical pages are mapped with one call.

The mapping limit, and why it matters for the page size
--------------------------------------------------------
Linux caps the separate mappings (VMAs) of a process at ``vm.max_map_count`` (65,530 by default).
The kernel merges neighbours that are both reservation or both the memfd at consecutive offsets,
so a range costs one VMA per *run* of consecutive physical pages plus one per unmapped gap: with R
runs at most 2R + 1. A slot mapped from its start with scattered pages costs about one VMA per
page. The backend counts VMAs exactly (the count changes only next to a changed page) and raises
:class:`MappingLimitError` *before* any system call that would exceed its budget:
``vm.max_map_count`` minus what the rest of the process already maps, minus a safety margin of
``max(4096, 10 %)`` for libraries, threads and malloc arenas that map later. That leaves ~58,000
VMAs here, i.e. ~58,000 scattered pages in use at once across all slots: ~3.6 GiB of KV with 64 KiB
pages, ~116 GiB with 2 MiB pages. So choose ``page_size >= kv_bytes_in_use / 50_000``, hand out
consecutive pages where possible (each run is one VMA), or raise ``vm.max_map_count``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from vmemkv.errors import ConfigError, MappingError, MappingLimitError, NativeExtensionError
from vmemkv.memory.vmm.base import MapStats, VirtualMemoryBackend, VirtualRange, index_array
from vmemkv.memory.vmm.cpu_limits import (budget_lock, count_range_mappings, huge_page_info,
                                          process_mapping_budget)

# The compiled batch mapper, loaded by the first CpuBackend (load_native): `import vmemkv` and the
# CUDA backend must work where the C extension was not built (a GPU machine may build it with an
# older toolchain, or not at all).
_native: ModuleType | None = None

OS_PAGE_SIZE = mmap.PAGESIZE

# fallocate(2) with its flags, for giving pages back (Python's os has only posix_fallocate)
_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_KEEP_SIZE, _PUNCH_HOLE = 0x01, 0x02


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ``pages`` as runs ``(first, count)`` of consecutive pages."""
    runs: list[list[int]] = []
    for page in pages:
        if runs and page == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([page, 1])
    return [(first, count) for first, count in runs]

def load_native() -> ModuleType:
    """The ``vmemkv._native`` module; raises :class:`NativeExtensionError` when it is not built."""
    global _native
    if _native is None:
        try:
            from vmemkv import _native as module
        except ImportError as e:
            raise NativeExtensionError(
                f"the CPU backend needs the compiled extension vmemkv._native, which cannot be "
                f"imported ({e}); build it from the repository root with `pip install -e .` or "
                f"`python setup.py build_ext --inplace` (needs a C compiler and the Python headers). "
                f"The CUDA backend (device='cuda') does not need it") from e
        _native = module
    return _native


class _Region:
    """One span of address space this backend mmap'ed (a reservation or the pool window).

    Tensors over it keep it alive (tensor -> ctypes array -> region), so garbage collection never
    unmaps memory under a live view: only an explicit ``release``/``close`` does, and after that
    the views must not be used.
    """

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size

    def bytes_tensor(self) -> torch.Tensor:
        """A uint8 tensor over the whole region; zero copy, touches no memory."""
        array = (ctypes.c_uint8 * self.size).from_address(self.address)
        array.region = self  # frombuffer keeps `array` alive, `array` keeps the region
        return torch.frombuffer(array, dtype=torch.uint8)

    def unmap(self) -> None:
        if self.address:
            address, self.address = self.address, 0
            _native.release(address, self.size)

    def __del__(self) -> None:
        try:  # at interpreter exit _native may be gone; the OS reclaims the memory then
            self.unmap()
        except Exception:  # noqa: BLE001, S110 -- a destructor must not raise
            pass


@dataclass(eq=False)
class _RangeState:
    vrange: VirtualRange
    mappings: int  # VMAs this range costs now
    region: _Region
    # uint8 over the whole range; tensor() views derive from it. Never printed: printing reads
    # every byte, and unmapped pages fault.
    bytes_view: torch.Tensor = field(repr=False)


class CpuBackend(VirtualMemoryBackend):
    """Virtual ranges in this process's address space, physical pages in a memfd.

    ``max_mappings`` caps the VMAs this backend may hold (ranges, mapped runs, gaps and the pool
    window) on top of the process-wide budget; tests use it to reach the limit cheaply.
    """

    granularity = OS_PAGE_SIZE  # the huge page size on an instance with huge_pages=True
    batched_reads_need_filler = True  # CPU attention reads several whole slots in one call

    def __init__(self, page_size: int, num_pages: int, huge_pages: bool = False,
                 max_mappings: int | None = None) -> None:
        load_native()  # first, so a missing build is reported before anything is created
        self.page_size = int(page_size)
        self.num_pages = int(num_pages)
        self.huge_pages = huge_pages
        self.device = torch.device("cpu")
        self.stats = MapStats()
        self.max_mappings = max_mappings
        self._fd = -1
        self._closed = False
        self._mappings_used = 0
        self._ranges: dict[int, _RangeState] = {}
        self._window: torch.Tensor | None = None
        self._window_region: _Region | None = None
        self._check_config()
        self._budget = process_mapping_budget()
        self._create_pool()

    # ---------------------------------------------------------------- construction

    def _check_config(self) -> None:
        if self.page_size <= 0 or self.page_size % OS_PAGE_SIZE != 0:
            raise ConfigError(f"page_size {self.page_size} is not a positive multiple of the OS page "
                              f"({OS_PAGE_SIZE} bytes); use e.g. {64 * 1024} or {2 * 1024 * 1024}")
        if self.num_pages <= 0:
            raise ConfigError(f"num_pages must be positive, got {self.num_pages}")
        if self.max_mappings is not None and self.max_mappings < 1:
            raise ConfigError(f"max_mappings must be at least 1 (the pool window), got {self.max_mappings}")
        if self.huge_pages:
            self._check_huge_pages()

    def _check_huge_pages(self) -> None:
        total, huge_size = huge_page_info()
        if total <= 0 or huge_size <= 0:
            raise ConfigError("huge_pages=True but the OS has no huge pages reserved (HugePages_Total "
                              "is 0 in /proc/meminfo); reserve some with `sysctl vm.nr_hugepages=N` "
                              "or use huge_pages=False")
        if self.page_size % huge_size != 0:
            raise ConfigError(f"page_size {self.page_size} is not a multiple of the huge page size "
                              f"({huge_size} bytes); use a multiple of it or huge_pages=False")
        if total * huge_size < self.num_pages * self.page_size:
            raise ConfigError(f"the pool needs {self.num_pages * self.page_size} bytes of huge pages but "
                              f"the OS reserves {total} x {huge_size} bytes; raise vm.nr_hugepages or "
                              f"shrink num_pages")
        self.granularity = huge_size

    def _create_pool(self) -> None:
        flags = os.MFD_CLOEXEC | (os.MFD_HUGETLB if self.huge_pages else 0)
        pool_bytes = self.num_pages * self.page_size
        try:
            self._fd = os.memfd_create("vmemkv-pool", flags)
            os.ftruncate(self._fd, pool_bytes)
        except OSError as e:
            self.close()
            raise ConfigError(f"cannot create a memfd pool of {self.num_pages} pages x {self.page_size} "
                              f"bytes: {e}") from e
        try:
            self._charge(1, "map the pool window")
        except MappingLimitError:
            self.close()
            raise
        try:
            self._window_region = _Region(_native.map_shared(self._fd, pool_bytes), pool_bytes)
        except OSError as e:
            self.close()  # gives the window's charge back with the rest
            raise MappingError(f"cannot map the pool window ({pool_bytes} bytes): {e}") from e
        self._window = self._window_region.bytes_tensor().view(self.num_pages, self.page_size)

    # ---------------------------------------------------------------- mapping budget

    @property
    def mappings_in_use(self) -> int:
        """VMAs this backend holds now (ranges, runs, gaps, the pool window)."""
        return self._mappings_used

    def mapping_room(self, charged_elsewhere: int = 0, charged_here: int = 0) -> int:
        """How many more VMAs this backend may use before map/unmap/reserve is refused; with
        ``charged_elsewhere``, once other backends of the process hold that many more, and with
        ``charged_here``, once this one does (a caller planning mappings in several backends, or
        several reservations of this one, before making any)."""
        room = self._budget.limit - self._budget.used - charged_elsewhere - charged_here
        if self.max_mappings is not None:
            room = min(room, self.max_mappings - self._mappings_used - charged_here)
        return room

    def _charge(self, count: int, what: str) -> None:
        with budget_lock:
            room = self.mapping_room()
            if count > room:
                raise MappingLimitError(self._limit_message(what, count, room))
            self._account(count)

    def _uncharge(self, count: int) -> None:
        with budget_lock:
            self._account(-count)

    def _account(self, delta: int) -> None:
        self._mappings_used += delta
        self._budget.used += delta

    def _limit_message(self, what: str, needed: int, room: int) -> str:
        if self.max_mappings is not None and self.max_mappings - self._mappings_used == room:
            limit = f"this backend's max_mappings is {self.max_mappings} and it holds {self._mappings_used}"
        else:
            limit = f"{self._budget.describe()}, and {self._budget.used} are in use"
        return (f"refused to {what}: it needs {needed} more kernel mappings (VMAs) but only {room} are "
                f"left ({limit}); nothing was changed. Each run of consecutive physical pages and each "
                f"unmapped gap is one mapping: use a larger page_size, fewer slots or a shorter "
                f"max_model_len, hand out consecutive pages, or raise vm.max_map_count "
                f"(sysctl -w vm.max_map_count=...)")

    # ---------------------------------------------------------------- ranges

    def reserve(self, num_pages: int) -> VirtualRange:
        self._check_open()
        num_pages = int(num_pages)
        if num_pages <= 0:
            raise ConfigError(f"reserve needs a positive number of pages, got {num_pages}")
        size = num_pages * self.page_size
        self._charge(1, f"reserve {num_pages} pages")
        try:
            address = _native.reserve(size, self.granularity)
        except OSError as e:
            self._uncharge(1)
            raise MappingError(f"cannot reserve {size} bytes of address space: {e}") from e
        vrange = VirtualRange(address, num_pages, self.page_size, np.full(num_pages, -1, np.int64))
        region = _Region(address, size)
        self._ranges[address] = _RangeState(vrange, 1, region, region.bytes_tensor())
        return vrange

    def release(self, vrange: VirtualRange) -> None:
        """Give the range back. Tensors viewing it must not be used afterwards (they would fault)."""
        state = self._state(vrange)
        del self._ranges[vrange.address]
        state.region.unmap()
        self._uncharge(state.mappings)
        vrange.page_table[:] = -1

    def _state(self, vrange: VirtualRange) -> _RangeState:
        self._check_open()
        state = self._ranges.get(vrange.address)
        if state is None or state.vrange is not vrange:
            raise MappingError(f"range at {vrange.address:#x} is not reserved by this backend "
                               f"(released already, or from another backend)")
        return state

    # ---------------------------------------------------------------- map / unmap

    # The hot path: numpy arrays go to C as they are (C takes 1-D int64 ones without a copy and
    # raises TypeError for anything else, before changing anything); other inputs are converted
    # first. Few Python calls per batch: at one page per batch they cost as much as the mmap.

    def map(self, vrange: VirtualRange, virtual_pages: Sequence[int] | np.ndarray,
            physical_pages: Sequence[int] | np.ndarray) -> None:
        start = time.perf_counter() if self.metrics is not None else 0.0
        state = self._ranges.get(vrange.address)
        if state is None or state.vrange is not vrange:
            state = self._state(vrange)  # raises MappingError
        if type(virtual_pages) is not np.ndarray or type(physical_pages) is not np.ndarray:
            virtual_pages = index_array(virtual_pages, "virtual_pages")
            physical_pages = index_array(physical_pages, "physical_pages")
        head = (self._fd, vrange.address, self.page_size, self.num_pages, vrange.page_table)
        try:
            calls, seconds = self._run_batch(state, "map", _native.map_batch,
                                             (*head, virtual_pages, physical_pages))
        except TypeError:  # numpy, but not 1-D contiguous int64: convert and go again
            virtual_pages = index_array(virtual_pages, "virtual_pages")
            physical_pages = index_array(physical_pages, "physical_pages")
            calls, seconds = self._run_batch(state, "map", _native.map_batch,
                                             (*head, virtual_pages, physical_pages))
        stats = self.stats
        stats.map_calls += calls
        stats.map_seconds += seconds
        stats.pages_mapped += len(virtual_pages)
        if self.metrics is not None:
            self.metrics.record_mapping(time.perf_counter() - start)

    def unmap(self, vrange: VirtualRange, virtual_pages: Sequence[int] | np.ndarray) -> None:
        start = time.perf_counter() if self.metrics is not None else 0.0
        state = self._ranges.get(vrange.address)
        if state is None or state.vrange is not vrange:
            state = self._state(vrange)
        if type(virtual_pages) is not np.ndarray:
            virtual_pages = index_array(virtual_pages, "virtual_pages")
        head = (vrange.address, self.page_size, vrange.page_table)
        try:
            calls, seconds = self._run_batch(state, "unmap", _native.unmap_batch, (*head, virtual_pages))
        except TypeError:
            virtual_pages = index_array(virtual_pages, "virtual_pages")
            calls, seconds = self._run_batch(state, "unmap", _native.unmap_batch, (*head, virtual_pages))
        stats = self.stats
        stats.unmap_calls += calls
        stats.unmap_seconds += seconds
        stats.pages_unmapped += len(virtual_pages)
        if self.metrics is not None:
            self.metrics.record_mapping(time.perf_counter() - start)

    def _run_batch(self, state: _RangeState, what: str, native_batch, args: tuple) -> tuple[int, float]:
        """One native batch under the lock: pass it the VMA room left, refuse if it needs more
        (C has then changed nothing), account the VMAs. Returns (system calls, seconds)."""
        budget = self._budget
        budget_lock.acquire()  # explicit acquire/release: half the cost of `with` on the hot path
        try:
            room = self.mapping_room()
            start = time.perf_counter()
            try:
                calls, delta = native_batch(*args, room)
            except (IndexError, ValueError) as e:
                raise MappingError(f"{what} refused, nothing changed: {e}") from None
            except OSError as e:
                self._resync(state)
                raise MappingError(f"the OS refused to {what} pages (pages before the failing call are "
                                   f"done, the failing run is unmapped; page_table is exact): {e}") from e
            if delta:
                if delta > 0 and delta > room:  # C refused and changed nothing
                    hint = " (unmapping inside a run splits it)" if what == "unmap" else ""
                    message = f"{what} {len(args[-1])} pages{hint}"
                    raise MappingLimitError(self._limit_message(message, delta, room))
                self._mappings_used += delta
                budget.used += delta
                state.mappings += delta
            return calls, time.perf_counter() - start
        finally:
            budget_lock.release()

    def _resync(self, state: _RangeState) -> None:
        """After a failed system call: recount the range's VMAs from its (exact) page table."""
        actual = count_range_mappings(state.vrange.page_table)
        self._account(actual - state.mappings)
        state.mappings = actual

    # ---------------------------------------------------------------- pages and tensors

    def pool_window(self) -> torch.Tensor:
        self._check_open()
        return self._window

    def _range_bytes(self, vrange: VirtualRange) -> torch.Tensor:
        state = self._ranges.get(vrange.address)
        if state is None or state.vrange is not vrange:
            state = self._state(vrange)  # raises MappingError
        return state.bytes_view

    # ---------------------------------------------------------------- giving memory back

    can_discard = True

    def discard_pages(self, pages: Sequence[int]) -> int:
        """Punch the pages out of the memfd (``fallocate(PUNCH_HOLE)``, one call per run of
        consecutive pages): the page cache frees them, every mapping of them stays and reads
        zeros, and the next write faults a fresh page in."""
        self._check_open()
        pages = sorted(set(index_array(pages, "pages").tolist()))
        if pages and not 0 <= pages[0] <= pages[-1] < self.num_pages:
            raise MappingError(f"discard_pages: pages must lie in [0, {self.num_pages}); got "
                               f"{pages[0]}..{pages[-1]}")
        start = time.perf_counter()
        for first, count in _runs(pages):
            if _fallocate(self._fd, _PUNCH_HOLE | _KEEP_SIZE, first * self.page_size,
                          count * self.page_size) != 0:
                errno = ctypes.get_errno()
                raise MappingError(f"fallocate(PUNCH_HOLE) of {count} pages refused: {os.strerror(errno)}")
        self.stats.pages_discarded += len(pages)
        self.stats.discard_seconds += time.perf_counter() - start
        return len(pages)

    def resident_bytes(self) -> int:
        """The memfd's allocated bytes (``st_blocks``): the pool's, the filler's and the hole
        page's pages touched and not given back."""
        self._check_open()
        return os.fstat(self._fd).st_blocks * 512

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Unmap every range and the pool window and close the memfd. Safe to call twice; views
        of this backend's memory must not be used afterwards."""
        self._shut_down(unmap=True)

    def _shut_down(self, unmap: bool) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for state in self._ranges.values():
            state.vrange.page_table[:] = -1
            if unmap:
                state.region.unmap()
        self._ranges.clear()
        if unmap and self._window_region is not None:
            self._window_region.unmap()
        self._window = self._window_region = None
        if self._fd >= 0:  # mappings still alive keep the memfd's pages until they go
            os.close(self._fd)
            self._fd = -1
        if getattr(self, "_budget", None) is not None:
            with budget_lock:
                self._account(-self._mappings_used)

    def __del__(self) -> None:
        # Garbage collection only drops references: ranges and the window are unmapped when their
        # last tensor goes, so a view that outlives its backend stays valid.
        try:
            self._shut_down(unmap=False)
        except Exception:  # noqa: BLE001, S110 -- a destructor must not raise
            pass

    def __repr__(self) -> str:
        return (f"CpuBackend(page_size={self.page_size}, num_pages={self.num_pages}, "
                f"ranges={len(self._ranges)}, mappings={self._mappings_used})")

