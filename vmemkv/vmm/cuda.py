"""The CUDA backend: the driver's virtual-memory API through cuda-python.

One ``cuMemCreate`` handle per physical page; ``cuMemAddressReserve`` for every range;
``cuMemMap`` per page and one ``cuMemSetAccess`` per run of consecutive virtual pages;
``cuMemUnmap`` per run, only after the device has finished (the driver does not wait for
kernels that may still read the range; PyTorch's "Note [Expandable Segments]" does the same).
Everything lives in torch's primary context of the device, so torch tensors and our mappings
share one address space.

Views over raw device memory are built through a DLPack capsule, not
``__cuda_array_interface__``: DLPack names the device explicitly, so torch never asks the
driver about the pointer (which fails on reserved addresses that have nothing mapped yet), and
creating a view never touches memory.

cuda-python is imported lazily: importing this module needs only torch and numpy; the pure
helpers here (run coalescing, the driver result check, the view builder) are tested on CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from vmemkv.errors import ConfigError, CudaDriverError, MappingError
from vmemkv.vmm.base import MapStats, VirtualMemoryBackend, VirtualRange

_INSTALL_HINT = ("pip install cuda-bindings (or install vmemkv with the [cuda] extra: "
                 "pip install 'vmemkv[cuda]')")


# --------------------------------------------------------------------------------------------
# Driver loading and the one result check every driver call goes through
# --------------------------------------------------------------------------------------------

def load_driver() -> Any:
    """cuda-python's driver module: ``cuda.bindings.driver``, or ``cuda.cuda`` of old releases."""
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as driver  # cuda-python < 12.6
        return driver
    except ImportError as exc:
        raise ConfigError(f"the CUDA backend needs cuda-python's driver bindings, which are not "
                          f"installed: {_INSTALL_HINT}") from exc


def _driver_text(driver: Any, getter: str, err: Any) -> str | None:
    try:
        status, text = getattr(driver, getter)(err)
    except Exception:  # the lookup itself must never hide the real error
        return None
    if status != driver.CUresult.CUDA_SUCCESS or not text:
        return None
    return text.decode() if isinstance(text, (bytes, bytearray)) else str(text)


def check_result(driver: Any, function: str, result: Any,
                 context: str | Callable[[], str] = "") -> Any:
    """Check what a cuda-python driver call returned: ``(CUresult, *values)``.

    Returns ``None`` when the call has no outputs, the value when it has one, else the tuple.
    Raises :class:`CudaDriverError` carrying the function, the driver's error name and string;
    ``context`` (a string, or a function making one, called only on failure) says what was asked.
    """
    if not isinstance(result, tuple):
        result = (result,)
    err, values = result[0], result[1:]
    if err != driver.CUresult.CUDA_SUCCESS:
        name = (_driver_text(driver, "cuGetErrorName", err) or getattr(err, "name", None)
                or f"CUresult {int(err)}")
        text = _driver_text(driver, "cuGetErrorString", err) or "no description"
        message = f"{function} failed: {name}: {text}"
        if callable(context):
            context = context()
        if context:
            message += f" ({context})"
        exc = CudaDriverError(message)
        exc.function, exc.error_name, exc.error_string, exc.code = function, name, text, int(err)
        raise exc
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def call_driver(driver: Any, function: str, *args: Any,
                context: str | Callable[[], str] = "") -> Any:
    """Call ``driver.<function>(*args)`` and check its result (see :func:`check_result`)."""
    return check_result(driver, function, getattr(driver, function)(*args), context)


# --------------------------------------------------------------------------------------------
# Pure helpers (no CUDA): coalescing, index validation, views, page copies
# --------------------------------------------------------------------------------------------

def consecutive_runs(indices: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """Split sorted ``indices`` into runs of consecutive values: ``[(start, length), ...]``."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [idx.size]))
    return [(int(idx[s]), int(e - s)) for s, e in zip(starts, ends)]


def paired_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs where ``src`` and ``dst`` both step by one: ``[(src_start, dst_start, length)]``."""
    if src.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends)]


