"""Rank 0's page decisions as a log that every other rank replays on its own pool.

The scheduler and the KV cache manager run once, on rank 0. Everything they decide reaches
memory through two narrow doors: the virtual-memory backend (``vmm/base.py``: reserve, map,
unmap, copy pages) and the host swap space (``swap.py``: store, load, discard). On rank 0 both are
wrapped by recorders that log every call in the order the memory saw it (the lookahead mapper
calls from another thread: one lock orders the log). Each step the log travels with the step's
model inputs; a worker applies it to its own backend and swap space, which hold pages of the same
count and geometry (every rank's cache holds its share of the KV heads, so the layouts agree), and
then runs the forward. Page ids and mappings agree by construction, and prefix caching, forks,
beam search, swap and recompute need nothing of their own: they are all rank-0 decisions.

``state_digest`` summarises what a rank's memory looks like (every reservation's page table, the
swap space's free host blocks) so a debug mode can compare ranks after every step.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Sequence

import numpy as np
import torch

from ...swap import SwapSpace
from ...vmm.base import VirtualMemoryBackend, VirtualRange, index_array

LogEntry = tuple  # ("map", range index, virtual pages, physical pages), ("copy", src, dst), ...


class BackendRecorder(VirtualMemoryBackend):
    """A backend that forwards every call to ``inner`` and logs the ones that change memory.

    A call is logged only once it succeeded (a refused map changed nothing, so there is nothing
    to replay). Ranges are named in the log by the order they were reserved in, which is the same
    on every rank because every rank builds its manager with the same code and configuration."""

    def __init__(self, inner: VirtualMemoryBackend):
        self.inner = inner
        self.page_size, self.num_pages = inner.page_size, inner.num_pages
        self.device, self.granularity = inner.device, inner.granularity
        self.copy_by_gather = inner.copy_by_gather
        self.ranges: list[VirtualRange] = []
        self.swap_space: SwapSpace | None = None  # set by SwapRecorder, for the digest
        self._log: list[LogEntry] = []
        self._lock = threading.Lock()

    # What the manager reads or sets on its backend, kept on the real one.
    stats = property(lambda self: self.inner.stats)
    _closed = property(lambda self: self.inner._closed)

    @property
    def metrics(self):
        return self.inner.metrics

    @metrics.setter
    def metrics(self, collector) -> None:
        self.inner.metrics = collector

    def reserve(self, num_pages: int) -> VirtualRange:
        with self._lock:
            vrange = self.inner.reserve(num_pages)
            self.ranges.append(vrange)
            self._log.append(("reserve", num_pages))
            return vrange

    def release(self, vrange: VirtualRange) -> None:
        with self._lock:
            index = self.ranges.index(vrange)
            self.inner.release(vrange)
            self._log.append(("release", index))

    def map(self, vrange, virtual_pages, physical_pages) -> None:
        # Copies: the slot mapper reuses small scratch arrays between calls.
        virtual = index_array(virtual_pages, "virtual_pages").copy()
        physical = index_array(physical_pages, "physical_pages").copy()
        with self._lock:
            self.inner.map(vrange, virtual, physical)
            self._log.append(("map", self.ranges.index(vrange), virtual, physical))

    def unmap(self, vrange, virtual_pages) -> None:
        virtual = index_array(virtual_pages, "virtual_pages").copy()
        with self._lock:
            self.inner.unmap(vrange, virtual)
            self._log.append(("unmap", self.ranges.index(vrange), virtual))

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        src, dst = index_array(src, "src").copy(), index_array(dst, "dst").copy()
        with self._lock:
            self.inner.copy_pages(src, dst)
            self._log.append(("copy", src, dst))

    def record_swap(self, entry: LogEntry) -> None:
        """Log a swap-space operation in order with the page operations (``SwapRecorder``)."""
        with self._lock:
            self._log.append(entry)

    def take_log(self, digest: bool = False) -> tuple[list[LogEntry], int | None]:
        """The calls logged since the last take, and (``digest``) this rank's ``state_digest``
        at exactly that point: taken under the lock, so a mapping the lookahead worker makes
        meanwhile lands wholly in the next log and the next digest."""
        with self._lock:
            log, self._log = self._log, []
            return log, (state_digest(self, self.swap_space) if digest else None)

    def pool_window(self) -> torch.Tensor:
        return self.inner.pool_window()

    def _range_bytes(self, vrange: VirtualRange) -> torch.Tensor:
        return self.inner._range_bytes(vrange)

    def tensor(self, vrange, dtype, shape, strides, offset_bytes: int = 0) -> torch.Tensor:
        return self.inner.tensor(vrange, dtype, shape, strides, offset_bytes)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def close(self) -> None:
        self.inner.close()


class SwapRecorder:
    """The manager's swap space, logging each store, load and discard into ``recorder``'s log.
    Everything else (``num_free``, ``check_room``, ...) is the wrapped swap space's."""

    def __init__(self, inner: SwapSpace, recorder: BackendRecorder):
        self.inner = inner
        self.recorder = recorder
        recorder.swap_space = inner

    def store(self, window: torch.Tensor, blocks: list[int]) -> list[int]:
        host = self.inner.store(window, blocks)
        self.recorder.record_swap(("swap_out", list(blocks), list(host)))
        return host

    def load(self, window: torch.Tensor, host: list[int], blocks: list[int]) -> None:
        self.inner.load(window, host, blocks)
        self.recorder.record_swap(("swap_in", list(host), list(blocks)))

    def discard(self, host: list[int]) -> None:
        self.inner.discard(host)
        self.recorder.record_swap(("swap_discard", list(host)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def replay(log: list[LogEntry], recorder: BackendRecorder, swap: SwapSpace,
           block_window: torch.Tensor) -> None:
    """Apply rank 0's ``log`` to this rank's backend (the one ``recorder`` wraps) and swap space,
    in order. ``block_window``: this rank's pool as ``[num_blocks, block_bytes]`` rows."""
    backend = recorder.inner
    for entry in log:
        kind = entry[0]
        if kind == "map":
            backend.map(recorder.ranges[entry[1]], entry[2], entry[3])
        elif kind == "unmap":
            backend.unmap(recorder.ranges[entry[1]], entry[2])
        elif kind == "copy":
            backend.copy_pages(entry[1], entry[2])
        elif kind == "swap_out":
            host = swap.store(block_window, entry[1])
            if host != entry[2]:  # the same free lists hand out the same host blocks
                raise RuntimeError(f"swap space diverged: rank 0 stored blocks {entry[1]} in host "
                                   f"blocks {entry[2]}, this rank in {host}")
        elif kind == "swap_in":
            swap.load(block_window, entry[1], entry[2])
        elif kind == "swap_discard":
            swap.discard(entry[1])
        elif kind == "reserve":
            recorder.ranges.append(backend.reserve(entry[1]))
        elif kind == "release":
            backend.release(recorder.ranges[entry[1]])
        else:
            raise ValueError(f"unknown log entry {kind!r}")


def state_digest(recorder: BackendRecorder, swap: SwapSpace | None) -> int:
    """A 63-bit digest of this rank's memory state: every live reservation's page table (what
    each virtual page maps) and the swap space's free host blocks (which swapped blocks it holds)."""
    digest = hashlib.blake2b(digest_size=8)
    for vrange in recorder.ranges:
        digest.update(np.ascontiguousarray(vrange.page_table).tobytes())
    if swap is not None:
        digest.update(np.asarray(sorted(swap._free), dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1
