"""Rank 0's page decisions as a log that every other rank replays on its own pool.

The scheduler and the KV cache manager run once, on rank 0. Everything they decide reaches
memory through two narrow doors: the virtual-memory backend (``vmm/base.py``: reserve, map,
unmap, copy pages, give pages back and take them again) and the host swap space (``swap.py``:
store, load, discard). On rank 0 both are wrapped by recorders that log every call in the order
the memory saw it (the lookahead mapper calls from another thread: one lock orders the log). Each
step the log travels with the step's model inputs (an idle give-back's in a message of its own,
with no forward); a worker applies it to its own backend and swap space, which hold pages of the same
count and geometry (every rank's cache holds its share of the KV heads, so the layouts agree), and
then runs the forward. Page ids and mappings agree by construction, and prefix caching, forks,
beam search, swap and recompute need nothing of their own: they are all rank-0 decisions.

A manager of several layer groups (local and global layers: ``KVCacheManager.layout_groups``)
has one backend and one swap space per pool (``KVCacheManager.memories``: one for groups whose
blocks have the same bytes, else one each). Each is wrapped by its own recorder, and the
recorders of a rank share one ``Recording``: one log, in the order memory saw the calls, each
entry naming its pool (``(pool, "map", range, virtual, physical)``). A worker builds the same
pools and replays each entry on its pool's backend and swap space.

``state_digest`` summarises what a rank's memory looks like (every group's reservations' page
tables and its swap space's free host blocks) so a debug mode can compare ranks after every step.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Sequence

import numpy as np
import torch

from vmemkv.cache.swap import SwapSpace
from vmemkv.memory.vmm.base import VirtualMemoryBackend, VirtualRange, index_array

LogEntry = tuple  # (group, "map", range index, virtual, physical), (group, "copy", src, dst),
# (group, "discard", pages): memory given back, (group, "take", pages): taken again, ...


class Recording:
    """One rank's recorders (one per pool of layer groups, in the order the manager builds them)
    and the log they share: one lock orders every group's calls, the lookahead mapper's too."""

    def __init__(self):
        self.recorders: list[BackendRecorder] = []
        self.lock = threading.Lock()
        self._log: list[LogEntry] = []

    def append(self, entry: LogEntry) -> None:
        """Log ``entry`` (the caller holds ``lock``)."""
        self._log.append(entry)

    def take_log(self, digest: bool = False) -> tuple[list[LogEntry], int | None]:
        """The calls logged since the last take, and (``digest``) this rank's ``state_digest``
        at exactly that point: taken under the lock, so a mapping the lookahead worker makes
        meanwhile lands wholly in the next log and the next digest."""
        with self.lock:
            log, self._log = self._log, []
            return log, (state_digest(self) if digest else None)


class BackendRecorder(VirtualMemoryBackend):
    """A backend that forwards every call to ``inner`` and logs the ones that change memory into
    ``recording`` (a new one when not given), as group ``len(recording.recorders)``.

    A call is logged only once it succeeded (a refused map changed nothing, so there is nothing
    to replay). Ranges are named in the log by the order they were reserved in, which is the same
    on every rank because every rank builds its manager with the same code and configuration."""

    def __init__(self, inner: VirtualMemoryBackend, recording: Recording | None = None):
        self.inner = inner
        self.page_size, self.num_pages = inner.page_size, inner.num_pages
        self.device, self.granularity = inner.device, inner.granularity
        self.copy_by_gather = inner.copy_by_gather
        self.can_discard, self.takes_pages_back = inner.can_discard, inner.takes_pages_back
        self.ranges: list[VirtualRange] = []
        self.swap_space: SwapSpace | None = None  # set by SwapRecorder: its replay and digest
        self.recording = recording if recording is not None else Recording()
        self.group = len(self.recording.recorders)
        self.recording.recorders.append(self)
        self._lock = self.recording.lock

    def _log(self, *entry) -> None:
        self.recording.append((self.group, *entry))

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
            self._log("reserve", num_pages)
            return vrange

    def release(self, vrange: VirtualRange) -> None:
        with self._lock:
            index = self.ranges.index(vrange)
            self.inner.release(vrange)
            self._log("release", index)

    def map(self, vrange, virtual_pages, physical_pages) -> None:
        # Copies: the slot mapper reuses small scratch arrays between calls.
        virtual = index_array(virtual_pages, "virtual_pages").copy()
        physical = index_array(physical_pages, "physical_pages").copy()
        with self._lock:
            self.inner.map(vrange, virtual, physical)
            self._log("map", self.ranges.index(vrange), virtual, physical)

    def unmap(self, vrange, virtual_pages) -> None:
        virtual = index_array(virtual_pages, "virtual_pages").copy()
        with self._lock:
            self.inner.unmap(vrange, virtual)
            self._log("unmap", self.ranges.index(vrange), virtual)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        src, dst = index_array(src, "src").copy(), index_array(dst, "dst").copy()
        with self._lock:
            self.inner.copy_pages(src, dst)
            self._log("copy", src, dst)

    def discard_pages(self, pages) -> int:
        pages = index_array(pages, "pages").copy()
        with self._lock:
            given = self.inner.discard_pages(pages)
            if given:
                self._log("discard", pages)
            return given

    def take_pages(self, pages) -> None:
        pages = index_array(pages, "pages").copy()
        with self._lock:
            self.inner.take_pages(pages)
            self._log("take", pages)

    def resident_bytes(self) -> int | None:
        return self.inner.resident_bytes()

    def record_swap(self, *entry) -> None:
        """Log a swap-space operation in order with the page operations (``SwapRecorder``)."""
        with self._lock:
            self._log(*entry)

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
        self.recorder.record_swap("swap_out", list(blocks), list(host))
        return host

    def load(self, window: torch.Tensor, host: list[int], blocks: list[int]) -> None:
        self.inner.load(window, host, blocks)
        self.recorder.record_swap("swap_in", list(host), list(blocks))

    def discard(self, host: list[int]) -> None:
        self.inner.discard(host)
        self.recorder.record_swap("swap_discard", list(host))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def replay(log: list[LogEntry], recording: Recording, block_windows: list[torch.Tensor]) -> None:
    """Apply rank 0's ``log`` to this rank's groups, in order: each entry to the backend its
    group's recorder wraps and that group's swap space. ``block_windows``: each group's pool as
    ``[num_blocks, block_bytes]`` rows."""
    for group, kind, *args in log:
        recorder = recording.recorders[group]
        backend, swap, window = recorder.inner, recorder.swap_space, block_windows[group]
        if kind == "map":
            backend.map(recorder.ranges[args[0]], args[1], args[2])
        elif kind == "unmap":
            backend.unmap(recorder.ranges[args[0]], args[1])
        elif kind == "copy":
            backend.copy_pages(args[0], args[1])
        elif kind == "discard":
            backend.discard_pages(args[0])
        elif kind == "take":
            backend.take_pages(args[0])
        elif kind == "swap_out":
            host = swap.store(window, args[0])
            if host != args[1]:  # the same free lists hand out the same host blocks
                raise RuntimeError(f"swap space diverged: rank 0 stored group {group}'s blocks "
                                   f"{args[0]} in host blocks {args[1]}, this rank in {host}")
        elif kind == "swap_in":
            swap.load(window, args[0], args[1])
        elif kind == "swap_discard":
            swap.discard(args[0])
        elif kind == "reserve":
            recorder.ranges.append(backend.reserve(args[0]))
        elif kind == "release":
            backend.release(recorder.ranges[args[0]])
        else:
            raise ValueError(f"unknown log entry {kind!r}")


def state_digest(recording: Recording) -> int:
    """A 63-bit digest of this rank's memory state: in every group, every live reservation's page
    table (what each virtual page maps) and the swap space's free host blocks (which swapped
    blocks it holds)."""
    digest = hashlib.blake2b(digest_size=8)
    for recorder in recording.recorders:
        for vrange in recorder.ranges:
            digest.update(np.ascontiguousarray(vrange.page_table).tobytes())
        if recorder.swap_space is not None:
            digest.update(np.asarray(sorted(recorder.swap_space._free), dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1
