"""The interface every virtual-memory backend implements.

A backend owns a fixed pool of ``num_pages`` physical pages of ``page_size`` bytes each, and
hands out virtual ranges (``reserve``) into which pages are mapped and unmapped in batches.
Physical pages are named by their index ``0 .. num_pages-1``. Besides the reserved ranges, every
backend keeps one *pool window*: all physical pages mapped once, in index order, so a page can be
copied, swapped to host memory, or addressed through a block table without a slot mapping.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch


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


class VirtualMemoryBackend(ABC):
    """Reserve virtual ranges, map physical pages into them, copy pages, view memory as tensors."""

    page_size: int
    num_pages: int
    device: torch.device
    stats: MapStats

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

    @abstractmethod
    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the bytes of physical page ``src[i]`` onto physical page ``dst[i]``."""

    @abstractmethod
    def pool_window(self) -> torch.Tensor:
        """All physical pages as one ``uint8`` tensor ``[num_pages, page_size]`` (zero copy)."""

    @abstractmethod
    def tensor(self, vrange: VirtualRange, dtype: torch.dtype, shape: Sequence[int],
               strides: Sequence[int], offset_bytes: int = 0) -> torch.Tensor:
        """A zero-copy tensor over ``vrange`` starting ``offset_bytes`` in, with element strides.

        Creating the view touches no memory; reading an element whose page is unmapped faults.
        """

    def synchronize(self) -> None:
        """Wait until the device has finished all work that may read mapped ranges."""

    @abstractmethod
    def close(self) -> None:
        """Release every range and every physical page. The backend is unusable afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
