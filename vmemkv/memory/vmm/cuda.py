"""The CUDA backend: the driver's virtual-memory API through cuda-python.

One ``cuMemCreate`` handle per physical page; ``cuMemAddressReserve`` for every range;
``cuMemMap`` per page and one ``cuMemSetAccess`` per run of consecutive virtual pages;
``cuMemUnmap`` per run, only after the device has finished (the driver does not wait for
kernels that may still read the range; PyTorch's "Note [Expandable Segments]" does the same).
Everything lives in torch's primary context of the device, so torch tensors and our mappings
share one address space.

Driver loading and result checks live in :mod:`vmemkv.memory.vmm.cuda_driver`, views over raw device
memory (DLPack) in :mod:`vmemkv.memory.vmm.dlpack`, index and view checks and page copies shared with the
CPU backend in :mod:`vmemkv.memory.vmm.base`. Importing this module needs only torch and numpy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from vmemkv.errors import ConfigError, CudaDriverError, MappingError
from vmemkv.memory.vmm.base import (HostRowCopier, MapStats, VirtualMemoryBackend, VirtualRange, check_indices,
                                    consecutive_runs, index_array, validate_map_request,
                                    validate_unmap_request)
# Re-exported: `from vmemkv.memory.vmm.cuda import load_driver` is the public spelling, and the backend
# looks these names up here, so tests can replace them with fakes (monkeypatch this module).
from vmemkv.memory.vmm.cuda_driver import (DEFAULT_GRANULARITY, access_desc, allocation_granularity,
                                           allocation_prop, call_driver, check_result, load_driver,
                                           resolve_device)
from vmemkv.memory.vmm.dlpack import tensor_from_address

__all__ = ["CudaBackend", "DEFAULT_GRANULARITY", "call_driver", "check_result", "load_driver",
           "tensor_from_address", "validate_map_request", "validate_unmap_request"]


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


class StreamRowCopier(HostRowCopier):
    """Row copies between pinned host rows and the GPU on a side stream, asynchronously for the
    host: the side stream first waits for the compute stream (the blocks' bytes are final), and
    the compute stream then waits for the copy's event, so the next kernel that writes or reads
    those blocks is ordered after the copy and the step thread never blocks. Copies on the side
    stream run in issue order, so a host row reused for another block is never overwritten
    before the earlier copy out of it finished. Rows on the host at both ends are copied there."""

    pin_host_memory = True

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None  # made at the first device copy

    def copy(self, dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor,
             src_rows: list[int]) -> None:
        device = dst.device if dst.is_cuda else src.device
        if not device.type == "cuda":
            super().copy(dst, dst_rows, src, src_rows)
            return
        compute = torch.cuda.current_stream(device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            for d, s in zip(dst_rows, src_rows):
                dst[d].copy_(src[s], non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._stream)
        compute.wait_event(done)


class CudaBackend(VirtualMemoryBackend):
    """Physical pages are ``cuMemCreate`` handles on one GPU; ranges are driver reservations.

    ``stats.map_calls`` counts ``cuMemMap`` calls (one per page: a handle is one page);
    ``access_calls`` counts ``cuMemSetAccess`` calls (one per run of consecutive virtual pages);
    ``stats.unmap_calls`` counts ``cuMemUnmap`` calls (one per run). The pool window is not
    counted in ``stats``.
    """

    copy_by_gather = True
    granularity = DEFAULT_GRANULARITY  # an instance has its GPU's, asked of the driver
    window_holes_need_page = True  # FlashAttention may load a tile before the window start
    host_row_copier = StreamRowCopier

    @classmethod
    def device_granularity(cls, device: int | str | torch.device = 0) -> int:
        """The allocation granularity of GPU ``device`` in bytes, without building a backend.

        Asks the driver where a GPU and cuda-python are present; anywhere else (a CPU machine,
        a driver that cannot answer) returns the documented default, ``DEFAULT_GRANULARITY``.
        """
        if not torch.cuda.is_available():
            return DEFAULT_GRANULARITY
        try:
            index = torch.device(device).index if not isinstance(device, int) else device
            driver = load_driver()
            call_driver(driver, "cuInit", 0)
            return allocation_granularity(driver, allocation_prop(driver, index or 0))
        except Exception:  # noqa: BLE001 -- the backend itself reports a broken driver clearly
            return DEFAULT_GRANULARITY

    def __init__(self, page_size: int | None = None, num_pages: int = 0,
                 device: int | str | torch.device = 0) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) \
                or num_pages < 1:
            raise ConfigError(f"num_pages must be a positive integer; got {num_pages!r}")
        self.num_pages = int(num_pages)
        if not torch.cuda.is_available():
            raise ConfigError("the CUDA backend needs a CUDA GPU, and torch.cuda.is_available() "
                              "is False; use the CPU backend (vmemkv.memory.vmm.cpu) instead")
        self._driver = load_driver()
        self.device = resolve_device(device)
        self.stats = MapStats()
        self.access_calls = 0
        self._closed = True  # until the constructor has finished
        self._ranges: dict[VirtualRange, torch.Tensor | None] = {}
        self._handles: list[Any] = []
        self._window_address: int | None = None
        self._window: torch.Tensor | None = None
        self._in_window: np.ndarray | None = None  # per page: mapped in the window (once made)
        self._pages_out: set[int] = set()  # given back and not yet taken again (wholly)
        self._ctx = None
        self._ctx_id = 0

        ordinal = self.device.index
        torch.cuda.init()
        self._call("cuInit", 0)
        self._cu_device = self._call("cuDeviceGet", ordinal)
        supported = self._call(
            "cuDeviceGetAttribute",
            self._driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            self._cu_device)
        if not supported:
            raise ConfigError(f"GPU {ordinal} does not support CUDA virtual memory management "
                              f"(cuMemMap); use the CPU backend or a newer GPU/driver")
        self._ctx = self._call("cuDevicePrimaryCtxRetain", self._cu_device)
        self._ctx_id = int(self._ctx)
        self._closed = False
        try:
            with self._context():
                self._prop = allocation_prop(self._driver, ordinal)
                self._access = access_desc(self._driver, ordinal)
                self.granularity = allocation_granularity(self._driver, self._prop)
                self.page_size = self._check_page_size(page_size)
                self._create_pages()
        except BaseException:
            self.close()
            raise

    # -- setup --------------------------------------------------------------------------------

    def _check_page_size(self, page_size: int | None) -> int:
        if page_size is None:
            return self.granularity
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
                or page_size <= 0 or page_size % self.granularity:
            raise ConfigError(
                f"page_size {page_size!r} is not a positive multiple of the CUDA allocation "
                f"granularity {self.granularity} bytes of GPU {self.device.index}; use "
                f"{self.granularity} or a multiple of it")
        return int(page_size)

    def _create_pages(self) -> None:
        total = self.num_pages * self.page_size
        for i in range(self.num_pages):
            self._handles.append(self._call(
                "cuMemCreate", self.page_size, self._prop, 0,
                context=lambda: f"creating physical page {i} of {self.num_pages}, "
                                f"{self.page_size} bytes each, {_gib(total)} in all; lower "
                                f"num_pages or free GPU memory"))

    # -- driver plumbing ----------------------------------------------------------------------

    def _call(self, function: str, *args: Any, context: str | Callable[[], str] = "") -> Any:
        return call_driver(self._driver, function, *args, context=context)

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        """Run driver calls in torch's primary context of our device, restoring the caller's."""
        current = self._call("cuCtxGetCurrent")
        if current is not None and int(current) == self._ctx_id:
            yield
            return
        self._call("cuCtxPushCurrent", self._ctx)
        try:
            yield
        finally:
            self._call("cuCtxPopCurrent")

    def _check_range(self, vrange: VirtualRange) -> None:
        self._check_open()
        if vrange not in self._ranges:
            raise MappingError(f"range at {vrange.address:#x} was not reserved by this backend "
                               f"or has been released")

    def _unmap_pages(self, vrange: VirtualRange, pages: np.ndarray) -> None:
        """cuMemUnmap each run of consecutive mapped ``pages`` (sorted, unique); the caller has
        synchronized. The page table follows every successful call."""
        start = time.perf_counter()
        try:
            for run_start, length in consecutive_runs(pages):
                self._call("cuMemUnmap", vrange.address + run_start * vrange.page_size,
                           length * vrange.page_size,
                           context=lambda: f"unmapping virtual pages {run_start}.."
                                           f"{run_start + length - 1}")
                vrange.page_table[run_start:run_start + length] = -1
                self.stats.unmap_calls += 1
                self.stats.pages_unmapped += length
        finally:
            self.stats.unmap_seconds += time.perf_counter() - start

    # -- the interface ------------------------------------------------------------------------

    def reserve(self, num_pages: int) -> VirtualRange:
        self._check_open()
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) \
                or num_pages < 1:
            raise ConfigError(f"reserve needs a positive number of pages; got {num_pages!r}")
        size = int(num_pages) * self.page_size
        with self._context():
            address = int(self._call("cuMemAddressReserve", size, self._alignment(), 0, 0,
                                     context=f"reserving {num_pages} pages, {_gib(size)}"))
        vrange = VirtualRange(address=address, num_pages=int(num_pages), page_size=self.page_size,
                              page_table=np.full(int(num_pages), -1, dtype=np.int64))
        self._ranges[vrange] = None
        return vrange

    def _alignment(self) -> int:
        # cuMemAddressReserve wants a power of two; every page start is granularity-aligned.
        ps = self.page_size
        return ps if ps & (ps - 1) == 0 else self.granularity

    def release(self, vrange: VirtualRange) -> None:
        self._check_range(vrange)
        mapped = vrange.mapped_pages()
        if mapped.size:
            self.synchronize()  # the device may still read these pages
        with self._context():
            if mapped.size:
                self._unmap_pages(vrange, mapped)
            self._call("cuMemAddressFree", vrange.address, vrange.size)
        del self._ranges[vrange]

    def map(self, vrange: VirtualRange, virtual_pages: Sequence[int] | np.ndarray,
            physical_pages: Sequence[int] | np.ndarray) -> None:
        began = time.perf_counter() if self.metrics is not None else 0.0
        self._check_range(vrange)
        virtual, physical = validate_map_request(vrange, virtual_pages, physical_pages,
                                                 self.num_pages)
        current = vrange.page_table[virtual]
        changed = current != physical  # mapping a page where it already is costs nothing
        virtual, physical, current = virtual[changed], physical[changed], current[changed]
        if virtual.size == 0:
            return
        self.take_pages(physical)  # given-back pages get memory again first
        base = vrange.address
        remapped = virtual[current >= 0]  # CUDA cannot map over a mapping: unmap those first,
        if remapped.size:                 # once the device is done with them
            self.synchronize()
        with self._context():
            if remapped.size:
                self._unmap_pages(vrange, remapped)
            start = time.perf_counter()
            try:
                position = 0
                for run_start, length in consecutive_runs(virtual):
                    run_physical = physical[position:position + length]
                    position += length
                    self._map_run(base, run_start, run_physical)
                    vrange.page_table[run_start:run_start + length] = run_physical
            finally:
                self.stats.map_seconds += time.perf_counter() - start
        if self.metrics is not None:
            self.metrics.record_mapping(time.perf_counter() - began)

    def _map_run(self, base: int, run_start: int, run_physical: np.ndarray) -> None:
        """Map one run of consecutive virtual pages and open it for the device, all or nothing."""
        ps, done = self.page_size, 0
        try:
            for k, page in enumerate(run_physical):
                self._call("cuMemMap", base + (run_start + k) * ps, ps, 0,
                           self._handles[int(page)], 0,
                           context=lambda: f"mapping physical page {int(page)} at virtual "
                                           f"page {run_start + k}")
                done += 1
                self.stats.map_calls += 1
            self._call("cuMemSetAccess", base + run_start * ps, len(run_physical) * ps,
                       [self._access], 1,
                       context=lambda: f"opening virtual pages {run_start}.."
                                       f"{run_start + done - 1}")
            self.access_calls += 1
            self.stats.pages_mapped += len(run_physical)
        except BaseException:
            if done:  # give the addresses of this run back; nothing was visible yet
                with contextlib.suppress(CudaDriverError):
                    self._call("cuMemUnmap", base + run_start * ps, done * ps)
            raise

    def unmap(self, vrange: VirtualRange, virtual_pages: Sequence[int] | np.ndarray) -> None:
        began = time.perf_counter() if self.metrics is not None else 0.0
        self._check_range(vrange)
        virtual = validate_unmap_request(vrange, virtual_pages)
        virtual = virtual[vrange.page_table[virtual] >= 0]  # already unmapped: nothing to do
        if virtual.size == 0:
            return
        self.synchronize()  # the device may still read these pages
        with self._context():
            self._unmap_pages(vrange, virtual)
        if self.metrics is not None:
            self.metrics.record_mapping(time.perf_counter() - began)

    def pool_window(self) -> torch.Tensor:
        self._check_open()
        if self._window is None:
            size = self.num_pages * self.page_size
            with self._context():
                address = int(self._call("cuMemAddressReserve", size, self._alignment(), 0, 0,
                                         context=f"reserving the pool window, {_gib(size)}"))
                live = np.flatnonzero([h is not None for h in self._handles])
                in_window = np.zeros(self.num_pages, dtype=bool)
                try:
                    for first, count in consecutive_runs(live):
                        self._map_window_run(address, first, count)
                        in_window[first:first + count] = True
                except BaseException:
                    with contextlib.suppress(CudaDriverError):
                        for first, count in consecutive_runs(np.flatnonzero(in_window)):
                            self._call("cuMemUnmap", address + first * self.page_size,
                                       count * self.page_size)
                        self._call("cuMemAddressFree", address, size)
                    raise
            self._window_address, self._in_window = address, in_window
            self._window = tensor_from_address(address, size, self.device).view(
                self.num_pages, self.page_size)
        return self._window

    def _map_window_run(self, address: int, first: int, count: int) -> None:
        """Map pages ``first .. first+count-1`` at their place in the window, all or nothing."""
        ps, done = self.page_size, 0
        try:
            for page in range(first, first + count):
                self._call("cuMemMap", address + page * ps, ps, 0, self._handles[page], 0,
                           context=lambda: f"mapping physical page {page} in the window")
                done += 1
            self._call("cuMemSetAccess", address + first * ps, count * ps, [self._access], 1,
                       context="opening the pool window")
        except BaseException:
            if done:
                with contextlib.suppress(CudaDriverError):
                    self._call("cuMemUnmap", address + first * ps, done * ps)
            raise

    # -- giving memory back: cuMemRelease frees a handle once no mapping holds it; a take: a new one
    can_discard = True
    takes_pages_back = True

    def discard_pages(self, pages: Sequence[int]) -> int:
        """Unmap every mapping of physical pages ``pages`` (the window's, and any range's: those
        page tables then say -1), then release their handles; pages given back already are
        skipped. ``take_pages`` (or a map naming them) gives them memory again."""
        self._check_open()
        pages = np.unique(check_indices(index_array(pages, "pages"), self.num_pages,
                                        "physical page", "pool"))
        pages = pages[[self._handles[p] is not None for p in pages.tolist()]]
        if not pages.size:
            return 0
        start = time.perf_counter()
        self.synchronize()  # the device may still read these pages
        going, ps = np.zeros(self.num_pages + 1, dtype=bool), self.page_size  # [-1]: unmapped
        going[pages] = True
        with self._context():
            for vrange in self._ranges:
                mapped = np.flatnonzero(going[vrange.page_table])
                if mapped.size:
                    self._unmap_pages(vrange, mapped)
            for first, count in consecutive_runs(pages):
                if self._in_window is not None:
                    self._call("cuMemUnmap", self._window_address + first * ps, count * ps,
                               context=lambda: f"unmapping pages from {first} in the window")
                    self._in_window[first:first + count] = False
                for page in range(first, first + count):
                    self._call("cuMemRelease", self._handles[page],
                               context=lambda: f"giving physical page {page} back")
                    self._handles[page] = None
                    self._pages_out.add(page)
        self.stats.pages_discarded += len(pages)
        self.stats.discard_seconds += time.perf_counter() - start
        return len(pages)

    def take_pages(self, pages: Sequence[int] | np.ndarray) -> None:
        """New handles (bytes undefined) for given-back pages among ``pages``, in the window if made."""
        self._check_open()
        wanted = self._pages_out.intersection(index_array(pages, "pages").tolist()) \
            if self._pages_out else None
        if not wanted:
            return  # the usual case: one set lookup, no driver call
        handles, in_window = self._handles, self._in_window
        with self._context():
            for page in sorted(wanted):
                if handles[page] is None:
                    handles[page] = self._call(
                        "cuMemCreate", self.page_size, self._prop, 0,
                        context=lambda: f"taking physical page {page} again, {self.page_size} "
                                        "bytes; free GPU memory or lower num_blocks")
            if in_window is not None:  # a page made above, or one a failed take left out
                for first, count in consecutive_runs(sorted(p for p in wanted if not in_window[p])):
                    self._map_window_run(self._window_address, first, count)
                    in_window[first:first + count] = True
        self._pages_out -= wanted  # only once every step succeeded: a failed take is retried

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.take_pages(dst)  # a copy's target may be a page given back
        super().copy_pages(src, dst)

    def resident_bytes(self) -> int:
        """Bytes of the pages that have a handle (every page but those given back)."""
        return sum(h is not None for h in self._handles) * self.page_size

    def _range_bytes(self, vrange: VirtualRange) -> torch.Tensor:
        self._check_range(vrange)
        base = self._ranges[vrange]
        if base is None:
            base = tensor_from_address(vrange.address, vrange.size, self.device)
            self._ranges[vrange] = base
        return base

    def synchronize(self) -> None:
        if not self._closed:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Synchronize, unmap and free every range and the window, release every page.

        Idempotent. Tensors made by this backend must not be used afterwards.
        """
        if self._closed and self._ctx is None:
            return
        errors: list[BaseException] = []

        def attempt(fn, *args):
            try:
                fn(*args)
            except Exception as exc:  # keep freeing; report the first failure at the end
                errors.append(exc)

        was_open, self._closed = not self._closed, True
        if was_open:
            attempt(torch.cuda.synchronize, self.device)
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self._context())
            except Exception as exc:
                errors.append(exc)
            for vrange in list(self._ranges):
                mapped = vrange.mapped_pages()
                if mapped.size:
                    attempt(self._unmap_pages, vrange, mapped)
                attempt(self._call, "cuMemAddressFree", vrange.address, vrange.size)
            self._ranges.clear()
            if self._window_address is not None:
                size, ps = self.num_pages * self.page_size, self.page_size
                for first, count in consecutive_runs(np.flatnonzero(self._in_window)):
                    attempt(self._call, "cuMemUnmap", self._window_address + first * ps, count * ps)
                attempt(self._call, "cuMemAddressFree", self._window_address, size)
                self._window_address, self._window, self._in_window = None, None, None
            for handle in self._handles:
                if handle is not None:
                    attempt(self._call, "cuMemRelease", handle)
            self._handles.clear()
        if self._ctx is not None:
            attempt(self._call, "cuDevicePrimaryCtxRelease", self._cu_device)
            self._ctx = None
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._ranges)} ranges"
        return (f"CudaBackend(device={self.device}, page_size={getattr(self, 'page_size', None)}, "
                f"num_pages={self.num_pages}, {state})")