def _as_index_array(values: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise MappingError(f"{what} must be a 1-D sequence of integers; got shape {arr.shape}, "
                           f"dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def validate_map_request(vrange: VirtualRange, virtual_pages: Sequence[int] | np.ndarray,
                         physical_pages: Sequence[int] | np.ndarray,
                         pool_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Check a map request before anything changes; return int64 arrays sorted by virtual page."""
    virtual = _as_index_array(virtual_pages, "virtual_pages")
    physical = _as_index_array(physical_pages, "physical_pages")
    if virtual.shape != physical.shape:
        raise MappingError(f"map got {virtual.size} virtual pages but {physical.size} physical "
                           f"pages; pass one physical page per virtual page")
    bad = virtual[(virtual < 0) | (virtual >= vrange.num_pages)]
    if bad.size:
        raise MappingError(f"virtual page {int(bad[0])} is outside the range of "
                           f"{vrange.num_pages} pages (valid: 0..{vrange.num_pages - 1})")
    bad = physical[(physical < 0) | (physical >= pool_pages)]
    if bad.size:
        raise MappingError(f"physical page {int(bad[0])} is outside the pool of {pool_pages} "
                           f"pages (valid: 0..{pool_pages - 1})")
    order = np.argsort(virtual, kind="stable")
    virtual, physical = virtual[order], physical[order]
    if virtual.size > 1 and np.any(np.diff(virtual) == 0):
        dup = int(virtual[np.flatnonzero(np.diff(virtual) == 0)[0]])
        raise MappingError(f"virtual page {dup} appears twice in one map call; map each "
                           f"virtual page once")
    return virtual, physical


def validate_unmap_request(vrange: VirtualRange,
                           virtual_pages: Sequence[int] | np.ndarray) -> np.ndarray:
    """Sorted unique int64 virtual pages, all inside ``vrange`` (else MappingError)."""
    virtual = _as_index_array(virtual_pages, "virtual_pages")
    bad = virtual[(virtual < 0) | (virtual >= vrange.num_pages)]
    if bad.size:
        raise MappingError(f"virtual page {int(bad[0])} is outside the range of "
                           f"{vrange.num_pages} pages (valid: 0..{vrange.num_pages - 1})")
    return np.unique(virtual)


def strided_view(base: torch.Tensor, dtype: torch.dtype, shape: Sequence[int],
                 strides: Sequence[int], offset_bytes: int = 0) -> torch.Tensor:
    """A ``dtype`` view with element ``strides`` over the 1-D ``uint8`` tensor ``base``.

    Checks that every element lies inside ``base`` before building the view; touches no memory.
    """
    shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
    itemsize = dtype.itemsize
    nbytes = base.numel()
    if len(shape) != len(strides):
        raise ConfigError(f"shape {shape} has {len(shape)} dims but strides {strides} has "
                          f"{len(strides)}; give one stride per dim")
    if any(s < 0 for s in shape) or any(s < 0 for s in strides):
        raise ConfigError(f"shape {shape} and strides {strides} must be non-negative")
    if offset_bytes < 0 or offset_bytes % itemsize:
        raise ConfigError(f"offset_bytes {offset_bytes} must be a non-negative multiple of the "
                          f"{dtype} element size ({itemsize} bytes)")
    if nbytes % itemsize:
        raise ConfigError(f"a range of {nbytes} bytes cannot be viewed as {dtype} "
                          f"({itemsize}-byte elements)")
    first = offset_bytes // itemsize
    if 0 in shape:
        last = first - 1  # empty view: only the offset must lie inside
        if offset_bytes > nbytes:
            raise MappingError(f"view offset {offset_bytes} bytes is outside the range of "
                               f"{nbytes} bytes")
    else:
        last = first + sum((n - 1) * st for n, st in zip(shape, strides))
        if (last + 1) * itemsize > nbytes:
            raise MappingError(
                f"view of shape {shape}, strides {strides}, offset {offset_bytes} bytes reaches "
                f"byte {(last + 1) * itemsize} but the range holds {nbytes} bytes; shrink the "
                f"view or reserve a larger range")
    return base.view(dtype).as_strided(shape, strides, first)


def copy_window_pages(window: torch.Tensor, src: Sequence[int] | np.ndarray,
                      dst: Sequence[int] | np.ndarray, chunk_pages: int = 64,
                      max_run_copies: int = 16) -> None:
    """Copy rows ``src[i]`` of ``window`` (``[num_pages, page_size]``) onto rows ``dst[i]``.

    All sources are read before any destination is written, so ``src`` and ``dst`` may overlap.
    Runs of consecutive pages become one copy each; many scattered pages go through gathers of
    ``chunk_pages`` pages (bounded scratch memory) when no page is both a source and a target.
    """
    num_pages = window.shape[0]
    src_arr = _as_index_array(src, "src")
    dst_arr = _as_index_array(dst, "dst")
    if src_arr.shape != dst_arr.shape:
        raise MappingError(f"copy_pages got {src_arr.size} sources but {dst_arr.size} "
                           f"destinations; pass one destination per source")
    for arr, what in ((src_arr, "source"), (dst_arr, "destination")):
        bad = arr[(arr < 0) | (arr >= num_pages)]
        if bad.size:
            raise MappingError(f"{what} page {int(bad[0])} is outside the pool of {num_pages} "
                               f"pages (valid: 0..{num_pages - 1})")
    if src_arr.size == 0:
        return
    if np.unique(dst_arr).size != dst_arr.size:
        raise MappingError("copy_pages got the same destination page twice; each destination "
                           "page may be written once per call")
    keep = src_arr != dst_arr
    src_arr, dst_arr = src_arr[keep], dst_arr[keep]
    if src_arr.size == 0:
        return
    device = window.device
    if np.intersect1d(src_arr, dst_arr).size:
        # A page is both read and written: gather every source first, then scatter.
        src_idx = torch.as_tensor(src_arr, device=device)
        dst_idx = torch.as_tensor(dst_arr, device=device)
        window.index_copy_(0, dst_idx, window.index_select(0, src_idx))
        return
    runs = paired_runs(src_arr, dst_arr)
    if len(runs) <= max_run_copies:
        for s, d, n in runs:
            window[d:d + n].copy_(window[s:s + n])
        return
    for start in range(0, src_arr.size, chunk_pages):
        src_idx = torch.as_tensor(src_arr[start:start + chunk_pages], device=device)
        dst_idx = torch.as_tensor(dst_arr[start:start + chunk_pages], device=device)
        window.index_copy_(0, dst_idx, window.index_select(0, src_idx))


# --------------------------------------------------------------------------------------------
# Zero-copy tensors over raw addresses, through a DLPack capsule
# --------------------------------------------------------------------------------------------

_DL_CPU, _DL_CUDA = 1, 2
_DL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DLDeleter)]

# Structures handed to torch, kept alive until torch calls the deleter (when the tensor dies).
_LIVE_CAPSULES: dict[int, tuple[_DLManagedTensor, Any]] = {}


@_DLDeleter
def _release_capsule(managed: Any) -> None:
    try:
        _LIVE_CAPSULES.pop(ctypes.cast(managed, ctypes.c_void_p).value, None)
    except Exception:  # called from torch's deleter, maybe at interpreter shutdown
        pass


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CAPSULE_NAME = b"dltensor"  # module-level: the capsule keeps a pointer to these bytes


def tensor_from_address(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A 1-D ``uint8`` tensor of ``nbytes`` bytes at ``address`` on ``device`` (zero copy).

    Nothing is read or written; the memory must outlive the tensor (the caller's job). On CUDA
    the device is named explicitly, so the address may be reserved and still unmapped.
    """
    shape = (ctypes.c_int64 * 1)(int(nbytes))
    managed = _DLManagedTensor()
    managed.dl_tensor.data = int(address)
    if device.type == "cuda":
        managed.dl_tensor.device = _DLDevice(_DL_CUDA, device.index or 0)
    elif device.type == "cpu":
        managed.dl_tensor.device = _DLDevice(_DL_CPU, 0)
    else:
        raise ConfigError(f"cannot view raw memory on device {device}; use cpu or cuda")
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_DL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _release_capsule
    key = ctypes.addressof(managed)
    _LIVE_CAPSULES[key] = (managed, shape)
    try:
        capsule = _PyCapsule_New(key, _CAPSULE_NAME, None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        _LIVE_CAPSULES.pop(key, None)
        raise


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------

def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


class CudaBackend(VirtualMemoryBackend):
    """Physical pages are ``cuMemCreate`` handles on one GPU; ranges are driver reservations.

    ``stats.map_calls`` counts ``cuMemMap`` calls (one per page: a handle is one page);
    ``access_calls`` counts ``cuMemSetAccess`` calls (one per run of consecutive virtual pages);
    ``stats.unmap_calls`` counts ``cuMemUnmap`` calls (one per run). The pool window is not
    counted in ``stats``.
    """

    def __init__(self, page_size: int | None = None, num_pages: int = 0,
                 device: int | str | torch.device = 0) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) \
                or num_pages < 1:
            raise ConfigError(f"num_pages must be a positive integer; got {num_pages!r}")
        self.num_pages = int(num_pages)
        if not torch.cuda.is_available():
            raise ConfigError("the CUDA backend needs a CUDA GPU, and torch.cuda.is_available() "
                              "is False; use the CPU backend (vmemkv.vmm.cpu) instead")
        self._driver = load_driver()
        self.device = self._resolve_device(device)
        self.stats = MapStats()
        self.access_calls = 0
        self._closed = True  # until the constructor has finished
        self._ranges: dict[VirtualRange, torch.Tensor | None] = {}
        self._handles: list[Any] = []
        self._window_address: int | None = None
        self._window: torch.Tensor | None = None
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
                self._prop = self._allocation_prop(ordinal)
                self._access = self._access_desc(ordinal)
                self.granularity = int(self._call(
                    "cuMemGetAllocationGranularity", self._prop,
                    self._driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
                self.page_size = self._check_page_size(page_size)
                self._create_pages()
        except BaseException:
            self.close()
            raise

    # -- setup --------------------------------------------------------------------------------

    @staticmethod
    def _resolve_device(device: int | str | torch.device) -> torch.device:
        if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
            dev = torch.device("cuda", int(device))
        else:
            dev = torch.device(device)
        if dev.type != "cuda":
            raise ConfigError(f"the CUDA backend needs a cuda device; got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        count = torch.cuda.device_count()
        if not 0 <= dev.index < count:
            raise ConfigError(f"GPU {dev.index} does not exist; this process sees {count} GPU(s) "
                              f"(0..{count - 1})")
        return dev

    def _allocation_prop(self, ordinal: int) -> Any:
        d = self._driver
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        return prop

    def _access_desc(self, ordinal: int) -> Any:
        d = self._driver
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

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

    def _check_open(self) -> None:
        if self._closed:
            raise MappingError("this CudaBackend is closed; create a new one")

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
        self._check_range(vrange)
        virtual, physical = validate_map_request(vrange, virtual_pages, physical_pages,
                                                 self.num_pages)
        current = vrange.page_table[virtual]
        changed = current != physical  # mapping a page where it already is costs nothing
        virtual, physical, current = virtual[changed], physical[changed], current[changed]
        if virtual.size == 0:
            return
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
        self._check_range(vrange)
        virtual = validate_unmap_request(vrange, virtual_pages)
        virtual = virtual[vrange.page_table[virtual] >= 0]  # already unmapped: nothing to do
        if virtual.size == 0:
            return
        self.synchronize()  # the device may still read these pages
        with self._context():
            self._unmap_pages(vrange, virtual)

    def pool_window(self) -> torch.Tensor:
        self._check_open()
        if self._window is None:
            size = self.num_pages * self.page_size
            with self._context():
                address = int(self._call("cuMemAddressReserve", size, self._alignment(), 0, 0,
                                         context=f"reserving the pool window, {_gib(size)}"))
                mapped = 0
                try:
                    for i, handle in enumerate(self._handles):
                        self._call("cuMemMap", address + i * self.page_size, self.page_size, 0,
                                   handle, 0,
                                   context=lambda: f"mapping physical page {i} in the window")
                        mapped += 1
                    self._call("cuMemSetAccess", address, size, [self._access], 1,
                               context="opening the pool window")
                except BaseException:
                    with contextlib.suppress(CudaDriverError):
                        if mapped:
                            self._call("cuMemUnmap", address, mapped * self.page_size)
                        self._call("cuMemAddressFree", address, size)
                    raise
            self._window_address = address
            self._window = tensor_from_address(address, size, self.device).view(
                self.num_pages, self.page_size)
        return self._window

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self._check_open()
        copy_window_pages(self.pool_window(), src, dst,
                          chunk_pages=max(1, (256 << 20) // self.page_size))

    def tensor(self, vrange: VirtualRange, dtype: torch.dtype, shape: Sequence[int],
               strides: Sequence[int], offset_bytes: int = 0) -> torch.Tensor:
        self._check_range(vrange)
        base = self._ranges[vrange]
        if base is None:
            base = tensor_from_address(vrange.address, vrange.size, self.device)
            self._ranges[vrange] = base
        return strided_view(base, dtype, shape, strides, offset_bytes)

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
                size = self.num_pages * self.page_size
                attempt(self._call, "cuMemUnmap", self._window_address, size)
                attempt(self._call, "cuMemAddressFree", self._window_address, size)
                self._window_address, self._window = None, None
            for handle in self._handles:
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
