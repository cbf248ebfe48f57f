"""The interface every virtual-memory backend implements.

A backend owns a fixed pool of ``num_pages`` physical pages of ``page_size`` bytes each, and
hands out virtual ranges (``reserve``) into which pages are mapped and unmapped in batches.
Physical pages are named by their index ``0 .. num_pages-1``. Besides the reserved ranges, every
backend keeps one *pool window*: all physical pages mapped once, in index order, so a page can be
copied, swapped to host memory, or addressed through a block table without a slot mapping.

What every backend does the same way lives here too: page-index checks, view bounds checks
(``tensor``) and page copies through the pool window (``copy_pages``). A backend implements the
mapping itself and ``_range_bytes`` (the bytes of one live range as a ``uint8`` tensor).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from vmemkv.errors import ConfigError, MappingError

# Scratch memory one gather of scattered pages may use in copy_pages.
GATHER_SCRATCH_BYTES = 256 << 20


@dataclass(eq=False)
class VirtualRange:
    """A reserved span of virtual addresses, ``num_pages`` pages long.

    ``page_table[v]`` is the physical page mapped at virtual page ``v``, or -1 when unmapped; the
    backend keeps it up to date and it is the truth about what the addresses point to.
    """

    address: int
    num_pages: int
    page_size: int
    page_table: np.ndarray = field(repr=False)

    @property
    def size(self) -> int:
        return self.num_pages * self.page_size

    def mapped_pages(self) -> np.ndarray:
        """Virtual page indices that currently have a physical page behind them."""
        return np.flatnonzero(self.page_table >= 0)


@dataclass
class MapStats:
    """Counters of what a backend did, for benchmarks and the A/B harness."""

    map_calls: int = 0  # OS / driver calls made to map (after coalescing)
    unmap_calls: int = 0
    pages_mapped: int = 0
    pages_unmapped: int = 0
    map_seconds: float = 0.0
    unmap_seconds: float = 0.0
    pages_discarded: int = 0  # physical pages given back to the OS (discard_pages)
    discard_seconds: float = 0.0


class HostRowCopier:
    """Copies rows between host memory and a backend's memory (the swap space and host tier
    use one each): ``copy(dst, dst_rows, src, src_rows)`` sets ``dst[dst_rows[i]] =
    src[src_rows[i]]``. This one copies row by row on the host: torch's indexed copies of uint8
    rows run element by element on the CPU (~10x slower than a memcpy per row; numpy's row
    assignment costs a tenth of a torch row copy)."""

    pin_host_memory = False  # whether host rows are pinned (asynchronous device copies)

    def copy(self, dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor,
             src_rows: list[int]) -> None:
        dst_array, src_array = dst.numpy(), src.numpy()
        for d, s in zip(dst_rows, src_rows):
            dst_array[d] = src_array[s]


class VirtualMemoryBackend(ABC):
    """Reserve virtual ranges, map physical pages into them, copy pages, view memory as tensors."""

    page_size: int
    num_pages: int
    device: torch.device
    stats: MapStats
    # Bytes that page sizes and range addresses must be multiples of (the OS page on CPU, the
    # driver's allocation granularity on CUDA).
    granularity: int
    # How copy_pages copies many scattered pages: False, one copy per run of consecutive pages
    # (a memcpy each: right on CPU, where torch's indexed copy of uint8 rows goes byte by byte);
    # True, gathers through bounded scratch memory once there are more than a few runs (one
    # kernel per chunk: right on a GPU).
    copy_by_gather: bool = False
    # A vmemkv.KVMetricsCollector that map/unmap report their time to (the manager sets it to
    # its own); None: nothing is recorded, at the cost of one attribute check per call.
    metrics = None
    # What the device decides for the KV cache above it (cache/ names no device):
    # - a slot's rows read by one batched call for several slots need filler pages past the pool
    #   where a request has no block (CPU attention reads whole slots; a GPU kernel stops at each
    #   request's length);
    batched_reads_need_filler: bool = False
    # - positions released behind a window need a page behind them: a GPU kernel may load a
    #   tile before the window start, and an unmapped address there faults;
    window_holes_need_page: bool = False
    # - how rows are copied between host memory and the backend's (swap, host tier).
    host_row_copier: type[HostRowCopier] = HostRowCopier

    @abstractmethod
    def reserve(self, num_pages: int) -> VirtualRange:
        """Reserve ``num_pages * page_size`` bytes of virtual address space, all unmapped."""

    @abstractmethod
    def release(self, vrange: VirtualRange) -> None:
        """Unmap everything in ``vrange`` and give its addresses back."""

    @abstractmethod
    def map(self, vrange: VirtualRange, virtual_pages: Sequence[int] | np.ndarray,
            physical_pages: Sequence[int] | np.ndarray) -> None:
        """Map ``physical_pages[i]`` at virtual page ``virtual_pages[i]`` of ``vrange``.

        A virtual page that is already mapped is remapped (its old page stays intact). Runs of
        consecutive virtual pages backed by consecutive physical pages cost one call.
        """

    @abstractmethod
    def unmap(self, vrange: VirtualRange, virtual_pages: Sequence[int] | np.ndarray) -> None:
        """Unmap the given virtual pages; their addresses go back to the reservation."""

    can_discard = False  # whether discard_pages gives memory back

    def discard_pages(self, pages: Sequence[int]) -> int:
        """Give the memory behind physical pages ``pages`` back (to the OS, or the GPU's free
        memory); their bytes are gone. On CPU their mappings stay valid, read zeros, and a write
        takes a page again; where ``takes_pages_back`` (CUDA) every mapping of them goes (the
        page tables say so) and ``take_pages`` must come before any use. Returns the pages given
        back: 0 on a backend that cannot (its memory stays resident)."""
        return 0

    # Whether a given-back page must be taken back (``take_pages``) before it is used again
    # (CUDA: its handle is gone), rather than coming back when written (CPU: a page fault).
    takes_pages_back = False

    def take_pages(self, pages: Sequence[int]) -> None:
        """Give physical pages ``pages`` memory again after ``discard_pages`` (new bytes, not
        zeroed) where that is not automatic; a no-op for pages that have memory."""

    def resident_bytes(self) -> int | None:
        """Bytes of physical memory the pages hold now (None where the backend cannot tell)."""
        return None

    @abstractmethod
    def pool_window(self) -> torch.Tensor:
        """All physical pages as one ``uint8`` tensor ``[num_pages, page_size]`` (zero copy)."""

    @abstractmethod
    def _range_bytes(self, vrange: VirtualRange) -> torch.Tensor:
        """The whole of ``vrange`` as a 1-D ``uint8`` tensor (zero copy, touches no memory);
        MappingError when the range is not a live one of this backend."""

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the bytes of physical page ``src[i]`` onto physical page ``dst[i]``; all sources
        are read before any page is written."""
        self._check_open()
        copy_window_pages(self.pool_window(), src, dst,
                          chunk_pages=max(1, GATHER_SCRATCH_BYTES // self.page_size),
                          max_run_copies=16 if self.copy_by_gather else None)

    def tensor(self, vrange: VirtualRange, dtype: torch.dtype, shape: Sequence[int],
               strides: Sequence[int], offset_bytes: int = 0) -> torch.Tensor:
        """A zero-copy tensor over ``vrange`` starting ``offset_bytes`` in, with element strides.

        Creating the view touches no memory; reading an element whose page is unmapped faults.
        A view reaching past the range is refused.
        """
        return strided_view(self._range_bytes(vrange), dtype, shape, strides, offset_bytes)

    def synchronize(self) -> None:
        """Wait until the device has finished all work that may read mapped ranges."""

    @abstractmethod
    def close(self) -> None:
        """Release every range and every physical page. The backend is unusable afterwards."""

    def _check_open(self) -> None:
        if self._closed:
            raise MappingError(f"this {type(self).__name__} is closed; create a new one")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Checks and copies every backend shares
# --------------------------------------------------------------------------------------------

def index_array(pages: Sequence[int] | np.ndarray | torch.Tensor, name: str) -> np.ndarray:
    """A 1-D contiguous int64 array of page indices (no copy when it already is one)."""
    if type(pages) is np.ndarray and pages.dtype == np.int64 and pages.ndim == 1 \
            and pages.flags.c_contiguous:
        return pages
    if isinstance(pages, torch.Tensor):
        pages = pages.detach().cpu().numpy()
    try:
        array = np.asarray(pages)
    except (TypeError, ValueError) as e:
        raise MappingError(f"{name} must be a 1-D sequence of integer page indices: {e}") from None
    if array.dtype == np.int64 and array.ndim == 1 and array.flags.c_contiguous:
        return array  # a list of ints
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise MappingError(f"{name} must be a 1-D sequence of integer page indices; got shape "
                           f"{array.shape}, dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.int64)


def check_indices(array: np.ndarray, limit: int, what: str, where: str) -> np.ndarray:
    """``array`` itself when every index is in ``0 .. limit-1``, else MappingError naming the first
    bad one: "<what> 9 is outside the <where> of 8 pages"."""
    if array.size and (array.min() < 0 or array.max() >= limit):
        raise _outside(int(array[(array < 0) | (array >= limit)][0]), limit, what, where)
    return array


def _outside(bad: int, limit: int, what: str, where: str) -> MappingError:
    return MappingError(f"{what} {bad} is outside the {where} of {limit} pages "
                        f"(valid: 0..{limit - 1})")


def validate_map_request(vrange: VirtualRange, virtual_pages: Sequence[int] | np.ndarray,
                         physical_pages: Sequence[int] | np.ndarray,
                         pool_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Check a map request before anything changes; return int64 arrays sorted by virtual page."""
    virtual = index_array(virtual_pages, "virtual_pages")
    physical = index_array(physical_pages, "physical_pages")
    if virtual.shape != physical.shape:
        raise MappingError(f"map got {virtual.size} virtual pages but {physical.size} physical "
                           f"pages; pass one physical page per virtual page")
    check_indices(virtual, vrange.num_pages, "virtual page", "range")
    check_indices(physical, pool_pages, "physical page", "pool")
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
    virtual = check_indices(index_array(virtual_pages, "virtual_pages"), vrange.num_pages,
                            "virtual page", "range")
    return np.unique(virtual)


def consecutive_runs(indices: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """Split sorted ``indices`` into runs of consecutive values: ``[(start, length), ...]``."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [idx.size]))
    return [(int(idx[s]), int(e - s)) for s, e in zip(starts, ends)]


def paired_runs(src: Sequence[int] | np.ndarray,
                dst: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
    """Runs where ``src`` and ``dst`` both step by one: ``[(src_start, dst_start, length)]``."""
    runs: list[list[int]] = []
    for s, d in zip(_as_list(src), _as_list(dst)):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def _as_list(values: Sequence[int] | np.ndarray) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def strided_view(base: torch.Tensor, dtype: torch.dtype, shape: Sequence[int],
                 strides: Sequence[int], offset_bytes: int = 0) -> torch.Tensor:
    """A ``dtype`` view with element ``strides`` over the 1-D ``uint8`` tensor ``base``.

    Checks that every element lies inside ``base`` before building the view; touches no memory.
    """
    shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
    itemsize = dtype.itemsize
    nbytes = base.numel()
    if len(shape) != len(strides):
        raise ConfigError(f"shape {shape} and strides {strides} need the same number of dimensions "
                          f"(one stride per dim)")
    if any(s < 0 for s in shape) or any(s < 0 for s in strides):
        raise ConfigError(f"shape {shape} and strides {strides} must be non-negative")
    if offset_bytes < 0 or offset_bytes % itemsize:
        raise ConfigError(f"offset_bytes {offset_bytes} must be a non-negative multiple of the "
                          f"element size ({itemsize} bytes of {dtype})")
    if nbytes % itemsize:
        raise ConfigError(f"a range of {nbytes} bytes cannot be viewed as {dtype} "
                          f"({itemsize}-byte elements)")
    first = offset_bytes // itemsize
    if 0 in shape:
        end = offset_bytes  # empty view: only the offset must lie inside
    else:
        end = (first + 1 + sum((n - 1) * st for n, st in zip(shape, strides))) * itemsize
    if end > nbytes:
        raise MappingError(f"a view with shape {shape}, strides {strides} at offset {offset_bytes} "
                           f"bytes reaches byte {end} but the range holds {nbytes} bytes; shrink "
                           f"the view or reserve a larger range")
    return base.view(dtype).as_strided(shape, strides, first)


def copy_window_pages(window: torch.Tensor, src: Sequence[int] | np.ndarray,
                      dst: Sequence[int] | np.ndarray, chunk_pages: int = 64,
                      max_run_copies: int | None = 16) -> None:
    """Copy rows ``src[i]`` of ``window`` (``[num_pages, page_size]``) onto rows ``dst[i]``.

    All sources are read before any destination is written, so ``src`` and ``dst`` may overlap.
    Runs of consecutive pages become one copy each; with more than ``max_run_copies`` runs (never,
    when it is None), the pages go through gathers of ``chunk_pages`` pages (bounded scratch
    memory) when no page is both a source and a target.
    """
    num_pages = window.shape[0]
    # Checked on Python lists: a copy is mostly a page or two, where numpy's overhead dominates.
    sources = index_array(src, "src").tolist()
    destinations = index_array(dst, "dst").tolist()
    for pages, what in ((sources, "source page"), (destinations, "destination page")):
        if pages and (min(pages) < 0 or max(pages) >= num_pages):
            raise _outside(next(p for p in pages if not 0 <= p < num_pages), num_pages, what, "pool")
    if len(sources) != len(destinations):
        raise MappingError(f"copy_pages got {len(sources)} sources but {len(destinations)} "
                           f"destinations; pass one destination per source")
    if len(set(destinations)) != len(destinations):
        raise MappingError("copy_pages got the same destination page twice; each destination "
                           "page may be written once per call")
    if any(s == d for s, d in zip(sources, destinations)):  # a page onto itself: nothing to do
        pairs = [(s, d) for s, d in zip(sources, destinations) if s != d]
        sources, destinations = [s for s, _ in pairs], [d for _, d in pairs]
    if not sources:
        return
    device = window.device
    if not set(sources).isdisjoint(destinations):
        # A page is both read and written: gather every source first, then scatter.
        src_idx = torch.as_tensor(sources, dtype=torch.int64, device=device)
        dst_idx = torch.as_tensor(destinations, dtype=torch.int64, device=device)
        window.index_copy_(0, dst_idx, window.index_select(0, src_idx))
        return
    runs = paired_runs(sources, destinations)
    if max_run_copies is None or len(runs) <= max_run_copies:
        # on CPU through numpy: a tenth of a torch copy's fixed cost, on the page or two of a fork
        rows = window.numpy() if device.type == "cpu" else window
        for s, d, n in runs:
            rows[d:d + n] = rows[s:s + n]
        return
    for start in range(0, len(sources), chunk_pages):
        src_idx = torch.as_tensor(sources[start:start + chunk_pages], dtype=torch.int64, device=device)
        dst_idx = torch.as_tensor(destinations[start:start + chunk_pages], dtype=torch.int64,
                                  device=device)
        window.index_copy_(0, dst_idx, window.index_select(0, src_idx))
